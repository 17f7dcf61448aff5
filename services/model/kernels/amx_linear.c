/*
 * bfloat16 products by a weight on AMX tiles (services/model/linear.py's AmxLinear), each
 * output row summed one way whatever else the call computes: y[r, n] is TDPBF16PS's sum over
 * the inputs in chunks of 32, in chunk order, from zero, whether row r is alone, in a decode
 * batch or in a 1,024-row prompt, and whichever thread computes it; then + bias (float32),
 * rounded to bfloat16 to nearest even as torch rounds. oneDNN's AMX kernels promise no such
 * thing and, on a Xeon, summed a row differently at 37-257 rows than at 1-36.
 *
 * The weight [N, K] is packed once (amx_linear_pack) into the tiles' second operand: for each
 * 16 output columns and 32 inputs a 1 KB tile, 16 rows of input pairs by 16 columns x 2.
 * N a multiple of 16 and K of 32 (linear.py leaves other shapes to oneDNN).
 *
 * Work: the output in blocks of 32 rows x 32 columns, four accumulator tiles (0-3) fed by two
 * tiles of x (4, 5) and two of the weight (6, 7). The columns are split among the threads, so
 * each weight byte is read by one thread once per ROWS_AT_ONCE rows; those rows of x stay in
 * the L2 cache while a thread's columns pass over them. x is first copied into tiles, each
 * 1 KB in a row, zero past its last row (a tile load reads 16 rows): 10-15% faster than
 * loading x's rows where they lie, 64 bytes every K * 2.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "vectors.h"

#if HAVE_AMX
#include <omp.h>
#endif

#define TR 16            /* rows of a tile */
#define TC 16            /* output columns of an accumulator tile */
#define TK 32            /* inputs in a tile row (16 pairs) */
#define ROWS_AT_ONCE 256 /* rows of x a thread's columns pass over before the next rows */

/* Whether the library was built with the tile path. */
int amx_linear_compiled(void) { return HAVE_AMX; }

/* Pack w [n, k] (bfloat16) for amx_linear: out holds n * k elements. */
void amx_linear_pack(const uint16_t *w, uint16_t *out, int64_t n, int64_t k) {
    const int64_t chunks = k / TK;
    for (int64_t nb = 0; nb < n / TC; nb++)
        for (int64_t c = 0; c < chunks; c++) {
            uint16_t *tile = out + (nb * chunks + c) * TR * TK;
            for (int64_t p = 0; p < TK / 2; p++)
                for (int64_t col = 0; col < TC; col++)
                    for (int64_t j = 0; j < 2; j++)
                        tile[p * TK + col * 2 + j] = w[(nb * TC + col) * k + c * TK + 2 * p + j];
        }
}

#if HAVE_AMX
/* This thread's eight tiles, each 16 rows of 64 bytes. */
static void configure(void) {
    const int rows[8] = {TR, TR, TR, TR, TR, TR, TR, TR};
    const int colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure_tiles(8, rows, colsb);
}

/* Accumulator tile (one of 0-3, stored into acc) as bfloat16 rows [0, rows) of y at (r0, c0). */
INLINE void put(float acc[TR][TC], const float *bias, uint16_t *y, int64_t ldy, int64_t r0,
                int64_t rows, int64_t c0) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < TC; i += LANES) {
            vf v;
            memcpy(&v, &acc[r][i], sizeof v);
            if (bias) v += load(bias, c0 + i, 0);
            store(y, (r0 + r) * ldy + c0 + i, v, 1);
        }
}

/* One block: row tiles at x0 (and x1 when two_rows), column tiles w0 (and w1 when two_cols),
 * summed over `chunks` chunks of 32 inputs. Tile numbers must be constants: the four shapes
 * of a block are this function inlined with constant flags. */
