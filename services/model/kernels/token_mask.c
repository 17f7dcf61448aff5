/* Structured output: a grammar's token bitmask applied to a batch's logits in place.
 *
 * bits[i] holds one bit per token (little-endian 32-bit words, token t at word t / 32, bit
 * t % 32; llguidance's layout); a clear bit sets the logit of x row rows[i] to -inf. A word of
 * all ones (inside a JSON string most tokens are allowed) is skipped whole. */
#include <math.h>
#include <stdint.h>

void apply_token_mask(float *x, int64_t row_stride, const int64_t *rows, int64_t nrows,
                      const int32_t *bits, int64_t words, int64_t vocab) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nrows; i++) {
        float *row = x + rows[i] * row_stride;
        const uint32_t *w = (const uint32_t *)(bits + i * words);
        for (int64_t k = 0; k < words; k++) {
            uint32_t allowed = w[k];
            if (allowed == 0xffffffffu)
                continue;
            int64_t base = k * 32;
            int64_t end = base + 32 < vocab ? 32 : vocab - base;
            for (int64_t b = 0; b < end; b++)
                if (!((allowed >> b) & 1u))
                    row[base + b] = -INFINITY;
        }
    }
}
