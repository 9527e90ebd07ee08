/* The AVX-512 VNNI level of the quantized linears (quant.h: layout and arithmetic).
 *
 * One zmm lane per output column of a strip of 16: VPDPBUSD multiplies a chunk's 16 columns x 4 k unsigned quants
 * by the row's 4 int8 activations (broadcast) and sums them into each column's int32, exactly. Up to 8 rows share
 * each chunk loaded; per block of 32 each row's 16 sums are scaled into its float accumulators as quant.h says.
 * Compiled for AVX-512 by the target pragma below whatever the library's baseline; run only where quant_levels
 * reports the instructions.
 */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include <immintrin.h>

#include "quant.h"

#define AI static inline __attribute__((always_inline))
#define MAX_ROWS 8
/* How far ahead of the block being computed the payload is prefetched: at one row a call streams its weights
 * from memory, and the hardware's prefetcher alone left ~10% on the table (gate/up of a 1B shape, Q4_K, one row,
 * median of 5 alternated runs of CPU time on the shared 2-core machine: 2.02 ms without, 1.81 at 1 KiB ahead,
 * 1.79 at 4 KiB). */
#define PREFETCH_AHEAD 4096

AI __m512i dot(__m512i acc, __m512i w, const int8_t *a) {
  int32_t v;
  memcpy(&v, a, 4);
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(v));
}

AI __m512 halves(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

AI __m512 bytes_u8(const uint8_t *p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

AI __m512i plane(__m512i v, const uint8_t *bits, int shift) {
  uint64_t mask;
  memcpy(&mask, bits, 8);
  return _mm512_mask_add_epi8(v, _cvtu64_mask64(mask), v, _mm512_set1_epi8((char)(16 << shift)));
}

/* Rows [r0, r0 + R) of strip s: every block of k, then the 16 (or fewer) outputs of each row stored. */
AI void strip_rows(const qmat *w, const qact *x, long r0, const int R, long s, float *y, long ldy, const int T) {
  const long k = w->k, nb = k / QBLOCK, payload = q_payload(T);
  const uint8_t *strip = w->packed + s * q_strip_bytes(T, k), *meta = strip + q_meta_offset(T, k);
  const long corr_stride = T == Q_Q6_K ? 2 * nb : nb;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 f[MAX_ROWS];
  __m512i acc[MAX_ROWS], acc2[MAX_ROWS];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  for (long b = 0; b < nb; ++b) {
    const uint8_t *p = strip + b * payload;
    for (long o = 0; o < payload; o += 64) _mm_prefetch((const char *)p + PREFETCH_AHEAD + o, _MM_HINT_T0);
    __m512 ws = _mm512_setzero_ps(), wm = _mm512_setzero_ps();
    __m512i sc0 = _mm512_setzero_si512(), sc1 = _mm512_setzero_si512();
    if (q_is_k(T)) {
      const uint8_t *mu = meta + (b / 8) * q_meta(T);
      const int j = (int)(b % 8);
      if (j == 0) {
        d = halves(mu);
        if (T != Q_Q6_K) dmin = halves(mu + 32);
      }
      if (T == Q_Q6_K) {
        sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(mu + 32 + 16 * (2 * j))));
        sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(mu + 32 + 16 * (2 * j + 1))));
      } else {
        ws = _mm512_mul_ps(d, bytes_u8(mu + 64 + 16 * j));
        wm = _mm512_mul_ps(dmin, bytes_u8(mu + 192 + 16 * j));
      }
    } else {
      const uint8_t *mb = meta + b * q_meta(T);
      ws = halves(mb);
      if (q_has_min(T)) wm = halves(mb + 32);
    }
    for (int r = 0; r < R; ++r) {
      const int32_t *corr = x->corr + (r0 + r) * corr_stride;
      if (T == Q_Q6_K) {
        acc[r] = _mm512_set1_epi32(corr[2 * b]);
        acc2[r] = _mm512_set1_epi32(corr[2 * b + 1]);
      } else {
        acc[r] = _mm512_set1_epi32(corr[b]);
      }
    }
    if (T == Q_Q8_0) {
      for (int g = 0; g < 8; ++g) {
        const __m512i v = _mm512_loadu_si512(p + 64 * g);
        for (int r = 0; r < R; ++r) acc[r] = dot(acc[r], v, x->a + (r0 + r) * k + b * QBLOCK + 4 * g);
      }
    } else {
      for (int i = 0; i < 4; ++i) {
        const __m512i v = _mm512_loadu_si512(p + 64 * i);
        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int pl = 0; pl < q_planes(T); ++pl) {
          lo = plane(lo, p + 256 + 64 * pl + 16 * i, pl);
          hi = plane(hi, p + 256 + 64 * pl + 16 * i + 8, pl);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t *a = x->a + (r0 + r) * k + b * QBLOCK + 4 * i;
          acc[r] = dot(acc[r], lo, a);
          if (T == Q_Q6_K)
            acc2[r] = dot(acc2[r], hi, a + 16);
          else
            acc[r] = dot(acc[r], hi, a + 16);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x->dx[(r0 + r) * nb + b]);
      if (T == Q_Q6_K) {
        const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(acc[r], sc0), _mm512_mullo_epi32(acc2[r], sc1));
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, dx), f[r]);
        continue;
      }
      f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(ws, dx), f[r]);
      if (q_has_min(T)) {
        const __m512 sx = _mm512_set1_ps(x->sx[(r0 + r) * nb + b]);
        f[r] = q_is_k(T) ? _mm512_fnmadd_ps(wm, sx, f[r]) : _mm512_fmadd_ps(wm, sx, f[r]);
      }
    }
  }
  const long cols = w->n - s * STRIP;
  const __mmask16 mask = cols >= STRIP ? 0xFFFF : (__mmask16)((1u << cols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * ldy + s * STRIP, mask, f[r]);
}

