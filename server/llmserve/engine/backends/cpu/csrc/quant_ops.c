/* Linears over llama.cpp's block-quantized weights: packing, activation quantization, the portable kernel and
 * the dispatch to a level's kernel (quant.h states the layout and the arithmetic all levels share).
 *
 * This file is compiled for the baseline of the architecture (x86-64: no AVX), so that the portable level and
 * everything shared run on any CPU; quant_avx2.c and quant_avx512.c carry their own target pragmas, and a level
 * runs only where the CPU reports its instructions (quant_levels). Built with fp contraction off: the arithmetic
 * of quant.h is written out operation by operation.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "quant.h"

/* Below this many multiply-adds a call runs on the calling thread: waking the others costs more. */
#define QUANT_PARALLEL_MIN 65536L

/* bytes of one ggml block and weights in it */
static long src_block_bytes(int type) {
  switch (type) {
    case Q_Q4_0: return 18;
    case Q_Q4_1: return 20;
    case Q_Q5_0: return 22;
    case Q_Q5_1: return 24;
    case Q_Q8_0: return 34;
    case Q_Q4_K: return 144;
    case Q_Q5_K: return 176;
    case Q_Q6_K: return 210;
    default: return 0;
  }
}

static int known(int type) { return src_block_bytes(type) > 0; }

/* ggml's get_scale_min_k4: the j-th 6-bit (scale, min) pair of Q4_K/Q5_K's 12 packed bytes */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

/* The 32 unsigned quants of block b (of 32) of one source row, as quant.h's table has them (Q8_0: + 128). */
static void source_quants(int type, const uint8_t *row, long b, uint8_t q[QBLOCK]) {
  if (!q_is_k(type)) {
    const uint8_t *p = row + b * src_block_bytes(type);
    uint32_t qh = 0;
    const uint8_t *qs = p + 2;
    switch (type) {
      case Q_Q4_1: qs = p + 4; break;
      case Q_Q5_0: memcpy(&qh, p + 2, 4); qs = p + 6; break;
      case Q_Q5_1: memcpy(&qh, p + 4, 4); qs = p + 8; break;
      case Q_Q8_0:
        for (int i = 0; i < QBLOCK; ++i) q[i] = p[2 + i] ^ 0x80;  /* the int8 quant + 128 */
        return;
      default: break;
    }
    for (int i = 0; i < 16; ++i) {
      q[i] = (uint8_t)((qs[i] & 0xF) | (((qh >> i) & 1) << 4));
      q[i + 16] = (uint8_t)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
    }
    return;
  }
  const uint8_t *sp = row + (b / 8) * src_block_bytes(type);
  const int j = (int)(b % 8);
  if (type == Q_Q6_K) {  /* ggml's dequantize_row_q6_K, one 32-part of a 128-half at a time */
    const int half = j / 4, t = j % 4;
    const uint8_t *ql = sp + 64 * half + 32 * (t & 1), *qh = sp + 128 + 32 * half;
    for (int l = 0; l < QBLOCK; ++l) {
      const int low = t & 2 ? ql[l] >> 4 : ql[l] & 0xF;
      q[l] = (uint8_t)(low | (((qh[l] >> (2 * t)) & 3) << 4));
    }
    return;
  }
  const uint8_t *qs = sp + (type == Q_Q4_K ? 16 : 48) + 32 * (j / 2), *qh = sp + 16;
  for (int l = 0; l < QBLOCK; ++l) {
    q[l] = j & 1 ? qs[l] >> 4 : qs[l] & 0xF;
    if (type == Q_Q5_K) q[l] |= (uint8_t)(((qh[l] >> j) & 1) << 4);
  }
}

long quant_packed_bytes(int type, long n, long k) {
  if (!known(type) || n <= 0 || k <= 0 || k % (q_is_k(type) ? 256 : QBLOCK)) return -1;
  return (n + STRIP - 1) / STRIP * q_strip_bytes(type, k);
}

/* Packs one strip: `cols` (1..16) source rows, `row_bytes` apart, into quant.h's layout (padding columns stay 0).
 * Block by block for all 16 columns at once, each packed byte written once. */
