"""``ringattn bench --jax``: ringattn inside JAX programs, on this CPU.

Local table: ``ringattn.jax.attention`` (an XLA FFI custom call) against
``jax.nn.dot_product_attention`` (XLA's own attention), forward and
forward+backward under ``jax.jit``, B=1, H=8, D=64, float32.

Ring table: ``ringattn.jax.ring_attention`` under ``jax.shard_map`` against
the Ring Attention authors' JAX ring (the ``ringattention`` package on
PyPI, its ``ring_attention`` blockwise JAX version) on the same 4 CPU
devices (``--xla_force_host_platform_device_count=4``), contiguous layout,
H = H_kv (their ring has no GQA), their query/key chunk sizes set to
ringattn's CPU tile sizes (128 query rows, 64 keys).  Each row also gives
the largest difference between the two rings' outputs.

The devices are made before JAX is imported, so run it in a fresh process
(the ``ringattn`` command does).  Optional packages it needs (ringattention
with flax and einops) are named when missing; the local table runs without
them.
"""

import importlib.util
import os
import sys

from .timing import median_time

DEVICES = 4
Q_CHUNK, K_CHUNK = 128, 64   # RA_CPU_BQ, RA_CPU_BK (csrc/attn_cpu_kern.h)


def _setup_devices():
    if "jax" in sys.modules:
        raise RuntimeError("ringattn bench --jax must start before JAX is "
                           "imported (it sets the number of CPU devices)")
    flag = f"--xla_force_host_platform_device_count={DEVICES}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _authors_ring():
    """The ringattention package's blockwise JAX ring_attention, or the
    reason it cannot be loaded.  Its package __init__ calls an API newer
    JAX no longer has, so the module file is loaded on its own."""
    missing = [m for m in ("ringattention", "flax", "einops")
               if importlib.util.find_spec(m) is None]
    if missing:
        return None, ("not run: pip install ringattention==0.1.2 flax einops "
                      f"(missing: {', '.join(missing)})")
    spec = importlib.util.find_spec("ringattention")
    path = os.path.join(list(spec.submodule_search_locations)[0],
                        "ringattention_jax.py")
    try:
        mod_spec = importlib.util.spec_from_file_location(
            "ringattention_jax_module", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
    except Exception as exc:  # an incompatible version: say so, go on
        return None, f"not run: loading {path} failed: {exc!r}"
    return mod.ring_attention, None


def run_local(jax, rj, seq_lens, repeat):
    import jax.numpy as jnp
    import numpy as np

    B, H, D = 1, 8, 64
    rng = np.random.default_rng(0)
    lines = ["### Local attention under jax.jit (1 CPU device)", "",
             f"B={B}, H={H}, D={D}, float32; jax.nn.dot_product_attention with "
             "implementation='xla'. fwd+bwd is jax.grad of sum(out * w).", "",
             "| S | causal | pass | ringattn.jax ms | jax.nn.dot_product_attention "
             "ms | speed-up |", "|---:|:---:|:---:|---:|---:|---:|"]
    for S in seq_lens:
        q, k, v, w = (jnp.asarray(rng.standard_normal((B, S, H, D), np.float32))
                      for _ in range(4))
        for causal in (False, True):
            impls = {
                "ringattn": lambda q, k, v: rj.attention(q, k, v, causal=causal),
                "xla": lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="xla"),
            }
            for name, loss_of in (("fwd", None), ("fwd+bwd", True)):
                t = {}
                for key, f in impls.items():
                    if loss_of:
                        g = jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) * w),
                                             argnums=(0, 1, 2)))
                    else:
                        g = jax.jit(f)
                    t[key] = median_time(lambda: jax.block_until_ready(g(q, k, v)), repeat)
                lines.append(f"| {S} | {'yes' if causal else 'no'} | {name} | "
                             f"{t['ringattn'] * 1e3:.1f} | {t['xla'] * 1e3:.1f} | "
                             f"{t['xla'] / t['ringattn']:.1f}x |")
                print(lines[-1], flush=True)
    return lines


