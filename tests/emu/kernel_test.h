/*
 * kernel_test.h -- what the emulated GPU's kernel test programs share
 * (tests/emu/test_simt.cpp, test_ptx.cpp, test_hopper.cpp, test_tma.cpp):
 * a CUDA call that must succeed, and the verdict on a deliberately broken
 * kernel.
 */
#ifndef RA_EMU_KERNEL_TEST_H
#define RA_EMU_KERNEL_TEST_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include <string>

#include "emu/emu.h"

#define CK(x)                                                                      \
    do {                                                                           \
        cudaError_t e_ = (x);                                                      \
        if (e_ != cudaSuccess) {                                                   \
            fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #x,           \
                    cudaGetErrorString(e_));                                       \
            exit(1);                                                               \
        }                                                                          \
    } while (0)

/* Broken case `name` was launched with status `launch`: 0 (and "flagged:
 * <the reports>" on stdout) when the grid failed with a report containing
 * `want`, else 1 with what happened on stderr. */
static inline int expect_flagged(const char *name, cudaError_t launch, const char *want) {
    cudaError_t e = launch;
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    const std::string text = ra_emu_reports_text();
    if (e == cudaSuccess || text.empty() || text.find(want) == std::string::npos) {
        fprintf(stderr, "case %s: not flagged (status %d), reports:\n%s\n", name, (int)e,
                text.c_str());
        return 1;
    }
    printf("flagged: %s", text.c_str());
    return 0;
}

#endif /* RA_EMU_KERNEL_TEST_H */
