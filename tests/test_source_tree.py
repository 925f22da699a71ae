"""The C core's source tree keeps its architecture.

csrc/ is cut into concept folders whose dependencies point one way:

    core/   may include core/ only
    attn/   core/, attn/, and cuda/attn_cuda.h (the CUDA launchers)
    comm/   core/, comm/
    xla/    core/, xla/, attn/attn_params.h and attn/attn_cpu.h (the CPU
            kernels), and cuda/attn_cuda.h (the CUDA launchers)
    csrc/   (module.c, the module's init) any of core/, attn/, comm/, xla/
    cuda/   cuda/, core/, attn/attn_params.h (the kernels' params),
            emu/ptx.h (mma.cuh's PTX wrappers on the emulated GPU) and
            emu/ptx_sm90.h (cuda/hopper/ptx_sm90.cuh's)
    emu/    emu/ only (the emulated GPU: below everything, it is "the
            device"); core/ and comm/ reach it only through emu/emu.h
    emu/nccl/  (the stand-in NCCL, a library of its own) emu/, emu/nccl/;
            it defines the functions the system's <nccl.h> declares

Every function shared between files is declared in a header: no .c or .cu
file declares a non-static function (or extern data) defined elsewhere, and
no .c or .cu file defines a non-static function that no header declares.

The checks read the sources with a small C tokenizer (comments, strings and
preprocessor lines removed; file-scope statements split at `;` and at
function bodies), so they need no compiler.  The tests at the end feed the
same checks a broken tree to show that they fail when they should.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# folder -> folders its files may include ("csrc" is csrc/ itself)
ALLOWED = {
    "core": {"core", "emu"},
    "attn": {"core", "attn", "cuda"},
    "comm": {"core", "comm", "emu"},
    "xla": {"core", "attn", "cuda", "xla"},
    "csrc": {"core", "attn", "comm", "xla"},
    "cuda": {"cuda", "core", "attn", "emu"},
    "emu": {"emu"},
    "emu_nccl": {"emu", "emu_nccl"},
}
# where a folder may reach into another only through one header
ONLY_THROUGH = {
    ("attn", "cuda"): {"cuda/attn_cuda.h"},
    ("cuda", "attn"): {"csrc/attn/attn_params.h"},
    ("xla", "cuda"): {"cuda/attn_cuda.h"},
    ("xla", "attn"): {"csrc/attn/attn_params.h", "csrc/attn/attn_cpu.h"},
    ("cuda", "emu"): {"csrc/emu/ptx.h", "csrc/emu/ptx_sm90.h"},
    ("core", "emu"): {"csrc/emu/emu.h"},
    ("comm", "emu"): {"csrc/emu/emu.h"},
    ("emu_nccl", "emu"): {"csrc/emu/emu.h"},
}
SOURCE_SUFFIXES = (".c", ".cu")
HEADER_SUFFIXES = (".h", ".cuh")

_LEXEME = re.compile(
    r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)
_DIRECTIVE = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)
# `int *name(args) __attribute__((...))`: at least one type word before the
# name, so a macro call such as `FOO(x);` is not a declaration
_FUNCTION = re.compile(
    r"^(?P<spec>(?:[A-Za-z_]\w*[\s*]+)+?)\**\s*(?P<name>[A-Za-z_]\w*)\s*"
    r"\((?P<args>.*)\)\s*(?:__attribute__\s*\(\(.*\)\)\s*)*$", re.S)


def _strip_comments(text):
    """Comments become blanks (newlines kept); strings stay."""
    def blank(m):
        s = m.group(0)
        return re.sub(r"[^\n]", " ", s) if s[0] == "/" else s
    return _LEXEME.sub(blank, text)


def _strip_code(text):
    """Comments, strings, char literals and preprocessor lines removed."""
    def blank(m):
        s = m.group(0)
        if s[0] == "/":
            return re.sub(r"[^\n]", " ", s)
        return s[0] * 2   # "" or ''
    text = _LEXEME.sub(blank, text)
    return _DIRECTIVE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def file_scope(text):
    """(declarations, definitions) at file scope of C/C++ source `text`:
    declarations are the statements ended by `;` (struct bodies and
    initialisers folded in), definitions the heads of function bodies.
    `extern "C" { ... }` blocks are transparent; other blocks (namespaces,
    functions) are skipped."""
    code = _strip_code(text)
    decls, defs = [], []
    stmt, depth, linkage, head_is_def = [], 0, 0, False
    for ch in code:
        if depth == 0 and ch == "{":
            head = " ".join("".join(stmt).split())
            if re.fullmatch(r'extern\s*""', head):
                linkage += 1
                stmt = []
                continue
            head_is_def = head.endswith(")") or bool(
                re.search(r"\)\s*(__attribute__\s*\(\(.*\)\)\s*)+$", head))
            if head_is_def:
                defs.append(head)
            depth = 1
            stmt.append("{}")
            continue
        if depth > 0:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0 and head_is_def:
                    stmt, head_is_def = [], False
            continue
        if ch == "}" and linkage:
            linkage -= 1
            stmt = []
        elif ch == ";":
            s = " ".join("".join(stmt).split())
            if s:
                decls.append(s)
            stmt = []
        else:
            stmt.append(ch)
    return decls, defs


def function_name(statement):
    """(name, is_static) of a function declaration or definition head, or
    None when `statement` is not one."""
    s = re.sub(r'^extern\s*""\s*', "", statement)
    m = _FUNCTION.match(s)
    if m is None or m.group("name") in ("_Static_assert", "static_assert"):
        return None
    words = m.group("spec").replace("*", " ").split()
    return m.group("name"), ("static" in words or "typedef" in words)


def folder_of(path, root):
    """'core', 'attn', 'comm', 'emu', 'emu_nccl' (csrc/emu/nccl), 'csrc'
    (csrc/ itself), 'cuda', or None."""
    parts = path.relative_to(root).parts
    if parts[0] == "csrc":
        if parts[1] == "emu" and len(parts) > 3 and parts[2] == "nccl":
            return "emu_nccl"
        return parts[1] if len(parts) > 2 else "csrc"
    if parts[0] == "cuda":
        return "cuda"
    return None


def tree_files(root, suffixes):
    return sorted(p for top in ("csrc", "cuda") for p in (root / top).rglob("*")
                  if p.is_file() and p.name.endswith(suffixes))


def resolve_include(path, name, root):
    """The file `#include "name"` in `path` reads: the including file's
    folder first, then the include path of the build (csrc/, cuda/)."""
    for base in (path.parent, root / "csrc", root / "cuda"):
        candidate = base / name
        if candidate.is_file():
            return candidate.resolve()
    return None


def include_violations(root):
    """Every #include that points the wrong way or cannot be found."""
    root = Path(root).resolve()
    found = []
    for path in tree_files(root, SOURCE_SUFFIXES + HEADER_SUFFIXES):
        src = folder_of(path, root)
        rel = path.relative_to(root).as_posix()
        for name in _INCLUDE.findall(_strip_comments(path.read_text())):
            if ".." in Path(name).parts:
                found.append(f"{rel}: #include \"{name}\" climbs out of its "
                             "folder; name the folder from csrc/ or cuda/")
            target = resolve_include(path, name, root)
            if target is None:
                found.append(f"{rel}: #include \"{name}\" is not in csrc/ "
                             "or cuda/")
                continue
            dst = folder_of(target, root)
            trel = target.relative_to(root).as_posix()
            if src not in ALLOWED:
                found.append(f"{rel}: csrc/{src}/ has no rule; add to "
                             "ALLOWED what it may include")
            elif dst not in ALLOWED[src]:
                found.append(f"{rel}: {src}/ must not include {dst}/ "
                             f"({trel})")
            elif trel not in ONLY_THROUGH.get((src, dst), {trel}):
                allowed = ", ".join(sorted(ONLY_THROUGH[(src, dst)]))
                found.append(f"{rel}: {src}/ reaches {dst}/ only through "
                             f"{allowed}, not {trel}")
    return found


