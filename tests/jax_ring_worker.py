"""Runs ``ringattn.jax.ring_attention`` under ``jax.shard_map`` on p CPU
devices (with ``ulysses_axis`` on a 2-D mesh for the Ulysses cases), for
tests/test_jax_ring.py.

A separate process because XLA_FLAGS=--xla_force_host_platform_device_count
must be set before JAX is imported, and the rest of the test suite must
keep its one CPU device.  The parent writes the cases (global q, k, v, dout
and segment ids in natural order; window and softcap in the case) to an
.npz; this writes back, per case, out and dq, dk, dv (as float64, natural
order) and what the lowered forward+backward program contains.

usage: python jax_ring_worker.py CASES.npz RESULTS.npz
"""

import json
import sys

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import ringattn as ra
import ringattn.jax as rj
from ringattn.jax_ring import shard_map
from ringattn.testing import np_dtype


def run_case(case, arrays):
    p, layout = case["p"], case["layout"]
    q, k, v, dout = (arrays[f"{case['name']}/{x}"] for x in ("q", "k", "v", "dout"))
    dt = np_dtype(case["dtype"])
    n = q.shape[1]
    # ulysses=u: a (p / u, u) mesh, the sequence over both axes, Ulysses
    # minor; "pure": no ring axis in the call
    u = case.get("ulysses", 1)
    order = np.concatenate(ra.shard_indices(n, p, layout, ulysses=u))
    devices = np.array(jax.devices()[:p])
    if u > 1:
        mesh = jax.sharding.Mesh(devices.reshape(p // u, u), ("sp", "ul"))
        seq = ("sp", "ul")
        axes = dict(axis_name=None if case.get("pure") else "sp",
                    ulysses_axis="ul")
    else:
        mesh = jax.sharding.Mesh(devices, ("sp",))
        seq, axes = "sp", dict(axis_name="sp")
    spec = P(None, seq)
    place = lambda x: jax.device_put(jnp.asarray(x[:, order].astype(dt)),
                                     NamedSharding(mesh, spec))
    with_lse = case.get("lse", False)
    # lse (B, H, n_r) is sharded along its last dim
    lse_spec = P(None, None, seq)
    masks = {key: tuple(case[key]) if key == "window" else case[key]
             for key in ("window", "softcap") if key in case}
    ids = arrays.get(f"{case['name']}/ids")
    ring = shard_map(lambda q, k, v, *ids: rj.ring_attention(
        q, k, v, causal=case["causal"], layout=layout,
        seq_len=n, return_lse=with_lse,
        segment_ids=ids[0] if ids else None, **axes, **masks), mesh,
        (spec,) * (3 + (ids is not None)),
        (spec, lse_spec) if with_lse else spec)
    placed_ids = () if ids is None else (jax.device_put(
        jnp.asarray(ids[:, order].astype(np.int32)),
        NamedSharding(mesh, spec)),)

    def out_and_grads(q, k, v, dout, *dlse):
        out, pullback = jax.vjp(lambda q, k, v: ring(q, k, v, *placed_ids),
                                q, k, v)
        if with_lse:
            return out + tuple(pullback((dout, dlse[0])))
        return (out,) + tuple(pullback(dout))

    args = [place(x) for x in (q, k, v, dout)]
    if with_lse:
        dlse = arrays[f"{case['name']}/dlse"][:, :, order]
        args.append(jax.device_put(jnp.asarray(dlse, jnp.float64 if dt == np.float64
                                               else jnp.float32),
                                   NamedSharding(mesh, lse_spec)))
    step = jax.jit(out_and_grads)
    text = step.lower(*args).as_text()
    results = step(*args)
    back = np.argsort(order)
    names = ("out", "lse", "dq", "dk", "dv") if with_lse else ("out", "dq", "dk", "dv")
    got = {name: np.asarray(r.astype(jnp.float32) if dt.itemsize == 2 else r,
                            dtype=np.float64)[..., back] if name == "lse" else
           np.asarray(r.astype(jnp.float32) if dt.itemsize == 2 else r,
                      dtype=np.float64)[:, back]
           for name, r in zip(names, results)}
    got["targets"] = np.array(sorted({t for t in (
        "ringattn_attn_fwd", "ringattn_attn_fwd_acc", "ringattn_attn_bwd_pre",
        "ringattn_attn_bwd", "ringattn_attn_bwd_acc") if f"@{t}(" in text}))
    got["callbacks"] = np.array("callback" in text)
    got["permutes"] = np.array(text.count("collective_permute"))
    got["all_to_alls"] = np.array(text.count("all_to_all"))
    got["calls"] = np.array(text.count("@ringattn_attn_fwd_acc(") +
                            text.count("@ringattn_attn_bwd_acc("))
    return got


def main():
    cases_path, out_path = sys.argv[1], sys.argv[2]
    arrays = dict(np.load(cases_path))
    cases = json.loads(str(arrays.pop("cases")))
    jax.config.update("jax_enable_x64", True)
    out = {}
    for case in cases:
        for key, value in run_case(case, arrays).items():
            out[f"{case['name']}/{key}"] = value
    np.savez(out_path, **out)


if __name__ == "__main__":
    main()
