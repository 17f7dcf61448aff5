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
 * or prefilled, alone or in any batch, in float32 and bfloat16 alike. Where the CPU has
 * AVX512-BF16, a bfloat16 cache and bfloat16 products take its pair instruction (vdpbf16ps:
 * two exact products per term of a sum) with the queries, the softmax weights and the attended
 * latent rounded to bfloat16, as a bfloat16 model's expanded form would have them; the sums
 * still run over a row's own terms in a fixed order. Built as
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
 * Tasks are (head, COLS columns): a task's weights (N x COLS) are read once per ROWS rows,
 * each weight vector loaded once for the rows' multiply-adds (ROWS x WIDTH accumulators stay
 * in registers). A row's sums are the same in any group of rows. */
enum { WIDTH = 4, COLS = WIDTH * LANES, ROWS = 3 };

/* rows x width vectors of out for head h, columns from c0; always inlined, so the common
 * call with constant ROWS x WIDTH gets fixed trip counts and its accumulators in registers */
INLINE void heads_tile(const void *x, int x_bf16, const void *w, int w_bf16, void *out,
                       int out_bf16, int64_t t0, int64_t rows, int64_t h, int64_t c0,
                       int64_t width, int64_t H, int64_t N, int64_t C) {
    vf a[ROWS][WIDTH];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++) a[r][i] = (vf){0};
    for (int64_t n = 0; n < N; n++) {
        const int64_t at = (h * N + n) * C + c0;
        vf wn[WIDTH];
        for (int64_t i = 0; i < width; i++) wn[i] = load(w, at + i * LANES, w_bf16);
        for (int64_t r = 0; r < rows; r++) {
            const vf xn = (vf){0} + scalar(x, ((t0 + r) * H + h) * N + n, x_bf16);
            for (int64_t i = 0; i < width; i++) a[r][i] = fmadd(xn, wn[i], a[r][i]);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++)
            store(out, ((t0 + r) * H + h) * C + c0 + i * LANES, a[r][i], out_bf16);
}

#if defined(__AVX512BF16__)
/* With AVX512-BF16, bfloat16 x and w are multiplied a pair of n at a time (vdpbf16ps: the two
 * exact products added to the sum, denormals flushed): out[t][h][c] = the sum over pairs
 * p = 0, 1, ..., N/2 - 1, in that order, of x[t][h][2p] * w[h][2p][c] + x[t][h][2p+1] *
 * w[h][2p+1][c]. Half the instructions of the float32 loop and no conversions; a row's sums
 * are still its own. More rows share each weight load (the pairs are interleaved on load). */
enum { PAIR_ROWS = 6 };
int mla_heads_pairs(void) { return 1; }

/* w's rows n and n + 1 at column `at`, LANES columns, interleaved: (w[n][c], w[n+1][c]) */
INLINE __m512i row_pairs(const uint16_t *w, int64_t at, int64_t C) {
    static const uint16_t order[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                       21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(w + at));
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(w + at + C));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(order), both);
}

INLINE void pairs_tile(const uint16_t *x, const uint16_t *w, void *out, int out_bf16, int64_t t0,
                       int64_t rows, int64_t h, int64_t c0, int64_t width, int64_t H, int64_t N,
                       int64_t C) {
    __m512 a[PAIR_ROWS][WIDTH];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++) a[r][i] = _mm512_setzero_ps();
    for (int64_t n = 0; n < N; n += 2) {
        __m512i wn[WIDTH];
        for (int64_t i = 0; i < width; i++)
            wn[i] = row_pairs(w, (h * N + n) * C + c0 + i * LANES, C);
        for (int64_t r = 0; r < rows; r++) {
            uint32_t pair;
            memcpy(&pair, x + ((t0 + r) * H + h) * N + n, sizeof pair);
            const __m512bh xn = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int64_t i = 0; i < width; i++)
                a[r][i] = _mm512_dpbf16_ps(a[r][i], xn, (__m512bh)wn[i]);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++)
            store(out, ((t0 + r) * H + h) * C + c0 + i * LANES, (vf)a[r][i], out_bf16);
}

