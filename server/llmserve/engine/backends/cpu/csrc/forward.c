/* The fused Llama-family forward over a GGUF's blocks, a whole step in one call (fused_layers.py's StepProgram).
 *
 * At one sequence a decode step of SmolLM2-135M is ~450 kernel calls from Python (30 layers of norms, linears,
 * rotary, the cache write, attention), and their dispatch cost more than their arithmetic: here the same calls are
 * made from C, in the same order, with the same arguments, so a row's results are bit for bit the Python loop's
 * (tests/engine/backends/cpu/test_step_program.py). It serves the steps whose every token attends through the
 * compiled decode kernel (decode steps; every step where the forward attends every token so), without LoRA rows
 * or pooling; anything else runs the Python loop.
 *
 * The kernels come from three libraries: the row operations are this library's own (fused_ops.c), the linears and
 * the attention are reached through function pointers (quant_ops.c's quant_linear / quant_linear_f32, the
 * (head dim, group) variant of paged_decode.c), which the caller takes from their libraries.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*fw_linear_fn)(int level, int type, const uint8_t *packed, long n, long k, const float *x, long m,
                            float *y, long ldy, int threads);
typedef int (*fw_attend_fn)(const float *q, long q_seq, long q_head, const float *k, const float *v, long kv_head,
                            const int *tables, long table_stride, const int *lens, int num_seqs, int num_kv_heads,
                            int block_size, int max_len, double scale, float *out, int threads);

void rms_norm_f32(const float *x, long x_stride, const float *w, float *out, long out_stride, long rows, int dim,
                  double eps, int threads);
void add_rms_norm_f32(float *residual, const float *x, long x_stride, const float *w, float *out, long rows, int dim,
                      double eps, int threads);
void rotary_f32(float *x, long x_tok, long x_head, int heads, long tokens, const float *cos, const float *sin,
                long cs_tok, int dim, int threads);
void silu_mul_f32(const float *gate_up, float *out, long rows, int inter, int threads);

#define FW_PARTS 3

/* One fused linear: up to FW_PARTS block-type runs, each writing its columns of one output side by side (a
 * BlockLinear), then the bias. */
typedef struct {
  int parts;
  int level[FW_PARTS];
  int type[FW_PARTS];
  const uint8_t *packed[FW_PARTS];
  long n[FW_PARTS];
  long k;
  long width; /* the output's columns: the parts' n summed */
  const float *bias;
} fw_linear;

typedef struct {
  const float *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm/k_norm: Qwen3's per-head norms, or NULL */
  double input_eps, post_eps, q_eps, k_eps;
  double scaling;
  fw_linear qkv, o, gate_up, down;
  float *k_cache, *v_cache; /* [kv heads, slots, head dim] */
} fw_layer;

typedef struct {
  int layers, heads, kv_heads, head_dim, hidden, inter;
  long cache_slots; /* slots per kv head */
  const fw_layer *layer;
  const float *final_norm;
  double final_eps;
  fw_linear head;
  fw_linear_fn linear; /* quant_linear or quant_linear_f32 */
  fw_attend_fn attend;
} fw_model;

/* The step's tokens: `tokens` rows, each a query of the decode kernel. */
typedef struct {
  long tokens;
  const float *cos, *sin; /* [tokens, head dim] */
  const long *slots;      /* [tokens]: where each token's K/V go */
  const int *tables;      /* [tokens, table_stride] */
  long table_stride;
  const int *lens; /* [tokens] */
  int max_len, block_size;
  const long *keep; /* the rows whose logits are computed, or NULL for rows [0, kept) */
  long kept;
} fw_step;

static int fw_linear_run(const fw_model *m, const fw_linear *l, const float *x, long rows, float *y, int threads) {
  long start = 0;
  for (int p = 0; p < l->parts; ++p) {
    const int failed = m->linear(l->level[p], l->type[p], l->packed[p], l->n[p], l->k, x, rows, y + start, l->width,
                                 threads);
    if (failed) return failed;
    start += l->n[p];
  }
  if (l->bias != NULL)
    for (long r = 0; r < rows; ++r)
      for (long c = 0; c < l->width; ++c) y[r * l->width + c] = y[r * l->width + c] + l->bias[c];
  return 0;
}

/* One step: `residual` [tokens, hidden] holds the tokens' embeddings and is added to in place; `logits`
 * [kept, vocab] is written. `scratch` holds at least fw_scratch_floats(m, tokens) floats. Returns 0, or the
 * failing kernel's code. */
