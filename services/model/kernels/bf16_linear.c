/*
 * bfloat16 products with float32 sums kept: y[r, n] = sum_k x[r, k] w[n, k] (+ bias[n]), x and
 * w bfloat16, y float32 (or rounded once to bfloat16), on AVX512-BF16's pair instruction
 * (vdpbf16ps: two products added into a float32 lane). The model's logits come from here in
 * bfloat16: oneDNN rounds its float32 sums to bfloat16, 0.125 apart near a logit of 25, enough
 * to turn a near tie between two first tokens into a tie broken by the vocabulary's order.
 *
 * Every y[r, n] is one lane of one accumulator, summed from zero over k two at a time in
 * order, then the bias added: the same instructions in the same order whatever the number of
 * rows, a row's place among them or the tile it falls in, so a row has the same bits alone or
 * in any batch. Threads split the columns, never a sum.
 *
 * The weight is packed once (bf16_linear_pack) into panels of 16 columns with pairs of k
 * interleaved, one 64-byte vector per pair: w[16p + j, 2i + e] at ((p * K/2 + i) * 16 + j) * 2
 * + e. Columns past N are zeros, so every panel is whole; K is even.
 */
#include <stdint.h>
#include <string.h>

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
/* rows x panels outputs starting at row 0 of x and panel 0 of w (both already offset). */
static inline __attribute__((always_inline)) void tile(
    const uint16_t *x, const uint16_t *w, const float *bias, void *y, int64_t n, int64_t k,
    int64_t col, int rows, int panels, int out_bf16) {
    const int64_t pairs = k / 2, panel_size = pairs * PANEL * 2;
    __m512 acc[ROWS][PANELS];
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < panels; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; i++) {
        __m512bh b[PANELS];
        for (int p = 0; p < panels; p++)
            b[p] = (__m512bh)_mm512_loadu_si512(w + p * panel_size + i * PANEL * 2);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * k + 2 * i, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int p = 0; p < panels; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], a, b[p]);
        }
    }
    for (int p = 0; p < panels; p++) {
        const int64_t c = col + p * PANEL;
        const __mmask16 keep = n - c >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias + c) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 v = _mm512_add_ps(acc[r][p], add);
            if (out_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)y + r * n + c, keep,
                                         (__m256i)_mm512_cvtneps_pbh(v));
            else
                _mm512_mask_storeu_ps((float *)y + r * n + c, keep, v);
        }
    }
}

/* whole tiles with constant sizes, so the accumulators are registers */
#define TILE(R, P) tile(xs, ws, bias, ys, n, k, col, R, P, out_bf16)
static void any_tile(const uint16_t *xs, const uint16_t *ws, const float *bias, void *ys,
                     int64_t n, int64_t k, int64_t col, int rows, int panels, int out_bf16) {
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
#endif

/* y [rows, n] = x [rows, k] w^T (+ bias [n], float32), float32 or bfloat16 (`out_bf16`);
 * packed by bf16_linear_pack. Returns 0 where the library was built without AVX512-BF16. */
int bf16_linear(const uint16_t *x, const uint16_t *packed, const float *bias, void *y,
                int64_t rows, int64_t n, int64_t k, int out_bf16) {
#ifdef HAVE_BF16
    const int64_t panels = (n + PANEL - 1) / PANEL, groups = (panels + PANELS - 1) / PANELS;
    const int64_t panel_size = (k / 2) * PANEL * 2, size = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows * n * k >= PARALLEL)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t first = g * PANELS, col = first * PANEL;
        const int used = (int)(panels - first < PANELS ? panels - first : PANELS);
        for (int64_t r = 0; r < rows; r += ROWS) {
            const int tile_rows = (int)(rows - r < ROWS ? rows - r : ROWS);
            any_tile(x + r * k, packed + first * panel_size, bias,
                     (char *)y + r * n * size, n, k, col, tile_rows, used, out_bf16);
        }
    }
    return 1;
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)rows, (void)n, (void)k, (void)out_bf16;
    return 0;
#endif
}