#else
int mla_heads_pairs(void) { return 0; }
#endif

void mla_heads_matmul(const void *x, int x_bf16, const void *w, int w_bf16, void *out,
                      int out_bf16, int64_t T, int64_t H, int64_t N, int64_t C) {
#if defined(__AVX512BF16__)
    const int pairs = x_bf16 && w_bf16 && N % 2 == 0;
    const int64_t step = pairs ? PAIR_ROWS : ROWS;
#else
    const int64_t step = ROWS;
#endif
    const int64_t chunks = (C + COLS - 1) / COLS;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t h = 0; h < H; h++)
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            const int64_t c0 = chunk * COLS;
            const int64_t width = (C - c0) / LANES < WIDTH ? (C - c0) / LANES : WIDTH;
            for (int64_t t0 = 0; t0 < T; t0 += step) {
                const int64_t rows = T - t0 < step ? T - t0 : step;
                const int full = rows == step && width == WIDTH; /* constant sizes, inlined */
#if defined(__AVX512BF16__)
                if (pairs) {
                    if (full)
                        pairs_tile(x, w, out, out_bf16, t0, PAIR_ROWS, h, c0, WIDTH, H, N, C);
                    else
                        pairs_tile(x, w, out, out_bf16, t0, rows, h, c0, width, H, N, C);
                    continue;
                }
#endif
                if (full)
                    heads_tile(x, x_bf16, w, w_bf16, out, out_bf16, t0, ROWS, h, c0, WIDTH, H, N, C);
                else
                    heads_tile(x, x_bf16, w, w_bf16, out, out_bf16, t0, rows, h, c0, width, H, N, C);
            }
        }
}

/* One task's state: up to TILE rows of one sequence (consecutive rows of a prefill chunk, or
 * one decode row), GROUP heads each: R = rows x heads accumulators, sized for the call's D and
 * C. A block's keys are loaded once for all of them and its latents turned into rows once. */
#define TILE 4
#define MAX_R (TILE * GROUP)
typedef struct {
    float *q;                 /* [D][MAX_R] the queries, times the softmax scale */
    uint32_t *qp;             /* [D/2][MAX_R] the same in bfloat16 pairs (AVX512-BF16) */
    float m[MAX_R], l[MAX_R]; /* running maximum and sum of weights */
    float rescale[MAX_R];     /* what the last fold multiplied the outputs by */
    float p[MAX_R][BLOCK];    /* the last block's weights */
    int64_t n[MAX_R];         /* the last block's keys each row counts (0: none) */
    float *values;            /* [BLOCK][C] the last block's latents c, a row per token */
    uint16_t *vp;             /* [BLOCK/2][C][2] the same in bfloat16, tokens paired */
    uint32_t pp[MAX_R][BLOCK / 2]; /* the last block's weights, paired in bfloat16 */
    vf *acc;                  /* [MAX_R][C / LANES] the weighted sums so far */
} task_t;

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

/* scores s[r][t] = the sum over d = 0, ..., D-1, in order, of q[d][r] * K[d][t], for the
 * accumulators r < R: RB of them at a time held in registers over all of D, the block's key
 * rows reloaded (from cache) for each RB. */
#define RB 4
INLINE void scores(vb *s, const task_t *w, const void *k, int64_t at, int bf16, int64_t R,
                   int64_t D) {
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
        vb a[RB];
        for (int j = 0; j < RB; j++) a[j] = zero_block();
        const int64_t width = R - r0 < RB ? R - r0 : RB;
        if (width == RB) { /* the common case, without a test per product */
            for (int64_t d = 0; d < D; d++) {
                const vb kd = key_row(k, at, d, bf16);
                const float *qd = w->q + d * MAX_R + r0;
                for (int j = 0; j < RB; j++) fma_block(&a[j], qd[j], kd);
            }
        } else {
            for (int64_t d = 0; d < D; d++) {
                const vb kd = key_row(k, at, d, bf16);
                const float *qd = w->q + d * MAX_R + r0;
                for (int j = 0; j < width; j++) fma_block(&a[j], qd[j], kd);
            }
        }
        for (int64_t j = 0; j < width; j++) s[r0 + j] = a[j];
    }
}

