/* The AVX2 levels of the quantized linears (quant.h: layout and arithmetic): quant_avx2_body.h compiled twice,
 * for AVX2 alone (q_kernel_avx2) and with AVX-VNNI (q_kernel_avx2_vnni), each under its own target pragma
 * whatever the library's baseline; run only where quant_levels reports the instructions. */
#if defined(__x86_64__)
#include <immintrin.h>
#include <stdlib.h>

#include "quant.h"

#define AI static inline __attribute__((always_inline))
/* How far ahead of the block being computed a strip's payload is asked for: into L2 32 KiB ahead (locality 1: L2
 * keeps many more misses in flight than L1's few miss buffers, as paged_decode.c found for the KV blocks) and into L1
 * 8 KiB ahead; before, into L1 only, 4 KiB ahead. Zen 4 at the avx2 level, 2026-12-08, before -> after:
 * - one SmolLM2 layer, one thread (benchmarks/probes/quant_ab.py, min of 7): Q4_1 M=1 0.255 -> 0.216 ms, M=4 0.691
 *   -> 0.627; Q8_0 M=1 0.358 -> 0.235, M=4 0.778 -> 0.722; M=32 the same (2.8 ms: compute-bound);
 * - a whole one-row decode step in the engine, 2 threads (benchmarks/probes/decode_step.py --batches 1, the two
 *   builds alternated three times, medians): Q4_1 8.44 -> 6.34 ms, Q8_0 9.56 -> 6.53;
 * - the same step's 121 linears in a C loop (143 MB of Q8_0 blocks): 24 GB/s after (median of 8 alternated runs),
 *   where a plain read of as many bytes moves 30; prefetching into L1 only, 8-32 KiB ahead, gained less than half
 *   as much. */
#define PREFETCH_L2 32768
#define PREFETCH_L1 8192

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define VNNI 0
#define NAME(x) x##_avx2
#include "quant_avx2_body.h"
#undef NAME
#undef VNNI
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define VNNI 1
#define NAME(x) x##_avx2_vnni
#include "quant_avx2_body.h"
#undef NAME
#undef VNNI
#pragma GCC pop_options
#endif