INLINE void block(const uint16_t *x0, const uint16_t *x1, const uint16_t *w0,
                  const uint16_t *w1, int64_t chunks, const int two_rows, const int two_cols,
                  float acc[4][TR][TC]) {
    _tile_zero(0);
    if (two_cols) _tile_zero(1);
    if (two_rows) _tile_zero(2);
    if (two_rows && two_cols) _tile_zero(3);
    for (int64_t c = 0; c < chunks; c++) {
        _tile_loadd(4, x0 + c * TR * TK, 64);
        _tile_loadd(6, w0 + c * TR * TK, 64);
        if (two_cols) _tile_loadd(7, w1 + c * TR * TK, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_cols) _tile_dpbf16ps(1, 4, 7);
        if (two_rows) {
            _tile_loadd(5, x1 + c * TR * TK, 64);
            _tile_dpbf16ps(2, 5, 6);
            if (two_cols) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc[0], TC * sizeof(float));
    if (two_cols) _tile_stored(1, acc[1], TC * sizeof(float));
    if (two_rows) _tile_stored(2, acc[2], TC * sizeof(float));
    if (two_rows && two_cols) _tile_stored(3, acc[3], TC * sizeof(float));
}
#endif

/* Run a tile product once (a probe, in a process that can die of it: a CPU can list AMX while
 * the machine refuses it). 1 if it ran and summed right. */
int amx_linear_probe(void) {
#if HAVE_AMX
    if (!amx_permitted()) return 0;
    configure();
    uint16_t ones[TR * TK];
    for (int i = 0; i < TR * TK; i++) ones[i] = 0x3F80; /* bfloat16 1.0 */
    float acc[TR][TC];
    _tile_zero(0);
    _tile_loadd(4, ones, 64);
    _tile_loadd(6, ones, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_stored(0, acc, TC * sizeof(float));
    _tile_release();
    return acc[TR - 1][TC - 1] == (float)TK;
#else
    return 0;
#endif
}

/* Allow this process the tile state (once, before amx_linear); 1 if allowed. */
int amx_linear_permit(void) {
#if HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* y [m, n] = x [m, k] @ w.T (+ bias [n], float32, or NULL), all bfloat16 but bias; w packed
 * by amx_linear_pack. x and y contiguous. */
void amx_linear(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y, int64_t m,
                int64_t n, int64_t k) {
#if HAVE_AMX
    const int64_t chunks = k / TK, col_tiles = n / TC, row_tiles = (m + TR - 1) / TR;
    /* x in tiles: [row tile][chunk][16 rows x 32], zero past row m */
    uint16_t *xt = aligned_alloc(64, (size_t)(row_tiles * TR * k) * sizeof(uint16_t));
    if (!xt) abort();
#pragma omp parallel for schedule(static) if (m * k >= 65536)
    for (int64_t t = 0; t < row_tiles; t++)
        for (int64_t r = 0; r < TR; r++)
            for (int64_t c = 0; c < chunks; c++) {
                uint16_t *to = xt + (t * chunks + c) * TR * TK + r * TK;
                if (t * TR + r < m) memcpy(to, x + (t * TR + r) * k + c * TK, TK * sizeof(uint16_t));
                else memset(to, 0, TK * sizeof(uint16_t));
            }
#pragma omp parallel
    {
        configure();
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t pairs = (col_tiles + 1) / 2; /* column blocks of 32 (the last maybe 16) */
        const int64_t first = pairs * me / threads, last = pairs * (me + 1) / threads;
        float acc[4][TR][TC] __attribute__((aligned(64)));
        for (int64_t t0 = 0; t0 < row_tiles; t0 += ROWS_AT_ONCE / TR) {
            const int64_t t1 = t0 + ROWS_AT_ONCE / TR < row_tiles ? t0 + ROWS_AT_ONCE / TR : row_tiles;
            for (int64_t p = first; p < last; p++) {
                const int64_t cb = 2 * p;
                const int two_cols = cb + 1 < col_tiles;
                const uint16_t *w0 = w + cb * chunks * TR * TK, *w1 = w0 + chunks * TR * TK;
                for (int64_t t = t0; t < t1; t += 2) {
                    const int two_rows = t + 1 < t1;
                    const uint16_t *x0 = xt + t * chunks * TR * TK, *x1 = x0 + chunks * TR * TK;
                    if (two_rows && two_cols) block(x0, x1, w0, w1, chunks, 1, 1, acc);
                    else if (two_rows) block(x0, x1, w0, w1, chunks, 1, 0, acc);
                    else if (two_cols) block(x0, x1, w0, w1, chunks, 0, 1, acc);
                    else block(x0, x1, w0, w1, chunks, 0, 0, acc);
                    for (int h = 0; h < 1 + two_rows; h++) {
                        const int64_t r0 = (t + h) * TR, rows = m - r0 < TR ? m - r0 : TR;
                        for (int g = 0; g < 1 + two_cols; g++)
                            put(acc[2 * h + g], bias, y, n, r0, rows, (cb + g) * TC);
                    }
                }
            }
        }
        _tile_release();
    }
    free(xt);
#else
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)n, (void)k;
#endif
}