#if defined(__AVX512BF16__)
/* scores as above with a bfloat16 cache, a pair of dimensions at a time (vdpbf16ps against the
 * queries rounded to bfloat16): s[r][t] = the sum over pairs p = 0, ..., D/2 - 1, in order, of
 * q[2p][r] * K[2p][t] + q[2p+1][r] * K[2p+1][t]. The cache's pair layout is the instruction's
 * operand as it stands: a block's pair row is one load. */
#define RBP 16 /* sixteen sums in flight: the pair instruction's latency covered twice over */
INLINE void scores_pairs(vb *s, const task_t *w, const uint16_t *k, int64_t at, int64_t R,
                         int64_t D) {
    for (int64_t r0 = 0; r0 < R; r0 += RBP) {
        __m512 a[RBP];
        for (int j = 0; j < RBP; j++) a[j] = _mm512_setzero_ps();
        const int64_t width = R - r0 < RBP ? R - r0 : RBP;
        for (int64_t p = 0; p < D / 2; p++) {
            const __m512bh kp = (__m512bh)_mm512_loadu_si512(k + at + p * 2 * BLOCK);
            const uint32_t *qp = w->qp + p * MAX_R + r0;
            if (width == RBP) /* the common case, fixed trip count */
                for (int j = 0; j < RBP; j++)
                    a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_set1_epi32((int)qp[j]), kp);
            else
                for (int64_t j = 0; j < width; j++)
                    a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_set1_epi32((int)qp[j]), kp);
        }
        for (int64_t j = 0; j < width; j++) memcpy(&s[r0 + j], &a[j], sizeof a[j]);
    }
}

INLINE uint32_t bf16_bits(float x) { /* rounded to nearest even, as to_bf16 */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
}
#endif

/* the block's first C dimensions, a row per token: values[t][c] = K[c][t] */
INLINE void latents(task_t *w, const void *k, int64_t at, int bf16, int64_t C) {
    for (int64_t c = 0; c < C; c++) {
        const vb row = key_row(k, at, c, bf16);
        float flat[BLOCK];
        memcpy(flat, row.v, sizeof flat);
        for (int64_t t = 0; t < BLOCK; t++) w->values[t * C + c] = flat[t];
    }
}

/* Fold accumulator r's scores of a block (its first n[r] keys counted) into its softmax. */
INLINE void fold(task_t *w, int64_t r, vb s, int first) {
    const int64_t n = w->n[r];
    vb x = n < BLOCK ? where(up_to(n - 1), s, -FLT_MAX) : s;
    const float top = hmax(x, first ? -FLT_MAX : w->m[r]);
    w->rescale[r] = first ? 0.0f : expf(w->m[r] - top);
    vb e = vexp_block(add_sub(x, zero_block(), top));
    if (n < BLOCK) e = where(up_to(n - 1), e, 0.0f);
    memcpy(w->p[r], e.v, sizeof w->p[r]);
#if defined(__AVX512BF16__) /* rounded to nearest even, as to_bf16; pairs in token order */
    const __m256bh paired = _mm512_cvtneps_pbh(_mm512_loadu_ps(w->p[r]));
    memcpy(w->pp[r], &paired, sizeof w->pp[r]);
#endif
    w->l[r] = w->l[r] * w->rescale[r] + hsum(e);
    w->m[r] = top;
}

