"""``ringattn.jax.ring_attention`` under ``jax.shard_map`` on 1-4 CPU devices
against the float64 reference: every layout, causal and not, GQA, forward
and gradients, several dtypes and odd shard lengths; masks (documents,
windows, soft-capping) on every layout and p, the hops a window takes, and
Ulysses / hybrid parallelism over a second mesh axis (``ulysses_axis``).

The rings run in one subprocess (tests/jax_ring_worker.py) started with
XLA_FLAGS=--xla_force_host_platform_device_count=4, so this process and
the rest of the suite keep JAX's default single CPU device.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ringattn.testing import assert_close, random_problem, ref_attention, \
    ref_attention_backward, ref_segment_ids

pytest.importorskip("jax")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "jax_ring_worker.py")


def _cases():
    cases = []
    # (p, tokens per shard, heads, kv heads, head dim)
    shapes = {1: (7, 4, 2, 8), 2: (9, 4, 1, 16), 3: (5, 6, 3, 8), 4: (13, 4, 2, 8)}
    for p, (m, H, Hkv, D) in shapes.items():
        for layout in ("contiguous", "zigzag", "striped"):
            for causal in (False, True):
                cases.append(dict(p=p, layout=layout, causal=causal, m=m, H=H,
                                  Hkv=Hkv, D=D, dtype="float64"))
    for dtype in ("float32", "bfloat16"):
        cases.append(dict(p=4, layout="zigzag", causal=True, m=29, H=4, Hkv=2,
                          D=32, dtype=dtype))
    # lse returned and differentiated through
    for layout in ("contiguous", "zigzag", "striped"):
        cases.append(dict(p=3, layout=layout, causal=True, m=7, H=4, Hkv=2,
                          D=8, dtype="float64", lse=True))
    cases.append(dict(p=2, layout="zigzag", causal=False, m=11, H=2, Hkv=2,
                      D=16, dtype="float32", lse=True))
    # one token per device; more devices' worth of heads than tokens
    cases.append(dict(p=4, layout="striped", causal=True, m=1, H=2, Hkv=1, D=4,
                      dtype="float64"))
    # masks: every layout and p, gradients through out and lse
    masks = [dict(causal=True, window=[4, 0], docs=True),
             dict(causal=False, window=[2, 5], softcap=2.0),
             dict(causal=True, softcap=1.5, docs=True, lse=True),
             dict(causal=False, window=[None, 3], docs=True, lse=True)]
    for p in (1, 2, 3, 4):
        for i, layout in enumerate(("contiguous", "zigzag", "striped")):
            mask = masks[(p + i) % len(masks)]
            cases.append(dict(mask, p=p, layout=layout, m=7, H=4, Hkv=2, D=8,
                              dtype="float64"))
    cases.append(dict(p=4, layout="contiguous", causal=True, window=[3, 0],
                      m=9, H=2, Hkv=1, D=8, dtype="float32", docs=True))
    # NaN in q and k: it reaches the rows that see it across ring steps
    # (the gradients may be NaN on more of a tile: extra_nan)
    cases.append(dict(p=3, layout="zigzag", causal=True, m=7, H=4, Hkv=2, D=8,
                      dtype="float64", nan=True))
    cases.append(dict(p=2, layout="contiguous", causal=True, m=9, H=2, Hkv=1, D=8,
                      dtype="float32", window=[5, 0], docs=True, lse=True, nan=True))
    # Ulysses: heads all-to-all'd over a second mesh axis (H_kv = 1 and 2
    # below u: replicated); equal shards need n divisible by 2 r and p
    for layout in ("contiguous", "zigzag", "striped"):
        for causal in (False, True):
            cases.append(dict(p=4, ulysses=2, layout=layout, causal=causal,
                              m=6, H=4, Hkv=1, D=8, dtype="float64"))
    cases.append(dict(p=4, ulysses=4, pure=True, layout="zigzag", causal=True,
                      m=5, H=4, Hkv=2, D=8, dtype="float64"))
    cases.append(dict(p=2, ulysses=2, layout="striped", causal=True, m=7,
                      H=2, Hkv=2, D=8, dtype="float64", lse=True))
    cases.append(dict(p=4, ulysses=2, layout="zigzag", causal=True, m=6, H=4,
                      Hkv=2, D=8, dtype="float64", window=[5, 0], docs=True,
                      lse=True))
    cases.append(dict(p=4, ulysses=4, layout="contiguous", causal=False,
                      m=4, H=8, Hkv=2, D=16, dtype="float32", softcap=2.0))
    for c in cases:
        tags = "".join(f"-{key}" for key in ("lse", "window", "softcap", "docs", "nan")
                       if c.get(key))
        if c.get("ulysses"):
            tags += f"-u{c['ulysses']}{'-pure' if c.get('pure') else ''}"
        c["name"] = (f"p{c['p']}-{c['layout']}-{'causal' if c['causal'] else 'full'}"
                     f"-n{c['p'] * c['m']}-h{c['H']}/{c['Hkv']}-{c['dtype']}"
                     f"{tags}")
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory):
    """Inputs (per case) and what the worker computed from them."""
    rng = np.random.default_rng(20240611)
    arrays, inputs = {}, {}
    for c in CASES:
        q, k, v, dout = random_problem(rng, 2, c["p"] * c["m"], c["H"], c["Hkv"],
                                       c["D"], c["dtype"])
        dlse = (rng.standard_normal((2, c["H"], c["p"] * c["m"]))
                if c.get("lse") else None)
        if c.get("softcap"):
            q = q * 6                   # large scores: the cap bites
        if c.get("nan"):
            q[0, 11, 1, 2] = np.nan
            k[1, 3, 0, 0] = np.nan
        n = c["p"] * c["m"]
        ids = np.stack([ref_segment_ids([0, 1, n // 3, n // 3 + 2], n)[0],
                        ref_segment_ids([0, n // 2], n)[0]]) \
            if c.get("docs") else None
        inputs[c["name"]] = (q, k, v, dout, dlse, ids)
        for name, x in zip(("q", "k", "v", "dout", "dlse"), (q, k, v, dout, dlse)):
            if x is not None:
                arrays[f"{c['name']}/{name}"] = x.astype(np.float64)
        if ids is not None:
            arrays[f"{c['name']}/ids"] = ids
    tmp = tmp_path_factory.mktemp("jax_ring")
    cases_path, out_path = tmp / "cases.npz", tmp / "results.npz"
    np.savez(cases_path, cases=np.array(json.dumps(CASES)), **arrays)
    env = dict(os.environ,
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, WORKER, str(cases_path), str(out_path)],
                          env=env, capture_output=True, text=True, timeout=540)
    if proc.returncode != 0:
        pytest.fail(f"ring worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return inputs, dict(np.load(out_path))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_ring_matches_reference(ring_runs, case):
    inputs, results = ring_runs
    q, k, v, dout, dlse, ids = inputs[case["name"]]
    pos = np.arange(q.shape[1])
    kw = dict(causal=case["causal"], q_pos=pos, k_pos=pos, segment_ids=ids,
              window=case.get("window"), softcap=case.get("softcap"))
    ref_out, ref_lse = ref_attention(q, k, v, **kw)
    grads = tuple(ref_attention_backward(dout, q, k, v, dlse=dlse, **kw))
    names = ("out", "dq", "dk", "dv")
    refs = (ref_out,) + grads
    if dlse is not None:
        names, refs = ("lse",) + names, (ref_lse,) + refs
    if case.get("nan"):
        assert np.isnan(ref_out).any() and not np.isnan(ref_out).all()
    for name, ref in zip(names, refs):
        assert_close(results[f"{case['name']}/{name}"], ref, case["dtype"], name,
                     extra_nan=bool(case.get("nan")) and name.startswith("d"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [c for c in CASES if c["dtype"] == "float64"
                                  and c["layout"] == "zigzag"
                                  and not c.get("window")
                                  and not c.get("ulysses")],
                         ids=lambda c: c["name"])
def test_ring_program_is_custom_calls_and_permutes(ring_runs, case):
    """The lowered forward+backward is FFI custom calls and ppermutes: no
    host callback, one k/v hop per step forward, k/v plus dk/dv hops back."""
    _, results = ring_runs
    targets = set(results[f"{case['name']}/targets"].tolist())
    assert not results[f"{case['name']}/callbacks"]
    expected = {"ringattn_attn_fwd", "ringattn_attn_bwd_pre", "ringattn_attn_bwd"}
    if case["p"] > 1:
        expected |= {"ringattn_attn_fwd_acc", "ringattn_attn_bwd_acc"}
    assert targets == expected
    assert results[f"{case['name']}/permutes"] >= (3 * (case["p"] - 1) + 1
                                                   if case["p"] > 1 else 0)


@pytest.mark.timeout(600)
def test_window_ring_takes_only_the_hops_it_needs(ring_runs):
    """Contiguous, causal window of 3 over shards of 9: one hop forward
    (and one back), not p - 1: fewer block calls than the full ring."""
    _, results = ring_runs
    name = [c["name"] for c in CASES if c["dtype"] == "float32"
            and c.get("window")][0]
    # forward: one block step; backward: one block step
    assert int(results[f"{name}/calls"]) == 2, int(results[f"{name}/calls"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [c for c in CASES if c.get("ulysses")],
                         ids=lambda c: c["name"])
def test_ulysses_program_is_all_to_alls_and_custom_calls(ring_runs, case):
    """Ulysses inside the program: XLA all-to-alls (q, k, v and out in, and
    their transposes back), ringattn's FFI kernels, no host callback."""
    _, results = ring_runs
    assert not results[f"{case['name']}/callbacks"]
    assert int(results[f"{case['name']}/all_to_alls"]) >= 4
    targets = set(results[f"{case['name']}/targets"].tolist())
    assert {"ringattn_attn_fwd", "ringattn_attn_bwd"} <= targets
