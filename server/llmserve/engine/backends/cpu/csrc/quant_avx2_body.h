/* The AVX2 kernel body, included by quant_avx2.c once with VNNI 0 (VPMADDUBSW + VPMADDWD) and once with VNNI 1
 * (AVX-VNNI's VPDPBUSD), each under its own target pragma; NAME(x) suffixes its functions. A strip's 16 columns
 * are two ymm halves of 8; up to 2 rows share each chunk loaded. The integer sums are exact either way, so both
 * give the AVX-512 level's results bit for bit. */

/* acc + the 4-products sums of unsigned quants w (at most 63; Q8_0's 255 go through `dot_wide`) and a's 4 bytes */
AI __m256i NAME(dot)(__m256i acc, __m256i w, const int8_t *a) {
  int32_t v;
  memcpy(&v, a, 4);
#if VNNI
  return _mm256_dpbusd_avx_epi32(acc, w, _mm256_set1_epi32(v));
#else
  /* pairs of products fit int16 without saturating: 2 * 63 * 127 < 32767 */
  const __m256i pairs = _mm256_maddubs_epi16(w, _mm256_set1_epi32(v));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* the same for quants up to 255 (Q8_0 offset-binary) */
AI __m256i NAME(dot_wide)(__m256i acc, __m256i w, const int8_t *a) {
#if VNNI
  return NAME(dot)(acc, w, a);
#else
  /* 2 * 255 * 127 would saturate int16: the high and low nibbles separately, the high ones weighted 16 */
  int32_t v;
  memcpy(&v, a, 4);
  const __m256i av = _mm256_set1_epi32(v), low = _mm256_set1_epi8(0x0F);
  const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), low), av);
  const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(w, low), av);
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(hi, _mm256_set1_epi16(16)));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(lo, _mm256_set1_epi16(1)));
#endif
}

/* Asks for the payload of the blocks PREFETCH_L2 and PREFETCH_L1 bytes past p (quant_avx2.c: into L2, into L1). */
AI void NAME(prefetch)(const uint8_t *p, long payload) {
  for (long o = 0; o < payload; o += 64) {
    _mm_prefetch((const char *)p + PREFETCH_L2 + o, _MM_HINT_T1);
    _mm_prefetch((const char *)p + PREFETCH_L1 + o, _MM_HINT_T0);
  }
}

AI __m256 NAME(halves)(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

AI __m256 NAME(bytes_u8)(const uint8_t *p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* v + (16 << shift) in each byte whose bit is set in the 32 bits at `bits` */
AI __m256i NAME(plane)(__m256i v, const uint8_t *bits, int shift) {
  uint32_t word;
  memcpy(&word, bits, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32((int)word),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_add_epi8(v, _mm256_and_si256(on, _mm256_set1_epi8((char)(16 << shift))));
}

AI void NAME(strip_rows)(const qmat *w, const qact *x, long r0, const int R, long s, float *y, long ldy, const int T) {
  const long k = w->k, nb = k / QBLOCK, payload = q_payload(T);
  const uint8_t *strip = w->packed + s * q_strip_bytes(T, k), *meta = strip + q_meta_offset(T, k);
  const long corr_stride = T == Q_Q6_K ? 2 * nb : nb;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 f[2][2];
  __m256i acc[2][2], acc2[2][2];
  __m256 d[2], dmin[2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  d[0] = d[1] = dmin[0] = dmin[1] = _mm256_setzero_ps();
  for (long b = 0; b < nb; ++b) {
    const uint8_t *p = strip + b * payload;
    NAME(prefetch)(p, payload);
    __m256 ws[2], wm[2];
    __m256i sc0[2], sc1[2];
    for (int h = 0; h < 2; ++h) {
      ws[h] = wm[h] = _mm256_setzero_ps();
      sc0[h] = sc1[h] = _mm256_setzero_si256();
      if (q_is_k(T)) {
        const uint8_t *mu = meta + (b / 8) * q_meta(T);
        const int j = (int)(b % 8);
        if (j == 0) {
          d[h] = NAME(halves)(mu + 16 * h);
          if (T != Q_Q6_K) dmin[h] = NAME(halves)(mu + 32 + 16 * h);
        }
        if (T == Q_Q6_K) {
          sc0[h] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(mu + 32 + 16 * (2 * j) + 8 * h)));
          sc1[h] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(mu + 32 + 16 * (2 * j + 1) + 8 * h)));
        } else {
          ws[h] = _mm256_mul_ps(d[h], NAME(bytes_u8)(mu + 64 + 16 * j + 8 * h));
          wm[h] = _mm256_mul_ps(dmin[h], NAME(bytes_u8)(mu + 192 + 16 * j + 8 * h));
        }
      } else {
        const uint8_t *mb = meta + b * q_meta(T);
        ws[h] = NAME(halves)(mb + 16 * h);
        if (q_has_min(T)) wm[h] = NAME(halves)(mb + 32 + 16 * h);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int32_t *corr = x->corr + (r0 + r) * corr_stride;
      for (int h = 0; h < 2; ++h) {
        if (T == Q_Q6_K) {
          acc[r][h] = _mm256_set1_epi32(corr[2 * b]);
          acc2[r][h] = _mm256_set1_epi32(corr[2 * b + 1]);
        } else {
          acc[r][h] = _mm256_set1_epi32(corr[b]);
        }
      }
    }
    if (T == Q_Q8_0) {
      for (int g = 0; g < 8; ++g)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * g + 32 * h));
          for (int r = 0; r < R; ++r) acc[r][h] = NAME(dot_wide)(acc[r][h], v, x->a + (r0 + r) * k + b * QBLOCK + 4 * g);
        }
    } else {
      for (int i = 0; i < 4; ++i)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * i + 32 * h));
          __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int pl = 0; pl < q_planes(T); ++pl) {
            lo = NAME(plane)(lo, p + 256 + 64 * pl + 16 * i + 4 * h, pl);
            hi = NAME(plane)(hi, p + 256 + 64 * pl + 16 * i + 8 + 4 * h, pl);
          }
          for (int r = 0; r < R; ++r) {
            const int8_t *a = x->a + (r0 + r) * k + b * QBLOCK + 4 * i;
            acc[r][h] = NAME(dot)(acc[r][h], lo, a);
            if (T == Q_Q6_K)
              acc2[r][h] = NAME(dot)(acc2[r][h], hi, a + 16);
            else
              acc[r][h] = NAME(dot)(acc[r][h], hi, a + 16);
          }
        }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(x->dx[(r0 + r) * nb + b]);
      for (int h = 0; h < 2; ++h) {
        if (T == Q_Q6_K) {
          const __m256i isum =
              _mm256_add_epi32(_mm256_mullo_epi32(acc[r][h], sc0[h]), _mm256_mullo_epi32(acc2[r][h], sc1[h]));
          f[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d[h], dx), f[r][h]);
          continue;
        }
        f[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_mul_ps(ws[h], dx), f[r][h]);
        if (q_has_min(T)) {
          const __m256 sx = _mm256_set1_ps(x->sx[(r0 + r) * nb + b]);
          f[r][h] = q_is_k(T) ? _mm256_fnmadd_ps(wm[h], sx, f[r][h]) : _mm256_fmadd_ps(wm[h], sx, f[r][h]);
        }
      }
    }
  }
  const long cols = w->n - s * STRIP;
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      float *out = y + (r0 + r) * ldy + s * STRIP + 8 * h;
      const long here = cols - 8 * h;
      if (here >= 8) {
        _mm256_storeu_ps(out, f[r][h]);
      } else if (here > 0) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)here), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        _mm256_maskstore_ps(out, mask, f[r][h]);
      }
    }
}