/* acc[r] = acc[r] * rescale[r] + the block's weighted latents: the even tokens' products
 * summed in order onto the rescaled output, the odd tokens' apart, then the two added (two
 * chains of multiply-adds per row keep the FMA units busy), RB rows at a time, each value
 * row loaded once for them. Past a row's n[r] its weights are 0 and the values finite (the
 * cache is zeroed at allocation), so they add exactly nothing (sums start at +0 and never
 * become -0): a row's sums are those it has alone, in a tile or not. */
INLINE void accumulate(task_t *w, const int64_t *rs, int64_t count, int64_t C) {
    int64_t n = 0;
    for (int64_t j = 0; j < count; j++) n = w->n[rs[j]] > n ? w->n[rs[j]] : n;
    n += n % 2; /* whole pairs: a token past the last adds nothing */
    for (int64_t c = 0; c < C / LANES; c++) {
        vf even[RB], odd[RB];
        for (int64_t j = 0; j < count; j++) {
            even[j] = w->acc[rs[j] * (C / LANES) + c] * w->rescale[rs[j]];
            odd[j] = (vf){0};
        }
        for (int64_t t = 0; t < n; t += 2) {
            vf row0, row1;
            memcpy(&row0, &w->values[t * C + c * LANES], sizeof row0);
            memcpy(&row1, &w->values[(t + 1) * C + c * LANES], sizeof row1);
            for (int64_t j = 0; j < count; j++) {
                even[j] = fmadd((vf){0} + w->p[rs[j]][t], row0, even[j]);
                odd[j] = fmadd((vf){0} + w->p[rs[j]][t + 1], row1, odd[j]);
            }
        }
        for (int64_t j = 0; j < count; j++) w->acc[rs[j] * (C / LANES) + c] = even[j] + odd[j];
    }
}

#if defined(__AVX512BF16__)
/* With a bfloat16 cache: the block's first C dimensions paired by token, vp[t/2][c][t%2] =
 * K[c][t], each pair row of the cache (tokens' (c, c+1)) reordered in one permute into four
 * elements per token pair: (t, c), (t+1, c), (t, c+1), (t+1, c+1). */
INLINE void latents_pairs(task_t *w, const uint16_t *k, int64_t at, int64_t C) {
    static const uint16_t order[32] = {0,  2,  1,  3,  4,  6,  5,  7,  8,  10, 9,
                                       11, 12, 14, 13, 15, 16, 18, 17, 19, 20, 22,
                                       21, 23, 24, 26, 25, 27, 28, 30, 29, 31};
    const __m512i by_token_pair = _mm512_loadu_si512(order);
    for (int64_t c = 0; c < C; c += 2) {
        const __m512i row = _mm512_loadu_si512(k + at + c * BLOCK);
        uint64_t four[BLOCK / 2];
        _mm512_storeu_si512(four, _mm512_permutexvar_epi16(by_token_pair, row));
        for (int64_t t = 0; t < BLOCK / 2; t++) memcpy(w->vp + (t * C + c) * 2, &four[t], 8);
    }
}

/* accumulate with the block's weights and latents in bfloat16, a pair of tokens at a time
 * (vdpbf16ps): acc[r] = acc[r] * rescale[r] + the sum over token pairs, in order, of
 * p[r][t] * c_t + p[r][t+1] * c_{t+1}. Past a row's n[r] its weights are 0 and the pairs add
 * exactly nothing, as above. VW value vectors of the rows at a time: RB x VW sums in flight
 * (one chain per row would wait on the instruction's latency), each value vector loaded once
 * for the rows, each weight broadcast once for the vectors. */