static void pack_strip(int type, const uint8_t *rows, long row_bytes, int cols, long k, uint8_t *strip) {
  const long nb = k / QBLOCK, payload = q_payload(type);
  uint8_t *meta = strip + q_meta_offset(type, k);
  uint8_t q[STRIP][QBLOCK];
  for (long b = 0; b < nb; ++b) {
    memset(q, 0, sizeof q);
    for (int c = 0; c < cols; ++c) source_quants(type, rows + c * row_bytes, b, q[c]);
    uint8_t *p = strip + b * payload;
    if (type == Q_Q8_0) {
      for (int g = 0; g < 8; ++g)
        for (int c = 0; c < STRIP; ++c)
          for (int j = 0; j < 4; ++j) p[64 * g + 4 * c + j] = q[c][4 * g + j];
    } else {
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < STRIP; ++c)
          for (int j = 0; j < 4; ++j)
            p[64 * i + 4 * c + j] = (uint8_t)((q[c][4 * i + j] & 0xF) | (q[c][16 + 4 * i + j] << 4));
      for (int plane = 0; plane < q_planes(type); ++plane)
        for (int i = 0; i < 4; ++i)
          for (int h = 0; h < 2; ++h) {
            uint64_t bits = 0;
            for (int c = 0; c < STRIP; ++c)
              for (int j = 0; j < 4; ++j)
                bits |= (uint64_t)((q[c][16 * h + 4 * i + j] >> (4 + plane)) & 1) << (4 * c + j);
            memcpy(p + 256 + 64 * plane + 16 * i + 8 * h, &bits, 8);
          }
    }
    if (!q_is_k(type)) {
      uint8_t *mb = meta + b * q_meta(type);
      for (int c = 0; c < cols; ++c) {
        const uint8_t *src = rows + c * row_bytes + b * src_block_bytes(type);
        memcpy(mb + 2 * c, src, 2);  /* d */
        if (q_has_min(type)) memcpy(mb + 32 + 2 * c, src + 2, 2);  /* m */
      }
    }
  }
  if (!q_is_k(type)) return;
  for (long u = 0; u < k / 256; ++u) {
    uint8_t *mu = meta + u * q_meta(type);
    for (int c = 0; c < cols; ++c) {
      const uint8_t *sp = rows + c * row_bytes + u * src_block_bytes(type);
      if (type == Q_Q6_K) {
        memcpy(mu + 2 * c, sp + 208, 2);
        for (int sub = 0; sub < 16; ++sub) mu[32 + 16 * sub + c] = sp[192 + sub];
        continue;
      }
      memcpy(mu + 2 * c, sp, 2);
      memcpy(mu + 32 + 2 * c, sp + 2, 2);
      for (int j = 0; j < 8; ++j) scale_min_k4(j, sp + 4, mu + 64 + 16 * j + c, mu + 192 + 16 * j + c);
    }
  }
}

/* Packs `n` rows of `k` weights of `type` (rows `row_bytes` apart in src) into dst (quant_packed_bytes of them).
 * Returns 0, or 1 for an unknown type or a shape it does not take. */
int quant_pack(int type, const uint8_t *src, long row_bytes, long n, long k, uint8_t *dst, int threads) {
  const long total = quant_packed_bytes(type, n, k);
  if (total < 0) return 1;
  const long strips = (n + STRIP - 1) / STRIP, sb = q_strip_bytes(type, k);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long s = 0; s < strips; ++s) {
    uint8_t *strip = dst + s * sb;
    memset(strip, 0, (size_t)sb);
    const int cols = n - s * STRIP < STRIP ? (int)(n - s * STRIP) : STRIP;
    pack_strip(type, src + s * STRIP * row_bytes, row_bytes, cols, k, strip);
  }
  return 0;
}

