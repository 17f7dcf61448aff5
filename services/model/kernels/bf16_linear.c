/*
 * bfloat16 products with float32 sums kept: y[r, n] = sum_k x[r, k] w[n, k] (+ bias[n]), x and
 * w bfloat16, y float32 (or rounded once to bfloat16), on AVX512-BF16's pair instruction
 * (vdpbf16ps: two products added into a float32 lane). The model's logits come from here in
 * bfloat16: oneDNN rounds its float32 sums to bfloat16, 0.125 apart near a logit of 25, enough
 * to turn a near tie between two first tokens into a tie broken by the vocabulary's order.
 * `bf16_experts` runs a MoE layer's routed experts (gate/up, SiLU, down) in one call on the
 * same tiles: the layer's weights read once, however many rows share an expert.
 *
 * Every y[r, n] is one lane of one accumulator, summed from zero over k two at a time in
 * order, then the bias added: the same instructions in the same order whatever the number of
 * rows, a row's place among them or the tile it falls in, so a row has the same bits alone or
 * in any batch. Threads split the columns and the rows, never a sum.
 *
 * The weight is packed once (bf16_linear_pack) into panels of 16 columns with pairs of k
 * interleaved, one 64-byte vector per pair: w[16p + j, 2i + e] at ((p * K/2 + i) * 16 + j) * 2
 * + e. Columns past N are zeros, so every panel is whole; K is even.
 */
#include <stdint.h>
#include <string.h>

#include "vectors.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16 1
#endif

#define PANEL 16        /* columns per panel: one vector of float32 sums */
#define ROWS 6          /* rows per tile: ROWS x PANELS accumulators stay in registers */
#define PANELS 4        /* panels per tile */
#define PARALLEL (1 << 20) /* multiply-adds in a call worth a second thread */

int bf16_linear_compiled(void) {
#ifdef HAVE_BF16
    return 1;
#else
    return 0;
#endif
}

/* packed [ceil(n / 16), k / 2, 16, 2] from w [n, k] (bfloat16 bits) */
void bf16_linear_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    const int64_t panels = (n + PANEL - 1) / PANEL, pairs = k / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < pairs; i++)
            for (int64_t j = 0; j < PANEL; j++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t col = p * PANEL + j;
                    packed[((p * pairs + i) * PANEL + j) * 2 + e] =
                        col < n ? w[col * k + 2 * i + e] : 0;
                }
}

#ifdef HAVE_BF16
/* What a tile does with its float32 sums. */
enum { STORE_F32, STORE_BF16, SWIGLU };

/* rows x panels sums: row r of x at xr[r], panel p of the weight at wp[p]. Then per `mode`:
 * each sum (+ bias at column c0 + 16p) stored at yr[r] + c0 + 16p, float32 or rounded to
 * bfloat16 (the columns from n on left alone); or, for SWIGLU (panels 0, 1 a gate's, 2, 3 the
 * up's of the same columns), bfloat16(silu(gate) * up) at yr[r] + c0 + 16p for p = 0, 1. */
static inline __attribute__((always_inline)) void tile(
    const uint16_t *const *xr, const uint16_t *const *wp, const float *bias, void *const *yr,
    int64_t n, int64_t k, int64_t c0, int rows, int panels, int mode) {
    __m512 acc[ROWS][PANELS];
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < panels; p++) acc[r][p] = _mm512_setzero_ps();
    /* the lines this tile writes, asked for now: their reads for ownership go on while it
     * sums instead of stalling its stores (a tile of a long product writes lines not cached) */
    const int size = mode == STORE_F32 ? 4 : 2, cols = mode == SWIGLU ? 2 * PANEL : panels * PANEL;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < cols * size; b += 64)
            _m_prefetchw((char *)yr[r] + c0 * size + b);
    for (int64_t i = 0; i < k / 2; i++) {
        __m512bh b[PANELS];
        for (int p = 0; p < panels; p++)
            b[p] = (__m512bh)_mm512_loadu_si512(wp[p] + i * PANEL * 2);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, xr[r] + 2 * i, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int p = 0; p < panels; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], a, b[p]);
        }
    }
    if (mode == SWIGLU) {
        vf gate[ROWS * 2], e[ROWS * 2]; /* silu(g) = g / (1 + e^-g), the twelve together */
        for (int r = 0; r < rows; r++)
            for (int p = 0; p < 2; p++) {
                memcpy(&gate[2 * r + p], &acc[r][p], sizeof(vf));
                gate[2 * r + p] = -gate[2 * r + p];
            }
        vexp_n(e, gate, 2 * rows);
        for (int r = 0; r < rows; r++)
            for (int p = 0; p < 2; p++) {
                vf up;
                memcpy(&up, &acc[r][p + 2], sizeof up);
                const vf g = -gate[2 * r + p];
                store(yr[r], c0 + p * PANEL, g / (1.0f + e[2 * r + p]) * up, 1);
            }
        return;
    }
    for (int p = 0; p < panels; p++) {
        const int64_t c = c0 + p * PANEL;
        const __mmask16 keep = n - c >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias + c) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 v = _mm512_add_ps(acc[r][p], add);
            if (mode == STORE_BF16)
                _mm256_mask_storeu_epi16((uint16_t *)yr[r] + c, keep, (__m256i)_mm512_cvtneps_pbh(v));
            else
                _mm512_mask_storeu_ps((float *)yr[r] + c, keep, v);
        }
    }
}