enum { VW = 4 };
INLINE void accumulate_vectors(task_t *w, const int64_t *rs, int64_t count, int64_t C,
                               int64_t v0, int64_t vw, int64_t pairs) {
    __m512 a[RB][VW];
    for (int64_t j = 0; j < count; j++)
        for (int64_t i = 0; i < vw; i++)
            a[j][i] = (__m512)(w->acc[rs[j] * (C / LANES) + v0 + i] * w->rescale[rs[j]]);
    for (int64_t t = 0; t < pairs; t++) {
        __m512bh v[VW];
        for (int64_t i = 0; i < vw; i++)
            v[i] = (__m512bh)_mm512_loadu_si512(w->vp + (t * C + (v0 + i) * LANES) * 2);
        for (int64_t j = 0; j < count; j++) {
            const __m512bh p = (__m512bh)_mm512_set1_epi32((int)w->pp[rs[j]][t]);
            for (int64_t i = 0; i < vw; i++) a[j][i] = _mm512_dpbf16_ps(a[j][i], p, v[i]);
        }
    }
    for (int64_t j = 0; j < count; j++)
        for (int64_t i = 0; i < vw; i++) w->acc[rs[j] * (C / LANES) + v0 + i] = (vf)a[j][i];
}

INLINE void accumulate_pairs(task_t *w, const int64_t *rs, int64_t count, int64_t C) {
    int64_t n = 0;
    for (int64_t j = 0; j < count; j++) n = w->n[rs[j]] > n ? w->n[rs[j]] : n;
    const int64_t vectors = C / LANES;
    for (int64_t v0 = 0; v0 < vectors; v0 += VW) {
        const int64_t vw = vectors - v0 < VW ? vectors - v0 : VW;
        if (count == RB && vw == VW) /* constant sizes, inlined */
            accumulate_vectors(w, rs, RB, C, v0, VW, (n + 1) / 2);
        else
            accumulate_vectors(w, rs, count, C, v0, vw, (n + 1) / 2);
    }
}
#endif

/* accumulate in the cache's arithmetic */
INLINE void accumulate_block(task_t *w, const int64_t *rs, int64_t count, int64_t C, int bf16) {
#if defined(__AVX512BF16__)
    if (bf16) {
        accumulate_pairs(w, rs, count, C);
        return;
    }
#endif
    (void)bf16;
    accumulate(w, rs, count, C);
}

#if defined(__AVX512BF16__)
/* accumulator r's query times the scale, rounded to bfloat16 and paired for scores_pairs:
 * qp[p][r] = (q[2p], q[2p+1]), 32 dimensions a conversion */
INLINE void query_pairs(task_t *w, const float *row, int64_t r, int64_t D, float scale) {
    const __m512 times = _mm512_set1_ps(scale);
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(row + d), times);
        const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(row + d + 16), times);
        uint32_t pairs[16];
        _mm512_storeu_si512(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        for (int64_t j = 0; j < 16; j++) w->qp[(d / 2 + j) * MAX_R + r] = pairs[j];
    }
    for (; d < D; d += 2)
        w->qp[d / 2 * MAX_R + r] = bf16_bits(row[d] * scale) | bf16_bits(row[d + 1] * scale) << 16;
}
#endif

