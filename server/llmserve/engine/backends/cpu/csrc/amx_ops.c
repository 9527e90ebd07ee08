/* Float32 linears on AMX tiles as three bfloat16 products (split_linear.py says when and why).
 *
 * y = x @ w.T + bias (+ residual), with x and w each split into a bfloat16 head and a bfloat16 tail
 * (v = hi + lo exactly up to the 16 bits below lo): x.w ~= hi(x).hi(w) + hi(x).lo(w) + lo(x).hi(w), the fourth
 * product (~2^-16 of the others) dropped. Every product of two bfloat16 is exact in float32 and the tiles sum them in
 * float32, so the result is float32's up to a few units in its 2^-17th: measured ~4e-6 of the largest output, float32
 * GEMM's own ~6e-7 (tests/engine/test_split_linear.py).
 *
 * The three products are one reduction over K' = 3K: rows [hi(x) | hi(x) | lo(x)] against columns
 * [hi(w) | lo(w) | hi(w)]. Layouts, all of 16 x 32 bfloat16 tiles (1 KiB, what one TILELOADD reads with a 64-byte
 * stride):
 *   a (made here per call): [mp/16][kp/32][16 rows][32 k]; rows past m and k past 3K are zero;
 *   w (split_linear.pack, once at load): [np/16][kp/32][16 k pairs][16 columns][2], the pair layout TDPBF16PS
 *   reads; columns past n and k past 3K are zero.
 * A 32 x 32 block of the output is four float32 tiles (2 x 2), summed over the reduction in chunks of CHUNK k-tiles
 * through a float32 buffer, so that one chunk's weights stay in the core's L2 across the rows. Each output's sum
 * runs in the same order whatever the row count and however the threads split the blocks: a row's result does not
 * depend on the rows beside it.
 *
 * Compiled for AMX by the target pragma below whatever the library's baseline; run only where the CPU reports
 * AMX-BF16 and `amx_request` has been granted the tile state (Linux asks each process to request it).
 */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE 512   /* bfloat16 elements in one 16 x 32 tile */
/* k-tiles (of 32) per chunk of the reduction: 36 is K' = 3 x 384. At 512 rows of all-MiniLM-L6-v2's shapes, 2
 * threads, chunks of 36 / 72 / whole: down projection (K' = 4,608) 0.97 / 0.96 / 1.28 ms, the others equal. */
#define CHUNK 36

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} tile_config;

/* 0 where this process may use the AMX tile state (granted now or before), -1 where the kernel refuses it. */
int amx_request(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1; }

