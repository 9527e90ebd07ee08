/* Decode attention over the paged KV cache, for the CPU.
 *
 * One query token per sequence attends to that sequence's context by reading its blocks where they lie
 * (through the block table): no gathered copy of the context, each key and value row is read once and
 * used by every query head of its group (GQA). Work items are (sequence, kv head) pairs, spread over
 * OpenMP threads. HEAD_DIM and GROUP (query heads per kv head) are compile-time constants, so that the
 * inner loops have constant trip counts and vectorize fully: the build (setup.py, at install time) includes
 * this file once per common (HEAD_DIM, GROUP) pair with VARIANT naming the pair, giving functions
 * paged_decode_f32_d<HEAD_DIM>_g<GROUP> and paged_decode_f64_d<HEAD_DIM>_g<GROUP>. The torch path in
 * backends/torch_paged.py computes the same thing for any other shape.
 *
 * Layouts (element strides, not bytes):
 *   q      [num_seqs, num_heads, HEAD_DIM]  seq stride q_seq, head stride q_head, dim stride 1
 *   k, v   [num_kv_heads, slots, HEAD_DIM]  kv-head stride kv_head; slot = block * block_size + offset
 *   tables [num_seqs, table_stride]         block ids, int32
 *   lens   [num_seqs]                       context length (the new token included), int32, >= 1
 *   out    [num_seqs, num_heads, HEAD_DIM]  contiguous
 * Returns 0, or 1 when a score buffer could not be allocated.
 *
 * For each pair the file includes itself once per scalar type (float, double), and once more for a bfloat16
 * cache: paged_decode_bf16_d<HEAD_DIM>_g<GROUP> reads bfloat16 q, k and v (uint16 storage), widens each exactly,
 * computes in float32 as the float32 function does, and writes bfloat16 (one rounding). Half the bytes per key and
 * value row: the decode kernel is bound by reading them.
 */
#ifndef SCALAR

#include <stdint.h>
#include <stdlib.h>

#include "common.h"

#if !defined(HEAD_DIM) || !defined(GROUP) || !defined(VARIANT)
#error "include with HEAD_DIM, GROUP and VARIANT (e.g. _d64_g3) defined"
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#ifndef LLMSERVE_SUM8
#define LLMSERVE_SUM8
/* The eight lane sums of a[0..7], in order. */
static inline __m256 sum8(const __m256 a[8]) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__) && HEAD_DIM % 8 == 0
/* float32 scores, eight key rows at a time: eight dot products accumulate side by side and one shuffle
 * tree sums them, instead of one horizontal sum per dot product. The same loop over a float32 cache and over a
 * bfloat16 one: KEY_T is the cache's storage, LOAD8 reads eight of its values as float32. */
#define SCORES_BY_8 CAT(scores_by_8, VARIANT)
#define SCORES_BY_8_BF16 CAT(scores_by_8_bf16, VARIANT)

/* Eight bfloat16 values widened to float32 per load (a bfloat16 is a float32's top half). */
static inline __m256 CAT(load8_bf16, VARIANT)(const uint16_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

#define DEFINE_SCORES_BY_8(NAME, KEY_T, LOAD8)                                                                   \
  static inline void NAME(const float *restrict qs, const KEY_T *restrict keys, float *restrict scores,          \
                          long stride) {                                                                         \
    for (int g = 0; g < GROUP; ++g) {                                                                            \
      __m256 a[8];                                                                                               \
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();                                                    \
      for (int d = 0; d < HEAD_DIM; d += 8) {                                                                    \
        const __m256 q = _mm256_loadu_ps(qs + g * HEAD_DIM + d);                                                 \
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(q, LOAD8(keys + j * HEAD_DIM + d), a[j]);            \
      }                                                                                                          \
      _mm256_storeu_ps(scores + g * stride, sum8(a));                                                            \
    }                                                                                                            \
  }
DEFINE_SCORES_BY_8(SCORES_BY_8, float, _mm256_loadu_ps)
DEFINE_SCORES_BY_8(SCORES_BY_8_BF16, uint16_t, CAT(load8_bf16, VARIANT))
#undef DEFINE_SCORES_BY_8
#define BY_8 1
#endif

/* Storage of q/out (IO_T) and of the cache (KV_T), and how a stored value becomes a SCALAR and back. */
#define IDENTITY(x) (x)

#define SCALAR float
#define IO_T float
#define KV_T float
#define LOAD IDENTITY
#define STORE IDENTITY
#define FUNCTION CAT(paged_decode_f32, VARIANT)
#define EXP expf
#include "paged_decode.c"
#undef FUNCTION

#ifdef BY_8
#undef SCORES_BY_8
#define SCORES_BY_8 SCORES_BY_8_BF16
#endif
#undef IO_T
#undef KV_T
#undef LOAD
#undef STORE
#define IO_T uint16_t
#define KV_T uint16_t
#define LOAD bf16_to_f32
#define STORE f32_to_bf16
#define FUNCTION CAT(paged_decode_bf16, VARIANT)
#include "paged_decode.c"
#undef SCALAR
#undef IO_T
#undef KV_T
#undef LOAD
#undef STORE
#undef FUNCTION
#undef EXP
#undef BY_8
#undef SCORES_BY_8
#undef SCORES_BY_8_BF16

#define SCALAR double
#define IO_T double
#define KV_T double
#define LOAD IDENTITY
#define STORE IDENTITY
#define FUNCTION CAT(paged_decode_f64, VARIANT)
#define EXP exp
#include "paged_decode.c"
#undef SCALAR
#undef IO_T
#undef KV_T
#undef LOAD
#undef STORE
#undef FUNCTION
#undef EXP
#undef IDENTITY

#else

/* Scores of the GROUP query heads against `rows` consecutive key rows. */
static inline void CAT(FUNCTION, _scores)(const SCALAR *restrict qs, const KV_T *restrict keys, int rows,
                                     SCALAR *restrict scores, long stride) {
  int r = 0;
#if defined(BY_8) && BY_8
  for (; r + 8 <= rows; r += 8) SCORES_BY_8(qs, keys + (long)r * HEAD_DIM, scores + r, stride);
#endif
  for (; r < rows; ++r) {
    const KV_T *restrict row = keys + (long)r * HEAD_DIM;
    for (int g = 0; g < GROUP; ++g) {
      SCALAR dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < HEAD_DIM; ++d) dot += qs[g * HEAD_DIM + d] * LOAD(row[d]);
      scores[g * stride + r] = dot;
    }
  }
}