def declaration_violations(root):
    """Non-static functions declared in a source file, extern data declared
    in a source file, and non-static functions that no header of their own
    folder declares (cuda/ may implement what a header of core/ or attn/
    declares)."""
    root = Path(root).resolve()
    declared = {}   # function name -> folders of the headers declaring it
    for header in tree_files(root, HEADER_SUFFIXES):
        for statement in file_scope(header.read_text())[0]:
            fn = function_name(statement)
            if fn is not None:
                declared.setdefault(fn[0], set()).add(folder_of(header, root))
    found = []
    for path in tree_files(root, SOURCE_SUFFIXES):
        rel = path.relative_to(root).as_posix()
        decls, defs = file_scope(path.read_text())
        for statement in decls:
            fn = function_name(statement)
            if fn is not None and not fn[1]:
                found.append(f"{rel}: declares {fn[0]}(); declare it in "
                             "its owner's header")
            elif fn is None and re.match(r"extern\b(?!\s*\"\")", statement):
                found.append(f"{rel}: declares `{statement}`; declare it "
                             "in its owner's header")
        owner = folder_of(path, root)
        for head in defs:
            fn = function_name(head)
            if fn is None or fn[1] or fn[0].startswith("PyInit_"):
                continue
            if owner == "emu_nccl" and fn[0].startswith("nccl"):
                continue   # the stand-in NCCL implements <nccl.h>
            where = declared.get(fn[0], set())
            if not where:
                found.append(f"{rel}: defines {fn[0]}() that no header "
                             "declares; declare it in its header or make "
                             "it static")
            elif owner not in where and not (
                    owner in ("cuda", "emu_nccl") and where & ALLOWED[owner]):
                found.append(f"{rel}: defines {fn[0]}(), declared only in "
                             f"{', '.join(sorted(where))}/; declare it in a "
                             f"header of {owner}/")
    return list(dict.fromkeys(found))   # #if/#else twins once