/* Rows [first, first + rows) of one sequence, heads [h0, h0 + G): their attention. */
static void attend_tile(task_t *w, const float *q, const void *k, int bf16, const int64_t *table,
                        const int64_t *lens, float *out, int64_t first, int64_t rows, int64_t h0,
                        int64_t G, int64_t H, int64_t D, int64_t C, float scale) {
    const int64_t R = rows * G;
    int64_t longest = 0;
    for (int64_t i = 0; i < rows; i++) longest = lens[first + i] > longest ? lens[first + i] : longest;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = i * G + g;
            const float *row = q + ((first + i) * H + h0 + g) * D;
#if defined(__AVX512BF16__)
            if (bf16) /* scores_pairs' queries; the float32 ones go unused */
                query_pairs(w, row, r, D, scale);
            else
#endif
                for (int64_t d = 0; d < D; d++) w->q[d * MAX_R + r] = row[d] * scale;
            for (int64_t c = 0; c < C / LANES; c++) w->acc[r * (C / LANES) + c] = (vf){0};
            w->l[r] = 0.0f;
        }
    for (int64_t b = 0; b * BLOCK < longest; b++) {
        for (int64_t i = 0; i < rows; i++) {
            const int64_t left = lens[first + i] - b * BLOCK;
            const int64_t n = left <= 0 ? 0 : left < BLOCK ? left : BLOCK;
            for (int64_t g = 0; g < G; g++) w->n[i * G + g] = n;
        }
        const int64_t at = table[b] * D * BLOCK;
        vb s[MAX_R];
#if defined(__AVX512BF16__)
        if (bf16)
            scores_pairs(s, w, k, at, R, D);
        else
#endif
            scores(s, w, k, at, bf16, R, D);
#if defined(__AVX512BF16__)
        if (bf16)
            latents_pairs(w, k, at, C);
        else
#endif
            latents(w, k, at, bf16, C);
        int64_t counted[RB], count = 0;
        for (int64_t r = 0; r < R; r++) {
            if (!w->n[r]) continue;
            fold(w, r, s[r], b == 0);
            counted[count++] = r;
            if (count == RB) {
                accumulate_block(w, counted, count, C, bf16);
                count = 0;
            }
        }
        if (count) accumulate_block(w, counted, count, C, bf16);
    }
    for (int64_t i = 0; i < rows; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = i * G + g;
            for (int64_t c = 0; c < C / LANES; c++) {
                const vf x = w->acc[r * (C / LANES) + c] / w->l[r];
                memcpy(out + ((first + i) * H + h0 + g) * C + c * LANES, &x, sizeof x);
            }
        }
}

/* Returns 0, or -1 where a size is out of range or memory ran out. A row's result is the same
 * in any tile: its sums run over the same terms in the same order. */
int mla_attend(const float *q, const void *k, int bf16, const int64_t *tables,
               const int64_t *row_seq, const int64_t *lens, float *out, int64_t T, int64_t H,
               int64_t D, int64_t C, int64_t W, float scale) {
    if (C > D || C % LANES || (bf16 && D % 2)) return -1;
    int64_t *tiles = malloc((size_t)(T + 1) * sizeof *tiles); /* first row of each tile */
    if (tiles == NULL) return -1;
    int64_t count = 0;
    for (int64_t t = 0; t < T; t++)
        if (t == 0 || row_seq[t] != row_seq[t - 1] || t - tiles[count - 1] == TILE)
            tiles[count++] = t;
    tiles[count] = T;
    const int64_t groups = (H + GROUP - 1) / GROUP;
    int failed = 0;
#pragma omp parallel
    {
        task_t w;
        w.q = malloc((size_t)MAX_R * D * sizeof(float));
        w.qp = malloc((size_t)MAX_R * (D / 2 + 1) * sizeof(uint32_t));
        w.values = malloc((size_t)BLOCK * C * sizeof(float));
        w.vp = malloc((size_t)BLOCK * C * sizeof(uint16_t));
        w.acc = aligned_alloc(LINE, ((size_t)MAX_R * C * sizeof(float) + LINE - 1) / LINE * LINE);
        const int ready = w.q && w.qp && w.vp && w.values && w.acc;
        if (!ready) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic)
        for (int64_t i = 0; i < count; i++)
            for (int64_t group = 0; group < groups; group++) {
                if (!ready) continue;
                const int64_t h0 = group * GROUP, G = H - h0 < GROUP ? H - h0 : GROUP;
                const int64_t first = tiles[i], rows = tiles[i + 1] - tiles[i];
                attend_tile(&w, q, k, bf16, tables + row_seq[first] * W, lens, out, first,
                            rows, h0, G, H, D, C, scale);
            }
        free(w.q);
        free(w.qp);
        free(w.values);
        free(w.vp);
        free(w.acc);
    }
    free(tiles);
    return failed ? -1 : 0;
}
