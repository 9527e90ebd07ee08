/* The elementwise parts of a Llama-family layer when its linears run in bfloat16 or int8 (fused_layers.py).
 *
 * The same operations as fused_ops.c (RMSNorm, residual add plus RMSNorm, rotary embedding, SiLU-and-multiply),
 * with rows stored in the format the next linear reads, and the arithmetic in float32:
 *   ROW_F32   float32;
 *   ROW_BF16  bfloat16 (uint16_t, common.h's conversions: what torch's .to(torch.bfloat16) gives);
 *   ROW_Q8    int8 quantized per row, symmetric, stored as uint8 with zero point 128 (what oneDNN's u8 x s8
 *             kernels read): value = (q - 128) * scale[row], scale = max |value| / 127 (1 for a zero row).
 * The residual stream stays float32. Each row is computed by one thread with the same code whatever the row
 * count, so a row's result never depends on the other rows of the call (batch invariance).
 *
 * A row is first computed into a float32 scratch row, then written in its format (int8 needs the row's maximum
 * before it can write anything). Rows are addressed through element strides; within a row elements are
 * contiguous. Built with fp contraction off, as fused_ops.c is.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

enum { ROW_F32 = 0, ROW_BF16 = 1, ROW_Q8 = 2 };

/* Below this many elements an operation runs on the calling thread: waking the others costs more. */
#define MIXED_PARALLEL_MIN 65536
/* The widest row a thread's stack scratch holds; wider rows get a heap buffer. */
#define STACK_ROW 4096

static void load_row(const void *base, int fmt, long offset, int n, float *restrict out) {
  if (fmt == ROW_BF16) {
    const uint16_t *restrict x = (const uint16_t *)base + offset;
#pragma omp simd
    for (int i = 0; i < n; ++i) out[i] = bf16_to_f32(x[i]);
  } else {
    memcpy(out, (const float *)base + offset, sizeof(float) * (size_t)n);
  }
}

static void store_row(const float *restrict v, int n, void *out, int fmt, long offset, float *scales, long row) {
  if (fmt == ROW_F32) {
    memcpy((float *)out + offset, v, sizeof(float) * (size_t)n);
  } else if (fmt == ROW_BF16) {
    uint16_t *restrict o = (uint16_t *)out + offset;
#pragma omp simd
    for (int i = 0; i < n; ++i) o[i] = f32_to_bf16(v[i]);
  } else {
    uint8_t *restrict o = (uint8_t *)out + offset;
    float top = 0;
#pragma omp simd reduction(max : top)
    for (int i = 0; i < n; ++i) top = fabsf(v[i]) > top ? fabsf(v[i]) : top;
    const float inv = top > 0 ? 127.0f / top : 0.0f;
    scales[row] = top > 0 ? top / 127.0f : 1.0f;
#pragma omp simd
    for (int i = 0; i < n; ++i) {
      float q = nearbyintf(v[i] * inv);
      q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
      o[i] = (uint8_t)((int)q + 128);
    }
  }
}

static float *scratch(float *stack, int n) {
  return n <= STACK_ROW ? stack : malloc(sizeof(float) * (size_t)n);
}

static inline void norm_in_place(float *restrict x, const float *restrict w, int dim, double eps) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < dim; ++i) sum += x[i] * x[i];
  const float inv = 1 / sqrtf(sum / dim + (float)eps);
#pragma omp simd
  for (int i = 0; i < dim; ++i) x[i] = w[i] * (x[i] * inv);
}

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps); w float32. Returns 0, or 1 when a scratch row could not be had. */
int mixed_rms_norm(const void *x, int x_fmt, long x_stride, const float *w, void *out, int out_fmt, long out_stride,
                   float *scales, long rows, int dim, double eps, int threads) {
  int failed = 0;
#pragma omp parallel num_threads(threads) if (rows * dim >= MIXED_PARALLEL_MIN) reduction(| : failed)
  {
    float stack[STACK_ROW], *v = scratch(stack, dim);
    failed = v == NULL;
#pragma omp for schedule(static)
    for (long r = 0; r < rows; ++r) {
      if (v == NULL) continue;
      load_row(x, x_fmt, r * x_stride, dim, v);
      norm_in_place(v, w, dim, eps);
      store_row(v, dim, out, out_fmt, r * out_stride, scales, r);
    }
    if (v != stack) free(v);
  }
  return failed;
}

/* residual[r] += x[r] (float32, in place), then out[r] = rms_norm(residual[r]): a layer's residual add and the
 * next norm in one pass. residual is contiguous [rows, dim]; x has a row stride; out is contiguous. */