def run_ring(jax, rj, seq_lens, repeat):
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from ..jax_ring import shard_map

    B, H, D = 1, 8, 64
    theirs, why = _authors_ring()
    devices = jax.devices()[:DEVICES]
    mesh = jax.sharding.Mesh(np.array(devices), ("sp",))
    spec = P(None, "sp")
    lines = [f"### Ring on {len(devices)} CPU devices under jax.shard_map", "",
             f"B={B}, H=H_kv={H}, D={D}, float32, contiguous layout; the "
             f"authors' ring with query_chunk_size={Q_CHUNK}, key_chunk_size="
             f"{K_CHUNK}, float32_logits, causal_block_size=1 when causal. "
             "fwd+bwd is jax.grad of sum(out * w). The device programs share "
             f"the machine's {os.cpu_count()} cores.", ""]
    if why:
        lines.append(f"authors' ring: {why}")
        lines.append("")
    lines += ["| n | causal | pass | ringattn.jax ring ms | authors' ring ms | "
              "speed-up | max abs diff |", "|---:|:---:|:---:|---:|---:|---:|---:|"]
    rng = np.random.default_rng(1)
    for n in seq_lens:
        put = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
        q, k, v, w = (put(rng.standard_normal((B, n, H, D), np.float32))
                      for _ in range(4))
        for causal in (False, True):
            blockwise = dict(causal_block_size=1 if causal else None,
                             query_chunk_size=Q_CHUNK, key_chunk_size=K_CHUNK,
                             deterministic=True, dropout_rng=None, attn_pdrop=0.0,
                             dtype=jnp.float32, policy=jax.checkpoint_policies.nothing_saveable,
                             precision=None, prevent_cse=True)
            impls = {"ringattn": lambda q, k, v: rj.ring_attention(
                q, k, v, axis_name="sp", causal=causal)}
            if theirs is not None:
                impls["authors"] = lambda q, k, v: theirs(
                    q, k, v, None, None, None, "sp", True, blockwise)
            # the authors' code predates shard_map's varying-axes checks
            rings = {key: shard_map(f, mesh, spec, spec, check=key == "ringattn")
                     for key, f in impls.items()}
            outs = {key: np.asarray(jax.jit(r)(q, k, v)) for key, r in rings.items()}
            diff = (f"{np.abs(outs['ringattn'] - outs['authors']).max():.1e}"
                    if "authors" in outs else "n/a")
            for name in ("fwd", "fwd+bwd"):
                t = {}
                for key, r in rings.items():
                    if name == "fwd":
                        g = jax.jit(r)
                    else:
                        g = jax.jit(jax.grad(lambda q, k, v, r=r: jnp.sum(r(q, k, v) * w),
                                             argnums=(0, 1, 2)))
                    t[key] = median_time(lambda: jax.block_until_ready(g(q, k, v)), repeat)
                other = (f"{t['authors'] * 1e3:.1f} | {t['authors'] / t['ringattn']:.1f}x"
                         if "authors" in t else "n/a | n/a")
                lines.append(f"| {n} | {'yes' if causal else 'no'} | {name} | "
                             f"{t['ringattn'] * 1e3:.1f} | {other} | {diff} |")
                print(lines[-1], flush=True)
    return lines


def run(args):
    _setup_devices()
    try:
        import jax
    except ImportError:
        print("ringattn bench --jax: JAX is not installed (pip install jax)")
        return 1
    import ringattn.jax as rj

    if args.seq_lens:
        seq_lens = [int(x) for x in args.seq_lens.split(",")]
    else:
        seq_lens = [1024, 2048] if args.quick else [1024, 4096]
    ring_lens = [2048] if args.quick else [4096, 8192]
    print(f"jax {jax.__version__}, {len(jax.devices())} CPU devices, "
          f"{os.cpu_count()} cores, repeat {args.repeat}", flush=True)
    lines = run_local(jax, rj, seq_lens, args.repeat)
    lines += [""] + run_ring(jax, rj, ring_lens, args.repeat)
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    sys.exit(run(parser.parse_args()))
