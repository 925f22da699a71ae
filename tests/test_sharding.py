"""ra.shard / ra.unshard keep the caller's array kind (JAX arrays stay JAX
arrays) and invert each other for every layout, including n < p."""

import numpy as np
import pytest

import ringattn as ra


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("n", [0, 3, 11])
def test_jax_shards_round_trip_and_stay_jax(jax_module, layout, n):
    jnp = jax_module.numpy
    x = jnp.arange(2 * n * 3, dtype=jnp.float32).reshape(2, n, 3)
    shards = [ra.shard(x, r, 4, layout) for r in range(4)]
    back = ra.unshard(shards, layout)
    expect = [len(i) for i in ra.shard_indices(n, 4, layout)]
    assert (all(isinstance(s, jax_module.Array) for s in shards)
            and [s.shape[1] for s in shards] == expect
            and isinstance(back, jax_module.Array)
            and np.array_equal(np.asarray(back), np.asarray(x)))


def test_buffer_shards_come_back_as_numpy():
    x = np.arange(24, dtype=np.float32).reshape(1, 8, 3)
    buf = ra.from_dlpack(x)
    shards = [ra.shard(buf, r, 2, "zigzag") for r in range(2)]
    assert np.array_equal(ra.unshard(shards, "zigzag"), x)
