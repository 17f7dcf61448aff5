/*
 * The two element-wise halves of an int8 product (services/model/quantize.py): rows of
 * activations to int8 with one scale each, and the int32 sums back to the compute dtype.
 *
 * Each reproduces the torch reference bit for bit: float32 arithmetic in the same order,
 * quotients rounded half to even, float32 to bfloat16 rounded to nearest even. Rows are
 * independent. Built without -ffast-math so every rounding stays where it is.
 */
#include <stdint.h>
#include <string.h>

#include "vectors.h"

/* rows of a call worth a second thread: below this, waking it costs more than it saves */
#define PARALLEL_ELEMS 16384
#define TINY 1e-30f /* the scale of an all-zero row */

/* x rounded half to even to an integer, for |x| < 2^22 (the quotients here are <= 127.x) */
INLINE vf round_even(vf x) {
    const vf magic = (vf){0} + 12582912.0f; /* 1.5 * 2^23 */
    return (x + magic) - magic;
}

/* Per row r of x [rows, dim] (float32 or bfloat16): s = max|x * smooth| / 127 (TINY if 0),
 * q = round(x * smooth / s) as int8; scale[r] = s. dim is a multiple of LANES. */
void quantize_rows(const void *x, const float *smooth, int8_t *q, float *scale, int64_t rows,
                   int64_t dim, int bf16) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = r * dim;
        vf top = {0};
        for (int64_t c = 0; c < dim; c += LANES) {
            vf v = load(x, row + c, bf16) * load(smooth, c, 0);
            v = select(v < 0, v, -v);
            top = select(v > top, top, v);
        }
        float amax = 0;
        for (int i = 0; i < LANES; i++) amax = top[i] > amax ? top[i] : amax;
        const float s = (amax > TINY ? amax : TINY) / 127.0f;
        scale[r] = s;
        for (int64_t c = 0; c < dim; c += LANES) {
            vf v = round_even((load(x, row + c, bf16) * load(smooth, c, 0)) / s);
            v = select(v > 127.0f, v, (vf){0} + 127.0f);
            v = select(v < -127.0f, v, (vf){0} - 127.0f);
            vi n = __builtin_convertvector(v, vi);
            for (int i = 0; i < LANES; i++) q[row + c + i] = (int8_t)n[i];
        }
    }
}

/* y[r, n] = dtype(float(acc[r, n]) * xs[r] * ws[n]); acc, y: [rows, cols], cols a multiple
 * of LANES. */
void dequantize(const int32_t *acc, const float *xs, const float *ws, void *y, int64_t rows,
                int64_t cols, int bf16) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = r * cols;
        for (int64_t c = 0; c < cols; c += LANES) {
            vi a;
            memcpy(&a, acc + row + c, sizeof a);
            store(y, row + c, __builtin_convertvector(a, vf) * xs[r] * load(ws, c, 0), bf16);
        }
    }
}