/* whole tiles with constant sizes, so the accumulators are registers */
#define TILE(R, P) tile(xr, wp, bias, yr, n, k, c0, R, P, mode)
static void any_tile(const uint16_t *const *xr, const uint16_t *const *wp, const float *bias,
                     void *const *yr, int64_t n, int64_t k, int64_t c0, int rows, int panels,
                     int mode) {
    if (panels == PANELS) {
        switch (rows) {
            case 6: TILE(6, PANELS); return;
            case 5: TILE(5, PANELS); return;
            case 4: TILE(4, PANELS); return;
            case 3: TILE(3, PANELS); return;
            case 2: TILE(2, PANELS); return;
            default: TILE(1, PANELS); return;
        }
    }
    TILE(rows, panels); /* the last columns' tile: fewer panels */
}

/* Column group g (PANELS panels from panel g * PANELS) of y = x w^T (+ bias) for `rows` rows,
 * row r of x at xr[r] and of y at yr[r]: every ROWS of them one tile, the panels' weights
 * read from memory once. */
static void column_group(const uint16_t *const *xr, void *const *yr, int64_t rows,
                         const uint16_t *packed, const float *bias, int64_t n, int64_t k,
                         int64_t g, int mode) {
    const int64_t panels = (n + PANEL - 1) / PANEL, first = g * PANELS;
    const int used = (int)(panels - first < PANELS ? panels - first : PANELS);
    const uint16_t *wp[PANELS];
    for (int p = 0; p < used; p++) wp[p] = packed + (first + p) * (k / 2) * PANEL * 2;
    for (int64_t r = 0; r < rows; r += ROWS) {
        const int tile_rows = (int)(rows - r < ROWS ? rows - r : ROWS);
        any_tile(xr + r, wp, bias, yr + r, n, k, first * PANEL, tile_rows, used, mode);
    }
}

/* Phase one of bf16_experts: act row i = bfloat16(silu(gate) * up) of choice i through its
 * expert (choices [start[e], start[e + 1]) through expert e, reading row src[i] of x, or row
 * i where src is NULL). Threads take (expert, 32 columns) pieces; called inside a parallel
 * region. */
static void swiglu(const uint16_t *x, const int64_t *src, const int64_t *start, int64_t experts,
                   const uint16_t *const *gate_up, uint16_t *act, int64_t hidden, int64_t ff) {
    const int64_t pairs = ff / (2 * PANEL), up_panel = (hidden / 2) * PANEL * 2;
    const uint16_t *xr[ROWS], *wp[PANELS];
    void *yr[ROWS];
    /* gate and up panels of the same 32 columns, their SiLU product straight to act */
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < experts * pairs; item++) {
        const int64_t e = item / pairs, g = item % pairs;
        for (int p = 0; p < 2; p++) {
            wp[p] = gate_up[e] + (2 * g + p) * up_panel;
            wp[p + 2] = gate_up[e] + (ff / PANEL + 2 * g + p) * up_panel;
        }
        for (int64_t r = start[e]; r < start[e + 1]; r += ROWS) {
            const int rows = (int)(start[e + 1] - r < ROWS ? start[e + 1] - r : ROWS);
            for (int i = 0; i < rows; i++) {
                xr[i] = x + (src ? src[r + i] : r + i) * hidden;
                yr[i] = act + (r + i) * ff;
            }
            any_tile(xr, wp, NULL, yr, ff, hidden, g * 2 * PANEL, rows, PANELS, SWIGLU);
        }
    }
}
#endif

/* act [rows, ff] = bfloat16(silu(gate) * up) of x [rows, hidden], gate | up = gate_up x
 * (gate_up [2 ff, hidden] packed by bf16_linear_pack, float32 sums): the first half of a
 * dense MLP as bf16_experts computes it, bit for bit (a tensor-parallel rank's own columns,
 * docs/parallel.md). ff a multiple of 32. Returns 0 where built without AVX512-BF16. */
