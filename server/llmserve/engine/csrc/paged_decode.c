/* Decode attention over the paged KV cache, for the CPU.
 *
 * One query token per sequence attends to that sequence's context by reading its blocks where they lie
 * (through the block table): no gathered copy of the context, each key and value row is read once and
 * used by every query head of its group (GQA). Work items are (sequence, kv head) pairs, spread over
 * OpenMP threads. Built at run time by llmserve/engine/native.py with HEAD_DIM and GROUP (query heads per
 * kv head) fixed, so that the inner loops have constant trip counts and vectorize fully; the torch path
 * in runner.py computes the same thing.
 *
 * Layouts (element strides, not bytes):
 *   q      [num_seqs, num_heads, HEAD_DIM]  seq stride q_seq, head stride q_head, dim stride 1
 *   k, v   [num_kv_heads, slots, HEAD_DIM]  kv-head stride kv_head; slot = block * block_size + offset
 *   tables [num_seqs, table_stride]         block ids, int32
 *   lens   [num_seqs]                       context length (the new token included), int32, >= 1
 *   out    [num_seqs, num_heads, HEAD_DIM]  contiguous
 * Returns 0, or 1 when a score buffer could not be allocated.
 *
 * The file includes itself once per scalar type (float, double).
 */
#ifndef SCALAR

#include <math.h>
#include <stdlib.h>

#ifdef VECTOR_EXP
/* glibc's libmvec has vector exp/expf; declaring them SIMD-callable lets the softmax loop use them without
 * -ffast-math (which would also switch the whole process to flush-to-zero). Link with -lmvec. */
float expf(float) __attribute__((__simd__("notinbranch")));
double exp(double) __attribute__((__simd__("notinbranch")));
#endif

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

#if !defined(HEAD_DIM) || !defined(GROUP)
#error "build with -DHEAD_DIM=<head dim> -DGROUP=<query heads per kv head>"
#endif

#define SCALAR float
#define FUNCTION paged_decode_f32
#define EXP expf
#include "paged_decode.c"
#undef SCALAR
#undef FUNCTION
#undef EXP

#define SCALAR double
#define FUNCTION paged_decode_f64
#define EXP exp
#include "paged_decode.c"

#else

/* Scores of the GROUP query heads against `rows` consecutive key rows. */
static inline void CAT(FUNCTION, _scores)(const SCALAR *restrict qs, const SCALAR *restrict keys, int rows,
                                     SCALAR *restrict scores, long stride) {
  for (int r = 0; r < rows; ++r) {
    const SCALAR *restrict row = keys + (long)r * HEAD_DIM;
    for (int g = 0; g < GROUP; ++g) {
      SCALAR dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < HEAD_DIM; ++d) dot += qs[g * HEAD_DIM + d] * row[d];
      scores[g * stride + r] = dot;
    }
  }
}

/* Blocks lie anywhere in the cache, so the hardware prefetcher cannot see the next one coming: ask for it
 * while the current one is being read. */
static inline void CAT(FUNCTION, _prefetch)(const SCALAR *rows, int count) {
  const char *p = (const char *)rows, *end = p + (long)count * HEAD_DIM * sizeof(SCALAR);
  for (; p < end; p += 64) __builtin_prefetch(p);
}

int FUNCTION(const SCALAR *q, long q_seq, long q_head, const SCALAR *k, const SCALAR *v, long kv_head,
             const int *tables, long table_stride, const int *lens, int num_seqs, int num_kv_heads, int block_size,
             int max_len, double scale, SCALAR *out, int num_threads) {
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
      const SCALAR *kh = k + (long)h * kv_head, *vh = v + (long)h * kv_head;
      for (int g = 0; g < GROUP; ++g)
        for (int d = 0; d < HEAD_DIM; ++d)
          qs[g * HEAD_DIM + d] = q[(long)s * q_seq + (long)(h * GROUP + g) * q_head + d] * (SCALAR)scale;

      for (int start = 0; start < len; start += block_size) {
        const int rows = len - start < block_size ? len - start : block_size;
        const int b = start / block_size;
        if (start + block_size < len) CAT(FUNCTION, _prefetch)(kh + (long)table[b + 1] * block_size * HEAD_DIM, block_size);
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
        if (start + block_size < len) CAT(FUNCTION, _prefetch)(vh + (long)table[b + 1] * block_size * HEAD_DIM, block_size);
        const SCALAR *restrict values = vh + (long)table[b] * block_size * HEAD_DIM;
        for (int r = 0; r < rows; ++r)
          for (int g = 0; g < GROUP; ++g) {
            const SCALAR p = scores[(long)g * max_len + start + r];
#pragma omp simd
            for (int d = 0; d < HEAD_DIM; ++d) acc[g * HEAD_DIM + d] += p * values[(long)r * HEAD_DIM + d];
          }
      }
      SCALAR *o = out + ((long)s * num_heads + h * GROUP) * HEAD_DIM;
      for (int i = 0; i < GROUP * HEAD_DIM; ++i) o[i] = acc[i] * inv_sum[i / HEAD_DIM];
    }
    free(scores);
  }
  return failed;
}

#endif
