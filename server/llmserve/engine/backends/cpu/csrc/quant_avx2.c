/* The AVX2 levels of the quantized linears (quant.h: layout and arithmetic): quant_avx2_body.h compiled twice,
 * for AVX2 alone (q_kernel_avx2) and with AVX-VNNI (q_kernel_avx2_vnni), each under its own target pragma
 * whatever the library's baseline; run only where quant_levels reports the instructions. */
#if defined(__x86_64__)
#include <immintrin.h>
#include <stdlib.h>

#include "quant.h"

#define AI static inline __attribute__((always_inline))
#define PREFETCH_AHEAD 4096 /* as quant_avx512.c's */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define VNNI 0
#define NAME(x) x##_avx2
#include "quant_avx2_body.h"
#undef NAME
#undef VNNI
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define VNNI 1
#define NAME(x) x##_avx2_vnni
#include "quant_avx2_body.h"
#undef NAME
#undef VNNI
#pragma GCC pop_options
#endif