/* quant.h's activation quantization of rows [0, m) of x [m][k] into a, dx, sx, corr for `type`. */
static void prepare(int type, const float *x, long m, long k, int8_t *a, float *dx, float *sx, int32_t *corr,
                    int threads) {
  const long nb = k / QBLOCK;
  const int z = q_zero(type), halves = type == Q_Q6_K;
#pragma omp parallel for num_threads(threads) if (m * k >= QUANT_PARALLEL_MIN) schedule(static)
  for (long r = 0; r < m; ++r) {
    for (long b = 0; b < nb; ++b) {
      const float *v = x + r * k + b * QBLOCK;
      int8_t *q = a + r * k + b * QBLOCK;
      float top = 0;
      int bad = 0;
      for (int i = 0; i < QBLOCK; ++i) {
        const float f = fabsf(v[i]);
        bad |= !(f <= FLT_MAX);
        top = f > top ? f : top;
      }
      /* A non-finite input makes the block's scale NaN (its quants 0), so that every output it reaches is NaN.
       * As llama.cpp's quantize_row_q8_0 (and the gguf package's Q8_0): d = max|x| / 127, x times 1 / d, rounded
       * half away from zero (roundf). */
      const float d = bad ? NAN : top / 127.0f, inv = bad || d == 0.0f ? 0.0f : 1.0f / d;
      /* For a subnormal scale the reciprocal overflows: such a block divides by its scale instead. */
      const int tiny = !bad && !(inv <= FLT_MAX);
      int sum[2] = {0, 0};
      for (int i = 0; i < QBLOCK; ++i) {
        float t = tiny ? roundf(v[i] / d) : roundf(v[i] * inv);
        t = t > 127.0f ? 127.0f : (t < -127.0f ? -127.0f : t);
        q[i] = bad ? 0 : (int8_t)t;
        sum[i / 16] += q[i];
      }
      dx[r * nb + b] = d;
      sx[r * nb + b] = d * (float)(sum[0] + sum[1]);
      if (halves) {
        corr[r * 2 * nb + 2 * b] = -z * sum[0];
        corr[r * 2 * nb + 2 * b + 1] = -z * sum[1];
      } else {
        corr[r * nb + b] = -z * (sum[0] + sum[1]);
      }
    }
  }
}

/* --- the portable kernel: quant.h's arithmetic written out per output ---------------------------------------- */

static int packed_quant(int type, const uint8_t *p, int c, int kk) {
  if (type == Q_Q8_0) return p[64 * (kk / 4) + 4 * c + kk % 4];
  const int chunk = (kk % 16) / 4, hi = kk / 16, bit = 4 * c + kk % 4;
  int q = (p[64 * chunk + bit] >> (4 * hi)) & 0xF;
  for (int plane = 0; plane < q_planes(type); ++plane)
    q |= ((p[256 + 64 * plane + 16 * chunk + 8 * hi + bit / 8] >> (bit % 8)) & 1) << (4 + plane);
  return q;
}

void q_kernel_portable(const qmat *w, const qact *x, long m, long s0, long s1, float *y, long ldy) {
  const int type = w->type;
  const long k = w->k, nb = k / QBLOCK, sb = q_strip_bytes(type, k), payload = q_payload(type);
  const long corr_stride = type == Q_Q6_K ? 2 * nb : nb;
  for (long s = s0; s < s1; ++s) {
    const uint8_t *strip = w->packed + s * sb, *meta = strip + q_meta_offset(type, k);
    for (int c = 0; c < STRIP && s * STRIP + c < w->n; ++c) {
      for (long r = 0; r < m; ++r) {
        const int8_t *a = x->a + r * k;
        const int32_t *corr = x->corr + r * corr_stride;
        float acc = 0.0f;
        for (long b = 0; b < nb; ++b) {
          const uint8_t *p = strip + b * payload;
          const float dx = x->dx[r * nb + b], sx = x->sx[r * nb + b];
          if (type == Q_Q6_K) {
            const uint8_t *mu = meta + (b / 8) * q_meta(type);
            const int j = (int)(b % 8);
            int32_t part[2] = {corr[2 * b], corr[2 * b + 1]};
            for (int kk = 0; kk < QBLOCK; ++kk) part[kk / 16] += packed_quant(type, p, c, kk) * a[b * QBLOCK + kk];
            const int32_t isum = (int8_t)mu[32 + 16 * (2 * j) + c] * part[0] + (int8_t)mu[32 + 16 * (2 * j + 1) + c] * part[1];
            const float scale = q_half(q_load16(mu + 2 * c)) * dx;
            acc = fmaf((float)isum, scale, acc);
            continue;
          }
          int32_t isum = corr[b];
          for (int kk = 0; kk < QBLOCK; ++kk) isum += packed_quant(type, p, c, kk) * a[b * QBLOCK + kk];
          float ws, wm = 0.0f;
          if (q_is_k(type)) {
            const uint8_t *mu = meta + (b / 8) * q_meta(type);
            const int j = (int)(b % 8);
            ws = q_half(q_load16(mu + 2 * c)) * (float)mu[64 + 16 * j + c];
            wm = -(q_half(q_load16(mu + 32 + 2 * c)) * (float)mu[192 + 16 * j + c]);
          } else {
            const uint8_t *mb = meta + b * q_meta(type);
            ws = q_half(q_load16(mb + 2 * c));
            if (q_has_min(type)) wm = q_half(q_load16(mb + 32 + 2 * c));
          }
          const float scale = ws * dx;
          acc = fmaf((float)isum, scale, acc);
          if (q_has_min(type)) acc = fmaf(wm, sx, acc);
        }
        y[r * ldy + s * STRIP + c] = acc;
      }
    }
  }
}