# ---- the tree as it is ---------------------------------------------------

needs_tree = pytest.mark.skipif(not (ROOT / "csrc").is_dir(),
                                reason="no C sources next to the tests")


@needs_tree
def test_csrc_is_its_concept_folders_and_module_c():
    folders = {p.name for p in (ROOT / "csrc").iterdir() if p.is_dir()}
    loose = {p.name for p in (ROOT / "csrc").iterdir()
             if p.is_file() and p.name.endswith(SOURCE_SUFFIXES +
                                                HEADER_SUFFIXES)}
    assert {"core", "attn", "comm"} <= folders <= set(ALLOWED), folders
    assert loose == {"module.c"}, loose


@needs_tree
def test_includes_point_one_way():
    assert include_violations(ROOT) == []


@needs_tree
def test_shared_functions_are_declared_in_headers():
    assert declaration_violations(ROOT) == []


@needs_tree
def test_the_checks_see_the_whole_tree():
    """The tokenizer finds what the tree is known to hold (so an empty list
    of violations above means the checks looked)."""
    decls, defs = file_scope((ROOT / "csrc/core/buffer.h").read_text())
    names = {function_name(s)[0] for s in decls if function_name(s)}
    assert {"ra_buffer_copy_into", "ra_buffer_from_object"} <= names
    decls, defs = file_scope((ROOT / "csrc/core/buffer.c").read_text())
    names = {function_name(h) for h in defs}
    assert ("ra_buffer_copy_into", False) in names
    assert ("buffer_dealloc", True) in names
    includes = _INCLUDE.findall((ROOT / "csrc/module.c").read_text())
    assert "attn/attn_api.h" in includes and "comm/comm_py.h" in includes


# ---- the checks fail when they should ------------------------------------

