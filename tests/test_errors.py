"""Bad input raises the exception DESIGN.md section 8 names, before any work.

ValueError for shapes, lengths, heads and layouts; TypeError for dtypes and
non-arrays; BufferError for DLPack problems.  Messages name the argument.
"""

import re
import time

import numpy as np
import pytest

import ringattn as ra
from ringattn import testing as rt

from dlpack_producer import HandMadeProducer


def qkv(B=1, S_q=5, S_k=6, H=4, H_kv=2, D=8, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, S_q, H, D)).astype(dtype),
            rng.standard_normal((B, S_k, H_kv, D)).astype(dtype),
            rng.standard_normal((B, S_k, H_kv, D)).astype(dtype))


def forward_state(q, k, v):
    return ra.attention(q, k, v, return_lse=True)


# ------------------------------------------------------------ attention

@pytest.mark.parametrize("which,bad,match", [
    ("q", np.zeros((5, 4, 8), np.float32), r"\bq\b"),                   # 3-d
    ("k", np.zeros((1, 6, 2, 8, 1), np.float32), r"\bk\b"),             # 5-d
    ("k", np.zeros((2, 6, 2, 8), np.float32), r"\bk\b"),                # batch
    ("v", np.zeros((1, 7, 2, 8), np.float32), r"\bv\b"),                # S_k of v
    ("k", np.zeros((1, 6, 2, 16), np.float32), r"\bk\b"),               # head dim
    ("v", np.zeros((1, 6, 2, 16), np.float32), r"\bv\b"),               # head dim
    ("k", np.zeros((1, 6, 3, 8), np.float32), r"head"),                 # 4 % 3 != 0
    ("v", np.zeros((1, 6, 1, 8), np.float32), r"\bv\b"),                # H_kv of v
])
def test_attention_shape_errors(which, bad, match):
    args = dict(zip("qkv", qkv()))
    args[which] = bad
    with pytest.raises(ValueError, match=match):
        ra.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("which,bad,match", [
    ("q", np.zeros((1, 5, 4, 8), np.int32), r"\bq\b"),
    ("k", np.zeros((1, 6, 2, 8), np.float64), r"\bk\b"),                # mixed
    ("v", np.zeros((1, 6, 2, 8), np.float16), r"\bv\b"),                # mixed
    ("q", np.zeros((1, 5, 4, 8), np.complex64), r"\bq\b"),
    ("q", [[[[0.0] * 8] * 4] * 5], r"\bq\b"),                           # list
    ("k", None, r"\bk\b"),
    ("v", "not an array", r"\bv\b"),
])
def test_attention_type_errors(which, bad, match):
    args = dict(zip("qkv", qkv()))
    args[which] = bad
    with pytest.raises(TypeError, match=match):
        ra.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("D", [0, 257, 512])
def test_unusual_head_dims_are_refused_or_correct(D):
    """A head dim the kernels do not support is a ValueError naming q/D, never wrong."""
    q, k, v = qkv(D=D)
    try:
        out = ra.attention(q, k, v, causal=True)
    except ValueError as exc:
        assert re.search(r"\bq\b|head|\bD\b", str(exc)), str(exc)
        return
    rt.assert_close(out, rt.ref_attention(q, k, v, causal=True)[0], "float32")


# ------------------------------------------------------------ backward

def _backward_args():
    q, k, v = qkv()
    out, lse = forward_state(q, k, v)
    return dict(dout=np.ones_like(q), q=q, k=k, v=v, out=out, lse=lse)


@pytest.mark.parametrize("which,bad,match", [
    ("lse", np.zeros((1, 4, 6), np.float32), r"\blse\b"),               # S_q wrong
    ("lse", np.zeros((1, 5, 4), np.float32), r"\blse\b"),               # transposed
    ("lse", np.zeros((1, 4, 5, 1), np.float32), r"\blse\b"),            # 4-d
    ("out", np.zeros((1, 5, 4, 4), np.float32), r"\bout\b"),
    ("dout", np.zeros((1, 6, 4, 8), np.float32), r"\bdout\b"),
    ("dout", np.zeros((5, 4, 8), np.float32), r"\bdout\b"),
])
def test_backward_shape_errors(which, bad, match):
    args = _backward_args()
    args[which] = bad
    with pytest.raises(ValueError, match=match):
        ra.attention_backward(*args.values())