/* Block b's scales for column c under the float contract (quant.h): ws, wm (0 without a min), and Q6_K's second
 * half's ws1. */
static void packed_scales(int type, const uint8_t *meta, long b, int c, float *ws, float *wm, float *ws1) {
  *wm = *ws1 = 0.0f;
  if (q_is_k(type)) {
    const uint8_t *mu = meta + (b / 8) * q_meta(type);
    const int j = (int)(b % 8);
    const float d = q_half(q_load16(mu + 2 * c));
    if (type == Q_Q6_K) {
      *ws = d * (float)(int8_t)mu[32 + 16 * (2 * j) + c];
      *ws1 = d * (float)(int8_t)mu[32 + 16 * (2 * j + 1) + c];
      return;
    }
    *ws = d * (float)mu[64 + 16 * j + c];
    *wm = -(q_half(q_load16(mu + 32 + 2 * c)) * (float)mu[192 + 16 * j + c]);
    return;
  }
  const uint8_t *mb = meta + b * q_meta(type);
  *ws = q_half(q_load16(mb + 2 * c));
  if (q_has_min(type)) *wm = q_half(q_load16(mb + 32 + 2 * c));
}

/* Group sums of x for the float contract: xs[r][g] = (s0 + s1) + (s2 + s3), s_j the adds of k = j mod 4 in order. */
static void group_sums(int type, const float *x, long m, long k, float *xs) {
  const long groups = q_groups(type, k), size = k / groups;
  for (long r = 0; r < m; ++r)
    for (long g = 0; g < groups; ++g) {
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (long kk = 0; kk < size; ++kk) part[kk % 4] += x[r * k + g * size + kk];
      xs[r * groups + g] = (part[0] + part[1]) + (part[2] + part[3]);
    }
}

void q_kernel_f32_portable(const qmat *w, const float *x, const float *xs, long m, long s0, long s1, float *y, long ldy,
                           float *acc) {
  (void)acc;
  const int type = w->type, halves = type == Q_Q6_K;
  const long k = w->k, nb = k / QBLOCK, sb = q_strip_bytes(type, k), groups = q_groups(type, k);
  const float z = (float)q_zero(type);
  for (long s = s0; s < s1; ++s) {
    const uint8_t *strip = w->packed + s * sb, *meta = strip + q_meta_offset(type, k);
    for (int c = 0; c < STRIP && s * STRIP + c < w->n; ++c) {
      for (long r = 0; r < m; ++r) {
        const float *xr = x + r * k;
        float out = 0.0f;
        for (long b = 0; b < nb; ++b) {
          const uint8_t *p = strip + b * q_payload(type);
          float ws, wm, ws1;
          packed_scales(type, meta, b, c, &ws, &wm, &ws1);
          for (int g = 0; g <= halves; ++g) {
            const int k0 = halves ? 16 * g : 0, kn = halves ? 16 : QBLOCK;
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int kk = k0; kk < k0 + kn; ++kk)
              part[kk % 4] = fmaf(xr[b * QBLOCK + kk], (float)packed_quant(type, p, c, kk), part[kk % 4]);
            const float xsum = xs[r * groups + (halves ? 2 * b + g : b)];
            float sum = (part[0] + part[1]) + (part[2] + part[3]);
            if (z != 0.0f) sum = fmaf(-z, xsum, sum);
            out = fmaf(g ? ws1 : ws, sum, out);
            if (q_has_min(type)) out = fmaf(wm, xsum, out);
          }
        }
        y[r * ldy + s * STRIP + c] = out;
      }
    }
  }
}

/* --- levels and dispatch ------------------------------------------------------------------------------------ */

/* Bit l set: this CPU runs level l. */
int quant_levels(void) {
  int levels = 1 << LEVEL_PORTABLE;
#if defined(__x86_64__)
  __builtin_cpu_init();
  const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) levels |= 1 << LEVEL_AVX2;
  if (avx2 && __builtin_cpu_supports("avxvnni")) levels |= 1 << LEVEL_AVX2_VNNI;
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    levels |= 1 << LEVEL_AVX512_VNNI;
#endif
  return levels;
}

