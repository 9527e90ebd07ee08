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

#include <stdint.h>

/* bfloat16 is stored as uint16_t, the top half of a float32: widening is exact, and narrowing rounds to nearest
 * even (NaN stays a quiet NaN) exactly as torch's c10::BFloat16 does, so that a value this code writes equals
 * what `tensor.to(torch.bfloat16)` makes of the same float32. Plain C over integers: loops over them vectorize. */
static inline float bf16_to_f32(uint16_t h) {
  union { uint32_t u; float f; } c = {(uint32_t)h << 16};
  return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
  union { float f; uint32_t u; } c = {f};
  if ((c.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

#endif
