/*
 * attn_family.cu -- which family of tensor-core kernels the dispatchers
 * run on a device:
 *   "sm90a"  the wgmma/TMA kernels (cuda/hopper/): on compute capability
 *            9.0 when the build has sm_90a code (RINGATTN_CUDA_ARCHS names
 *            90a; setup.py then defines RA_CUDA_SM90A), and always on the
 *            emulated GPU, which is an sm_90 device
 *   "sm80"   the mma.sync kernels (attn_fwd_tc.cu, attn_bwd_tc_*.cu):
 *            everywhere else, and wherever RINGATTN_CUDA_KERNELS=sm80 asks
 *            for them (comparison, bisection)
 * RINGATTN_CUDA_KERNELS is read at every call ("auto" or unset: the best
 * family; "sm80"; anything else is an error naming the variable), so one
 * process can time both.  Also counts which forward and backward kernel
 * each call ran (ra_cuda_fwd_kernel_counts, ra_cuda_bwd_kernel_counts),
 * for the tests.
 */
#include <atomic>
#include <string.h>

#include "attn_kernels.cuh"

/* Host code with atomics: on the emulated GPU every file of cuda/ is
 * compiled with the thread sanitizer's instrumentation, whose hooks are
 * the emulator's checker of kernel memory (it has none for atomics). */
#ifdef RA_CUDA_EMULATED
#define RA_HOST_ATOMICS __attribute__((no_sanitize("thread")))
#else
#define RA_HOST_ATOMICS
#endif

#if defined(RA_CUDA_EMULATED) || defined(RA_CUDA_SM90A)
static const bool kBuiltSm90a = true;
#else
static const bool kBuiltSm90a = false;
#endif

/* compute capability major * 10 + minor per device, 0: not asked yet */
static std::atomic<int> g_cc[64];

RA_HOST_ATOMICS static ra_status device_cc(int device, int *cc) {
    if (device >= 0 && device < 64) {
        const int known = g_cc[device].load(std::memory_order_relaxed);
        if (known) {
            *cc = known;
            return RA_OK;
        }
    }
    int major = 0, minor = 0;
    RA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    RA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    *cc = major * 10 + minor;
    if (device >= 0 && device < 64) g_cc[device].store(*cc, std::memory_order_relaxed);
    return RA_OK;
}

ra_status ra_kernel_family(int device, ra_family *family) {
    const char *env = getenv("RINGATTN_CUDA_KERNELS");
    bool force80 = false;
    if (env != NULL && *env != '\0' && strcmp(env, "auto") != 0) {
        if (strcmp(env, "sm80") != 0) {
            ra_set_error(RA_ERR_VALUE, "RINGATTN_CUDA_KERNELS must be auto or sm80, got '%.40s'",
                         env);
            return RA_ERR_VALUE;
        }
        force80 = true;
    }
    *family = RA_FAMILY_SM80;
    if (force80 || !kBuiltSm90a) return RA_OK;
    if (device < 0) RA_CUDA_CHECK(cudaGetDevice(&device));
    int cc = 0;
    RA_CHECK(device_cc(device, &cc));
    // sm_90a code runs on compute capability 9.0 only
    if (cc == 90) *family = RA_FAMILY_SM90A;
    return RA_OK;
}

static std::atomic<unsigned long long> g_fwd_counts[3];

RA_HOST_ATOMICS void ra_count_fwd_kernel(int which) {
    if (which >= 0 && which < 3) g_fwd_counts[which].fetch_add(1, std::memory_order_relaxed);
}

static std::atomic<unsigned long long> g_bwd_counts[3];

RA_HOST_ATOMICS void ra_count_bwd_kernel(int which) {
    if (which >= 0 && which < 3) g_bwd_counts[which].fetch_add(1, std::memory_order_relaxed);
}

extern "C" ra_status ra_cuda_kernel_family(int device, const char **name) {
    ra_family f = RA_FAMILY_SM80;
    RA_CHECK(ra_kernel_family(device, &f));
    *name = f == RA_FAMILY_SM90A ? "sm90a" : "sm80";
    return RA_OK;
}

extern "C" int ra_cuda_built_sm90a(void) { return kBuiltSm90a ? 1 : 0; }

extern "C" RA_HOST_ATOMICS void ra_cuda_fwd_kernel_counts(unsigned long long out[3]) {
    for (int i = 0; i < 3; i++) out[i] = g_fwd_counts[i].load(std::memory_order_relaxed);
}

extern "C" RA_HOST_ATOMICS void ra_cuda_bwd_kernel_counts(unsigned long long out[3]) {
    for (int i = 0; i < 3; i++) out[i] = g_bwd_counts[i].load(std::memory_order_relaxed);
}