def _tree(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


GOOD = {
    "csrc/core/buffer.h": "int ra_buffer_numel(void);\n",
    "csrc/core/buffer.c": '#include "core/buffer.h"\n'
                          "int ra_buffer_numel(void) { return 1; }\n",
    "csrc/attn/attn_args.h": '#include "core/buffer.h"\n'
                             "int check_qkv(int q);\n",
    "csrc/attn/attn_args.c": '#include "attn/attn_args.h"\n'
                             '#include "attn_cuda.h"\n'
                             "static int helper(void);\n"
                             "int check_qkv(int q) { return q; }\n",
    "csrc/comm/comm.h": '#include "core/buffer.h"\n'
                        'extern "C" {\nint ra_comm_size(void);\n}\n',
    "csrc/comm/comm.c": '#include "comm/comm.h"\n'
                        "int ra_comm_size(void) { return 2; }\n",
    "csrc/attn/attn_params.h": "typedef struct { int b; } ra_params;\n",
    "cuda/attn_cuda.h": '#include "attn/attn_params.h"\n'
                        "int ra_cuda_fwd(const ra_params *p);\n",
    "cuda/fwd.cu": '#include "attn_cuda.h"\n'
                   "namespace { int kern(int x) { return x; } }\n"
                   'extern "C" int ra_cuda_fwd(const ra_params *p) '
                   "{ return kern(p->b); }\n",
    "csrc/module.c": '#include "attn/attn_args.h"\n#include "comm/comm.h"\n'
                     "PyMODINIT_FUNC PyInit__C(void) { return 0; }\n",
}


def violations(tmp_path, check, added=()):
    """`check` run on the GOOD tree with each (file, text) of `added`
    appended to that file (or making it)."""
    files = dict(GOOD)
    for name, text in added:
        files[name] = files.get(name, "") + text
    return check(_tree(tmp_path, files))


def test_a_good_tree_passes(tmp_path):
    assert violations(tmp_path, include_violations) == []
    assert violations(tmp_path, declaration_violations) == []


@pytest.mark.parametrize("path, line, message", [
    ("csrc/core/buffer.c", '#include "attn/attn_args.h"',
     "core/ must not include attn/"),
    ("csrc/core/buffer.c", '#include "comm/comm.h"',
     "core/ must not include comm/"),
    ("csrc/core/buffer.c", '#include "attn_cuda.h"',
     "core/ must not include cuda/"),
    ("csrc/attn/attn_args.c", '#include "comm/comm.h"',
     "attn/ must not include comm/"),
    ("csrc/comm/comm.c", '#include "attn/attn_args.h"',
     "comm/ must not include attn/"),
    ("csrc/comm/comm.c", '#include "attn_cuda.h"',
     "comm/ must not include cuda/"),
    ("cuda/fwd.cu", '#include "attn/attn_args.h"',
     "cuda/ reaches attn/ only through csrc/attn/attn_params.h"),
    ("csrc/attn/attn_args.c", '#include "../core/buffer.h"',
     "climbs out of its folder"),
    ("csrc/core/buffer.c", '#include "core/bufer.h"', "is not in csrc/"),
    ("csrc/ffi/ffi.c", '#include "core/buffer.h"',
     "csrc/ffi/ has no rule; add to ALLOWED"),
])
def test_a_wrong_include_fails(tmp_path, path, line, message):
    found = violations(tmp_path, include_violations, [(path, line + "\n")])
    assert len(found) == 1 and message in found[0], found


def test_an_include_in_a_comment_is_not_a_dependency(tmp_path):
    comment = '/*\n#include "comm/comm.h"\n*/\n'
    assert violations(tmp_path, include_violations,
                      [("csrc/core/buffer.c", comment)]) == []


@pytest.mark.parametrize("added, message", [
    ([("csrc/core/buffer.c", "int check_qkv(int q);\n")],
     "csrc/core/buffer.c: declares check_qkv()"),
    ([("csrc/attn/attn_args.c", "ra_status ra_copy(int *dst,\n"
       "                  const int *src) __attribute__((nonnull));\n")],
     "csrc/attn/attn_args.c: declares ra_copy()"),
    ([("cuda/fwd.cu", 'extern "C" int ra_comm_size(void);\n')],
     "cuda/fwd.cu: declares ra_comm_size()"),
    ([("csrc/core/buffer.c", "extern int ra_table[];\n")],
     "csrc/core/buffer.c: declares `extern int ra_table[]`"),
    ([("csrc/attn/attn_args.c", "int load_tensor_ex(int a) { return a; }\n")],
     "csrc/attn/attn_args.c: defines load_tensor_ex() that no header "
     "declares"),
    ([("csrc/core/buffer.h", "int ra_comm_exec(void);\n"),
      ("csrc/comm/comm.c", "int ra_comm_exec(void) { return 0; }\n")],
     "csrc/comm/comm.c: defines ra_comm_exec(), declared only in core/; "
     "declare it in a header of comm/"),
])
def test_a_declaration_outside_its_header_fails(tmp_path, added, message):
    found = violations(tmp_path, declaration_violations, added)
    assert len(found) == 1 and found[0].startswith(message), found


def test_cuda_may_implement_what_core_declares(tmp_path):
    assert violations(tmp_path, declaration_violations, [
        ("csrc/core/buffer.h", "int ra_cuda_copy(const void *p);\n"),
        ("cuda/fwd.cu", 'extern "C" int ra_cuda_copy(const void *p) '
                        "{ return p != 0; }\n"),
    ]) == []


def test_statics_macros_and_initialisers_are_not_declarations(tmp_path):
    assert violations(tmp_path, declaration_violations, [(
        "csrc/core/buffer.c",
        "static const char *names[] = {\"a;b\", \"c\"};\n"
        "RA_DEFINE_TABLE(f32);\n"
        "_Static_assert(sizeof(int) == 4, \"int\");\n"
        "typedef int (*ra_launcher)(const void *params);\n"
        "static inline int twice(int x) { return 2 * x; }\n"
        "// int not_a_declaration(void);\n")]) == []
