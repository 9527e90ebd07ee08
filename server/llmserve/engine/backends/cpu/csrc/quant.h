/* Linears over llama.cpp's block-quantized weights (quant.py): the packed layout, the activation format and the
 * arithmetic every kernel level shares.
 *
 * Arithmetic (the contract; every level computes exactly this, so that results are bitwise equal across levels,
 * row counts and thread counts). Activations are quantized per block of 32 as llama.cpp's Q8_0 does:
 *   dx = max|x| / 127, a = roundf(x * (1 / dx)) (half away from zero) in [-127, 127], A = sum(a) over the block
 *   (llama.cpp's quantize_row_q8_0 bit for bit, checked against the gguf package's Q8_0).
 * A weight block of 32 decodes to w = ws * (q - z) + wm, q small unsigned integers, z an integer zero (see the
 * table), ws and wm floats exactly representable in float32 (float16 scales times integer sub-scales). For each
 * output (row r, column n) the kernel starts at acc = 0 and, block after block in order of k:
 *   isum = sum(q * a) - z * A                 (int32, exact)
 *   acc  = fma((float)isum, ws * dx, acc)     (ws * dx rounded to float first)
 *   acc  = fma(wm, dx * (float)A, acc)        (types with a min; dx * A rounded, as `sx`)
 * Q6_K's blocks hold two halves of 16 with their own int8 sub-scales sc0, sc1 and one float16 d:
 *   isum = sc0 * (sum_h0(q * a) - 32 * A_h0) + sc1 * (sum_h1(q * a) - 32 * A_h1), acc = fma((float)isum, d * dx, acc)
 *
 *   type   q bits  z    ws              wm
 *   Q4_0   4       8    d               -
 *   Q4_1   4       0    d               m
 *   Q5_0   5       16   d               -
 *   Q5_1   5       0    d               m
 *   Q8_0   8       128  d               -      (q stored offset-binary: the int8 quant + 128)
 *   Q4_K   4       0    d * sc_j        -(dmin * m_j)
 *   Q5_K   5       0    d * sc_j        -(dmin * m_j)
 *   Q6_K   6       32   (see above)
 *
 * Float activations (quant_linear_f32): x stays float32 and the weights are never rounded to float on their own:
 * per group g (a block of 32; Q6_K: each half of 16) the kernel sums x times the stored quants q, then applies the
 * group's zero and scales once. With X = the group's sum of x:
 *   p_j  = fma(x_k, (float)q_k, p_j) over k = j mod 4 in increasing k, from 0        (four chains, j = 0..3)
 *   S    = (p0 + p1) + (p2 + p3);   S = fma(-z, X, S) for a type with a zero z
 *   acc  = fma(ws, S, acc);         acc = fma(wm, X, acc) for a type with a min (wm = m; K types: -(dmin * m_j))
 * (Q6_K: acc = fma(d * sc_h, S_h, acc) per half.) X is computed once per call and row, the same way with adds:
 * (s0 + s1) + (s2 + s3), s_j the chain of k = j mod 4. This is x @ dequantize(w).T to float32 rounding (the
 * products x * q are exact-ish small-integer multiples; the bound is float32 GEMM's, a few times wider where the
 * zero cancels) with the same arithmetic at every level, row count and thread count; at one or two rows a call
 * (Q8_0: up to 7) the quants are extracted as the blocks stream in (Q8_0: once for all the rows), from there up
 * decoded once into tiles of floats that every row reads, from eight rows up eight rows to a vector. The AVX-512 level runs the AVX2 float kernel (the FMAs' order is the
 * contract, not the width).
 *
 * Packed layout (quant_pack): output columns in strips of 16 (the last strip padded with zero columns); a strip is
 * its payload (one part per block of 32, in order of k), then its metadata, then padding to 64 bytes.
 * A block's payload, for its 16 columns c and 32 k:
 *   4-bit and wider-than-4-bit types: 256 bytes of nibbles in 4 chunks of 64; byte 4c + j of chunk i holds
 *     q[c][4i + j] & 15 in its low nibble and q[c][16 + 4i + j] & 15 in its high nibble (so a chunk's low
 *     nibbles are one group of 4 k for 16 columns, as VNNI's dot products take them, and its high nibbles the
 *     group 16 k further), then one 64-byte bit plane per bit above the fourth (Q5: 1, Q6_K: 2): plane p, chunk i,
 *     half h (low/high nibbles) is the little-endian uint64 at 16i + 8h whose bit 4c + j is bit 4 + p of the q.
 *   Q8_0: 512 bytes in 8 chunks of 64; byte 4c + j of chunk g is q[c][4g + j] + 128.
 * Metadata, per block of 32 for the 32-blocks types: d[16] float16 (Q4_1/Q5_1: then m[16] float16);
 * per superblock of 256 for Q4_K/Q5_K: d[16], dmin[16] float16, sc[8][16], m[8][16] uint8;
 * for Q6_K: d[16] float16, sc[16][16] int8.
 */