AI void NAME(strips)(const qmat *w, const qact *x, long m, long s0, long s1, float *y, long ldy, const int T) {
  for (long s = s0; s < s1; ++s)
    for (long r0 = 0; r0 < m; r0 += 2) {
      if (m - r0 >= 2)
        NAME(strip_rows)(w, x, r0, 2, s, y, ldy, T);
      else
        NAME(strip_rows)(w, x, r0, 1, s, y, ldy, T);
    }
}

/* --- float activations (quant.h's float contract): per group, sums of x times the stored quants in four chains by
 * k mod 4, then the group's zero and scales applied once. A row runs either straight from the packed blocks (`direct`:
 * the quants extracted as the blocks stream in; Q8_0's 2..DIRECT_Q8_0 rows a call share each extraction) or over tiles
 * of quants decoded once for every row of the call (`tiles`); both add the same products in the same order, so a
 * row's result does not depend on the other rows. -- */

/* Byte j of each 32-bit lane, zero-extended, for VPSHUFB (its indices are per 128-bit half: lane d's byte j is
 * 4d + j there). */
AI __m256i NAME(byte_of_lane)(int j) {
  return _mm256_setr_epi32(0x80808000 + j, 0x80808004 + j, 0x80808008 + j, 0x8080800C + j, 0x80808000 + j,
                           0x80808004 + j, 0x80808008 + j, 0x8080800C + j);
}

/* Block b's scales for half h (8 columns): ws, and wm (added times X: +m, or -(dmin * m_j) for the K types);
 * Q6_K: ws and ws1, its two halves' d * sc. `d`/`dmin`: the superblock's, for the K types. */
AI void NAME(block_scales)(const uint8_t *meta, long b, const int T, int h, __m256 d, __m256 dmin, __m256 *ws,
                           __m256 *wm, __m256 *ws1) {
  *ws = *wm = *ws1 = _mm256_setzero_ps();
  if (q_is_k(T)) {
    const uint8_t *mu = meta + (b / 8) * q_meta(T);
    const int j = (int)(b % 8);
    if (T == Q_Q6_K) {
      const __m128i s0 = _mm_loadl_epi64((const __m128i *)(mu + 32 + 16 * (2 * j) + 8 * h));
      const __m128i s1 = _mm_loadl_epi64((const __m128i *)(mu + 32 + 16 * (2 * j + 1) + 8 * h));
      *ws = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s0)));
      *ws1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s1)));
    } else {
      *ws = _mm256_mul_ps(d, NAME(bytes_u8)(mu + 64 + 16 * j + 8 * h));
      *wm = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, NAME(bytes_u8)(mu + 192 + 16 * j + 8 * h)));
    }
  } else {
    const uint8_t *mb = meta + b * q_meta(T);
    *ws = NAME(halves)(mb + 16 * h);
    if (q_has_min(T)) *wm = NAME(halves)(mb + 32 + 16 * h);
  }
}

/* A group's sum from its chains, the first two already added (p01 = p0 + p1): (p0 + p1) + (p2 + p3), then - z * X
 * for a type with a zero z (0: none). Every path combines its chains here. */
AI __m256 NAME(chains_sum)(__m256 p01, __m256 p2, __m256 p3, __m256 xsum, float z) {
  const __m256 sum = _mm256_add_ps(p01, _mm256_add_ps(p2, p3));
  return z != 0.0f ? _mm256_fnmadd_ps(_mm256_set1_ps(z), xsum, sum) : sum;
}

/* A group's sum from its four chains, its zero folded in (chains_sum). */
AI __m256 NAME(group_sum)(const __m256 p[4], __m256 xsum, const int T) {
  return NAME(chains_sum)(_mm256_add_ps(p[0], p[1]), p[2], p[3], xsum, (float)q_zero(T));
}

/* acc + the group's sum scaled (and the min's term): acc = fma(ws, S, acc), then acc = fma(wm, X, acc). */
AI __m256 NAME(scaled)(__m256 acc, __m256 sum, __m256 ws, __m256 wm, __m256 xsum, const int T) {
  acc = _mm256_fmadd_ps(ws, sum, acc);
  return q_has_min(T) ? _mm256_fmadd_ps(wm, xsum, acc) : acc;
}

/* The quants of chunk i's half h (8 columns x 4 k), low nibbles (`high` 0: k = 4i + j) or high (k = 16 + 4i + j),
 * with their planes' bits, as bytes. */
AI __m256i NAME(chunk_quants)(const uint8_t *p, int i, int h, int high, const int T) {
  const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * i + 32 * h));
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i q = high ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low) : _mm256_and_si256(v, low);
  _Pragma("GCC unroll 8") for (int pl = 0; pl < q_planes(T); ++pl) q = NAME(plane)(q, p + 256 + 64 * pl + 16 * i + 8 * high + 4 * h, pl);
  return q;
}

