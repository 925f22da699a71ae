"""compute-sanitizer target (tools/gpu_check.sh, stage "sanitize"): the
Python layer's CUDA paths on small sizes, with buffers ringattn allocates
itself (no framework, so every kernel launched is ringattn's).

Covers what the selftest binary does not: argument handling into the
params structs, views with offsets (narrow), the running state of a ring
step (init_state, accumulate with position offsets), merge, the backward
with accumulated float32 grads, copies and casts.  Values are zeros:
memcheck, racecheck and initcheck look at which bytes are touched, not at
what they hold (tools/cuda_selftest.cu checks the values).
Run with RINGATTN_CUDA_CACHING=0 so that every allocation has its own
bounds.  Prints "sanitize case done" at the end.
"""
import ringattn as ra
from ringattn import _C

DEV = (2, 0)      # (DLPack device type of CUDA, device index) for _C calls


def zeros(shape, dtype):
    return _C.zeros(shape, dtype, *DEV)


def main():
    for dtype in ("bfloat16", "float16", "float32", "float64"):
        acc = "float64" if dtype == "float64" else "float32"
        for D in (8, 59, 64, 96, 128, 256):
            for causal in (False, True):
                q = zeros((2, 37, 4, D), dtype)
                kv = zeros((2, 70, 2, D), dtype)
                k, v = kv.narrow(1, 0, 60), kv.narrow(1, 10, 60)   # offset views
                out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
                dout = zeros((2, 37, 4, D), dtype)
                ra.attention_backward(dout, q, k, v, out, lse, causal=causal)
                # two key halves merged, and a running state over two ring steps
                o1, l1 = ra.attention(q, k.narrow(1, 0, 25), v.narrow(1, 0, 25),
                                      return_lse=True)
                o2, l2 = ra.attention(q, k.narrow(1, 25, 35), v.narrow(1, 25, 35),
                                      return_lse=True)
                ra.merge(o1, l1, o2, l2)
                s_out = _C.empty((2, 37, 4, D), acc, *DEV)
                s_lse = _C.empty((2, 4, 37), acc, *DEV)
                _C.init_state(s_out, s_lse)
                for lo, n in ((0, 25), (25, 35)):
                    _C.attn_fwd(q, k.narrow(1, lo, n), v.narrow(1, lo, n), causal=causal,
                                out=s_out, lse=s_lse, accumulate=True, q_pos_offset=40,
                                k_pos_offset=lo)
                s_out.astype(dtype)
                # the ring backward: float32 grads accumulated over two key blocks
                delta = _C.attn_bwd_preprocess(dout, out)
                dq = _C.zeros((2, 37, 4, D), acc, *DEV)
                dk, dv = (_C.zeros((2, 60, 2, D), acc, *DEV) for _ in range(2))
                for lo, n in ((0, 25), (25, 35)):
                    _C.attn_bwd(dout, q, k.narrow(1, lo, n), v.narrow(1, lo, n), None, lse,
                                causal=causal, dq=dq, dk=dk.narrow(1, lo, n),
                                dv=dv.narrow(1, lo, n), delta=delta, accumulate=True,
                                q_pos_offset=23, k_pos_offset=lo)
    # host <-> device copies: strided sources, dtype conversion, a strided
    # device destination (the copy kernel on staging buffers)
    import numpy as np

    host = np.zeros((3, 40, 6), np.float64)
    for dtype in ("bfloat16", "float16", "float32", "float64"):
        up = ra.to_device(host[:, ::3, 1:], "cuda", dtype=dtype)
        ra.to_device(up, "cpu")
        np_dst = np.zeros((3, 14, 5))
        ra.from_dlpack(np_dst).narrow(1, 0, 7, 2).copy_(up.narrow(1, 0, 7))
        dst = zeros((3, 30, 5), dtype)
        dst.narrow(1, 1, 14, 2).copy_(host[:, ::3, 1:])
    ra.to_device(ra.to_device(np.zeros((5, 7), np.int64), "cuda"), "cpu")
    _C.cuda_synchronize(0)
    print("sanitize case done")

if __name__ == "__main__":
    main()