static inline uint16_t bf16_of(float f) {
  union { float f; uint32_t u; } c = {f};
  return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline float float_of(uint16_t h) {
  union { uint32_t u; float f; } c = {(uint32_t)h << 16};
  return c.f;
}

/* Row i of x as [hi | hi | lo], written into its place in the tiles of `a`. */
static void split_row(const float *x, int64_t k, int64_t kp, uint16_t *a) {
  /* Element j of the row goes to a[(j / 32) * TILE + j % 32]: sixteen at a time where k is a multiple of 16 (a run
   * of 16 then never crosses a tile). */
  if (k % 16 == 0) {
    for (int64_t j = 0; j < k; j += 16) {
      __m512 v = _mm512_loadu_ps(x + j);
      __m256i hi = (__m256i)_mm512_cvtneps_pbh(v);
      __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
      __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
      int64_t at[3] = {j, k + j, 2 * k + j};
      __m256i part[3] = {hi, hi, lo};
      for (int p = 0; p < 3; p++) _mm256_storeu_si256((__m256i *)(a + (at[p] / 32) * TILE + at[p] % 32), part[p]);
    }
  } else {
    for (int64_t j = 0; j < k; j++) {
      uint16_t hi = bf16_of(x[j]), lo = bf16_of(x[j] - float_of(hi));
      int64_t at[3] = {j, k + j, 2 * k + j};
      uint16_t part[3] = {hi, hi, lo};
      for (int p = 0; p < 3; p++) a[(at[p] / 32) * TILE + at[p] % 32] = part[p];
    }
  }
  for (int64_t j = 3 * k; j < kp; j++) a[(j / 32) * TILE + j % 32] = 0;
}

/* The calling thread's scratch (the split rows, the float32 sums), grown to the largest call and kept: allocated
 * and freed per call, each call of 512 rows faulted its megabytes of fresh pages in again (and glibc returned them),
 * which cost the server a quarter of its embeddings/s at 32 texts per call (benchmarks/README.md). Per thread, so
 * callers on several threads never share it; it lives as long as the thread. */
static __thread void *scratch[2];
static __thread size_t scratch_bytes[2];

static void *scratch_of(int which, size_t bytes) {
  if (scratch_bytes[which] < bytes) {
    free(scratch[which]);
    bytes = (bytes + 4095) / 4096 * 4096;
    scratch[which] = aligned_alloc(4096, bytes);
    scratch_bytes[which] = scratch[which] ? bytes : 0;
  }
  return scratch[which];
}

/* x [m, k] float32 rows, w packed as above for [n, k] (np, kp: its padded sizes), bias [n] or NULL, residual
 * [m, n] or NULL, y [m, n]. Returns 0, or -1 where scratch memory could not be had. */
int amx_linear_split3(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, int64_t np, int64_t kp,
                      const float *bias, const float *residual, float *y, int threads) {
  int64_t mp = (m + 31) / 32 * 32, ktiles = kp / 32, mblocks = mp / 32, nblocks = np / 32;
  uint16_t *a = scratch_of(0, (size_t)(mp * kp) * sizeof(uint16_t));
  float *c = scratch_of(1, (size_t)(mp * np) * sizeof(float));
  if (a == NULL || c == NULL) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < mp; i++) {
    uint16_t *row = a + (i / 16) * ktiles * TILE + (i % 16) * 32;
    if (i < m) {
      split_row(x + i * k, k, kp, row);
    } else {
      for (int64_t t = 0; t < ktiles; t++) memset(row + t * TILE, 0, 64);
    }
  }
#pragma omp parallel num_threads(threads)
  {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
      cfg.rows[t] = 16;
      cfg.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&cfg);
    /* Each thread its own run of row blocks where there are enough of them, else its own run of column blocks. */
    int count = omp_get_num_threads(), id = omp_get_thread_num();
    int by_rows = mblocks >= 2 * count;
    int64_t parts = by_rows ? mblocks : nblocks;
    int64_t lo = parts * id / count, hi = parts * (id + 1) / count;
    int64_t m0 = by_rows ? lo : 0, m1 = by_rows ? hi : mblocks;
    int64_t n0 = by_rows ? 0 : lo, n1 = by_rows ? nblocks : hi;
    for (int64_t k0 = 0; k0 < ktiles; k0 += CHUNK) {
      int64_t k1 = k0 + CHUNK < ktiles ? k0 + CHUNK : ktiles;
      for (int64_t nb = n0; nb < n1; nb++) {
        const uint16_t *b0 = w + 2 * nb * ktiles * TILE, *b1 = b0 + ktiles * TILE;
        for (int64_t mb = m0; mb < m1; mb++) {
          const uint16_t *a0 = a + 2 * mb * ktiles * TILE, *a1 = a0 + ktiles * TILE;
          float *out = c + mb * 32 * np + nb * 32;
          if (k0 == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          } else {
            _tile_loadd(0, out, np * 4);
            _tile_loadd(1, out + 16, np * 4);
            _tile_loadd(2, out + 16 * np, np * 4);
            _tile_loadd(3, out + 16 * np + 16, np * 4);
          }
          for (int64_t kt = k0; kt < k1; kt++) {
            _tile_loadd(4, a0 + kt * TILE, 64);
            _tile_loadd(5, a1 + kt * TILE, 64);
            _tile_loadd(6, b0 + kt * TILE, 64);
            _tile_loadd(7, b1 + kt * TILE, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, out, np * 4);
          _tile_stored(1, out + 16, np * 4);
          _tile_stored(2, out + 16 * np, np * 4);
          _tile_stored(3, out + 16 * np + 16, np * 4);
        }
      }
    }
    _tile_release();
    /* This thread's own blocks out: the bias and the residual added, rows and columns past m and n left. */
    int64_t r1 = m1 * 32 < m ? m1 * 32 : m, q1 = n1 * 32 < n ? n1 * 32 : n;
    for (int64_t r = m0 * 32; r < r1; r++) {
      const float *from = c + r * np;
      float *to = y + r * n;
      const float *add = residual ? residual + r * n : NULL;
      for (int64_t q = n0 * 32; q < q1; q++) {
        float v = from[q] + (bias ? bias[q] : 0.0f);
        to[q] = add ? v + add[q] : v;
      }
    }
  }
  return 0;
}
#endif
