/*
 * sanitizer_canary.cu -- the positive control of gpu_check.sh's sanitize
 * stage: one kernel, named the way ringattn's kernels are (an anonymous
 * namespace in a file of its own, "..._kernel"), that writes one element
 * past the end of its buffer.  compute-sanitizer's memcheck run with the
 * stage's kernel filter must report it (exit status 9); if it does not, the
 * filter matched no kernel and a clean sanitizer run would prove nothing.
 *
 *   nvcc -O1 -arch=sm_90 tools/sanitizer_canary.cu -o canary
 *   compute-sanitizer --tool memcheck --error-exitcode 9 \
 *       --kernel-name "$KERNEL_FILTER" ./canary           # must exit 9
 */
#include <cstdio>
#include <cuda_runtime.h>

namespace {

__global__ void sanitizer_canary_kernel(float *x, int n) {
    // thread n writes x[n]: one element past the end
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) x[i] = 1.0f;
}

}  // namespace

int main() {
    const int n = 256;
    float *x = nullptr;
    if (cudaMalloc(&x, n * sizeof(float)) != cudaSuccess) {
        fprintf(stderr, "canary: cudaMalloc failed (no CUDA device?)\n");
        return 2;
    }
    sanitizer_canary_kernel<<<2, 256>>>(x, n);
    cudaError_t err = cudaDeviceSynchronize();
    cudaFree(x);
    printf("canary: kernel finished (%s)\n", cudaGetErrorString(err));
    return 0;
}