@pytest.mark.parametrize("which,bad,match", [
    ("dout", np.zeros((1, 5, 4, 8), np.int64), r"\bdout\b"),
    ("lse", np.zeros((1, 4, 5), np.int32), r"\blse\b"),
    ("out", None, r"\bout\b"),
    ("dout", [1.0, 2.0], r"\bdout\b"),
    ("dout", np.zeros((1, 5, 4, 8), np.float64), r"\bdout\b"),        # mixed
    ("out", np.zeros((1, 5, 4, 8), np.float16), r"\bout\b"),          # mixed
    ("lse", np.zeros((1, 4, 5), np.float16), r"\blse\b"),             # below float32
])
def test_backward_type_errors(which, bad, match):
    args = _backward_args()
    args[which] = bad
    with pytest.raises(TypeError, match=match):
        ra.attention_backward(*args.values())


# ------------------------------------------------------------ merge

def _merge_args():
    rng = np.random.default_rng(1)
    return dict(out1=rng.standard_normal((1, 5, 4, 8)).astype(np.float32),
                lse1=rng.standard_normal((1, 4, 5)).astype(np.float32),
                out2=rng.standard_normal((1, 5, 4, 8)).astype(np.float32),
                lse2=rng.standard_normal((1, 4, 5)).astype(np.float32))


@pytest.mark.parametrize("which,bad,match", [
    ("out2", np.zeros((1, 6, 4, 8), np.float32), r"\bout2\b"),
    ("out1", np.zeros((1, 5, 4), np.float32), r"\bout1\b"),
    ("lse1", np.zeros((1, 5, 4), np.float32), r"\blse1\b"),
    ("lse2", np.zeros((1, 4, 6), np.float32), r"\blse2\b"),
])
def test_merge_shape_errors(which, bad, match):
    args = _merge_args()
    args[which] = bad
    with pytest.raises(ValueError, match=match):
        ra.merge(*args.values())


@pytest.mark.parametrize("which,bad,match", [
    ("out1", np.zeros((1, 5, 4, 8), np.int16), r"\bout1\b"),
    ("lse2", np.zeros((1, 4, 5), np.int32), r"\blse2\b"),
    ("lse1", None, r"\blse1\b"),
])
def test_merge_type_errors(which, bad, match):
    args = _merge_args()
    args[which] = bad
    with pytest.raises(TypeError, match=match):
        ra.merge(*args.values())


# ------------------------------------------------------------ layouts

@pytest.mark.parametrize("call,match", [
    (lambda: ra.shard_indices(8, 2, "spiral"), "layout"),
    (lambda: ra.shard_indices(8, 0, "zigzag"), "world_size"),
    (lambda: ra.shard(np.zeros((1, 8)), 2, 2, "striped"), "rank"),
    (lambda: ra.unshard([np.zeros((1, 3)), np.zeros((1, 1))], "contiguous"), "shards"),
])
def test_layout_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------ sizes

@pytest.mark.parametrize("shape", [(2**40, 2**40), (2**62, 4), (2**31, 2**31, 2**2)])
def test_empty_refuses_overflowing_sizes(shape):
    with pytest.raises((ValueError, OverflowError)):
        ra.empty(shape, dtype="float32")


def test_empty_refuses_negative_sizes():
    with pytest.raises(ValueError, match="shape"):
        ra.empty((3, -1), dtype="float32")


@pytest.mark.timeout(60)
def test_huge_broadcast_query_is_refused_not_crashed():
    """A zero-stride q claiming 2**45 bytes of output fails cleanly."""
    base = np.zeros(8, np.float32)
    q = np.lib.stride_tricks.as_strided(base, shape=(2**10, 2**30, 1, 8),
                                        strides=(0, 0, 0, 4))
    k = np.zeros((2**10, 1, 1, 8), np.float32)
    with pytest.raises((MemoryError, ValueError, OverflowError)):
        ra.attention(q, k, k)


# ------------------------------------------------------------ DLPack producers

