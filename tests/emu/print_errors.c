/*
 * print_errors.c -- the name and text of every cudaError_t code that the
 * emulated GPU's cuda_runtime.h defines, one line each.  Built twice by
 * tests/test_emu_runtime.py: against the CUDA toolkit's runtime (which
 * answers without a GPU) and against the emulated one; the outputs must be
 * the same.
 */
#include <stdio.h>

#include <cuda_runtime.h>

static const int kCodes[] = {0, 1, 2, 3, 4, 9, 12, 17, 21, 35, 98, 100, 101, 209, 400,
                             401, 600, 700, 701, 702, 705, 709, 710, 716, 719, 800,
                             801, 999};

int main(void) {
    for (unsigned i = 0; i < sizeof kCodes / sizeof kCodes[0]; i++) {
        const cudaError_t e = (cudaError_t)kCodes[i];
        printf("%d %s: %s\n", kCodes[i], cudaGetErrorName(e), cudaGetErrorString(e));
    }
    return 0;
}
