/* What every kernel in this folder needs: math.h, glibc's vector exp, and token pasting for the names of
 * the per-scalar-type functions (each .c file includes itself once per scalar type). */
#ifndef LLMSERVE_COMMON_H
#define LLMSERVE_COMMON_H

#include <math.h>

#ifdef VECTOR_EXP
/* glibc's libmvec has vector exp/expf; declaring them SIMD-callable lets loops over exp vectorize without
 * -ffast-math (which would also switch the whole process to flush-to-zero). Link with -lmvec. */
float expf(float) __attribute__((__simd__("notinbranch")));
double exp(double) __attribute__((__simd__("notinbranch")));
#endif

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

#endif