AI void NAME(store_cols)(float *out, long here, __m256 v) {
  if (here >= 8) {
    _mm256_storeu_ps(out, v);
  } else if (here > 0) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)here), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(out, mask, v);
  }
}

/* One row (x: its k floats; xs: its group sums) over strip s, straight from the packed blocks. */
AI void NAME(direct_f32)(const qmat *w, const float *x, const float *xs, long s, float *y, const int T) {
  const long k = w->k, nb = k / QBLOCK, payload = q_payload(T);
  const uint8_t *strip = w->packed + s * q_strip_bytes(T, k), *meta = strip + q_meta_offset(T, k);
  const int groups = T == Q_Q6_K ? 2 : 1;
  __m256i ctrl[4];
  _Pragma("GCC unroll 8") for (int j = 0; j < 4; ++j) ctrl[j] = NAME(byte_of_lane)(j);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, dmin[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (long b = 0; b < nb; ++b) {
    const uint8_t *p = strip + b * payload;
    NAME(prefetch)(p, payload);
    const float *xb = x + b * QBLOCK;
    __m256 ws[2], wm[2], ws1[2];
    _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h) {
      if (q_is_k(T) && b % 8 == 0) {
        const uint8_t *mu = meta + (b / 8) * q_meta(T);
        d[h] = NAME(halves)(mu + 16 * h);
        if (T != Q_Q6_K) dmin[h] = NAME(halves)(mu + 32 + 16 * h);
      }
      NAME(block_scales)(meta, b, T, h, d[h], dmin[h], &ws[h], &wm[h], &ws1[h]);
    }
    __m256 part[2][4];
    if (T == Q_Q8_0) {
      _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h)
        _Pragma("GCC unroll 8") for (int j = 0; j < 4; ++j) part[h][j] = _mm256_setzero_ps();
      _Pragma("GCC unroll 8") for (int g = 0; g < 8; ++g)
        _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * g + 32 * h));
          _Pragma("GCC unroll 8") for (int j = 0; j < 4; ++j)
            part[h][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + 4 * g + j),
                                         _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, ctrl[j])), part[h][j]);
        }
      const __m256 xsum = _mm256_broadcast_ss(xs + b);
      _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h) acc[h] = NAME(scaled)(acc[h], NAME(group_sum)(part[h], xsum, T), ws[h], wm[h], xsum, T);
      continue;
    }
    _Pragma("GCC unroll 8") for (int high = 0; high < 2; ++high) {
      if (high == 0 || groups == 2)
        _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h)
          _Pragma("GCC unroll 8") for (int j = 0; j < 4; ++j) part[h][j] = _mm256_setzero_ps();
      _Pragma("GCC unroll 8") for (int i = 0; i < 4; ++i)
        _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h) {
          const __m256i q = NAME(chunk_quants)(p, i, h, high, T);
          _Pragma("GCC unroll 8") for (int j = 0; j < 4; ++j)
            part[h][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + 16 * high + 4 * i + j),
                                         _mm256_cvtepi32_ps(_mm256_shuffle_epi8(q, ctrl[j])), part[h][j]);
        }
      if (groups == 2) {  /* Q6_K: each half of 16 its own group and scale */
        const __m256 xsum = _mm256_broadcast_ss(xs + 2 * b + high);
        _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h)
          acc[h] = _mm256_fmadd_ps(high ? ws1[h] : ws[h], NAME(group_sum)(part[h], xsum, T), acc[h]);
      }
    }
    if (groups == 1) {
      const __m256 xsum = _mm256_broadcast_ss(xs + b);
      _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h) acc[h] = NAME(scaled)(acc[h], NAME(group_sum)(part[h], xsum, T), ws[h], wm[h], xsum, T);
    }
  }
  const long cols = w->n - s * STRIP;
  _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h) NAME(store_cols)(y + s * STRIP + 8 * h, cols - 8 * h, acc[h]);
}

#define DIRECT_ROWS 8 /* the most rows direct_rows_f32 takes */

/* Q8_0 runs 2..DIRECT_Q8_0 rows a call through direct_rows_f32, the other types' 2 rows direct_f32 twice and 3+ rows
 * the tiles. One SmolLM2 layer, one thread, ms before (2 rows twice direct, 3+ tiles) -> after, the machine shared
 * (load 5-13; benchmarks/probes/quant_ab.py, whose old-vs-old run differs by up to 20% at a row count), 2026-12-07:
 * Q8_0 M=2 0.568 -> 0.554, M=3 0.746 -> 0.596, M=5 0.984 -> 0.801, M=6 1.073 -> 0.864, M=7 1.260 -> 1.010, M=8
 * 1.373 -> 1.369. Q4_1 through it gained nothing beyond the noise (M=2 0.474 -> 0.443, M=3 0.636 -> 0.705, M=4
 * 0.763 -> 0.864, M=8 1.257 -> 1.527): the nibbles are extracted again in each pass of chains, and whichever path
 * runs, each row's own FMAs (~60 cycles a row per block of 32 x 16 columns here) are what a row costs. The other
 * types stay where they were; direct_rows_f32 computes them too (every type gave the same bits through it when it
 * ran them all). */
#define DIRECT_Q8_0 7

/* Rows [0, R) (R = 2..DIRECT_ROWS) over strip s straight from the packed blocks: each chunk's quants are extracted
 * and converted once and used by every row, so the blocks are read and decoded once for R rows (what a verify step's
 * k + 1 rows need; each row's FMAs remain its own, which is what the measurements above show is left). Each row
 * keeps direct_f32's chains and scaling in the same order. xt: the rows interleaved (xt[kk * R + r] = row r's x[kk],
 * so that every broadcast is one pointer plus a constant: rows k apart gave a pointer per row and k that spilled);
 * xs, y: the first row's, rows `ngroups` and `ldy` apart. To hold the accumulators in 16 registers: one column half
 * at a time over the strip (the second pass reads the blocks from cache), and the four chains J at a time, J * R
 * accumulators (the order within a chain is the contract, not which chains interleave): four from 2 rows, two at 3,
 * one from 4 rows up (at 4 rows two chains at a time, 8 accumulators, ran 1.30x slower than one: Q8_0 M=4 0.729 ->
 * 0.561 ms, one layer, one thread, quant_ab.py, 2026-12-08). */
