"""Wall-clock timers shared by the ``ringattn bench`` tables."""

import statistics
import time

__all__ = ["best_time", "median_time", "best_ring_step"]


def _timed(fn, sync):
    t0 = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - t0


def best_time(fn, repeat, sync=None):
    """Fastest of `repeat` calls of fn(), in seconds; sync(), when given,
    runs after each call inside the timed region (e.g. a device sync)."""
    return min(_timed(fn, sync) for _ in range(repeat))


def median_time(fn, repeat, warmup=1, sync=None):
    """Median of `repeat` timed calls of fn() after `warmup` untimed ones,
    in seconds; sync() as in best_time."""
    for _ in range(warmup):
        fn()
        if sync is not None:
            sync()
    return statistics.median(_timed(fn, sync) for _ in range(repeat))


def best_ring_step(comm, q, k, v, dout, kw, repeat):
    """The fastest of `repeat` ring forward + backward calls on this rank
    (each after a barrier): (forward s, backward s, forward profile,
    backward profile).  kw: the ring's keywords for both calls."""
    import ringattn as ra

    best = None
    for _ in range(repeat):
        fwd, bwd = {}, {}
        comm.barrier()
        t0 = time.perf_counter()
        out, lse = ra.ring_attention(q, k, v, comm, return_lse=True,
                                     profile=fwd, **kw)
        t1 = time.perf_counter()
        comm.barrier()
        t2 = time.perf_counter()
        ra.ring_attention_backward(dout, q, k, v, out, lse, comm,
                                   profile=bwd, **kw)
        t3 = time.perf_counter()
        del out, lse
        if best is None or t1 - t0 + t3 - t2 < best[0] + best[1]:
            best = (t1 - t0, t3 - t2, fwd, bwd)
    return best