@pytest.mark.parametrize("producer", [
    pytest.param(dict(shape=(2**62, 2**62)), id="numel-overflow"),
    pytest.param(dict(shape=(2**61, 8)), id="bytes-overflow"),
    pytest.param(dict(shape=(4, -3)), id="negative-shape"),
    pytest.param(dict(shape=(4, 4), strides=(2**62, 1)), id="stride-overflow"),
    pytest.param(dict(shape=(1,) * 9), id="too-many-dims"),
    pytest.param(dict(shape=(1, 2, 1, 8), null_shape=True), id="shape-NULL"),
    pytest.param(dict(shape=(1, 2, 1, 8), null_data=True), id="data-NULL"),
    pytest.param(dict(shape=(1, 2, 1, 8), byte_offset=2**63), id="offset-2**63"),
    pytest.param(dict(shape=(1, 2, 1, 8), byte_offset=2**64 - 8),
                 id="offset-wraps"),
    pytest.param(dict(shape=(1, 2, 1, 8), ndim=2**31 - 1), id="ndim-huge"),
    pytest.param(dict(shape=(1, 2, 1, 8), ndim=-1), id="ndim-negative"),
    pytest.param(dict(shape=(3, 8), strides=(-2**62, 1)), id="negative-stride-overflow"),
    pytest.param(dict(shape=(3, 8), strides=(-2**63, 1)), id="stride-int64-min"),
    pytest.param(dict(shape=(4, 4), strides=(2**60, 2**60)), id="stride-sum-overflow"),
    pytest.param(dict(shape=(2**31, 2**31, 4)), id="numel-bytes-overflow"),
])
def test_bad_dlpack_metadata_is_refused(producer):
    """Malformed capsules raise BufferError naming the argument, never crash."""
    with pytest.raises(BufferError, match=r"^q: "):
        ra.attention(HandMadeProducer(**producer), *qkv(S_q=2, S_k=2, H=1, H_kv=1)[1:])
    with pytest.raises(BufferError, match=r"^x: "):
        ra.from_dlpack(HandMadeProducer(**producer))


def test_dlpack_data_below_negative_strides_is_refused():
    """Negative strides that reach below address 0 (data near NULL)."""
    producer = HandMadeProducer(shape=(3, 8), strides=(-8, 1))
    producer.managed.dl_tensor.data = 16
    with pytest.raises(BufferError, match="does not address"):
        ra.from_dlpack(producer)


def test_empty_dlpack_tensor_may_have_null_data():
    buf = ra.from_dlpack(HandMadeProducer(shape=(0, 8), null_data=True))
    assert buf.shape == (0, 8)


class DeviceRaises(HandMadeProducer):
    def __dlpack_device__(self):
        raise RuntimeError("no device today")


def test_dlpack_device_errors_name_the_argument():
    q, k, v = qkv(S_q=2, S_k=2, H=1, H_kv=1)
    with pytest.raises(BufferError, match=r"^k: __dlpack_device__ .*no device today") as info:
        ra.attention(q, DeviceRaises(shape=(1, 2, 1, 8)), v)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_buffer_of_an_unsupported_numpy_dtype_names_it():
    with pytest.raises(TypeError, match=r"complex256|clongdouble"):
        ra.Buffer(np.zeros(4, np.clongdouble))


def test_merge_with_a_wrong_lse1_dtype_blames_lse1():
    args = _merge_args()
    args["lse1"] = args["lse1"].astype(np.float64)
    with pytest.raises(TypeError, match=r"^lse1: "):
        ra.merge(*args.values())
    args = _merge_args()
    args["lse2"] = args["lse2"].astype(np.float64)
    with pytest.raises(TypeError, match=r"^lse2: "):
        ra.merge(*args.values())


def test_vector_lanes_are_refused():
    with pytest.raises((BufferError, TypeError)):
        ra.from_dlpack(HandMadeProducer(shape=(4,), lanes=4))


def test_attention_refuses_non_float_dlpack_dtype():
    producer = HandMadeProducer(shape=(1, 2, 1, 8), code=0, bits=32)  # int32
    q, k, v = qkv(S_q=2, S_k=2, H=1, H_kv=1)
    with pytest.raises(TypeError, match=r"\bq\b"):
        ra.attention(producer, k, v)


def test_from_dlpack_refuses_non_arrays():
    with pytest.raises(TypeError):
        ra.from_dlpack([1.0, 2.0])


# ------------------------------------------------------------ boolean flags

def _one_rank():
    return ra.ThreadsGroup(1).comm(0)