int bf16_swiglu(const uint16_t *x, const uint16_t *gate_up, uint16_t *act, int64_t rows,
                int64_t hidden, int64_t ff) {
#ifdef HAVE_BF16
    const int64_t start[2] = {0, rows};
#pragma omp parallel if (rows * 2 * ff * hidden >= PARALLEL)
    swiglu(x, NULL, start, 1, &gate_up, act, hidden, ff);
    return 1;
#else
    (void)x, (void)gate_up, (void)act, (void)rows, (void)hidden, (void)ff;
    return 0;
#endif
}

/* y [rows, n] = x [rows, k] w^T (+ bias [n], float32), float32 or bfloat16 (`out_bf16`);
 * packed by bf16_linear_pack. Returns 0 where the library was built without AVX512-BF16. */
int bf16_linear(const uint16_t *x, const uint16_t *packed, const float *bias, void *y,
                int64_t rows, int64_t n, int64_t k, int out_bf16) {
#ifdef HAVE_BF16
    const int64_t groups = ((n + PANEL - 1) / PANEL + PANELS - 1) / PANELS;
    const int64_t size = out_bf16 ? 2 : 4, tiles = (rows + ROWS - 1) / ROWS;
#pragma omp parallel if (rows * n * k >= PARALLEL)
    {
        const uint16_t *xr[ROWS];
        void *yr[ROWS];
        /* (column group, row tile) pieces in that order, an even share each: a thread's
         * tiles of one group follow each other (its weights stay in cache), and a product
         * with few groups (576 columns: 9) still splits evenly. */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < groups * tiles; item++) {
            const int64_t g = item / tiles, r = item % tiles * ROWS;
            const int64_t tile_rows = rows - r < ROWS ? rows - r : ROWS;
            for (int64_t i = 0; i < tile_rows; i++) {
                xr[i] = x + (r + i) * k;
                yr[i] = (char *)y + (r + i) * n * size;
            }
            column_group(xr, yr, tile_rows, packed, bias, n, k, g,
                         out_bf16 ? STORE_BF16 : STORE_F32);
        }
    }
    return 1;
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)rows, (void)n, (void)k, (void)out_bf16;
    return 0;
#endif
}

/* The routed experts of a MoE layer in one call. Choices are grouped by expert: choices
 * [start[e], start[e + 1]) go through expert e, choice i reading row src[i] of x [*, hidden]
 * and writing row dst[i] of y [*, hidden]: a = bfloat16(silu(gate) * up) with gate | up =
 * gate_up[e] x (float32 sums), y = bfloat16(down[e] a). gate_up[e] [2 ff, hidden] and down[e]
 * [hidden, ff] are packed by bf16_linear_pack; act: bfloat16 [choices, ff]. Each output is
 * summed as bf16_linear sums it, so a choice's bits depend on its row and expert alone.
 * Threads take (expert, column group) pieces, or parts of an expert's rows too where pieces
 * are few; each expert's weights read once a call. ff is a multiple of 32. Returns 0 where
 * built without AVX512-BF16. */
int bf16_experts(const uint16_t *x, const int64_t *src, const int64_t *dst,
                 const int64_t *start, int64_t experts, const uint16_t *const *gate_up,
                 const uint16_t *const *down, uint16_t *act, uint16_t *y, int64_t hidden,
                 int64_t ff) {
#ifdef HAVE_BF16
    const int64_t choices = start[experts];
    const int64_t down_groups = ((hidden + PANEL - 1) / PANEL + PANELS - 1) / PANELS;
    /* the down products' rows in parts where its pieces are few (one dense MLP of 576
     * columns: 9), so the threads' shares stay even */
    const int64_t parts = experts * down_groups >= 32 ? 1 : 4;
#pragma omp parallel if (choices * 3 * ff * hidden >= PARALLEL)
    {
        const uint16_t *xr[ROWS];
        void *yr[ROWS];
        swiglu(x, src, start, experts, gate_up, act, hidden, ff);
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < experts * down_groups * parts; item++) {
            const int64_t e = item / (down_groups * parts), g = item / parts % down_groups;
            const int64_t tiles = (start[e + 1] - start[e] + ROWS - 1) / ROWS, c = item % parts;
            const int64_t first = start[e] + tiles * c / parts * ROWS;
            const int64_t end = start[e] + tiles * (c + 1) / parts * ROWS;
            for (int64_t r = first; r < end && r < start[e + 1]; r += ROWS) {
                const int64_t rows = start[e + 1] - r < ROWS ? start[e + 1] - r : ROWS;
                for (int64_t i = 0; i < rows; i++) {
                    xr[i] = act + (r + i) * ff;
                    yr[i] = y + dst[r + i] * hidden;
                }
                column_group(xr, yr, rows, down[e], NULL, hidden, ff, g, STORE_BF16);
            }
        }
    }
    return 1;
#else
    (void)x, (void)src, (void)dst, (void)start, (void)experts, (void)gate_up, (void)down;
    (void)act, (void)y, (void)hidden, (void)ff;
    return 0;
#endif
}