#ifndef LLMSERVE_QUANT_H
#define LLMSERVE_QUANT_H

#include <stdint.h>
#include <string.h>

/* ggml's type ids */
enum { Q_F32 = 0, Q_F16 = 1, Q_Q4_0 = 2, Q_Q4_1 = 3, Q_Q5_0 = 6, Q_Q5_1 = 7, Q_Q8_0 = 8, Q_Q4_K = 12, Q_Q5_K = 13,
       Q_Q6_K = 14 };
/* kernel levels, as quant.py names them */
enum { LEVEL_PORTABLE = 0, LEVEL_AVX2 = 1, LEVEL_AVX2_VNNI = 2, LEVEL_AVX512_VNNI = 3, LEVEL_COUNT = 4 };

#define QBLOCK 32
#define STRIP 16

/* The activations of one call, quantized (quant_prepare): a [m][k], dx and sx [m][k / 32], and corr, the integer
 * zero correction -z * A per block ([m][k / 32]; Q6_K: -32 * A per half-block, [m][k / 16]). */
typedef struct {
  const int8_t *a;
  const float *dx;
  const float *sx;
  const int32_t *corr;
  long k;
} qact;

/* A packed weight: `n` output columns of `k` weights of `type`. */
typedef struct {
  int type;
  long n, k;
  const uint8_t *packed;
} qmat;

static inline int q_has_min(int type) {
  return type == Q_Q4_1 || type == Q_Q5_1 || type == Q_Q4_K || type == Q_Q5_K;
}
static inline int q_is_k(int type) { return type == Q_Q4_K || type == Q_Q5_K || type == Q_Q6_K; }
static inline int q_planes(int type) {
  return type == Q_Q5_0 || type == Q_Q5_1 || type == Q_Q5_K ? 1 : (type == Q_Q6_K ? 2 : 0);
}
static inline int q_zero(int type) {
  return type == Q_Q4_0 ? 8 : type == Q_Q5_0 ? 16 : type == Q_Q8_0 ? 128 : type == Q_Q6_K ? 32 : 0;
}
/* Payload bytes of one block of 32 for a strip. */
static inline long q_payload(int type) { return type == Q_Q8_0 ? 512 : 256 + 64L * q_planes(type); }
/* Metadata bytes per block of 32 (32-blocks types) or per superblock of 256 (K types). */
static inline long q_meta(int type) {
  switch (type) {
    case Q_Q4_1: case Q_Q5_1: return 64;
    case Q_Q4_K: case Q_Q5_K: return 64 + 256;
    case Q_Q6_K: return 32 + 256;
    default: return 32;
  }
}
static inline long q_meta_offset(int type, long k) { return k / QBLOCK * q_payload(type); }
static inline long q_strip_bytes(int type, long k) {
  const long meta = (q_is_k(type) ? k / 256 : k / QBLOCK) * q_meta(type);
  return (q_meta_offset(type, k) + meta + 63) / 64 * 64;
}

/* float16 -> float32, exactly (normals, subnormals, infinities, NaN). */
static inline float q_half(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (!man) {
    bits = sign;
  } else {  /* subnormal: normalize */
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t q_load16(const uint8_t *p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

/* Each level's kernel: y[r][c] for rows [0, m) and strips [s0, s1), y's rows `ldy` floats apart. */
typedef void (*q_kernel)(const qmat *w, const qact *x, long m, long s0, long s1, float *y, long ldy);
void q_kernel_portable(const qmat *w, const qact *x, long m, long s0, long s1, float *y, long ldy);
#if defined(__x86_64__)
void q_kernel_avx2(const qmat *w, const qact *x, long m, long s0, long s1, float *y, long ldy);
void q_kernel_avx2_vnni(const qmat *w, const qact *x, long m, long s0, long s1, float *y, long ldy);
void q_kernel_avx512_vnni(const qmat *w, const qact *x, long m, long s0, long s1, float *y, long ldy);
#endif

/* The float-activation kernels: x [m][k] float32 rows, xs [m][groups] each row's group sums X, `acc` scratch of
 * m * 16 floats. */
typedef void (*q_kernel_f32)(const qmat *w, const float *x, const float *xs, long m, long s0, long s1, float *y,
                             long ldy, float *acc);
void q_kernel_f32_portable(const qmat *w, const float *x, const float *xs, long m, long s0, long s1, float *y, long ldy,
                           float *acc);
#if defined(__x86_64__)
void q_kernel_f32_avx2(const qmat *w, const float *x, const float *xs, long m, long s0, long s1, float *y, long ldy,
                       float *acc);
void q_kernel_f32_avx2_vnni(const qmat *w, const float *x, const float *xs, long m, long s0, long s1, float *y,
                            long ldy, float *acc);
#endif

/* Groups of the float contract per row: one per block of 32, two for Q6_K. */
static inline long q_groups(int type, long k) { return (type == Q_Q6_K ? 2 : 1) * (k / QBLOCK); }

#endif