def _flag_calls():
    q, k, v = qkv(S_k=5)
    out, lse = forward_state(q, k, v)
    grads = (np.ones_like(q), q, k, v, out, lse)
    dil = ([4], [2])
    ring = dict(comm=_one_rank())
    return {
        "attention causal": lambda b: ra.attention(q, k, v, causal=b),
        "attention return_lse": lambda b: ra.attention(q, k, v, return_lse=b),
        "attention_backward causal":
            lambda b: ra.attention_backward(*grads, causal=b),
        "attention_backward deterministic":
            lambda b: ra.attention_backward(*grads, deterministic=b),
        "dilated_attention causal":
            lambda b: ra.dilated_attention(q, k, v, *dil, causal=b),
        "dilated_attention return_lse":
            lambda b: ra.dilated_attention(q, k, v, *dil, return_lse=b),
        "dilated_attention_backward causal":
            lambda b: ra.dilated_attention_backward(*grads, *dil, causal=b),
        "DilatedAttention causal": lambda b: ra.DilatedAttention(*dil, causal=b),
        "DilatedAttention() return_lse":
            lambda b: ra.DilatedAttention(*dil)(q, k, v, return_lse=b),
        "ring_attention causal":
            lambda b: ra.ring_attention(q, k, v, causal=b, **ring),
        "ring_attention return_lse":
            lambda b: ra.ring_attention(q, k, v, return_lse=b, **ring),
        "ring_attention_backward causal":
            lambda b: ra.ring_attention_backward(*grads, causal=b, **ring),
        "ring_dilated_attention causal":
            lambda b: ra.ring_dilated_attention(q, k, v, segment_lengths=[4],
                                                dilation_rates=[2], causal=b,
                                                **ring),
        "ring_dilated_attention return_lse":
            lambda b: ra.ring_dilated_attention(q, k, v, segment_lengths=[4],
                                                dilation_rates=[2],
                                                return_lse=b, **ring),
        "ring_dilated_attention_backward causal":
            lambda b: ra.ring_dilated_attention_backward(
                *grads, segment_lengths=[4], dilation_rates=[2], causal=b,
                **ring),
    }


FLAG_CALLS = list(_flag_calls())


@pytest.mark.parametrize("bad", ["false", "True", None, 0.0, 2, [True]])
@pytest.mark.parametrize("call", FLAG_CALLS)
def test_flags_refuse_anything_but_a_bool(call, bad):
    """causal="false" must not run causal: every flag is a TypeError
    naming it unless it is a bool (or 0/1, numpy.bool_)."""
    flag = call.split()[-1]
    with pytest.raises(TypeError, match=rf"^{flag}: expected a bool"):
        _flag_calls()[call](bad)


@pytest.mark.parametrize("good", [True, False, np.bool_(True), 0, 1])
@pytest.mark.parametrize("call", FLAG_CALLS)
def test_flags_take_bools(call, good):
    _flag_calls()[call](good)


# ------------------------------------------------------------ ring arguments

def _ring_call(entry, comm, overrides):
    """Call a ring entry point on rank 0 of `comm` with `overrides` applied
    to q, k, v (arrays) and the keywords."""
    rng = np.random.default_rng(3)
    a = dict(q=rng.standard_normal((1, 6, 4, 8)).astype(np.float32),
             k=rng.standard_normal((1, 6, 2, 8)).astype(np.float32),
             v=rng.standard_normal((1, 6, 2, 8)).astype(np.float32))
    arrays = {n: overrides.pop(n) for n in ("q", "k", "v") if n in overrides}
    a.update(arrays)
    q, k, v = a["q"], a["k"], a["v"]
    dout = np.ones_like(q)
    lse = np.zeros((1, q.shape[2], q.shape[1]), np.float32)
    dil = dict(segment_lengths=[4], dilation_rates=[2])
    if entry == "ring_attention":
        return ra.ring_attention(q, k, v, comm, **overrides)
    if entry == "ring_attention_backward":
        return ra.ring_attention_backward(dout, q, k, v, q, lse, comm,
                                          **overrides)
    if entry == "ring_dilated_attention":
        return ra.ring_dilated_attention(q, k, v, comm, **dil, **overrides)
    return ra.ring_dilated_attention_backward(dout, q, k, v, q, lse, comm,
                                              **dil, **overrides)


RING_ENTRIES = ["ring_attention", "ring_attention_backward",
                "ring_dilated_attention", "ring_dilated_attention_backward"]