AI void NAME(direct_rows_f32)(const qmat *w, const float *xt, const float *xs, long ngroups, long s, float *y, long ldy,
                              float *accm, const int R, const int T) {
  const long k = w->k, nb = k / QBLOCK, payload = q_payload(T);
  const uint8_t *strip = w->packed + s * q_strip_bytes(T, k), *meta = strip + q_meta_offset(T, k);
  const int groups = T == Q_Q6_K ? 2 : 1, steps = T == Q_Q6_K ? 4 : 8, J = R <= 2 ? 4 : R <= 3 ? 2 : 1;
  const long cols = w->n - s * STRIP;
  __m256i ctrl[4];
  _Pragma("GCC unroll 8") for (int j = 0; j < 4; ++j) ctrl[j] = NAME(byte_of_lane)(j);
  for (int h = 0; h < 2; ++h) {
    /* the rows' sums in memory (accm: 8 floats a row), so that the registers hold the chains */
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) _mm256_storeu_ps(accm + 8 * r, _mm256_setzero_ps());
    __m256 d = _mm256_setzero_ps(), dmin = _mm256_setzero_ps();
    for (long b = 0; b < nb; ++b) {
      const uint8_t *p = strip + b * payload;
      if (h == 0)
        NAME(prefetch)(p, payload);
      const float *xb = xt + b * QBLOCK * R;
      __m256 ws, wm, ws1;
      if (q_is_k(T) && b % 8 == 0) {
        const uint8_t *mu = meta + (b / 8) * q_meta(T);
        d = NAME(halves)(mu + 16 * h);
        if (T != Q_Q6_K) dmin = NAME(halves)(mu + 32 + 16 * h);
      }
      NAME(block_scales)(meta, b, T, h, d, dmin, &ws, &wm, &ws1);
      _Pragma("GCC unroll 8") for (int g = 0; g < groups; ++g) {
        __m256 chain[DIRECT_ROWS][4];
        _Pragma("GCC unroll 8") for (int j0 = 0; j0 < 4; j0 += J) {
          __m256 part[DIRECT_ROWS][4];
          _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
            _Pragma("GCC unroll 8") for (int jj = 0; jj < J; ++jj) part[r][jj] = _mm256_setzero_ps();
          /* the group's k in increasing order, 4 at a time: Q8_0's 8 chunks; the nibble types' low nibbles of
           * chunks 0..3, then their high ones (Q6_K: group g's only) */
          _Pragma("GCC unroll 8") for (int t = 0; t < steps; ++t) {
            const int high = T == Q_Q6_K ? g : t / 4, i = t % 4;
            const __m256i q = T == Q_Q8_0 ? _mm256_loadu_si256((const __m256i *)(p + 64 * t + 32 * h))
                                          : NAME(chunk_quants)(p, i, h, high, T);
            const int k0 = T == Q_Q8_0 ? 4 * t : 16 * high + 4 * i;
            _Pragma("GCC unroll 8") for (int jj = 0; jj < J; ++jj) {
              const __m256 qf = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(q, ctrl[j0 + jj]));
              _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
                part[r][jj] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + (k0 + j0 + jj) * R + r), qf, part[r][jj]);
            }
          }
          _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
            _Pragma("GCC unroll 8") for (int jj = 0; jj < J; ++jj) chain[r][j0 + jj] = part[r][jj];
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
          const __m256 xsum = _mm256_broadcast_ss(xs + r * ngroups + (T == Q_Q6_K ? 2 * b + g : b));
          const __m256 sum = NAME(group_sum)(chain[r], xsum, T);
          const __m256 acc = _mm256_loadu_ps(accm + 8 * r);
          _mm256_storeu_ps(accm + 8 * r, T == Q_Q6_K ? _mm256_fmadd_ps(g ? ws1 : ws, sum, acc)
                                                     : NAME(scaled)(acc, sum, ws, wm, xsum, T));
        }
      }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
      NAME(store_cols)(y + r * ldy + s * STRIP + 8 * h, cols - 8 * h, _mm256_loadu_ps(accm + 8 * r));
  }
}

/* direct_rows_f32 with R a constant, so that its loops unroll and its chains stay in registers. */
AI void NAME(direct_rows_any)(const qmat *w, const float *x, const float *xs, long ngroups, long s, float *y, long ldy,
                              float *accm, long rows, const int T) {
  switch (rows) {
    case 2: NAME(direct_rows_f32)(w, x, xs, ngroups, s, y, ldy, accm, 2, T); break;
    case 3: NAME(direct_rows_f32)(w, x, xs, ngroups, s, y, ldy, accm, 3, T); break;
    case 4: NAME(direct_rows_f32)(w, x, xs, ngroups, s, y, ldy, accm, 4, T); break;
    case 5: NAME(direct_rows_f32)(w, x, xs, ngroups, s, y, ldy, accm, 5, T); break;
    case 6: NAME(direct_rows_f32)(w, x, xs, ngroups, s, y, ldy, accm, 6, T); break;
    case 7: NAME(direct_rows_f32)(w, x, xs, ngroups, s, y, ldy, accm, 7, T); break;
    default: NAME(direct_rows_f32)(w, x, xs, ngroups, s, y, ldy, accm, 8, T); break;
  }
}

/* Rows [0, m) (2 <= m <= DIRECT_Q8_0) of a Q8_0 weight over strips [s0, s1) straight from the blocks; `acc`: scratch
 * of 16 floats a row. A function of its own, not inlined into q_kernel_f32, so that the one-row and tile paths there
 * compile as before. Returns 0, or 1 where the rows' interleaved copy could not be allocated (then the other paths
 * run: the same bits). */
static __attribute__((noinline)) int NAME(direct_rows_q8_0)(const qmat *w, const float *x, const float *xs, long m,
                                                            long s0, long s1, float *y, long ldy, float *acc) {
  const long k = w->k;
  float *xt = malloc(sizeof(float) * (size_t)(m * k));
  if (xt == NULL) return 1;
  for (long kk = 0; kk < k; ++kk)
    for (long r = 0; r < m; ++r) xt[kk * m + r] = x[r * k + kk];
  for (long s = s0; s < s1; ++s) NAME(direct_rows_any)(w, xt, xs, k / QBLOCK, s, y, ldy, acc, m, Q_Q8_0);
  free(xt);
  return 0;
}

