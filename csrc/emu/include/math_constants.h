/* math_constants.h -- the CUDART_* constants on ringattn's emulated GPU. */
#ifndef RA_EMU_MATH_CONSTANTS_H
#define RA_EMU_MATH_CONSTANTS_H
#define CUDART_INF_F __builtin_inff()
#define CUDART_NAN_F __builtin_nanf("")
#define CUDART_INF __builtin_inf()
#define CUDART_NAN __builtin_nan("")
#define CUDART_PI_F 3.141592654f
#define CUDART_PI 3.1415926535897931e+0
#define CUDART_LN2_F 0.693147181f
#define CUDART_L2E_F 1.442695041f
#define CUDART_MAX_NORMAL_F 3.40282347e+38f
#endif
