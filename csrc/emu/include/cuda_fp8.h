/* cuda_fp8.h -- ringattn's emulated GPU has no fp8 types; nccl.h includes
 * this header in C++ and needs nothing from it. */
#ifndef RA_EMU_CUDA_FP8_H
#define RA_EMU_CUDA_FP8_H
#endif
