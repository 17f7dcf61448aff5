/*
 * Multi-head latent attention (DeepSeek-V2/V3) for CPUs, in the absorbed form, over the paged
 * cache of latents read in place (services/model/mla.py says what the form computes):
 *
 *   mla_heads_matmul  per head, rows times a matrix: the query's key up-projection folded in
 *                     (q_lat = q_nope W_UK[h]) and the attended latent's value up-projection
 *                     (out = a W_UV[h]^T)
 *   mla_attend        each row's heads against its sequence's latents: scores of the query
 *                     (q_lat | q_pe) with every cached row (c | k_pe), a softmax, and the
 *                     weighted sum of the latents c
 *
 * Determinism: every output element is a sum whose terms and order depend on its own row only
 * (its query, its sequence's blocks, its context length), never on the rows computed with it,
 * and decode rows and prefill chunks run the same code. So a token gets the same bits decoded
 * or prefilled, alone or in any batch, in float32 and bfloat16 alike. Built as
 * paged_attention.c is (kernels/__init__.py): no reassociation, fused multiply-adds only where
 * the source says fmadd. tests/services/model/test_mla.py checks it bit for bit.
 *
 * Layouts (contiguous; services/model/kv_cache.py):
 *   cache:  float32 [blocks, 1, D, BLOCK]; bfloat16 [blocks, 1, D/2, BLOCK, 2], D = latent
 *           (C) + rotary (the rest), a block's tokens along each dimension
 *   q:      float32 [T, H, D]; out: float32 [T, H, C]
 *   tables: [S, W] int64 block ids; row_seq [T] each row's sequence; lens [T] the tokens it
 *           attends to (its position + 1)
 * C a multiple of LANES.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vectors.h"

#define BLOCK 16
#include "blocks.h"

#define GROUP 16 /* heads attended together: they share each block's loads */
#define LINE 64

int mla_attention_lanes(void) { return LANES; }

/* out[t][h][c] = the sum over n = 0, 1, ..., N-1, in that order, of x[t][h][n] * w[h][n][c].
 * x and w in float32 or bfloat16 (x_bf16, w_bf16), out in float32 or bfloat16 (out_bf16).
 * Tasks are (head, 64 columns): a task's weights (N x 64) stay in cache over all rows. */
void mla_heads_matmul(const void *x, int x_bf16, const void *w, int w_bf16, void *out,
                      int out_bf16, int64_t T, int64_t H, int64_t N, int64_t C) {
    enum { WIDTH = 64 / LANES }; /* vectors of columns per task */
    const int64_t chunks = (C / LANES + WIDTH - 1) / WIDTH;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t h = 0; h < H; h++)
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            const int64_t c0 = chunk * WIDTH * LANES;
            const int64_t width = (C - c0) / LANES < WIDTH ? (C - c0) / LANES : WIDTH;
            for (int64_t t = 0; t < T; t++) {
                vf a[WIDTH];
                for (int64_t i = 0; i < width; i++) a[i] = (vf){0};
                const int64_t row = (t * H + h) * N;
                for (int64_t n = 0; n < N; n++) {
                    const vf xn = (vf){0} + scalar(x, row + n, x_bf16);
                    const int64_t at = (h * N + n) * C + c0;
                    for (int64_t i = 0; i < width; i++)
                        a[i] = fmadd(xn, load(w, at + i * LANES, w_bf16), a[i]);
                }
                for (int64_t i = 0; i < width; i++)
                    store(out, (t * H + h) * C + c0 + i * LANES, a[i], out_bf16);
            }
        }
}

/* One task's state: GROUP heads of one row. */
typedef struct {
    float q[GROUP][1024];            /* the query, times the softmax scale */
    float m[GROUP], l[GROUP];        /* running maximum and sum of weights */
    float rescale[GROUP];            /* what the last fold multiplied the outputs by */
    float p[GROUP][BLOCK];           /* the last block's weights */
    float values[BLOCK][1024];       /* the last block's latents c, a row per token */
    vf acc[GROUP][1024 / LANES];     /* the weighted sum so far */
} __attribute__((aligned(LINE))) task_t;

#define MAX_D 1024

/* K row d of a block (its 16 tokens' dimension d) as float vectors */
INLINE vb key_row(const void *k, int64_t at, int64_t d, int bf16) {
    if (!bf16) return load_block(k, at + d * BLOCK, 0);
    vb x;
    const uint16_t *pairs = (const uint16_t *)k + at + (d / 2) * 2 * BLOCK;
    for (int i = 0; i < PER_BLOCK; i++) {
        vu u;
        memcpy(&u, pairs + 2 * i * LANES, sizeof u);
        if (d % 2)
            x.v[i] = (vf)(u & 0xFFFF0000u); /* the pair's second element: its upper half */
        else
            x.v[i] = (vf)(u << 16);
    }
    return x;
}