#define F_GROUP 8 /* blocks decoded at a time: 8 tiles of 2 KiB stay in L1 while every row runs over them */

/* Block b's stored quants as floats, tile[16 * k + c] (no zero, no scale: those come per group). */
AI void NAME(tile_quants)(const uint8_t *p, const int T, float *tile) {
  __m256i ctrl[4];
  _Pragma("GCC unroll 8") for (int j = 0; j < 4; ++j) ctrl[j] = NAME(byte_of_lane)(j);
  if (T == Q_Q8_0) {
    _Pragma("GCC unroll 8") for (int g = 0; g < 8; ++g)
      _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * g + 32 * h));
        _Pragma("GCC unroll 8") for (int j = 0; j < 4; ++j)
          _mm256_store_ps(tile + 16 * (4 * g + j) + 8 * h, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, ctrl[j])));
      }
    return;
  }
  _Pragma("GCC unroll 8") for (int high = 0; high < 2; ++high)
    _Pragma("GCC unroll 8") for (int i = 0; i < 4; ++i)
      _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h) {
        const __m256i q = NAME(chunk_quants)(p, i, h, high, T);
        _Pragma("GCC unroll 8") for (int j = 0; j < 4; ++j)
          _mm256_store_ps(tile + 16 * (16 * high + 4 * i + j) + 8 * h, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(q, ctrl[j])));
      }
}

/* Blocks [b0, b0 + count) of a strip decoded: their quants as tiles (tile_quants) and their scales as floats,
 * scs[48 * t ...] = ws[16], wm[16], ws1[16]; d and dmin carry the K types' superblock scales from call to call. */
AI void NAME(decode_group)(const uint8_t *strip, const uint8_t *meta, long b0, long count, __m256 d[2], __m256 dmin[2],
                           float *tiles, float *scs, const int T) {
  const long payload = q_payload(T);
  for (long t = 0; t < count; ++t) {
    const long b = b0 + t;
    const uint8_t *p = strip + b * payload;
    NAME(prefetch)(p, payload);
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
      if (q_is_k(T) && b % 8 == 0) {
        const uint8_t *mu = meta + (b / 8) * q_meta(T);
        d[h] = NAME(halves)(mu + 16 * h);
        if (T != Q_Q6_K) dmin[h] = NAME(halves)(mu + 32 + 16 * h);
      }
      __m256 ws, wm, ws1;
      NAME(block_scales)(meta, b, T, h, d[h], dmin[h], &ws, &wm, &ws1);
      _mm256_store_ps(scs + 48 * t + 8 * h, ws);
      _mm256_store_ps(scs + 48 * t + 16 + 8 * h, wm);
      _mm256_store_ps(scs + 48 * t + 32 + 8 * h, ws1);
    }
    NAME(tile_quants)(p, T, tiles + 512 * t);
  }
}

/* One row over `count` decoded blocks from b0: the same chains and scaling as direct_f32, acc (16 floats) updated. */
AI void NAME(row_tiles)(const float *tiles, const float *scales, long count, const float *x, const float *xs, long b0,
                        float *acc, const int T) {
  __m256 a[2] = {_mm256_loadu_ps(acc), _mm256_loadu_ps(acc + 8)};
  for (long t = 0; t < count; ++t) {
    const float *tile = tiles + 512 * t, *xb = x + (b0 + t) * QBLOCK;
    const float *sc = scales + 48 * t;  /* ws[16], wm[16], ws1[16] */
    __m256 part[2][4];
    _Pragma("GCC unroll 8") for (int g = 0; g < (T == Q_Q6_K ? 2 : 1); ++g) {
      const int k0 = T == Q_Q6_K ? 16 * g : 0, kn = T == Q_Q6_K ? 16 : QBLOCK;
      _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h)
        _Pragma("GCC unroll 8") for (int j = 0; j < 4; ++j) part[h][j] = _mm256_setzero_ps();
      _Pragma("GCC unroll 8") for (int kk = k0; kk < k0 + kn; kk += 4)
        _Pragma("GCC unroll 8") for (int j = 0; j < 4; ++j) {
          const __m256 xv = _mm256_broadcast_ss(xb + kk + j);
          _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h)
            part[h][j] = _mm256_fmadd_ps(xv, _mm256_load_ps(tile + 16 * (kk + j) + 8 * h), part[h][j]);
        }
      if (T == Q_Q6_K) {
        const __m256 xsum = _mm256_broadcast_ss(xs + 2 * (b0 + t) + g);
        _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h)
          a[h] = _mm256_fmadd_ps(_mm256_load_ps(sc + 32 * g + 8 * h), NAME(group_sum)(part[h], xsum, T), a[h]);
      } else {
        const __m256 xsum = _mm256_broadcast_ss(xs + b0 + t);
        _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h)
          a[h] = NAME(scaled)(a[h], NAME(group_sum)(part[h], xsum, T), _mm256_load_ps(sc + 8 * h),
                              _mm256_load_ps(sc + 16 + 8 * h), xsum, T);
      }
    }
  }
  _mm256_storeu_ps(acc, a[0]);
  _mm256_storeu_ps(acc + 8, a[1]);
}

/* Rows [0, R) (R = 2..4) over a decoded tile, the columns in lanes (two halves of 8) and each row's x broadcast, so
 * a k's two quant vectors feed 2R FMAs where row_tiles gives them two. The chains run one at a time in the contract's
 * order and are added as it says, (p0 + p1) + (p2 + p3) (as wide_tile), so a row's bits are direct_f32's. x: row 0 at
 * the block's first k, rows ldx apart; xs: row 0's group sums at the block's first group, rows ldxs apart; acc: 16
 * floats a row; sc: the block's scales (decode_group). One SmolLM2 layer, one thread, ms, row_tiles -> narrow_tile
 * (benchmarks/probes/quant_ab.py, min of 7, Zen 4 at the avx2 level, 2026-12-08): Q4_1 M=3 0.508 -> 0.430, M=4 0.626
 * -> 0.504, M=7 0.935 -> 0.749; Q5_0 M=4 0.645 -> 0.535. Q8_0's 2-7 rows stay on direct_rows_f32: through the tiles
 * they ran slower at 3, 5, 6 and 7 rows (M=3 0.431 -> 0.507), faster only at 4 (0.705 -> 0.562). */
