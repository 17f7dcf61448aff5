/*
 * Decode attention over a paged KV cache, for CPUs: one query token per sequence, keys and
 * values read in place from their blocks (no gather), float32 arithmetic.
 *
 * Each (sequence, KV head) is one task. For each block of the sequence, the G query heads
 * sharing that KV head score all the block's tokens at once (K is stored transposed, so the
 * tokens are contiguous along each head dimension and the arithmetic runs along them); then
 * softmax; then the weighted sum of the value rows. The order of every sum depends on the
 * sequence alone, never on the batch around it: a sequence gets bit-identical results alone
 * or in any batch.
 *
 * Layouts (contiguous; see services/model/kv_cache.py):
 *   q, out:  [B, H, D] float32
 *   k:       [num_blocks, KVH, D, BLOCK]  float32 or bfloat16 (one layer)
 *   v:       [num_blocks, KVH, BLOCK, D]
 *   tables:  [B, W] int64 block ids; lens: [B] int64 context lengths (>= 1)
 * BLOCK is 16, pdserve's block size: a block's scores then fit one 512-bit register.
 * Reference: _decode in services/model/attention.py; tests compare the two.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 16
#define MAX_GROUP 16
#define MAX_DIM 256

typedef struct {
    const void *k, *v;
    int bf16;
    int64_t kv_heads, group, dim;
} layer_t;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One row of BLOCK (K) or D (V) elements as float32. */
static inline void load_row(const layer_t *L, const void *base, int64_t at, int64_t n, float *dst) {
    if (L->bf16) {
        const uint16_t *src = (const uint16_t *)base + at;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + at, (size_t)n * sizeof(float));
    }
}

/* scores[g][t] for the tokens of one block: sum over d of q[g][d] * K[d][t]. */
static void score_block(const layer_t *L, int64_t block, int64_t kh,
                        float qs[][MAX_DIM], float s[][BLOCK]) {
    float row[BLOCK];
    int64_t base = (block * L->kv_heads + kh) * L->dim * BLOCK;
    for (int64_t g = 0; g < L->group; g++)
        for (int t = 0; t < BLOCK; t++) s[g][t] = 0.0f;
    for (int64_t d = 0; d < L->dim; d++) {
        load_row(L, L->k, base + d * BLOCK, BLOCK, row);
        for (int64_t g = 0; g < L->group; g++) {
            float qd = qs[g][d];
            for (int t = 0; t < BLOCK; t++) s[g][t] += qd * row[t];
        }
    }
}

static int attend(const layer_t *L, const float *q, const int64_t *table, int64_t len,
                  int64_t kh, float scale, float *out) {
    int64_t group = L->group, dim = L->dim, blocks = (len + BLOCK - 1) / BLOCK;
    int64_t padded = blocks * BLOCK;
    float *scores = malloc((size_t)(group * padded) * sizeof(float)); /* [group, padded] */
    if (scores == NULL) return -1;
    float qs[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], s[MAX_GROUP][BLOCK], row[MAX_DIM];
    for (int64_t g = 0; g < group; g++) {
        for (int64_t d = 0; d < dim; d++) qs[g][d] = q[g * dim + d] * scale;
        memset(acc[g], 0, (size_t)dim * sizeof(float));
    }
    for (int64_t b = 0; b < blocks; b++) {
        score_block(L, table[b], kh, qs, s);
        for (int64_t g = 0; g < group; g++)
            memcpy(scores + g * padded + b * BLOCK, s[g], sizeof s[g]);
    }
    float total[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * padded, m = -FLT_MAX, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
        for (int64_t t = 0; t < len; t++) sg[t] = expf(sg[t] - m);
        for (int64_t t = 0; t < len; t++) sum += sg[t];
        total[g] = sum;
    }
    for (int64_t t = 0; t < len; t++) {
        int64_t at = ((table[t / BLOCK] * L->kv_heads + kh) * BLOCK + t % BLOCK) * dim;
        load_row(L, L->v, at, dim, row);
        for (int64_t g = 0; g < group; g++) {
            float p = scores[g * padded + t];
            for (int64_t d = 0; d < dim; d++) acc[g][d] += p * row[d];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = acc[g][d] / total[g];
    free(scores);
    return 0;
}

/* Returns 0, or -1 if a size is out of range or memory ran out. */
int paged_decode_attention(const float *q, const void *k, const void *v, int bf16,
                           const int64_t *tables, const int64_t *lens, float *out,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                           int64_t block_size, int64_t width, float scale) {
    layer_t L = {k, v, bf16, kv_heads, heads / kv_heads, dim};
    if (block_size != BLOCK || L.group > MAX_GROUP || dim > MAX_DIM ||
        L.group * kv_heads != heads)
        return -1;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t b = 0; b < batch; b++)
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            int64_t first = (b * heads + kh * L.group) * dim;
            failed |= attend(&L, q + first, tables + b * width, lens[b], kh, scale, out + first);
        }
    return failed ? -1 : 0;
}
