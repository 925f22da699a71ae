"""Bounded fuzzing of every public entry point (hypothesis, derandomized).

Each example draws a valid call and, often, spoils one argument (a shape,
a dtype, a flag, the scale, a whole array).  The call must either raise
ValueError / TypeError / BufferError naming one of its arguments, or return
a result that matches the float64 reference (``ringattn.testing``, the
dtype's tolerance), with no NaN for finite input.  A crash or a hang fails
the run (pytest-timeout bounds each test).

The last section holds the input classes of the second hardening round:
copies between overlapping views, NaN / +-inf inputs (NaN goes where the
reference says), 64-bit segment ids and window scalars under jax.jit, and
dilation rates, segment lengths, positions and window sides up to the ends
of int64 -- so that CI's ASan/UBSan stage runs them too.

The examples are derandomized (the same on every run, so CI is
reproducible) and few: the whole file takes a few seconds.
"""

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ringattn as ra
from ringattn import testing as rt

from dlpack_producer import HandMadeProducer

ARG_ERRORS = (ValueError, TypeError, BufferError)
DTYPES = ["float32", "float64", "float16", "bfloat16"]
LAYOUTS = ["contiguous", "zigzag", "striped"]


def fuzz(examples):
    return settings(max_examples=examples, deadline=None, derandomize=True,
                    database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def names_an_argument(err, names):
    text = str(err)
    assert any(re.search(rf"(^|[\s(,]){re.escape(n)}\b", text) for n in names), \
        f"{type(err).__name__} names none of {names}: {text}"


def attempt(call, names):
    """call()'s result, or None when it raised an argument error naming
    one of `names`."""
    try:
        result = call()
    except ARG_ERRORS as err:
        names_an_argument(err, names)
        event(f"refused: {type(err).__name__}")
        return None
    event("accepted")
    return result


def close(actual, expected, dtype, names):
    bad = rt.close_failures(actual, expected, dtype, names)
    assert not bad, "\n".join(bad)


def arrays(seed, shapes, dtype, magnitude=1.0):
    rng = np.random.default_rng(seed)
    return [(magnitude * rng.standard_normal(s)).astype(rt.np_dtype(dtype))
            for s in shapes]


# ---- spoilers: what one argument may become --------------------------------
# Every example spoils at most one argument (half of them none), so that
# accepted calls, checked against the reference, are common too.

GOOD_FLAGS, BAD_FLAGS = [True, False, np.bool_(True), 0, 1], \
    ["false", None, 2, 0.5, [True]]
GOOD_SCALES, BAD_SCALES = [None, None, 0.3, 0.0, -1.5, 2, np.float32(0.7)], \
    [float("nan"), float("inf"), "x", [1.0]]


def pick_target(draw, targets):
    """The argument to spoil (None for a valid call, half of the time)."""
    return draw(st.sampled_from([None] * len(targets) + list(targets)))


def flag(draw, name, target):
    return draw(st.sampled_from(BAD_FLAGS if target == name else GOOD_FLAGS))


def scale(draw, target):
    return draw(st.sampled_from(BAD_SCALES if target == "scale"
                                else GOOD_SCALES))


def spoil_array(draw, x):
    """x made wrong in one way (shape, dtype, kind)."""
    how = draw(st.sampled_from(["dim", "ndim", "int", "complex", "f64", "f16",
                                "list", "none"]))
    if how == "dim":
        shape = list(x.shape)
        i = draw(st.integers(0, len(shape) - 1))
        shape[i] += draw(st.sampled_from([-1, 1, 3]))
        return np.zeros([max(s, 0) for s in shape], x.dtype)
    if how == "ndim":
        return np.zeros(x.shape[:-1], x.dtype)
    if how == "int":
        return np.zeros(x.shape, np.int32)
    if how == "complex":
        return np.zeros(x.shape, np.complex64)
    if how == "f64":
        return x.astype(np.float64)
    if how == "f16":
        return x.astype(np.float16)
    if how == "list":
        return x.tolist()
    return None


def spoil_arrays(draw, args, target):
    if target in args:
        args[target] = spoil_array(draw, args[target])
    return args


def as_flag(x):
    return bool(x)


# ---- attention ---------------------------------------------------------------

@st.composite
def attention_calls(draw):
    B, Sq, Sk = draw(st.integers(1, 2)), draw(st.integers(0, 9)), \
        draw(st.integers(0, 9))
    H = draw(st.sampled_from([1, 2, 4]))
    Hkv = draw(st.sampled_from([1, 2, 4, 3]))
    Hkv = Hkv if Hkv <= H else H
    D = draw(st.sampled_from([1, 3, 8, 17, 64, 0, 300]))
    dtype = draw(st.sampled_from(DTYPES))
    q, k, v = arrays(draw(st.integers(0, 2**31)),
                     [(B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D)], dtype,
                     draw(st.sampled_from([1.0, 10.0])))
    target = pick_target(draw, ["q", "k", "v", "causal", "scale",
                                "return_lse"])
    args = spoil_arrays(draw, {"q": q, "k": k, "v": v}, target)
    return (args, flag(draw, "causal", target), scale(draw, target),
            flag(draw, "return_lse", target), dtype)


@pytest.mark.timeout(120)
@fuzz(60)
@given(attention_calls())
def test_attention(call):
    args, causal, scale, return_lse, dtype = call
    got = attempt(lambda: ra.attention(args["q"], args["k"], args["v"],
                                       causal=causal, scale=scale,
                                       return_lse=return_lse),
                  ["q", "k", "v", "causal", "scale", "return_lse"])
    if got is None:
        return
    out, lse = got if return_lse else (got, None)
    ref_out, ref_lse = rt.ref_attention(args["q"], args["k"], args["v"],
                                        causal=as_flag(causal), scale=scale)
    close([out], [ref_out], dtype, ["out"])
    if return_lse:
        close([lse], [ref_lse], "float64" if dtype == "float64" else "float32",
              ["lse"])


@st.composite
def backward_calls(draw):
    B, S, H = draw(st.integers(1, 2)), draw(st.integers(0, 9)), \
        draw(st.sampled_from([1, 2, 4]))
    Hkv, D = draw(st.sampled_from([1, H])), draw(st.sampled_from([1, 8, 17]))
    dtype = draw(st.sampled_from(DTYPES))
    causal = draw(st.booleans())
    q, k, v, dout = arrays(draw(st.integers(0, 2**31)),
                           [(B, S, H, D), (B, S, Hkv, D), (B, S, Hkv, D),
                            (B, S, H, D)], dtype)
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    target = pick_target(draw, ["dout", "q", "k", "v", "out", "lse",
                                "causal", "deterministic"])
    args = spoil_arrays(draw, dict(dout=dout, q=q, k=k, v=v, out=out,
                                   lse=lse), target)
    flags = {"causal": causal if target != "causal"
             else draw(st.sampled_from(BAD_FLAGS)),
             "deterministic": flag(draw, "deterministic", target)}
    return args, flags, dtype, out


@pytest.mark.timeout(120)
@fuzz(40)
@given(backward_calls())
def test_attention_backward(call):
    args, flags, dtype, fwd_out = call
    got = attempt(lambda: ra.attention_backward(*args.values(), **flags),
                  list(args) + ["causal", "deterministic"])
    if got is None:
        return
    ref = rt.ref_attention_backward(args["dout"], args["q"], args["k"],
                                    args["v"], causal=as_flag(flags["causal"]),
                                    out=fwd_out)
    close(got, ref, dtype, ["dq", "dk", "dv"])


@st.composite
def merge_calls(draw):
    B, S, H, D = draw(st.integers(1, 2)), draw(st.integers(0, 7)), \
        draw(st.integers(1, 3)), draw(st.sampled_from([1, 8, 20]))
    dtype = draw(st.sampled_from(DTYPES))
    acc = "float64" if dtype == "float64" else "float32"
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    parts = []
    for _ in range(2):
        out = rng.standard_normal((B, S, H, D)).astype(rt.np_dtype(dtype))
        lse = (3 * rng.standard_normal((B, H, S))).astype(acc)
        lse[rng.random((B, H, S)) < 0.2] = -np.inf
        parts += [out, lse]
    args = dict(zip(["out1", "lse1", "out2", "lse2"], parts))
    return spoil_arrays(draw, args, pick_target(draw, list(args))), dtype


@pytest.mark.timeout(120)
@fuzz(40)
@given(merge_calls())
def test_merge(call):
    args, dtype = call
    got = attempt(lambda: ra.merge(*args.values()), list(args))
    if got is None:
        return
    ref_out, ref_lse = rt.ref_merge(*args.values())
    close([got[0]], [ref_out], dtype, ["out"])
    close([got[1]], [ref_lse], "float64" if dtype == "float64" else "float32",
          ["lse"])


# ---- dilated attention -------------------------------------------------------

BAD_CONFIG_VALUES = [0, -1, 2.0, "a", True, None]


@st.composite
def dilated_calls(draw):
    n, H = draw(st.integers(0, 20)), draw(st.sampled_from([1, 2, 4]))
    Hkv, D = draw(st.sampled_from([1, H])), draw(st.sampled_from([1, 8]))
    dtype = draw(st.sampled_from(DTYPES))
    m = draw(st.integers(1, 3))
    segs = draw(st.lists(st.integers(1, 12), min_size=m, max_size=m))
    rates = draw(st.lists(st.integers(1, 4), min_size=m, max_size=m))
    q, k, v, dout = arrays(draw(st.integers(0, 2**31)),
                           [(1, n, H, D), (1, n, Hkv, D), (1, n, Hkv, D),
                            (1, n, H, D)], dtype)
    target = pick_target(draw, ["q", "k", "v", "segment_lengths",
                                "dilation_rates", "causal", "scale"])
    args = spoil_arrays(draw, {"q": q, "k": k, "v": v}, target)
    if target == "segment_lengths":
        segs[draw(st.integers(0, m - 1))] = draw(
            st.sampled_from(BAD_CONFIG_VALUES))
    if target == "dilation_rates":
        rates = draw(st.sampled_from([
            rates + [1], rates[:-1], rates[:-1] + [draw(
                st.sampled_from(BAD_CONFIG_VALUES))]]))
    return (args, dout, segs, rates, flag(draw, "causal", target),
            scale(draw, target), dtype)


@pytest.mark.timeout(120)
@fuzz(40)
@given(dilated_calls())
def test_dilated_attention_and_backward(call):
    args, dout, segs, rates, causal, scale, dtype = call
    names = ["q", "k", "v", "segment_lengths", "dilation_rates", "causal",
             "scale", "return_lse"]
    got = attempt(lambda: ra.dilated_attention(
        args["q"], args["k"], args["v"], segs, rates, causal=causal,
        scale=scale, return_lse=True), names)
    if got is None:
        return
    q, k, v = args["q"], args["k"], args["v"]
    bias = rt.dilated_bias(q.shape[1], segs, rates, q.shape[2])
    ref = rt.ref_attention(q, k, v, causal=as_flag(causal), scale=scale,
                           bias=bias)
    close([got[0]], [ref[0]], dtype, ["out"])
    grads = ra.dilated_attention_backward(dout, q, k, v, got[0], got[1], segs,
                                          rates, causal=causal, scale=scale)
    ref_grads = rt.ref_attention_backward(dout, q, k, v, causal=as_flag(causal),
                                          scale=scale, bias=bias, out=got[0])
    close(grads, ref_grads, dtype, ["dq", "dk", "dv"])


# ---- sharding ----------------------------------------------------------------

def spec_indices(n, p, layout):
    """DESIGN §4, written out."""
    if layout == "contiguous":
        return np.array_split(np.arange(n), p)
    if layout == "zigzag":
        chunks = np.array_split(np.arange(n), 2 * p)
        return [np.concatenate([chunks[r], chunks[2 * p - 1 - r]])
                for r in range(p)]
    return [np.arange(r, n, p) for r in range(p)]


@pytest.mark.timeout(120)
@fuzz(60)
@given(n=st.one_of(st.integers(0, 40), st.sampled_from([-1, 2.5, "8", None])),
       p=st.one_of(st.integers(1, 6), st.sampled_from([0, -2, True, 1.0])),
       layout=st.sampled_from(LAYOUTS + ["spiral", None]),
       axis=st.sampled_from([1, -2, 0, 3, "1"]), seed=st.integers(0, 99))
def test_shard_indices_shard_and_unshard(n, p, layout, axis, seed):
    idx = attempt(lambda: ra.shard_indices(n, p, layout),
                  ["n", "world_size", "layout"])
    if idx is None:
        return
    want = spec_indices(n, p, layout)
    assert [list(a) for a in idx] == [list(b) for b in want]
    dim = axis % 3 if isinstance(axis, int) and -3 <= axis < 3 else 1
    shape = [2, 2, 2]
    shape[dim] = n
    x = np.random.default_rng(seed).standard_normal(shape)
    shards = attempt(lambda: [ra.shard(x, r, p, layout, axis=axis)
                              for r in range(p)], ["axis"])
    if shards is None:
        return
    assert [s.shape[dim] for s in shards] == [len(a) for a in want]
    back = ra.unshard(shards, layout, axis=axis)
    np.testing.assert_array_equal(back, x)


# ---- the ring (threads, p <= 3) ---------------------------------------------

def ring_call(comm, q, k, v, dout, layout, causal, pass_seq_len, bad):
    r, p = comm.rank, comm.size
    qs, ks, vs, ds = (ra.shard(x, r, p, layout) for x in (q, k, v, dout))
    kw = dict(causal=causal, layout=layout,
              seq_len=q.shape[1] if pass_seq_len else None)
    kw.update(bad)
    if "k" in kw:
        ks = kw.pop("k")
    out, lse = ra.ring_attention(qs, ks, vs, comm, return_lse=True, **kw)
    kw.pop("profile", None)
    grads = ra.ring_attention_backward(ds, qs, ks, vs, out, lse, comm, **kw)
    return (out, lse) + tuple(grads)


RING_SPOILERS = [{}, {}, {}, {"causal": "no"}, {"scale": float("nan")},
                 {"scale": "x"}, {"num_threads": -1}, {"num_threads": 2**40},
                 {"timeout": 0}, {"timeout": float("inf")},
                 {"layout": "diagonal"}, {"seq_len": -3},
                 {"progress": 7}, {"k": np.zeros((1, 1, 1, 1))}]


@pytest.mark.timeout(300)
@fuzz(15)
@given(p=st.integers(1, 3), n=st.integers(0, 12),
       layout=st.sampled_from(LAYOUTS), causal=st.booleans(),
       heads=st.sampled_from([(2, 1), (2, 2), (4, 2)]),
       dtype=st.sampled_from(["float32", "float64"]),
       pass_seq_len=st.booleans(), bad=st.sampled_from(RING_SPOILERS),
       seed=st.integers(0, 99))
def test_ring_attention(p, n, layout, causal, heads, dtype, pass_seq_len, bad,
                        seed):
    H, Hkv = heads
    q, k, v, dout = arrays(seed, [(1, n, H, 8), (1, n, Hkv, 8),
                                  (1, n, Hkv, 8), (1, n, H, 8)], dtype)
    try:
        results = ra.launch(ring_call, p,
                            args=(q, k, v, dout, layout, causal, pass_seq_len,
                                  bad), backend="threads", timeout=60)
    except ra.LaunchError as err:
        root = err.failures[0]
        assert root["exc_type"] in ("ValueError", "TypeError"), str(err)
        names_an_argument(root["message"], ["q", "k", "v", "causal", "scale",
                                            "num_threads", "timeout",
                                            "layout", "seq_len", "progress"])
        assert bad, f"a valid call failed: {err}"
        return
    assert not bad, f"{bad} was accepted"
    got = [ra.unshard([res[i] for res in results], layout,
                      axis=2 if i == 1 else 1) for i in range(5)]
    pos = np.arange(n)
    ref = rt.ref_attention(q, k, v, causal=causal, q_pos=pos, k_pos=pos)
    ref += rt.ref_attention_backward(dout, q, k, v, causal=causal, q_pos=pos,
                                     k_pos=pos)
    close(got, ref, dtype, ["out", "lse", "dq", "dk", "dv"])


# ---- Buffer and from_dlpack ----------------------------------------------------

NUMPY_DTYPES = ["float16", "float32", "float64", "bfloat16", "int8", "int64",
                "uint16", "bool", "complex64", "complex128", "clongdouble",
                "longdouble", "object", "U3", "datetime64[s]", ">f4"]


@pytest.mark.timeout(120)
@fuzz(60)
@given(dtype=st.sampled_from(NUMPY_DTYPES),
       shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
       view=st.sampled_from(["plain", "step", "reverse", "transpose",
                             "readonly"]))
def test_buffer_from_numpy(dtype, shape, view):
    arr = np.zeros(shape, rt.np_dtype(dtype) if dtype == "bfloat16" else dtype)
    if arr.dtype.kind in "fc":
        arr[...] = np.arange(arr.size).reshape(arr.shape) if arr.size else 0
    if view == "step" and arr.ndim:
        arr = arr[::2]
    elif view == "reverse" and arr.ndim:
        arr = arr[::-1]
    elif view == "transpose":
        arr = arr.T
    elif view == "readonly":
        arr.setflags(write=False)
    buf = attempt(lambda: ra.Buffer(arr), ["obj"])
    if buf is None:
        return
    assert buf.shape == arr.shape
    np.testing.assert_array_equal(buf.numpy(), arr)


@st.composite
def dlpack_metadata(draw):
    """Sound metadata with, half of the time, one field made malformed."""
    shape = draw(st.lists(st.integers(0, 3), min_size=0, max_size=5))
    meta = dict(shape=shape, strides=None, code=2, bits=32, lanes=1,
                device=(1, 0), ndim=None, null_shape=False, null_data=False,
                byte_offset=0)
    target = pick_target(draw, ["shape", "strides", "code", "bits", "lanes",
                                "device", "ndim", "null_shape", "null_data",
                                "byte_offset"])
    bad = {
        "shape": lambda: shape + [draw(st.sampled_from([-1, 2**62, 2**40]))],
        "strides": lambda: [draw(st.sampled_from([2**62, -2**63, 2**61,
                                                  -2**62]))] * len(shape),
        "code": lambda: draw(st.sampled_from([0, 1, 5, 6, 200])),
        "bits": lambda: draw(st.sampled_from([0, 1, 12, 255])),
        "lanes": lambda: draw(st.sampled_from([0, 4])),
        "device": lambda: draw(st.sampled_from([(2, 0), (13, 0), (7, 3)])),
        "ndim": lambda: draw(st.sampled_from([-1, 2**31 - 1, 9])),
        "null_shape": lambda: bool(shape),
        "null_data": lambda: True,
        "byte_offset": lambda: draw(st.sampled_from([2**63, 2**64 - 4])),
    }
    if target is not None:
        meta[target] = bad[target]()
    return meta


@pytest.mark.timeout(120)
@fuzz(60)
@given(dlpack_metadata())
def test_from_dlpack(meta):
    producer = HandMadeProducer(**meta)
    buf = attempt(lambda: ra.from_dlpack(producer), ["x"])
    if buf is None:
        return
    # accepted: the metadata was sound (the data is not read: a producer
    # may claim more than it holds)
    assert buf.shape == tuple(meta["shape"])
    assert min(meta["shape"], default=0) >= 0


# ---- hardening, round 2: overlap, NaN/inf, wide ids and windows, huge values --

VIEWS = [np.s_[:], np.s_[1:], np.s_[:-1], np.s_[::-1], np.s_[::2], np.s_[1::2],
         np.s_[:, 1:], np.s_[:, :-1], np.s_[:, ::-1], np.s_[2:, ::2]]


@pytest.mark.timeout(120)
@fuzz(60)
@given(dtype=st.sampled_from(DTYPES + ["int32", "int64", "uint8"]),
       rows=st.integers(2, 7), cols=st.integers(2, 9),
       dst=st.sampled_from(VIEWS), src=st.sampled_from(VIEWS),
       transpose=st.booleans(), seed=st.integers(0, 99))
def test_overlapping_copies(dtype, rows, cols, dst, src, transpose, seed):
    """Two views of one array: np.copyto's answer (as through a temporary),
    or a ValueError when their shapes differ."""
    base = (np.random.default_rng(seed).integers(0, 100, (rows, cols))
            .astype(rt.np_dtype(dtype)))
    want = base.copy()
    d_want, s_want = want[dst], want[src]
    d, s = base[dst], base[src]
    if transpose:
        d_want, d = d_want.T, d.T
    if d.shape != s.shape:
        with pytest.raises(ValueError, match="shape"):
            ra.from_dlpack(d).copy_(s)
        return
    np.copyto(d_want, s_want)
    ra.from_dlpack(d).copy_(s)
    np.testing.assert_array_equal(base, want)


NON_FINITE = [np.nan, np.inf, -np.inf]


@st.composite
def non_finite_calls(draw):
    """A small masked attention with a few NaN / +-inf entries in q, k or v."""
    B, Sq, Sk = draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    H, D = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 4, 8]))
    dtype = draw(st.sampled_from(["float32", "float64"]))
    q, k, v = arrays(draw(st.integers(0, 2**31)),
                     [(B, Sq, H, D), (B, Sk, H, D), (B, Sk, H, D)], "float64")
    for _ in range(draw(st.integers(1, 3))):
        x = draw(st.sampled_from([q, k, v]))
        idx = tuple(draw(st.integers(0, n - 1)) for n in x.shape)
        x[idx] = draw(st.sampled_from(NON_FINITE))
    if draw(st.booleans()):                     # inf * 0 somewhere
        k[..., 0] = 0.0
    kw = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        kw["window"] = (draw(st.sampled_from([0, 1, 3, None])),
                        draw(st.sampled_from([0, 2, None])))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 3.0]))
    if draw(st.booleans()) and Sq == Sk:
        kw["segment_ids"] = np.sort(np.random.default_rng(Sq).integers(0, 3, (B, Sq)),
                                    axis=1).astype(np.int32)
    dt = rt.np_dtype(dtype)
    dout = np.random.default_rng(Sk).standard_normal(q.shape).astype(dt)
    return q.astype(dt), k.astype(dt), v.astype(dt), dout, kw, dtype


