"""Command line: ``ringattn demo | bench | launch | info`` (also
``python -m ringattn``).

Every flag is checked before any work: a bad value ends the command with one
line naming the flag and exit status 2, never a traceback.  ``--help`` shows
every flag with its default.
"""

import argparse
import os
import sys

from ._version import __version__


class Parser(argparse.ArgumentParser):
    """argparse with defaults in the help and one-line errors."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kw)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} "
                     f"(see {self.prog} --help)\n")


def _int(text):
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer, got {text!r}") from None


def _int_at_least(minimum):
    def check(text):
        value = _int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum}, got {text!r}")
        return value
    return check


positive_int = _int_at_least(1)          # argparse type: an integer >= 1
nonnegative_int = _int_at_least(0)       # argparse type: an integer >= 0


def port(text):
    """argparse type: a TCP port, 1..65535."""
    value = _int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(
            f"expected a port in 1..65535, got {text!r}")
    return value


def positive_float(text):
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected a number > 0, got {text!r}")
    return value


def positive_int_list(text):
    """argparse type: comma-separated integers >= 1 (at least one), given
    back as a canonical "a,b,c" string (what the bench modules parse)."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 1, got {text!r}")
    return ",".join(str(positive_int(s)) for s in items)


def window_sides(text):
    """argparse type: LEFT[,RIGHT], integers >= 0 (RIGHT defaults to 0, the
    usual sliding window), given back as (left, right)."""
    parts = [x.strip() for x in text.split(",")]
    if len(parts) not in (1, 2) or not all(parts):
        raise argparse.ArgumentTypeError(
            f"expected LEFT or LEFT,RIGHT (integers >= 0), got {text!r}")
    sides = [nonnegative_int(x) for x in parts] + [0]
    return tuple(sides[:2])