AI void strips(const qmat *w, const qact *x, long m, long s0, long s1, float *y, long ldy, const int T) {
  for (long s = s0; s < s1; ++s) {
    for (long r0 = 0; r0 < m; r0 += MAX_ROWS) {
      switch (m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS) {
        case 1: strip_rows(w, x, r0, 1, s, y, ldy, T); break;
        case 2: strip_rows(w, x, r0, 2, s, y, ldy, T); break;
        case 3: strip_rows(w, x, r0, 3, s, y, ldy, T); break;
        case 4: strip_rows(w, x, r0, 4, s, y, ldy, T); break;
        case 5: strip_rows(w, x, r0, 5, s, y, ldy, T); break;
        case 6: strip_rows(w, x, r0, 6, s, y, ldy, T); break;
        case 7: strip_rows(w, x, r0, 7, s, y, ldy, T); break;
        default: strip_rows(w, x, r0, 8, s, y, ldy, T); break;
      }
    }
  }
}

void q_kernel_avx512_vnni(const qmat *w, const qact *x, long m, long s0, long s1, float *y, long ldy) {
  switch (w->type) {
    case Q_Q4_0: strips(w, x, m, s0, s1, y, ldy, Q_Q4_0); break;
    case Q_Q4_1: strips(w, x, m, s0, s1, y, ldy, Q_Q4_1); break;
    case Q_Q5_0: strips(w, x, m, s0, s1, y, ldy, Q_Q5_0); break;
    case Q_Q5_1: strips(w, x, m, s0, s1, y, ldy, Q_Q5_1); break;
    case Q_Q8_0: strips(w, x, m, s0, s1, y, ldy, Q_Q8_0); break;
    case Q_Q4_K: strips(w, x, m, s0, s1, y, ldy, Q_Q4_K); break;
    case Q_Q5_K: strips(w, x, m, s0, s1, y, ldy, Q_Q5_K); break;
    case Q_Q6_K: strips(w, x, m, s0, s1, y, ldy, Q_Q6_K); break;
    default: break;
  }
}
#endif
