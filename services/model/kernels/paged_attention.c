/*
 * Decode attention over a paged KV cache, for CPUs: one query token per sequence, keys and
 * values read in place from their blocks (no gather), float32 arithmetic.
 *
 * Each (sequence, KV head) is one task: the G query heads sharing that KV head are scored
 * against every key of the sequence in order, then softmax, then the weighted sum of values.
 * The order of every sum depends on the sequence alone, never on the batch around it, so a
 * sequence gets bit-identical results alone or in any batch.
 *
 * Layouts (all contiguous):
 *   q, out:  [B, H, D] float32
 *   k, v:    [num_blocks, block_size, KVH, D], float32 or bfloat16 (one layer)
 *   tables:  [B, W] int64 block ids; lens: [B] int64 context lengths (>= 1)
 * Reference: _decode in services/model/attention.py; tests compare the two.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One task, for a cache element type T read through LOAD(ptr, d) into float. */
#define DEFINE_ATTEND(NAME, T, LOAD)                                                          \
    static int NAME(const float *q, const T *k, const T *v, const int64_t *table,             \
                    int64_t len, float *out, int64_t kv_heads, int64_t kh, int64_t group,     \
                    int64_t dim, int64_t block_size, float scale) {                           \
        float *scores = malloc((size_t)(group * len) * sizeof(float));                        \
        if (scores == NULL) return -1;                                                        \
        float qs[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], row[MAX_DIM];                  \
        float best[MAX_GROUP], total[MAX_GROUP];                                              \
        for (int64_t g = 0; g < group; g++) {                                                 \
            for (int64_t d = 0; d < dim; d++) qs[g][d] = q[g * dim + d] * scale;              \
            best[g] = -FLT_MAX;                                                               \
            total[g] = 0.0f;                                                                  \
            memset(acc[g], 0, (size_t)dim * sizeof(float));                                   \
        }                                                                                     \
        for (int64_t t = 0; t < len; t++) {                                                   \
            int64_t slot = table[t / block_size] * block_size + t % block_size;               \
            const T *src = k + (slot * kv_heads + kh) * dim;                                  \
            for (int64_t d = 0; d < dim; d++) row[d] = LOAD(src, d);                          \
            for (int64_t g = 0; g < group; g++) {                                             \
                float s = 0.0f;                                                               \
                for (int64_t d = 0; d < dim; d++) s += qs[g][d] * row[d];                     \
                scores[g * len + t] = s;                                                      \
                best[g] = s > best[g] ? s : best[g];                                          \
            }                                                                                 \
        }                                                                                     \
        for (int64_t g = 0; g < group; g++) {                                                 \
            float *sg = scores + g * len, m = best[g], sum = 0.0f;                            \
            for (int64_t t = 0; t < len; t++) sg[t] = expf(sg[t] - m);                        \
            for (int64_t t = 0; t < len; t++) sum += sg[t];                                   \
            total[g] = sum;                                                                   \
        }                                                                                     \
        for (int64_t t = 0; t < len; t++) {                                                   \
            int64_t slot = table[t / block_size] * block_size + t % block_size;               \
            const T *src = v + (slot * kv_heads + kh) * dim;                                  \
            for (int64_t d = 0; d < dim; d++) row[d] = LOAD(src, d);                          \
            for (int64_t g = 0; g < group; g++) {                                             \
                float p = scores[g * len + t];                                                \
                for (int64_t d = 0; d < dim; d++) acc[g][d] += p * row[d];                    \
            }                                                                                 \
        }                                                                                     \
        for (int64_t g = 0; g < group; g++)                                                   \
            for (int64_t d = 0; d < dim; d++) out[g * dim + d] = acc[g][d] / total[g];        \
        free(scores);                                                                         \
        return 0;                                                                             \
    }

#define LOAD_F32(src, d) ((src)[d])
#define LOAD_BF16(src, d) bf16_to_f32((src)[d])
DEFINE_ATTEND(attend_f32, float, LOAD_F32)
DEFINE_ATTEND(attend_bf16, uint16_t, LOAD_BF16)

/* Returns 0, or -1 if a size is out of range or memory ran out. */
int paged_decode_attention(const float *q, const void *k, const void *v, int bf16,
                           const int64_t *tables, const int64_t *lens, float *out,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                           int64_t block_size, int64_t width, float scale) {
    int64_t group = heads / kv_heads;
    if (group > MAX_GROUP || dim > MAX_DIM || group * kv_heads != heads) return -1;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t b = 0; b < batch; b++)
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            int64_t first = (b * heads + kh * group) * dim;
            const int64_t *table = tables + b * width;
            failed |= bf16 ? attend_bf16(q + first, k, v, table, lens[b], out + first, kv_heads,
                                         kh, group, dim, block_size, scale)
                           : attend_f32(q + first, k, v, table, lens[b], out + first, kv_heads,
                                        kh, group, dim, block_size, scale);
        }
    return failed ? -1 : 0;
}