/* scores s[g][t] = the sum over d = 0, ..., D-1, in order, of q[g][d] * K[d][t] */
INLINE void scores(vb *s, const task_t *w, const void *k, int64_t at, int bf16, int64_t G,
                   int64_t D) {
    for (int64_t g = 0; g < G; g++) s[g] = zero_block();
    for (int64_t d = 0; d < D; d++) {
        const vb kd = key_row(k, at, d, bf16);
        for (int64_t g = 0; g < G; g++) fma_block(&s[g], w->q[g][d], kd);
    }
}

/* the block's first C dimensions, a row per token: values[t][c] = K[c][t] */
INLINE void latents(task_t *w, const void *k, int64_t at, int bf16, int64_t n, int64_t C) {
    for (int64_t c = 0; c < C; c++) {
        const vb row = key_row(k, at, c, bf16);
        float flat[BLOCK];
        memcpy(flat, row.v, sizeof flat);
        for (int64_t t = 0; t < n; t++) w->values[t][c] = flat[t];
    }
}

/* Fold a block's scores (tokens 0..n-1 counted) into each head's running softmax. */
INLINE void fold(task_t *w, vb *s, int64_t n, int first, int64_t G) {
    for (int64_t g = 0; g < G; g++) {
        vb x = n < BLOCK ? where(up_to(n - 1), s[g], -FLT_MAX) : s[g];
        const float top = hmax(x, first ? -FLT_MAX : w->m[g]);
        w->rescale[g] = first ? 0.0f : expf(w->m[g] - top);
        vb e = add_sub(x, zero_block(), top);
        e = vexp_block(e);
        if (n < BLOCK) e = where(up_to(n - 1), e, 0.0f);
        memcpy(w->p[g], e.v, sizeof w->p[g]);
        w->l[g] = w->l[g] * w->rescale[g] + hsum(e);
        w->m[g] = top;
    }
}

/* acc[g] = acc[g] * rescale[g] + the sum over t < n, in order, of p[g][t] * values[t] */
INLINE void accumulate(task_t *w, int64_t n, int64_t G, int64_t C) {
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < C / LANES; c++) {
            vf a = w->acc[g][c] * w->rescale[g];
            for (int64_t t = 0; t < n; t++) {
                vf row;
                memcpy(&row, &w->values[t][c * LANES], sizeof row);
                a = fmadd((vf){0} + w->p[g][t], row, a);
            }
            w->acc[g][c] = a;
        }
}

/* Returns 0, or -1 where a size is out of range or memory ran out. */
int mla_attend(const float *q, const void *k, int bf16, const int64_t *tables,
               const int64_t *row_seq, const int64_t *lens, float *out, int64_t T, int64_t H,
               int64_t D, int64_t C, int64_t W, float scale) {
    if (D > MAX_D || C > D || C % LANES || (bf16 && D % 2)) return -1;
    const int64_t groups = (H + GROUP - 1) / GROUP;
    int failed = 0;
#pragma omp parallel
    {
        task_t *w = aligned_alloc(LINE, sizeof *w);
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic)
        for (int64_t t = 0; t < T; t++)
            for (int64_t group = 0; group < groups; group++) {
                if (w == NULL) continue;
                const int64_t h0 = group * GROUP, G = H - h0 < GROUP ? H - h0 : GROUP;
                for (int64_t g = 0; g < G; g++) {
                    const float *row = q + (t * H + h0 + g) * D;
                    for (int64_t d = 0; d < D; d++) w->q[g][d] = row[d] * scale;
                    for (int64_t c = 0; c < C / LANES; c++) w->acc[g][c] = (vf){0};
                    w->l[g] = 0.0f;
                }
                const int64_t *table = tables + row_seq[t] * W, len = lens[t];
                for (int64_t b = 0; b * BLOCK < len; b++) {
                    const int64_t n = len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK;
                    const int64_t at = table[b] * D * BLOCK;
                    vb s[GROUP];
                    scores(s, w, k, at, bf16, G, D);
                    fold(w, s, n, b == 0, G);
                    latents(w, k, at, bf16, n, C);
                    accumulate(w, n, G, C);
                }
                for (int64_t g = 0; g < G; g++)
                    for (int64_t c = 0; c < C / LANES; c++) {
                        const vf x = w->acc[g][c] / w->l[g];
                        memcpy(out + ((t * H) + h0 + g) * C + c * LANES, &x, sizeof x);
                    }
            }
        free(w);
    }
    return failed ? -1 : 0;
}