def plot_file(text):
    """argparse type: an image path whose folder exists; needs matplotlib."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder!r} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError(
            "drawing needs matplotlib, which is not installed "
            "(pip install matplotlib)") from None
    return text


def _demo_parser(sub):
    d = sub.add_parser(
        "demo", help="ring attention over local ranks, checked against a "
                     "single-rank run",
        description="Ring attention over local ranks, forward and backward, "
                    "checked against a single-rank run of the whole sequence "
                    "at sampled rows; prints per-rank time and memory.")
    d.add_argument("--seq-len", "-n", type=positive_int, default=16384,
                   help="tokens in the whole sequence")
    d.add_argument("--ranks", "-p", type=positive_int, default=4,
                   help="ranks the sequence is sharded over")
    d.add_argument("--layout", default="zigzag",
                   choices=["contiguous", "zigzag", "striped"],
                   help="how the sequence is sharded")
    d.add_argument("--backend", default="auto",
                   choices=["auto", "host", "threads", "nccl"],
                   help="host: one process per rank over loopback TCP; "
                        "threads: ranks are threads of one process; "
                        "nccl: one process per rank on the GPUs (ranks "
                        "share a GPU with NCCL >= 2.30); auto: nccl where "
                        "it can run, else host")
    d.add_argument("--batch", type=positive_int, default=1, help="batch size")
    d.add_argument("--heads", type=positive_int, default=8,
                   help="query heads")
    d.add_argument("--kv-heads", type=nonnegative_int, default=0,
                   help="kv heads for GQA, a divisor of --heads (0: --heads)")
    d.add_argument("--head-dim", type=positive_int, default=64,
                   help="head dimension")
    d.add_argument("--dtype", default="float32",
                   choices=["float32", "float64", "float16", "bfloat16"],
                   help="storage dtype (arithmetic is float32 or wider)")
    d.add_argument("--no-causal", action="store_true",
                   help="full attention instead of causal")
    d.add_argument("--window", type=window_sides, default=None,
                   metavar="LEFT[,RIGHT]",
                   help="sliding window: a query sees keys from LEFT tokens "
                        "before it to RIGHT after it (RIGHT defaults to 0)")
    d.add_argument("--docs", type=positive_int, default=None, metavar="N",
                   help="pack N documents of random lengths into the "
                        "sequence; no attention across them")
    d.add_argument("--ulysses", "-u", type=positive_int, default=1,
                   metavar="U",
                   help="Ulysses degree: an all-to-all over heads inside "
                        "groups of U ranks, the ring across the groups (1: "
                        "the plain ring; --ranks: pure Ulysses); U divides "
                        "--ranks and --heads")
    d.add_argument("--samples", type=positive_int, default=64,
                   help="rows compared with the single-rank run")
    d.add_argument("--threads", type=nonnegative_int, default=0,
                   help="kernel threads per rank (0: cores / ranks)")
    d.add_argument("--seed", type=nonnegative_int, default=0,
                   help="seed of the random inputs")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    return d


def _check_demo(parser, args):
    """Checks that span several flags; parser.error() on the first failure."""
    if args.kv_heads and args.heads % args.kv_heads:
        parser.error(f"argument --kv-heads: must divide --heads "
                     f"{args.heads}, got {args.kv_heads}")
    if args.ranks % args.ulysses:
        parser.error(f"argument --ulysses: must divide --ranks {args.ranks}, "
                     f"got {args.ulysses}")
    if args.heads % args.ulysses:
        parser.error(f"argument --ulysses: must divide --heads {args.heads} "
                     f"(each rank of a group takes heads / U), got "
                     f"{args.ulysses}")
    if args.docs is not None and args.docs > args.seq_len:
        parser.error(f"argument --docs: at most --seq-len {args.seq_len} "
                     f"documents of one token or more, got {args.docs}")
    if args.backend == "nccl":
        from .demo import nccl_plan

        ok, why, _ = nccl_plan(args.ranks)
        if not ok:
            parser.error(f"argument --backend: nccl cannot run here: {why}")
    if args.dtype == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            parser.error("argument --dtype: bfloat16 host arrays need "
                         "ml_dtypes (pip install ml_dtypes)")
    # the kernels' own argument checks, on a one-token problem of this shape
    import numpy as np

    import ringattn as ra
    from .testing import np_dtype

    dtype = np_dtype(args.dtype)
    q = np.zeros((1, 1, args.heads, args.head_dim), dtype)
    kv = np.zeros((1, 1, args.kv_heads or args.heads, args.head_dim), dtype)
    try:
        ra.attention(q, kv, kv)
    except (ValueError, TypeError) as e:
        flag = "--head-dim" if "head_dim" in str(e) else "--heads"
        parser.error(f"argument {flag}: {e}")


def _bench_parser(sub):
    b = sub.add_parser(
        "bench", help="kernel and ring throughput tables",
        description="Throughput tables measured in this run (Markdown). "
                    "Without a table flag: --cpu.")
    b.add_argument("--cpu", action="store_true",
                   help="CPU kernel table against NumPy baselines")
    b.add_argument("--ring", action="store_true",
                   help="ring time, hidden transfer share and per-rank "
                        "memory for p = 1, 2, 4 (with --gpu: the NCCL ring "
                        "and thread ranks on the GPUs against one device)")
    b.add_argument("--dilated", action="store_true",
                   help="dilated vs dense attention table")
    b.add_argument("--masks", action="store_true",
                   help="packed documents, sliding window and softcap "
                        "against the unmasked problem and torch SDPA with "
                        "an explicit mask")
    b.add_argument("--ulysses", action="store_true",
                   help="the plain ring, hybrid and pure Ulysses on 4 CPU "
                        "ranks (u = 1, 2, 4), causal, n = 16384 (--seq-lens "
                        "N to change): time, bytes sent and peak memory per "
                        "rank")
    b.add_argument("--gpu", action="store_true",
                   help="GPU kernel table against PyTorch SDPA, and accuracy "
                        "(needs a GPU; without torch ringattn runs alone, "
                        "the SDPA columns skipped)")
    b.add_argument("--jax", action="store_true",
                   help="ringattn inside JAX programs (XLA FFI, shard_map "
                        "ring) against JAX baselines")
    b.add_argument("--threads", type=nonnegative_int, default=0,
                   help="CPU threads of --cpu (0: run single-threaded and "
                        "with every core)")
    b.add_argument("--seq-lens", type=positive_int_list, default=None,
                   help="comma-separated sequence lengths (--cpu default: "
                        "1024,4096,8192; 256,512 with --quick)")
    b.add_argument("--seq-len", type=positive_int, default=None,
                   help="sequence length of --ring (default 8192, 2048 "
                        "with --quick; with --gpu 16384, 4096 with --quick)")
    b.add_argument("--repeat", type=positive_int, default=3,
                   help="timed calls per case (the median is shown)")
    b.add_argument("--quick", action="store_true", help="small sizes")
    b.add_argument("--plot", type=plot_file, default=None, metavar="FILE.png",
                   help="also draw the --cpu and --ring tables into this "
                        "image (needs matplotlib)")
    b.add_argument("--rows-json", default=None, help=argparse.SUPPRESS)
    return b


def _check_bench(parser, args):
    cpu = args.cpu or not (args.ring or args.dilated or args.gpu or
                            args.masks or args.ulysses)
    host_ring = args.ring and not args.gpu
    if args.plot and not (cpu or host_ring):
        parser.error("argument --plot: draws the --cpu and --ring (CPU) "
                     "tables; add --cpu, or --ring without --gpu")


def build_parser():
    parser = Parser(prog="ringattn", description="torch-free ring attention")
    parser.add_argument("--version", action="version",
                        version=f"ringattn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = _demo_parser(sub)
    bench = _bench_parser(sub)
    sub.add_parser("launch", help="ringattn launch -n N script.py [args]: "
                                  "start N ranks with the environment "
                                  "ra.init() reads (see ringattn launch -h)")
    sub.add_parser("info", help="build and device information")
    return parser, {"demo": demo, "bench": bench}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "launch":
        from .launch import main_launch

        return main_launch(argv[1:])
    parser, subparsers = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        _check_demo(subparsers["demo"], args)
        from .demo import run

        return run(args)
    if args.command == "bench":
        _check_bench(subparsers["bench"], args)
        from .bench import run

        return run(args)
    if args.command == "info":
        import ringattn as ra

        print(f"ringattn {ra.__version__}")
        print(f"cpu: {ra.cpu_info()}")
        print(f"cuda: {ra.cuda_info()}")
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
