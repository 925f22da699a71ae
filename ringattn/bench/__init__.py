"""``ringattn bench``: speed and memory tables, each measured against a
baseline timed in the same run.

host        --cpu (the CPU kernels against NumPy) and --ring (host ranks
            against one rank)
dilated     --dilated (LongNet dilated attention, local and over a ring)
masks       --masks (documents and sliding windows against causal and SDPA)
masks_ring  the sliding window over a ring of host ranks (part of --masks)
ulysses     --ulysses (the ring, hybrid and pure Ulysses on 4 host ranks)
gpu         --gpu (the CUDA kernels against PyTorch SDPA)
gpu_ring    --ring --gpu (the NCCL ring)
jax         --jax (ringattn.jax against JAX's attention and another ring)
plot        --plot FILE (the --cpu and --ring tables as a figure)
timing      the timers they share
"""

__all__ = ["run"]


def run(args):
    """``ringattn bench`` with parsed (CLI-checked) arguments; returns the
    exit status."""
    if args.jax:
        from .jax import run as run_jax

        return run_jax(args)
    from .host import run_cpu, run_ring

    status = 0
    cpu_tables, ring_rows = [], []
    if args.cpu or not (args.ring or args.dilated or args.gpu or args.masks
                        or args.ulysses):
        code, cpu_tables = run_cpu(args)
        status |= code
    if args.ring and not args.gpu:
        code, ring_rows = run_ring(args)
        status |= code
    if args.dilated:
        from .dilated import run as run_dilated

        status |= run_dilated(args)
    if args.masks:
        from .masks import run as run_masks

        status |= run_masks(args)
    if args.ulysses:
        from .ulysses import run as run_ulysses

        status |= run_ulysses(args)
    if args.gpu:
        if args.ring:
            from .gpu_ring import run as run_gpu
        else:
            from .gpu import run as run_gpu
        status |= run_gpu(args)
    if args.plot and (cpu_tables or ring_rows):
        from .plot import draw

        draw(args.plot, cpu_tables, ring_rows)
        print(f"plot written to {args.plot}")
    return status