int mixed_add_rms_norm(float *residual, const void *x, int x_fmt, long x_stride, const float *w, void *out,
                       int out_fmt, float *scales, long rows, int dim, double eps, int threads) {
  int failed = 0;
#pragma omp parallel num_threads(threads) if (rows * dim >= MIXED_PARALLEL_MIN) reduction(| : failed)
  {
    float stack[STACK_ROW], *v = scratch(stack, dim);
    failed = v == NULL;
#pragma omp for schedule(static)
    for (long r = 0; r < rows; ++r) {
      if (v == NULL) continue;
      float *restrict res = residual + r * dim;
      load_row(x, x_fmt, r * x_stride, dim, v);
#pragma omp simd
      for (int i = 0; i < dim; ++i) {
        res[i] = res[i] + v[i];
        v[i] = res[i];
      }
      norm_in_place(v, w, dim, eps);
      store_row(v, dim, out, out_fmt, r * dim, scales, r);
    }
    if (v != stack) free(v);
  }
  return failed;
}

/* Rotary embedding in place on bfloat16 x [tokens, heads, dim] (strides x_tok, x_head), transformers'
 * rotate-half form computed in float32 with float32 cos/sin [tokens, dim] (stride cs_tok), rounded once. */
void mixed_rotary_bf16(uint16_t *x, long x_tok, long x_head, int heads, long tokens, const float *cos,
                       const float *sin, long cs_tok, int dim, int threads) {
  const int half = dim / 2;
#pragma omp parallel for num_threads(threads) if (tokens * heads * dim >= MIXED_PARALLEL_MIN) schedule(static)
  for (long t = 0; t < tokens; ++t) {
    const float *restrict c = cos + t * cs_tok, *restrict s = sin + t * cs_tok;
    for (int h = 0; h < heads; ++h) {
      uint16_t *restrict v = x + t * x_tok + (long)h * x_head;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float a = bf16_to_f32(v[i]), b = bf16_to_f32(v[i + half]);
        v[i] = f32_to_bf16(a * c[i] + (-b) * s[i]);
        v[i + half] = f32_to_bf16(b * c[i + half] + a * s[i + half]);
      }
    }
  }
}

/* out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:], silu(g) = g / (1 + exp(-g)); gate_up contiguous
 * [rows, 2 * inter], out contiguous [rows, inter]. */
int mixed_silu_mul(const void *gate_up, int in_fmt, void *out, int out_fmt, float *scales, long rows, int inter,
                   int threads) {
  int failed = 0;
#pragma omp parallel num_threads(threads) if (rows * inter >= MIXED_PARALLEL_MIN) reduction(| : failed)
  {
    float stack[2 * STACK_ROW], *v = 2 * inter <= 2 * STACK_ROW ? stack : malloc(sizeof(float) * 2 * (size_t)inter);
    failed = v == NULL;
#pragma omp for schedule(static)
    for (long r = 0; r < rows; ++r) {
      if (v == NULL) continue;
      load_row(gate_up, in_fmt, r * 2 * inter, 2 * inter, v);
      const float *restrict u = v + inter;
#pragma omp simd
      for (int i = 0; i < inter; ++i) v[i] = v[i] / (1 + expf(-v[i])) * u[i];
      store_row(v, inter, out, out_fmt, r * inter, scales, r);
    }
    if (v != stack) free(v);
  }
  return failed;
}

/* out[r] = x[r] * row_scale[r] + bias (row_scale NULL: 1; bias NULL: 0; bias float32 [n]), written in out's
 * format; x float32 or bfloat16 with a row stride, out contiguous. Finishes an int8 linear (its rows' scales, then
 * its bias) and quantizes rows for the next one. */
int mixed_convert_rows(const void *x, int x_fmt, long x_stride, const float *row_scale, const float *bias, void *out,
                       int out_fmt, float *scales, long rows, int n, int threads) {
  int failed = 0;
#pragma omp parallel num_threads(threads) if (rows * n >= MIXED_PARALLEL_MIN) reduction(| : failed)
  {
    float stack[STACK_ROW], *v = scratch(stack, n);
    failed = v == NULL;
#pragma omp for schedule(static)
    for (long r = 0; r < rows; ++r) {
      if (v == NULL) continue;
      load_row(x, x_fmt, r * x_stride, n, v);
      if (row_scale != NULL) {
        const float s = row_scale[r];
#pragma omp simd
        for (int i = 0; i < n; ++i) v[i] = v[i] * s;
      }
      if (bias != NULL) {
#pragma omp simd
        for (int i = 0; i < n; ++i) v[i] = v[i] + bias[i];
      }
      store_row(v, n, out, out_fmt, r * n, scales, r);
    }
    if (v != stack) free(v);
  }
  return failed;
}
