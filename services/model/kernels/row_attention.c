/*
 * Attention for query rows that each see their own list of keys (row_attention.py): a
 * sliding window, a window plus compressed entries (DeepSeek-V4), or everything before them;
 * an optional learned sink logit per head joins the softmax with no value.
 *
 * Per (row, head): logits = q . k * scale over the row's keys, in the listed order, each dot
 * product summed in a fixed pattern; the softmax in float32 with libm's expf; the weighted sum
 * of values key by key. Nothing depends on the other rows of the call, so a row gets the same
 * bits alone, batched or chunked. With bfloat16 tensors q . k, the scaled logit and the weights
 * are rounded to bfloat16 where the model's dtype has them (transformers' eager roundings).
 *
 * q [rows, heads, d]; keys [n, kv_heads, d]; values [n, kv_heads, dv]; row r's keys are
 * index[starts[r] .. starts[r + 1]) (rows of keys/values); out [rows, heads, dv].
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "vectors.h"

INLINE float round_bf16(float x, int bf16) {
    if (!bf16) return x;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}

static float dot(const void *a, int64_t at, const void *b, int64_t bt, int64_t d, int bf16) {
    vf acc = {0};
    int64_t c = 0;
    for (; c + LANES <= d; c += LANES) acc = fmadd(load(a, at + c, bf16), load(b, bt + c, bf16), acc);
    float sum = 0.0f;
    for (int i = 0; i < LANES; i++) sum += acc[i];
    for (; c < d; c++) sum += scalar(a, at + c, bf16) * scalar(b, bt + c, bf16);
    return sum;
}

static void one(const void *q, const void *keys, const void *values, int bf16,
                const int64_t *idx, int64_t n, const float *sinks, float scale, void *out,
                int64_t r, int64_t h, int64_t heads, int64_t kv_heads, int64_t d, int64_t dv,
                float *p, float *acc) {
    const int64_t g = h / (heads / kv_heads), qa = (r * heads + h) * d;
    float top = sinks ? sinks[h] : -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float qk = round_bf16(dot(q, qa, keys, (idx[j] * kv_heads + g) * d, d, bf16), bf16);
        p[j] = round_bf16(qk * scale, bf16);
        top = p[j] > top ? p[j] : top;
    }
    float sum = sinks ? expf(sinks[h] - top) : 0.0f;
    for (int64_t j = 0; j < n; j++) {
        p[j] = expf(p[j] - top);
        sum += p[j];
    }
    for (int64_t c = 0; c < dv; c++) acc[c] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const float w = round_bf16(p[j] / sum, bf16);
        const int64_t va = (idx[j] * kv_heads + g) * dv;
        for (int64_t c = 0; c < dv; c++) acc[c] += w * scalar(values, va + c, bf16);
    }
    const int64_t oa = (r * heads + h) * dv;
    for (int64_t c = 0; c < dv; c++) {
        if (bf16) {
            const float x = round_bf16(acc[c], 1);
            uint32_t u;
            memcpy(&u, &x, sizeof u);
            ((uint16_t *)out)[oa + c] = (uint16_t)(u >> 16);
        } else {
            ((float *)out)[oa + c] = acc[c];
        }
    }
}

/* 0, or 1 where scratch memory could not be had. max_keys: the longest list. */
int rows_attend(const void *q, const void *keys, const void *values, int bf16,
                const int64_t *starts, const int64_t *index, const float *sinks, float scale,
                void *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t dv,
                int64_t max_keys) {
    const int threads = omp_get_max_threads();
    const int64_t per = max_keys + dv;
    float *scratch = malloc((size_t)threads * (size_t)(per > 0 ? per : 1) * sizeof(float));
    if (!scratch) return 1;
#pragma omp parallel for schedule(dynamic, 4) if (rows * heads > 1)
    for (int64_t rh = 0; rh < rows * heads; rh++) {
        const int64_t r = rh / heads;
        float *p = scratch + (size_t)omp_get_thread_num() * (size_t)per;
        one(q, keys, values, bf16, index + starts[r], starts[r + 1] - starts[r], sinks, scale,
            out, r, rh % heads, heads, kv_heads, d, dv, p, p + max_keys);
    }
    free(scratch);
    return 0;
}
