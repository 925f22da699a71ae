"""Wall-clock timers shared by the ``ringattn bench`` tables."""

import statistics
import time

__all__ = ["best_time", "median_time"]


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
