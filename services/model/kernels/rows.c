/*
 * Reading parts of token rows out of a K-only paged pool (DeepSeek-V4's shares and window
 * parts: services/model/v4_rows.py), the pool in kv_cache.py's layout, one "head":
 *
 *   float32:   [blocks][dim][bs]          element d of slot s at (s / bs, d, s % bs)
 *   bfloat16:  [blocks][dim / 2][bs][2]   elements 2j, 2j + 1 side by side (a 32-bit word)
 *
 * A row's elements lie bs apart; torch's advanced indexing over the bfloat16 layout's
 * transposed view copied them 10x slower than this loop does. Pure copies: the bits are the
 * pool's.
 */
#include <stdint.h>

#define PARALLEL_ELEMS 32768

/* out[i][0 .. width) = elements [offset, offset + width) of the row at slots[i] */
void rows_read_f32(const float *cache, const int64_t *slots, int64_t n, int64_t dim,
                   int64_t bs, int64_t offset, int64_t width, float *out) {
#pragma omp parallel for schedule(static) if (n * width >= PARALLEL_ELEMS)
    for (int64_t i = 0; i < n; i++) {
        const float *row = cache + (slots[i] / bs) * dim * bs + slots[i] % bs + offset * bs;
        float *o = out + i * width;
        for (int64_t d = 0; d < width; d++) o[d] = row[d * bs];
    }
}

/* the same over bfloat16 pairs: offset and width even, counted in elements */
void rows_read_pairs(const uint32_t *cache, const int64_t *slots, int64_t n, int64_t dim,
                     int64_t bs, int64_t offset, int64_t width, uint32_t *out) {
    int64_t pairs = width / 2;
#pragma omp parallel for schedule(static) if (n * width >= PARALLEL_ELEMS)
    for (int64_t i = 0; i < n; i++) {
        const uint32_t *row =
            cache + (slots[i] / bs) * (dim / 2) * bs + slots[i] % bs + (offset / 2) * bs;
        uint32_t *o = out + i * pairs;
        for (int64_t j = 0; j < pairs; j++) o[j] = row[j * bs];
    }
}