static q_kernel kernel_of(int level) {
  switch (level) {
    case LEVEL_PORTABLE: return q_kernel_portable;
#if defined(__x86_64__)
    case LEVEL_AVX2: return q_kernel_avx2;
    case LEVEL_AVX2_VNNI: return q_kernel_avx2_vnni;
    case LEVEL_AVX512_VNNI: return q_kernel_avx512_vnni;
#endif
    default: return NULL;
  }
}

static q_kernel_f32 kernel_f32_of(int level) {
  switch (level) {
    case LEVEL_PORTABLE: return q_kernel_f32_portable;
#if defined(__x86_64__)
    case LEVEL_AVX2: return q_kernel_f32_avx2;
    case LEVEL_AVX2_VNNI: return q_kernel_f32_avx2_vnni;
    case LEVEL_AVX512_VNNI: return q_kernel_f32_avx2;  /* the contract's order, not the width, decides the bits */
#endif
    default: return NULL;
  }
}

#ifdef _OPENMP
extern int omp_get_thread_num(void);
extern int omp_get_num_threads(void);
#endif

/* quant_linear with float activations (quant.h): the same arguments and returns. */
int quant_linear_f32(int level, int type, const uint8_t *packed, long n, long k, const float *x, long m, float *y,
                     long ldy, int threads) {
  const q_kernel_f32 kernel = kernel_f32_of(level);
  if (kernel == NULL || !((quant_levels() >> level) & 1)) return 1;
  if (quant_packed_bytes(type, n, k) < 0 || m < 0 || ldy < n || threads < 1) return 3;
  if (m == 0) return 0;
  const qmat w = {type, n, k, packed};
  const long strips = (n + STRIP - 1) / STRIP;
  const int parallel = threads > 1 && m * n * k >= QUANT_PARALLEL_MIN && strips > 1;
  float *xs = malloc(sizeof(float) * (size_t)(m * q_groups(type, k)));
  if (xs == NULL) return 2;
  group_sums(type, x, m, k, xs);
  int failed = 0;
#pragma omp parallel num_threads(threads) if (parallel) reduction(| : failed)
  {
#ifdef _OPENMP
    const long t = omp_get_thread_num(), count = omp_get_num_threads();
#else
    const long t = 0, count = 1;
#endif
    float *acc = aligned_alloc(64, sizeof(float) * 16 * (size_t)(m > 0 ? m : 1));
    failed = acc == NULL;
    if (acc != NULL) kernel(&w, x, xs, m, strips * t / count, strips * (t + 1) / count, y, ldy, acc);
    free(acc);
  }
  free(xs);
  return failed ? 2 : 0;
}

/* y [m][n] = x [m][k] @ W.T for a packed W (quant_pack) with `level`'s kernel, y's rows `ldy` floats apart (a
 * column slice of a wider output: ldy > n). Returns 0; 1: the level is not
 * compiled in or this CPU lacks its instructions; 2: the scratch could not be allocated; 3: a bad type or shape.
 * Columns are split across threads in whole strips, each output computed by one thread with the same code. */
int quant_linear(int level, int type, const uint8_t *packed, long n, long k, const float *x, long m, float *y,
                 long ldy, int threads) {
  const q_kernel kernel = kernel_of(level);
  if (kernel == NULL || !((quant_levels() >> level) & 1)) return 1;
  if (quant_packed_bytes(type, n, k) < 0 || m < 0 || ldy < n || threads < 1) return 3;
  if (m == 0) return 0;
  const long nb = k / QBLOCK;
  int8_t *a = malloc((size_t)(m * k));
  float *dx = malloc(sizeof(float) * (size_t)(m * nb)), *sx = malloc(sizeof(float) * (size_t)(m * nb));
  int32_t *corr = malloc(sizeof(int32_t) * (size_t)(2 * m * nb));
  int failed = a == NULL || dx == NULL || sx == NULL || corr == NULL;
  if (!failed) {
    prepare(type, x, m, k, a, dx, sx, corr, threads);
    const qmat w = {type, n, k, packed};
    const qact act = {a, dx, sx, corr, k};
    const long strips = (n + STRIP - 1) / STRIP;
    const int parallel = threads > 1 && m * n * k >= QUANT_PARALLEL_MIN && strips > 1;
#pragma omp parallel num_threads(threads) if (parallel)
    {
#ifdef _OPENMP
      const long t = omp_get_thread_num(), count = omp_get_num_threads();
#else
      const long t = 0, count = 1;
#endif
      kernel(&w, &act, m, strips * t / count, strips * (t + 1) / count, y, ldy);
    }
  }
  free(a);
  free(dx);
  free(sx);
  free(corr);
  return failed ? 2 : 0;
}
