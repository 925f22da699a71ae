"""Nsight Compute target (tools/gpu_check.sh, stage "profile"): each
Hopper kernel once per case, on buffers ringattn allocates itself, so that
a profiler filtered to the wgmma kernels sees exactly the launches listed.

Cases (bfloat16, B 1, H 16, S 8192 by default; PROFILE_SEQ_LEN sets S):
for D in 64, 128 and causal off, on: the forward (fwd_wg), the backward
with deterministic=False (bwd_wg) and with deterministic=True (dkdv_wg,
then dq_wg); at D 128, causal, also a sliding window of 1024 keys and 8
packed documents, forward and backward (the masked instantiations).

It prints one line per case, "case <n> <pas> D=<D> causal=<0|1>
det=<0|1> mask=<none|window|docs> kernels=<k1,k2>", in launch order:
tools/profile_report.py pairs the profiler's launches with them.
``--list`` prints the lines without a GPU.
"""
import os
import sys

B, H = 1, 16
S = int(os.environ.get("PROFILE_SEQ_LEN", "8192"))


def cases():
    """[(pas, D, causal, det, mask, kernels)] in launch order."""
    out = []
    for D in (64, 128):
        for causal in (False, True):
            out.append(("fwd", D, causal, False, "none", ("fwd_wg",)))
            out.append(("bwd", D, causal, False, "none", ("bwd_wg",)))
            out.append(("bwd", D, causal, True, "none", ("dkdv_wg", "dq_wg")))
    for mask in ("window", "docs"):
        out.append(("fwd", 128, True, False, mask, ("fwd_wg",)))
        out.append(("bwd", 128, True, False, mask, ("bwd_wg",)))
    return out


def line(n, case):
    pas, D, causal, det, mask, kernels = case
    return (f"case {n} {pas} D={D} causal={int(causal)} det={int(det)} mask={mask} "
            f"kernels={','.join(kernels)}")


def main():
    if "--list" in sys.argv[1:]:
        for n, c in enumerate(cases()):
            print(line(n, c))
        return
    import numpy as np

    import ringattn as ra
    from ringattn import _C

    rng = np.random.default_rng(0)

    def dev(shape):
        return ra.to_device(rng.standard_normal(shape, np.float32), "cuda",
                            dtype="bfloat16")

    masks = {
        "none": {},
        "window": {"window": (1024, 0)},
        "docs": {"segment_ids": ra.to_device(
            np.repeat(np.arange(8, dtype=np.int32), S // 8)[None, :S], "cuda")},
    }
    inputs, fwd = {}, {}
    for n, case in enumerate(cases()):
        pas, D, causal, det, mask, _ = case
        if D not in inputs:
            inputs[D] = [dev((B, S, H, D)) for _ in range(4)]   # q, k, v, dout
        q, k, v, dout = inputs[D]
        kw = masks[mask]
        print(line(n, case), flush=True)
        if pas == "fwd":   # its out and lse serve the backward cases after it
            fwd[D, causal, mask] = ra.attention(q, k, v, causal=causal, return_lse=True,
                                                **kw)
        else:
            out, lse = fwd[D, causal, mask]
            ra.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                  deterministic=det, **kw)
        _C.cuda_synchronize(0)
    print("profile case done", flush=True)


if __name__ == "__main__":
    main()