AI void NAME(narrow_tile)(const float *tile, const float *sc, const float *x, long ldx, const float *xs, long ldxs,
                          float *acc, const int R, const int T) {
  const int ng = T == Q_Q6_K ? 2 : 1;
  for (int g = 0; g < ng; ++g) {
    __m256 p01[4][2], p2[4][2], p[4][2];
    /* not unrolled, as wide_tile: the chains' sums held across them spill */
    _Pragma("GCC unroll 1") for (int j = 0; j < 4; ++j) {
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) p[r][0] = p[r][1] = _mm256_setzero_ps();
      _Pragma("GCC unroll 8") for (int i = 0; i < (ng == 1 ? 8 : 4); ++i) {
        const int kk = 16 * g + j + 4 * i;
        const __m256 q0 = _mm256_load_ps(tile + 16 * kk), q1 = _mm256_load_ps(tile + 16 * kk + 8);
        _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
          const __m256 xb = _mm256_broadcast_ss(x + r * ldx + kk);
          p[r][0] = _mm256_fmadd_ps(xb, q0, p[r][0]);
          p[r][1] = _mm256_fmadd_ps(xb, q1, p[r][1]);
        }
      }
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
          if (j == 0) p01[r][h] = p[r][h];
          else if (j == 1) p01[r][h] = _mm256_add_ps(p01[r][h], p[r][h]);
          else if (j == 2) p2[r][h] = p[r][h];
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
      const __m256 xsum = _mm256_broadcast_ss(xs + r * ldxs + g);
      _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
        const __m256 sum = NAME(chains_sum)(p01[r][h], p2[r][h], p[r][h], xsum, (float)q_zero(T));
        float *out = acc + 16 * r + 8 * h;
        _mm256_storeu_ps(out, NAME(scaled)(_mm256_loadu_ps(out), sum, _mm256_load_ps(sc + (g ? 32 : 0) + 8 * h),
                                           _mm256_load_ps(sc + 16 + 8 * h), xsum, T));
      }
    }
  }
}

/* Rows [0, m) over strips [s0, s1): one or two rows straight from the blocks, more over decoded tiles. `xs`: each
 * row's group sums ([m][groups]); `acc`: scratch of 16 floats a row. */
AI void NAME(strips_f32)(const qmat *w, const float *x, const float *xs, long m, long s0, long s1, float *y, long ldy,
                         float *acc, const int T) {
  const long k = w->k, nb = k / QBLOCK;
  const long groups = T == Q_Q6_K ? 2 * nb : nb;
  if (m <= 2) {
    for (long s = s0; s < s1; ++s)
      for (long r = 0; r < m; ++r) NAME(direct_f32)(w, x + r * k, xs + r * groups, s, y + r * ldy, T);
    return;
  }
  float tiles[F_GROUP * 512] __attribute__((aligned(32)));
  float scales[F_GROUP * 48] __attribute__((aligned(32)));
  for (long s = s0; s < s1; ++s) {
    const uint8_t *strip = w->packed + s * q_strip_bytes(T, k), *meta = strip + q_meta_offset(T, k);
    memset(acc, 0, sizeof(float) * 16 * (size_t)m);
    __m256 d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, dmin[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long b0 = 0; b0 < nb; b0 += F_GROUP) {
      const long count = nb - b0 < F_GROUP ? nb - b0 : F_GROUP;
      NAME(decode_group)(strip, meta, b0, count, d, dmin, tiles, scales, T);
      /* four rows at a time over each tile (narrow_tile); a last lone row over row_tiles, which holds its eight
       * chains at once */
      for (long r0 = 0; r0 < m; r0 += 4) {
        const long R = m - r0 < 4 ? m - r0 : 4;
        const float *xr = x + r0 * k, *xsr = xs + r0 * groups;
        float *ar = acc + 16 * r0;
        if (R == 1) {
          NAME(row_tiles)(tiles, scales, count, xr, xsr, b0, ar, T);
          continue;
        }
        for (long t = 0; t < count; ++t) {
          const float *tile = tiles + 512 * t, *sc = scales + 48 * t, *xb = xr + (b0 + t) * QBLOCK;
          const float *xsb = xsr + (T == Q_Q6_K ? 2 : 1) * (b0 + t);
          if (R == 4) NAME(narrow_tile)(tile, sc, xb, k, xsb, groups, ar, 4, T);
          else if (R == 3) NAME(narrow_tile)(tile, sc, xb, k, xsb, groups, ar, 3, T);
          else NAME(narrow_tile)(tile, sc, xb, k, xsb, groups, ar, 2, T);
        }
      }
    }
    const long cols = w->n - s * STRIP;
    for (long r = 0; r < m; ++r)
      _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h) NAME(store_cols)(y + r * ldy + s * STRIP + 8 * h, cols - 8 * h, _mm256_loadu_ps(acc + 16 * r + 8 * h));
  }
}

/* --- eight rows and more: the same tiles, eight rows to a vector (`wide`). A row's x is a lane of a vector and a
 * column's quant a broadcast, so each broadcast feeds V row vectors and each x vector C columns: C * V chain
 * accumulators take C + V loads a k, where row_tiles takes three loads for two FMAs. The chains run one at a time
 * (all four at once would need 4 * C * V registers), in the contract's order within each, and are combined as it
 * says, (p0 + p1) + (p2 + p3), so the bits are direct_f32's and row_tiles'. One SmolLM2 layer, one thread, ms,
 * row_tiles -> wide (benchmarks/probes/quant_ab.py, Zen 4 at the avx2 level, 2026-12-07): Q4_1 M=8 1.095 -> 1.028,
 * M=16 1.947 -> 1.511, M=64 7.088 -> 5.381, M=256 28.551 -> 22.349; Q8_0 M=16 2.066 -> 1.599, M=256 28.959 ->
 * 22.075. Two row vectors and four columns (8 accumulators: 6 loads for 8 FMAs) ran faster than three and four (12:
 * the compiler folded the x loads into the FMAs, 13 loads for 12) at every M measured; 8 blocks of tiles at a time
 * instead of 4 changed nothing. */