RING_BAD = [
    # (overrides, exception, pattern)
    (dict(k=np.zeros((1, 6, 2, 16), np.float32)), ValueError, r"^k: .*head_dim"),
    (dict(v=np.zeros((1, 6, 2, 16), np.float32)), ValueError, r"^v: .*head_dim"),
    (dict(k=np.zeros((1, 6, 3, 8), np.float32),
          v=np.zeros((1, 6, 3, 8), np.float32)), ValueError, r"^k: .*heads"),
    (dict(v=np.zeros((1, 6, 1, 8), np.float32)), ValueError, r"^v: .*kv heads"),
    (dict(k=np.zeros((1, 6, 2, 8), np.float64)), TypeError, r"^k: .*dtype"),
    (dict(v=np.zeros((1, 6, 2, 8), np.float16)), TypeError, r"^v: .*dtype"),
    (dict(q=np.zeros((6, 4, 8), np.float32)), ValueError, r"^q: "),
    (dict(k=np.zeros((1, 5, 2, 8), np.float32),
          v=np.zeros((1, 5, 2, 8), np.float32)), ValueError, r"^k: "),
    (dict(num_threads=-3), ValueError, r"^num_threads: "),
    (dict(num_threads=2**40), ValueError, r"^num_threads: "),
    (dict(num_threads="4"), TypeError, r"^num_threads: "),
    (dict(num_threads=2.0), TypeError, r"^num_threads: "),
    (dict(scale="x"), TypeError, r"^scale: "),
    (dict(scale=float("nan")), ValueError, r"^scale: "),
    (dict(scale=float("inf")), ValueError, r"^scale: "),
    (dict(timeout=-1), ValueError, r"^timeout: "),
    (dict(timeout=0), ValueError, r"^timeout: "),
    (dict(timeout=float("nan")), ValueError, r"^timeout: "),
    (dict(timeout=float("inf")), ValueError, r"^timeout: "),
    (dict(timeout="1"), TypeError, r"^timeout: "),
    (dict(progress=5), TypeError, r"^progress: "),
    (dict(profile=[]), TypeError, r"^profile: "),
    (dict(layout="spiral"), ValueError, r"^layout: "),
    (dict(layout=None), ValueError, r"^layout: "),
    (dict(seq_len=-1), ValueError, r"^seq_len: "),
    (dict(seq_len="6"), TypeError, r"^seq_len: "),
    (dict(seq_len=6.0), TypeError, r"^seq_len: "),
    (dict(comm_is_not_a_comm=True), TypeError, r"^comm: "),
]


def _takes(entry, overrides):
    """Whether `entry` has every keyword in `overrides`."""
    missing = {"progress": "dilated", "profile": "backward"}
    return not any(word in entry for key, word in missing.items()
                   if key in overrides)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [1, 2], ids=["one-rank", "two-ranks"])
@pytest.mark.parametrize("entry,case", [
    (entry, case) for entry in RING_ENTRIES for case in range(len(RING_BAD))
    if _takes(entry, RING_BAD[case][0])])
def test_ring_validates_before_any_communication(entry, case, world):
    """Rank 0 of a 2-rank group whose peer never calls: a bad argument is
    refused at once (a call that communicated would wait for the peer)."""
    overrides, exc, pattern = RING_BAD[case]
    overrides = dict(overrides)
    comm = ra.ThreadsGroup(world, timeout=30).comm(0)
    if overrides.pop("comm_is_not_a_comm", False):
        comm = object()
    start = time.monotonic()
    with pytest.raises(exc, match=pattern):
        _ring_call(entry, comm, overrides)
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("overrides", [
    dict(k=np.zeros((1, 6, 2, 16), np.float32)),
    dict(v=np.zeros((1, 6, 1, 8), np.float32)),
    dict(k=np.zeros((1, 6, 2, 8), np.float64)),
    dict(scale="x"), dict(scale=float("nan")),
], ids=["head_dim", "kv-heads", "dtype", "scale-type", "scale-nan"])
def test_ring_and_local_refuse_with_the_same_message(overrides):
    """The ring runs the local entry point's own checks."""
    rng = np.random.default_rng(4)
    a = dict(q=rng.standard_normal((1, 6, 4, 8)).astype(np.float32),
             k=rng.standard_normal((1, 6, 2, 8)).astype(np.float32),
             v=rng.standard_normal((1, 6, 2, 8)).astype(np.float32))
    scale = overrides.pop("scale", None)
    a.update(overrides)
    with pytest.raises((TypeError, ValueError)) as local:
        ra.attention(a["q"], a["k"], a["v"], scale=scale)
    with pytest.raises(type(local.value)) as ring:
        ra.ring_attention(a["q"], a["k"], a["v"], _one_rank(), scale=scale)
    assert str(ring.value) == str(local.value)


@pytest.mark.parametrize("name", ["attention", "dilated_attention",
                                  "ring_attention", "ring_dilated_attention"])
@pytest.mark.parametrize("flag", ["causal", "return_lse"])
def test_jax_wrappers_check_flags(name, flag):
    """ringattn.jax's entry points refuse a non-bool flag before tracing."""
    pytest.importorskip("jax")
    rj = pytest.importorskip("ringattn.jax")
    q, k, v = qkv(S_k=5)
    args = {"attention": (q, k, v), "dilated_attention": (q, k, v, [4], [2]),
            "ring_attention": (q, k, v, _one_rank()),
            "ring_dilated_attention": (q, k, v, _one_rank(), [4], [2])}[name]
    with pytest.raises(TypeError, match=rf"^{flag}: expected a bool"):
        getattr(rj, name)(*args, **{flag: "false"})