/* Blocks lie anywhere in the cache, so the hardware prefetcher cannot see the next one coming: ask for it
 * while the current one is being read. Into L2 (locality 1), not L1: a prefetch into L1 holds one of L1's
 * few miss buffers until its line arrives, which capped the reads of a whole block at about 5 GB/s per
 * core; L2 keeps many more misses in flight. Measured (32 sequences of 150-650 tokens, blocks scattered
 * over a benchmark-sized pool, 30 layers): 63 -> 45 ms, and 43 ms with each value block also fetched
 * during the score pass. */
static inline void CAT(FUNCTION, _prefetch)(const KV_T *rows, int count) {
  const char *p = (const char *)rows, *end = p + (long)count * HEAD_DIM * sizeof(KV_T);
  for (; p < end; p += 64) __builtin_prefetch(p, 0, 1);
}

int FUNCTION(const IO_T *q, long q_seq, long q_head, const KV_T *k, const KV_T *v, long kv_head,
             const int *tables, long table_stride, const int *lens, int num_seqs, int num_kv_heads, int block_size,
             int max_len, double scale, IO_T *out, int num_threads) {
  const int num_heads = num_kv_heads * GROUP;
  const int items = num_seqs * num_kv_heads;
  int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
  {
    SCALAR *scores = malloc(sizeof(SCALAR) * (size_t)GROUP * max_len);
    SCALAR qs[GROUP * HEAD_DIM], acc[GROUP * HEAD_DIM];
    failed = scores == NULL;
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items; ++item) {
      if (scores == NULL) continue;
      const int s = item / num_kv_heads, h = item % num_kv_heads, len = lens[s];
      const int *table = tables + (long)s * table_stride;
      const KV_T *kh = k + (long)h * kv_head, *vh = v + (long)h * kv_head;
      for (int g = 0; g < GROUP; ++g)
        for (int d = 0; d < HEAD_DIM; ++d)
          qs[g * HEAD_DIM + d] = LOAD(q[(long)s * q_seq + (long)(h * GROUP + g) * q_head + d]) * (SCALAR)scale;

      for (int start = 0; start < len; start += block_size) {
        const int rows = len - start < block_size ? len - start : block_size;
        const int b = start / block_size;
        if (start + block_size < len) CAT(FUNCTION, _prefetch)(kh + (long)table[b + 1] * block_size * HEAD_DIM, block_size);
        CAT(FUNCTION, _prefetch)(vh + (long)table[b] * block_size * HEAD_DIM, rows); /* the value pass reads it next */
        CAT(FUNCTION, _scores)(qs, kh + (long)table[b] * block_size * HEAD_DIM, rows, scores + start, max_len);
      }
      SCALAR inv_sum[GROUP];
      for (int g = 0; g < GROUP; ++g) {
        SCALAR *sg = scores + (long)g * max_len, top = sg[0], sum = 0;
#pragma omp simd reduction(max : top)
        for (int j = 1; j < len; ++j) top = sg[j] > top ? sg[j] : top;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < len; ++j) {
          sg[j] = EXP(sg[j] - top);
          sum += sg[j];
        }
        inv_sum[g] = 1 / sum; /* applied to the output, not to every score */
      }

      for (int i = 0; i < GROUP * HEAD_DIM; ++i) acc[i] = 0;
      for (int start = 0; start < len; start += block_size) {
        const int rows = len - start < block_size ? len - start : block_size;
        const int b = start / block_size;
        const KV_T *restrict values = vh + (long)table[b] * block_size * HEAD_DIM;
        for (int r = 0; r < rows; ++r)
          for (int g = 0; g < GROUP; ++g) {
            const SCALAR p = scores[(long)g * max_len + start + r];
#pragma omp simd
            for (int d = 0; d < HEAD_DIM; ++d) acc[g * HEAD_DIM + d] += p * LOAD(values[(long)r * HEAD_DIM + d]);
          }
      }
      IO_T *o = out + ((long)s * num_heads + h * GROUP) * HEAD_DIM;
      for (int i = 0; i < GROUP * HEAD_DIM; ++i) o[i] = STORE(acc[i] * inv_sum[i / HEAD_DIM]);
    }
    free(scores);
  }
  return failed;
}

#endif