#define WIDE_GROUP 4 /* blocks decoded at a time here: 8 KiB of tiles beside the rows' x */

/* One chain's sums p[c][v] (C columns from c0, V row vectors) over the n k from k0 four apart: the contract's order. */
AI void NAME(wide_chain)(const float *tile, const float *xb, long xg, int c0, int k0, const int n, __m256 p[8][2],
                         const int C, const int V) {
  _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c)
    _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v) p[c][v] = _mm256_setzero_ps();
  _Pragma("GCC unroll 8") for (int i = 0; i < n; ++i) {
    const int kk = k0 + 4 * i;
    __m256 xr[2];
    _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v) xr[v] = _mm256_load_ps(xb + v * xg + 8 * kk);
    _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) {
      const __m256 q = _mm256_broadcast_ss(tile + 16 * kk + c0 + c);
      _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v) p[c][v] = _mm256_fmadd_ps(xr[v], q, p[c][v]);
    }
  }
}

/* A block's contribution over its tile, columns [c0, c0 + C), row vectors [0, V): xb is vector 0's x at the block's
 * first k (vector v at xb + v * xg, 8 floats a k), xsb its group sums at the block's first group (v at xsb + v *
 * xsg), acc its sums of column 0 (column c of vector v at acc + 8 * (16 * v + c)), scs the block's scales as
 * scalars (ws[16], wm[16], ws1[16]); ng groups a block (Q6_K: 2), z the type's zero, min whether it has a min. The
 * type comes as values, not as a constant that specializes the code: one compiled body for every type (compiled per
 * type, the zero types' bodies ran 1.2x slower than Q4_1's at the same M: the compiler's choice, not the work). */
AI void NAME(wide_tile)(const float *tile, const float *scs, const float *xb, long xg, const float *xsb, long xsg,
                        float *acc, int c0, int ng, float z, int min, const int C, const int V) {
  for (int g = 0; g < ng; ++g) {
    __m256 p01[8][2], p2[8][2], p[8][2]; /* (p0 + p1), p2 and the chain at hand, [C][V] of them */
    /* not unrolled: four chains unrolled into one body ran 2x slower (their sums spilled) */
    _Pragma("GCC unroll 1") for (int j = 0; j < 4; ++j) {
      if (ng == 1)
        NAME(wide_chain)(tile, xb, xg, c0, j, 8, p, C, V);
      else
        NAME(wide_chain)(tile, xb, xg, c0, 16 * g + j, 4, p, C, V);
      if (j == 0 || j == 2) {
        _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c)
          _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v) (j == 0 ? p01 : p2)[c][v] = p[c][v];
      } else if (j == 1) {
        _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c)
          _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v) p01[c][v] = _mm256_add_ps(p01[c][v], p[c][v]);
      }
    }
    _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v) {
      const __m256 xsum = _mm256_load_ps(xsb + v * xsg + 8 * g);
      _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) {
        const __m256 sum = NAME(chains_sum)(p01[c][v], p2[c][v], p[c][v], xsum, z);
        float *out = acc + 8 * (16 * v + c0 + c);
        __m256 a = _mm256_fmadd_ps(_mm256_broadcast_ss(scs + (g ? 32 : 0) + c0 + c), sum, _mm256_load_ps(out));
        if (min) a = _mm256_fmadd_ps(_mm256_broadcast_ss(scs + 16 + c0 + c), xsum, a);
        _mm256_store_ps(out, a);
      }
    }
  }
}

/* Row vectors [g0, g0 + V) over block b's tile: the strip's 16 columns, C at a time; two row vectors (4 columns at a
 * time) or one (8). */
static __attribute__((noinline)) void NAME(wide_rows)(const float *tile, const float *scs, const float *xt, long k,
                                                      const float *xst, long groups, float *acc, long g0, long b,
                                                      int V, int type) {
  const int ng = type == Q_Q6_K ? 2 : 1, min = q_has_min(type);
  const float z = (float)q_zero(type);
  const float *xb = xt + 8 * (g0 * k + b * QBLOCK), *xsb = xst + 8 * (g0 * groups + b * ng);
  float *accb = acc + 8 * 16 * g0;
  if (V == 2)
    for (int c0 = 0; c0 < STRIP; c0 += 4) NAME(wide_tile)(tile, scs, xb, 8 * k, xsb, 8 * groups, accb, c0, ng, z, min, 4, 2);
  else
    for (int c0 = 0; c0 < STRIP; c0 += 8) NAME(wide_tile)(tile, scs, xb, 8 * k, xsb, 8 * groups, accb, c0, ng, z, min, 8, 1);
}

/* Rows [0, m) over strips [s0, s1), eight rows to a vector (the last vector's missing rows zeros, their sums
 * dropped). Returns 0, or 1 where its scratch could not be allocated (then the other paths run: the same bits). */
