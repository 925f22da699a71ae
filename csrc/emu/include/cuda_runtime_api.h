/* cuda_runtime_api.h -- see cuda_runtime.h (ringattn's emulated GPU). */
#include "cuda_runtime.h"
