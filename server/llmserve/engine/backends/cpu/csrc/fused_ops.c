/* The elementwise parts of a Llama-family decoder layer, fused, for the CPU.
 *
 * transformers runs each of these as several torch operations (RMSNorm alone is a cast, a square, a mean,
 * an add, a reciprocal square root and two multiplies), each a pass over memory plus a dispatch. At the
 * row counts of a decode step the dispatches cost more than the arithmetic. Here each is one pass, and
 * calls on few rows stay on the calling thread. Built at run time by llmserve/engine/native.py; the
 * operations follow transformers' formulas term by term (see fused_layers.py), and fp contraction is off
 * in the build so that no multiply-add is fused where torch rounds twice.
 *
 * Rows are addressed through element strides; within a row elements are contiguous.
 *
 * The file includes itself once per scalar type (float, double).
 */
#ifndef SCALAR

#include "common.h"

/* Below this many elements an operation runs on the calling thread: waking the others costs more. */
#define PARALLEL_MIN 65536

#define SCALAR float
#define SUFFIX _f32
#define EXP expf
#define SQRT sqrtf
#include "fused_ops.c"
#undef SCALAR
#undef SUFFIX
#undef EXP
#undef SQRT

#define SCALAR double
#define SUFFIX _f64
#define EXP exp
#define SQRT sqrt
#include "fused_ops.c"

#else

static inline void CAT(norm_row, SUFFIX)(const SCALAR *restrict x, const SCALAR *restrict w, SCALAR *restrict out,
                                         int dim, double eps) {
  SCALAR sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < dim; ++i) sum += x[i] * x[i];
  const SCALAR inv = 1 / SQRT(sum / dim + (SCALAR)eps);
#pragma omp simd
  for (int i = 0; i < dim; ++i) out[i] = w[i] * (x[i] * inv);
}

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps). */
void CAT(rms_norm, SUFFIX)(const SCALAR *x, long x_stride, const SCALAR *w, SCALAR *out, long out_stride, long rows,
                           int dim, double eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_MIN) schedule(static)
  for (long r = 0; r < rows; ++r) CAT(norm_row, SUFFIX)(x + r * x_stride, w, out + r * out_stride, dim, eps);
}

/* residual[r] += x[r] (in place), then out[r] = rms_norm(residual[r]): a layer's residual add and the
 * next norm in one pass. residual and out are contiguous [rows, dim]; x has a row stride. */
void CAT(add_rms_norm, SUFFIX)(SCALAR *residual, const SCALAR *x, long x_stride, const SCALAR *w, SCALAR *out,
                               long rows, int dim, double eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_MIN) schedule(static)
  for (long r = 0; r < rows; ++r) {
    SCALAR *restrict res = residual + r * dim;
    const SCALAR *restrict xr = x + r * x_stride;
#pragma omp simd
    for (int i = 0; i < dim; ++i) res[i] = res[i] + xr[i];
    CAT(norm_row, SUFFIX)(res, w, out + r * dim, dim, eps);
  }
}

/* Rotary embedding in place, transformers' rotate-half form: for each token t and head h, with
 * a = x[i], b = x[i + dim/2]: x[i] = a*cos[i] - b*sin[i] and x[i + dim/2] = b*cos[i + dim/2] + a*sin[i + dim/2].
 * x is [tokens, heads, dim] with strides (x_tok, x_head); cos/sin are [tokens, dim] with stride cs_tok. */
void CAT(rotary, SUFFIX)(SCALAR *x, long x_tok, long x_head, int heads, long tokens, const SCALAR *cos,
                         const SCALAR *sin, long cs_tok, int dim, int threads) {
  const int half = dim / 2;
#pragma omp parallel for num_threads(threads) if (tokens * heads * dim >= PARALLEL_MIN) schedule(static)
  for (long t = 0; t < tokens; ++t) {
    const SCALAR *restrict c = cos + t * cs_tok, *restrict s = sin + t * cs_tok;
    for (int h = 0; h < heads; ++h) {
      SCALAR *restrict v = x + t * x_tok + (long)h * x_head;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const SCALAR a = v[i], b = v[i + half];
        v[i] = a * c[i] + (-b) * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

/* out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:], silu(g) = g / (1 + exp(-g)).
 * gate_up is contiguous [rows, 2 * inter]; out contiguous [rows, inter]. */
void CAT(silu_mul, SUFFIX)(const SCALAR *gate_up, SCALAR *out, long rows, int inter, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_MIN) schedule(static)
  for (long r = 0; r < rows; ++r) {
    const SCALAR *restrict g = gate_up + r * 2 * inter, *restrict u = g + inter;
    SCALAR *restrict o = out + r * inter;
#pragma omp simd
    for (int i = 0; i < inter; ++i) o[i] = g[i] / (1 + EXP(-g[i])) * u[i];
  }
}

#endif