AI int NAME(wide_f32)(const qmat *w, const float *x, const float *xs, long m, long s0, long s1, float *y, long ldy,
                      const int T) {
  const long k = w->k, nb = k / QBLOCK, groups = T == Q_Q6_K ? 2 * nb : nb;
  const long G = (m + 7) / 8;
  float *xt = aligned_alloc(32, sizeof(float) * (size_t)(8 * G * k));
  float *xst = aligned_alloc(32, sizeof(float) * (size_t)(8 * G * groups));
  float *acc = aligned_alloc(32, sizeof(float) * (size_t)(8 * 16 * G));
  if (xt == NULL || xst == NULL || acc == NULL) {
    free(xt);
    free(xst);
    free(acc);
    return 1;
  }
  for (long r = 0; r < 8 * G; ++r) {
    float *to = xt + 8 * (r / 8) * k + r % 8, *sto = xst + 8 * (r / 8) * groups + r % 8;
    for (long kk = 0; kk < k; ++kk) to[8 * kk] = r < m ? x[r * k + kk] : 0.0f;
    for (long g = 0; g < groups; ++g) sto[8 * g] = r < m ? xs[r * groups + g] : 0.0f;
  }
  float tiles[WIDE_GROUP * 512] __attribute__((aligned(32)));
  float scs[WIDE_GROUP * 48] __attribute__((aligned(32)));
  for (long s = s0; s < s1; ++s) {
    const uint8_t *strip = w->packed + s * q_strip_bytes(T, k), *meta = strip + q_meta_offset(T, k);
    memset(acc, 0, sizeof(float) * (size_t)(8 * 16 * G));
    __m256 d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, dmin[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long b0 = 0; b0 < nb; b0 += WIDE_GROUP) {
      const long count = nb - b0 < WIDE_GROUP ? nb - b0 : WIDE_GROUP;
      NAME(decode_group)(strip, meta, b0, count, d, dmin, tiles, scs, T);
      /* two row vectors at a time (the last one alone: eight columns at a time), each over the group's blocks in
       * order */
      for (long g0 = 0; g0 < G; g0 += 2)
        for (long t = 0; t < count; ++t) {
          const float *tile = tiles + 512 * t, *sc = scs + 48 * t;
          NAME(wide_rows)(tile, sc, xt, k, xst, groups, acc, g0, b0 + t, G - g0 >= 2 ? 2 : 1, T);
        }
    }
    const long cols = w->n - s * STRIP < STRIP ? w->n - s * STRIP : STRIP;
    for (long r = 0; r < m; ++r)
      for (long c = 0; c < cols; ++c) y[r * ldy + s * STRIP + c] = acc[8 * (16 * (r / 8) + c) + r % 8];
  }
  free(xt);
  free(xst);
  free(acc);
  return 0;
}

/* wide_f32 for w's type: its own function, not inlined into q_kernel_f32, so that the other paths compile as
 * before. */
static __attribute__((noinline)) int NAME(wide_any)(const qmat *w, const float *x, const float *xs, long m, long s0,
                                                    long s1, float *y, long ldy) {
  switch (w->type) {
    case Q_Q4_0: return NAME(wide_f32)(w, x, xs, m, s0, s1, y, ldy, Q_Q4_0);
    case Q_Q4_1: return NAME(wide_f32)(w, x, xs, m, s0, s1, y, ldy, Q_Q4_1);
    case Q_Q5_0: return NAME(wide_f32)(w, x, xs, m, s0, s1, y, ldy, Q_Q5_0);
    case Q_Q5_1: return NAME(wide_f32)(w, x, xs, m, s0, s1, y, ldy, Q_Q5_1);
    case Q_Q8_0: return NAME(wide_f32)(w, x, xs, m, s0, s1, y, ldy, Q_Q8_0);
    case Q_Q4_K: return NAME(wide_f32)(w, x, xs, m, s0, s1, y, ldy, Q_Q4_K);
    case Q_Q5_K: return NAME(wide_f32)(w, x, xs, m, s0, s1, y, ldy, Q_Q5_K);
    case Q_Q6_K: return NAME(wide_f32)(w, x, xs, m, s0, s1, y, ldy, Q_Q6_K);
    default: return 1;
  }
}

void NAME(q_kernel_f32)(const qmat *w, const float *x, const float *xs, long m, long s0, long s1, float *y, long ldy,
                        float *acc) {
  /* eight rows and more: the whole vectors wide, and the rows left over too where they fill half a vector; fewer
   * go the ways below (every path gives a row the same bits) */
  const long wide = m < 8 ? 0 : m % 8 >= 4 ? m : m - m % 8;
  if (wide > 0 && NAME(wide_any)(w, x, xs, wide, s0, s1, y, ldy) == 0) {
    const long groups = q_groups(w->type, w->k);
    x += wide * w->k;
    xs += wide * groups;
    y += wide * ldy;
    m -= wide;
  }
  if (m == 0) return;
  if (w->type == Q_Q8_0 && m >= 2 && m <= DIRECT_Q8_0 && NAME(direct_rows_q8_0)(w, x, xs, m, s0, s1, y, ldy, acc) == 0)
    return;
  switch (w->type) {
    case Q_Q4_0: NAME(strips_f32)(w, x, xs, m, s0, s1, y, ldy, acc, Q_Q4_0); break;
    case Q_Q4_1: NAME(strips_f32)(w, x, xs, m, s0, s1, y, ldy, acc, Q_Q4_1); break;
    case Q_Q5_0: NAME(strips_f32)(w, x, xs, m, s0, s1, y, ldy, acc, Q_Q5_0); break;
    case Q_Q5_1: NAME(strips_f32)(w, x, xs, m, s0, s1, y, ldy, acc, Q_Q5_1); break;
    case Q_Q8_0: NAME(strips_f32)(w, x, xs, m, s0, s1, y, ldy, acc, Q_Q8_0); break;
    case Q_Q4_K: NAME(strips_f32)(w, x, xs, m, s0, s1, y, ldy, acc, Q_Q4_K); break;
    case Q_Q5_K: NAME(strips_f32)(w, x, xs, m, s0, s1, y, ldy, acc, Q_Q5_K); break;
    case Q_Q6_K: NAME(strips_f32)(w, x, xs, m, s0, s1, y, ldy, acc, Q_Q6_K); break;
    default: break;
  }
}

void NAME(q_kernel)(const qmat *w, const qact *x, long m, long s0, long s1, float *y, long ldy) {
  switch (w->type) {
    case Q_Q4_0: NAME(strips)(w, x, m, s0, s1, y, ldy, Q_Q4_0); break;
    case Q_Q4_1: NAME(strips)(w, x, m, s0, s1, y, ldy, Q_Q4_1); break;
    case Q_Q5_0: NAME(strips)(w, x, m, s0, s1, y, ldy, Q_Q5_0); break;
    case Q_Q5_1: NAME(strips)(w, x, m, s0, s1, y, ldy, Q_Q5_1); break;
    case Q_Q8_0: NAME(strips)(w, x, m, s0, s1, y, ldy, Q_Q8_0); break;
    case Q_Q4_K: NAME(strips)(w, x, m, s0, s1, y, ldy, Q_Q4_K); break;
    case Q_Q5_K: NAME(strips)(w, x, m, s0, s1, y, ldy, Q_Q5_K); break;
    case Q_Q6_K: NAME(strips)(w, x, m, s0, s1, y, ldy, Q_Q6_K); break;
    default: break;
  }
}
