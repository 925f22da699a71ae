/*
 * test_convert.cpp -- float16 / bfloat16 conversions on the emulated GPU,
 * in a kernel: float32 bit patterns in (a file), the bits of
 * __float2half_rn and __float2bfloat16_rn of each, and of the round trip
 * back to float32, out (a file).  tests/test_emu_simt.py compares them with
 * NumPy's float16 and ml_dtypes' bfloat16 (round to nearest even; NaN only
 * as NaN: the device's NaN is 0x7fff).
 * Usage: test_convert IN OUT   (IN: n uint32; OUT: n x (u16 half, u16 bf16,
 * u32 half->float, u32 bf16->float))
 */
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#include <stdio.h>
#include <stdlib.h>

#include <vector>

__global__ void k_convert(const float *x, uint16_t *h, uint16_t *b, float *hf, float *bf,
                          int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const __half hv = __float2half_rn(x[i]);
    const __nv_bfloat16 bv = __float2bfloat16_rn(x[i]);
    h[i] = __half_as_ushort(hv);
    b[i] = __bfloat16_as_ushort(bv);
    hf[i] = __half2float(hv);
    bf[i] = __bfloat162float(bv);
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    FILE *f = fopen(argv[1], "rb");
    if (!f) return 2;
    std::vector<float> x;
    float v;
    while (fread(&v, 4, 1, f) == 1) x.push_back(v);
    fclose(f);
    const int n = (int)x.size();
    float *dx, *dhf, *dbf;
    uint16_t *dh, *db;
    if (cudaMalloc((void **)&dx, n * 4) || cudaMalloc((void **)&dhf, n * 4) ||
        cudaMalloc((void **)&dbf, n * 4) || cudaMalloc((void **)&dh, n * 2) ||
        cudaMalloc((void **)&db, n * 2))
        return 3;
    cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice);
    RA_EMU_LAUNCH(k_convert, (n + 255) / 256, 256, 0, 0)(dx, dh, db, dhf, dbf, n);
    if (cudaDeviceSynchronize() != cudaSuccess) return 4;
    std::vector<uint16_t> h(n), b(n);
    std::vector<float> hf(n), bf(n);
    cudaMemcpy(h.data(), dh, n * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(b.data(), db, n * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(hf.data(), dhf, n * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(bf.data(), dbf, n * 4, cudaMemcpyDeviceToHost);
    FILE *o = fopen(argv[2], "wb");
    if (!o) return 2;
    for (int i = 0; i < n; i++) {
        fwrite(&h[i], 2, 1, o);
        fwrite(&b[i], 2, 1, o);
        fwrite(&hf[i], 4, 1, o);
        fwrite(&bf[i], 4, 1, o);
    }
    fclose(o);
    printf("ok %d\n", n);
    return 0;
}