@pytest.mark.timeout(120)
@fuzz(60)
@given(non_finite_calls())
def test_nan_and_inf_reach_the_rows_that_see_them(call):
    """The reference's NaN (DESIGN 2: a row that sees a NaN score is NaN,
    one that sees nothing is (0, -inf)); the backward may NaN more of a
    tile, never less."""
    q, k, v, dout, kw, dtype = call
    out, lse = ra.attention(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = rt.ref_attention(q, k, v, **kw)
    v_bad = not np.isfinite(v).all()
    rt.assert_close(out, ref_out, dtype, "out", extra_nan=v_bad)
    rt.assert_close(lse, ref_lse, dtype, "lse")
    grads = ra.attention_backward(dout, q, k, v, out, lse, **kw)
    ref_grads = rt.ref_attention_backward(dout, q, k, v, out=out, **kw)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        rt.assert_close(g, r, dtype, name, extra_nan=True)


@pytest.mark.timeout(300)
@fuzz(25)
@given(dtype=st.sampled_from(["int64", "uint64", "uint32", "int32"]),
       bad=st.sampled_from([None, None, 2**31, 2**32, -2**31 - 1, 2**63 + 7]),
       left=st.sampled_from([0, 2, np.int64(3), np.uint8(1), "jnp", None, 2**63]),
       right=st.sampled_from([0, np.int32(1), None, 2**61]),
       seed=st.integers(0, 99))
def test_wide_ids_and_window_scalars_under_jit(jax_module, dtype, bad, left, right,
                                                seed):
    """64-bit (and uint32) ids under jit: the reference, or an error naming
    segment_ids when one is outside int32 (never truncated); window sides
    from NumPy / JAX scalars read as ints, past every position unbounded."""
    jax, jnp = jax_module, jax_module.numpy
    import ringattn.jax as rj

    info = np.iinfo(dtype)
    if bad is not None and not info.min <= bad <= info.max:
        bad = None
    q, k, v = arrays(seed, [(1, 10, 2, 8)] * 3, "float64")
    ids = np.sort(np.random.default_rng(seed).integers(0, 3, (1, 10))).astype(dtype)
    if bad is not None:
        ids[0, 7:] = bad
    left = jnp.int32(2) if isinstance(left, str) else left
    window = (left, right)
    f = jax.jit(lambda q, ids: rj.attention(q, k, v, causal=True, window=window,
                                            segment_ids=ids))
    outside = bad is not None and not -2**31 <= bad < 2**31
    if outside:
        with pytest.raises(Exception, match="segment_ids: expected ids that fit in int32"):
            np.asarray(f(q, jnp.asarray(ids)))
        return
    sides = tuple(None if s is None or int(s) >= 2**61 else int(s) for s in window)
    ref, _ = rt.ref_attention(q, k, v, causal=True, window=sides, segment_ids=ids)
    rt.assert_close(np.asarray(f(q, jnp.asarray(ids))), ref, "float64")


HUGE = [1, 2, 3, 7, 2**31, 2**40, 2**61, 2**62, 2**63 - 1]


@pytest.mark.timeout(120)
@fuzz(40)
@given(m=st.integers(1, 3), data=st.data(), n=st.integers(1, 12),
       offset=st.sampled_from([0, 3, 2**40, 2**59, 2**60 - 40]),
       causal=st.booleans(), seed=st.integers(0, 99))
def test_huge_dilation_rates_lengths_and_offsets(m, data, n, offset, causal, seed):
    """Rates and segment lengths up to int64's end, rows far along the
    sequence: the dense reference with the bias of the selections at those
    positions (no stride or position arithmetic may overflow: the sanitizer
    build runs this)."""
    segs = data.draw(st.lists(st.sampled_from(HUGE), min_size=m, max_size=m))
    rates = data.draw(st.lists(st.sampled_from(HUGE), min_size=m, max_size=m))
    H = 4
    q, k, v = arrays(seed, [(1, n, H, 8), (1, n, 2, 8), (1, n, 2, 8)], "float64")
    out, lse = ra._C.dilated_fwd(q, k, v, segs, rates, causal=causal,
                                 q_pos_offset=offset, k_pos_offset=offset)
    pos = offset + np.arange(n, dtype=np.int64)
    count = np.zeros((H, n, n))
    for w, r in zip(segs, rates):
        seg = pos // w
        for h in range(H):
            sel = (pos - seg * w) % r == h % r
            count[h] += (seg[:, None] == seg[None, :]) & sel[:, None] & sel[None, :]
    with np.errstate(divide="ignore"):
        bias = np.log(count)
    ref_out, ref_lse = rt.ref_attention(q, k, v, causal=causal, bias=bias,
                                        q_pos=pos, k_pos=pos)
    close([out, lse], [ref_out, ref_lse], "float64", ["out", "lse"])


@pytest.mark.timeout(120)
@fuzz(40)
@given(q_off=st.sampled_from([0, -5, 2**59, 2**60 - 50, -(2**60) + 50]),
       k_off=st.sampled_from([0, 7, 2**59, 2**60 - 50, -(2**60) + 50]),
       q_st=st.sampled_from([1, 2, 2**40]), k_st=st.sampled_from([1, 3]),
       window=st.sampled_from([None, (0, 0), (2**61, 0), (5, 2**63), (None, 3),
                               (2**62 - 1, 2**62 - 1)]),
       causal=st.booleans(), seed=st.integers(0, 99))
def test_positions_near_the_bound(q_off, k_off, q_st, k_st, window, causal, seed):
    """Positions at the +-2^60 bound with huge window sides and strides:
    the reference, or a ValueError naming the positions."""
    q, k, v = arrays(seed, [(1, 5, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8)], "float64")
    got = attempt(lambda: ra._C.attn_fwd(q, k, v, causal=causal, window=window,
                                         q_pos_offset=q_off, q_pos_stride=q_st,
                                         k_pos_offset=k_off, k_pos_stride=k_st),
                  ["q_pos_offset", "k_pos_offset"])
    if got is None:
        return
    qp = q_off + q_st * np.arange(5, dtype=np.int64)
    kp = k_off + k_st * np.arange(6, dtype=np.int64)
    sides = None if window is None else \
        tuple(None if s is None or s >= 2**61 else s for s in window)
    ref = rt.ref_attention(q, k, v, causal=causal, q_pos=qp, k_pos=kp, window=sides)
    close(list(got), list(ref), "float64", ["out", "lse"])