long fw_scratch_floats(const fw_model *m, long tokens) {
  const long qkv = (long)(m->heads + 2 * m->kv_heads) * m->head_dim, q = (long)m->heads * m->head_dim;
  const long wide = 2L * m->inter > qkv ? 2L * m->inter : qkv;
  return tokens * (3L * m->hidden + wide + q + m->inter);
}

int fw_step_run(const fw_model *m, const fw_step *s, float *residual, float *logits, float *scratch, int threads) {
  const long t = s->tokens, hidden = m->hidden, dim = m->head_dim;
  const long q_width = (long)m->heads * dim, kv_width = (long)m->kv_heads * dim;
  float *x = scratch, *delta = x + t * hidden, *wide = delta + t * hidden;
  const long qkv_w = q_width + 2 * kv_width, wide_w = 2L * m->inter > qkv_w ? 2L * m->inter : qkv_w;
  float *attended = wide + t * wide_w, *inner = attended + t * q_width, *last = inner + t * m->inter;
  int failed = 0;
  for (int i = 0; i < m->layers; ++i) {
    const fw_layer *ly = &m->layer[i];
    if (i == 0)
      rms_norm_f32(residual, hidden, ly->input_norm, x, hidden, t, (int)hidden, ly->input_eps, threads);
    else
      add_rms_norm_f32(residual, delta, hidden, ly->input_norm, x, t, (int)hidden, ly->input_eps, threads);
    float *qkv = wide;
    if ((failed = fw_linear_run(m, &ly->qkv, x, t, qkv, threads))) return failed;
    float *q = qkv, *k = qkv + q_width, *v = k + kv_width;
    for (long r = 0; r < t; ++r) { /* per head, in place: a row's norm reads it whole before writing */
      if (ly->q_norm != NULL)
        rms_norm_f32(q + r * qkv_w, dim, ly->q_norm, q + r * qkv_w, dim, m->heads, (int)dim, ly->q_eps, 1);
      if (ly->k_norm != NULL)
        rms_norm_f32(k + r * qkv_w, dim, ly->k_norm, k + r * qkv_w, dim, m->kv_heads, (int)dim, ly->k_eps, 1);
    }
    rotary_f32(q, qkv_w, dim, m->heads, t, s->cos, s->sin, dim, (int)dim, threads);
    rotary_f32(k, qkv_w, dim, m->kv_heads, t, s->cos, s->sin, dim, (int)dim, threads);
    for (long r = 0; r < t; ++r)
      for (int h = 0; h < m->kv_heads; ++h) {
        const long at = ((long)h * m->cache_slots + s->slots[r]) * dim;
        memcpy(ly->k_cache + at, k + r * qkv_w + h * dim, sizeof(float) * (size_t)dim);
        memcpy(ly->v_cache + at, v + r * qkv_w + h * dim, sizeof(float) * (size_t)dim);
      }
    if ((failed = m->attend(q, qkv_w, dim, ly->k_cache, ly->v_cache, m->cache_slots * dim, s->tables,
                            s->table_stride, s->lens, (int)t, m->kv_heads, s->block_size, s->max_len, ly->scaling,
                            attended, threads)))
      return failed;
    if ((failed = fw_linear_run(m, &ly->o, attended, t, delta, threads))) return failed;
    add_rms_norm_f32(residual, delta, hidden, ly->post_norm, x, t, (int)hidden, ly->post_eps, threads);
    if ((failed = fw_linear_run(m, &ly->gate_up, x, t, wide, threads))) return failed;
    silu_mul_f32(wide, inner, t, m->inter, threads);
    if ((failed = fw_linear_run(m, &ly->down, inner, t, delta, threads))) return failed;
  }
  /* The kept rows: copies of the residual and the last delta (the residual itself keeps the last layer's input). */
  const long kept = s->kept; /* keep NULL: rows [0, kept) */
  float *rows = x, *lastd = last;
  for (long r = 0; r < kept; ++r) {
    const long from = s->keep == NULL ? r : s->keep[r];
    memcpy(rows + r * hidden, residual + from * hidden, sizeof(float) * (size_t)hidden);
    memcpy(lastd + r * hidden, delta + from * hidden, sizeof(float) * (size_t)hidden);
  }
  float *normed = delta; /* free now: the kept deltas are copied */
  add_rms_norm_f32(rows, lastd, hidden, m->final_norm, normed, kept, (int)hidden, m->final_eps, threads);
  return fw_linear_run(m, &m->head, normed, kept, logits, threads);
}
