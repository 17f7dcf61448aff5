/*
 * The element-wise work of a decoder layer, for CPUs, one pass over each row where torch
 * makes several: residual add + RMS norm, rotary embedding of q and k, SiLU(gate) * up.
 *
 * Each function reproduces the torch reference's roundings (services/model/layer_ops.py:
 * TorchLayerOps): every intermediate torch rounds to the compute dtype is rounded here too,
 * statistics are float32 as transformers computes them. Rotary and the residual add are
 * bit-identical to torch in both dtypes; the norm's sum and SiLU's exp differ from torch's in
 * the last bits of a float32. Built without -ffast-math so the compiler keeps every rounding
 * and contracts nothing into a fused multiply-add (tests compare with the reference).
 *
 * Rows are independent: a row's result never depends on the other rows of the call, so a
 * request gets the same numbers alone or in any batch. Tensors are contiguous, rows of
 * `dim` elements, float32 or bfloat16 (`bf16`); every dim is a multiple of LANES (the Python
 * side checks and falls back to torch otherwise).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vectors.h"

/* rows of a call worth a second thread: below this, waking it costs more than it saves */
#define PARALLEL_ELEMS 16384

/* x rounded to the compute dtype, kept as float32 for the next operation. */
INLINE vf round_to(vf x, int bf16) {
    if (!bf16) return x;
    vu u = __builtin_convertvector(to_bf16(x), vu) << 16;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* The vector width the library was built for. */
int layer_ops_lanes(void) { return LANES; }

/* h += delta (if delta), then out = weight * dtype(h * rsqrt(mean(h^2) + eps)), per row.
 * h, delta, out: [rows, dim]; weight: [dim]. With `wide`, h (the residual stream) is float32
 * while delta, weight and out are in the compute dtype, and the norm rounds once:
 * out = dtype(weight * h * rsqrt(...)). */
void add_rms_norm(void *h, const void *delta, const void *weight, void *out, int64_t rows,
                  int64_t dim, float eps, int bf16, int wide) {
    const int h16 = bf16 && !wide; /* h's dtype */
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = r * dim;
        vf sq = {0};
        for (int64_t c = 0; c < dim; c += LANES) {
            vf x = load(h, row + c, h16);
            if (delta) {
                x = round_to(x + load(delta, row + c, bf16), h16);
                store(h, row + c, x, h16);
            }
            sq += x * x;
        }
        float sum = 0.0f;
        for (int i = 0; i < LANES; i++) sum += sq[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t c = 0; c < dim; c += LANES) {
            vf x = load(h, row + c, h16) * inv;
            if (!wide) x = round_to(x, bf16);
            store(out, row + c, load(weight, c, bf16) * x, bf16);
        }
    }
}

/* Rotate-half rotary embedding of `heads` heads of `dim` at x + row * stride, into out
 * ([rows, heads, dim]): out = x * cos + rotate_half(x) * sin, each product rounded. */
INLINE void rotate(const void *x, int64_t stride, const void *cos, const void *sin,
                   const int64_t *positions, void *out, int64_t rows, int64_t heads,
                   int64_t dim, int bf16) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * dim >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = positions[r] * dim;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t in = r * stride + h * dim, to = (r * heads + h) * dim;
            for (int64_t c = 0; c < half; c += LANES) {
                vf a = load(x, in + c, bf16), b = load(x, in + half + c, bf16);
                vf lo = round_to(a * load(cos, at + c, bf16), bf16) +
                        round_to(-b * load(sin, at + c, bf16), bf16);
                vf hi = round_to(b * load(cos, at + half + c, bf16), bf16) +
                        round_to(a * load(sin, at + half + c, bf16), bf16);
                store(out, to + c, lo, bf16);
                store(out, to + half + c, hi, bf16);
            }
        }
    }
}

/* q and k of a fused qkv projection ([rows, (heads + 2 kv_heads) * dim]: q, then k, then v),
 * rotated into q_out [rows, heads, dim] and k_out [rows, kv_heads, dim]. cos, sin:
 * [max_positions, dim] tables; positions: [rows]. */
void rotary(const void *qkv, const void *cos, const void *sin, const int64_t *positions,
            void *q_out, void *k_out, int64_t rows, int64_t heads, int64_t kv_heads,
            int64_t dim, int bf16) {
    const int64_t stride = (heads + 2 * kv_heads) * dim;
    const int64_t elem = bf16 ? 2 : 4;
    rotate(qkv, stride, cos, sin, positions, q_out, rows, heads, dim, bf16);
    rotate((const char *)qkv + heads * dim * elem, stride, cos, sin, positions, k_out, rows,
           kv_heads, dim, bf16);
}

/* out = dtype(silu(gate)) * up, per row of gate_up ([rows, 2 ff]: gate, then up);
 * out: [rows, ff]. silu(x) = x / (1 + e^-x) in float32, as torch computes it. */
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t ff, int bf16) {
#pragma omp parallel for schedule(static) if (rows * ff >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < ff; c += LANES) {
            vf g = load(gate_up, r * 2 * ff + c, bf16), u = load(gate_up, r * 2 * ff + ff + c, bf16);
            vf s = round_to(g / (1.0f + vexp(-g)), bf16);
            store(out, r * ff + c, s * u, bf16);
        }
}

/* A router's scores, per row of logits ([rows, experts], float32): sigmoid (sigmoid = 1) or
 * softmax over the row, lane by lane with vexp (experts padded to whole vectors with the
 * row's first logit, then dropped), so that an expert's score depends on its own row only,
 * whatever else the call holds: torch's sigmoid and softmax took other bits for a row alone
 * than for the same row among others. The softmax's sum runs over the experts in order. */
void router_scores(const float *logits, float *out, int64_t rows, int64_t experts,
                   int sigmoid) {
#pragma omp parallel for schedule(static) if (rows * experts >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * experts;
        float *y = out + r * experts, top = x[0], sum = 0.0f;
        for (int64_t e = 1; e < experts; e++) top = x[e] > top ? x[e] : top;
        for (int64_t c = 0; c < experts; c += LANES) {
            float lane[LANES], score[LANES];
            for (int j = 0; j < LANES; j++) lane[j] = c + j < experts ? x[c + j] : x[0];
            vf v;
            memcpy(&v, lane, sizeof v);
            v = sigmoid ? 1.0f / (1.0f + vexp(-v)) : vexp(v - top);
            memcpy(score, &v, sizeof v);
            for (int j = 0; j < LANES && c + j < experts; j++) y[c + j] = score[j];
        }
        if (sigmoid) continue;
        for (int64_t e = 0; e < experts; e++) sum += y[e];
        for (int64_t e = 0; e < experts; e++) y[e] = y[e] / sum;
    }
}

/* The experts each row of router scores ([rows, experts], float32) chooses, and their
 * weights: layers/layer_ops.py select_experts, the reference, in one pass a row. choice = score
 * + bias (when bias is given); with groups > 1 and method 1 (group_limited_greedy) or 2
 * (noaux_tc), only the experts of the topk_group groups ranked best (by their best choice, or
 * the sum of their best two) stay, the others set to 0 or -inf; then the top_k choices, best
 * first (of equals the lower expert); weights = their scores, over (their sum in that order +
 * 1e-20) when normalize, times scaling. A row's result depends on its row alone. */
#define MAX_EXPERTS 1024
#define MAX_GROUPS 64
void router_select(const float *scores, const float *bias, int64_t rows, int64_t experts,
                   int64_t groups, int64_t topk_group, int64_t top_k, int method,
                   int normalize, float scaling, int64_t *ids, float *weights) {
#pragma omp parallel for schedule(static) if (rows * experts >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *s = scores + r * experts;
        float choice[MAX_EXPERTS];
        for (int64_t e = 0; e < experts; e++) choice[e] = bias ? s[e] + bias[e] : s[e];
        if (method && groups > 1) {
            const int64_t per = experts / groups;
            float rank[MAX_GROUPS];
            int keep[MAX_GROUPS] = {0};
            for (int64_t g = 0; g < groups; g++) {
                float a = -INFINITY, b = -INFINITY; /* the group's best two */
                for (int64_t i = 0; i < per; i++) {
                    const float x = choice[g * per + i];
                    if (x > a) {
                        b = a;
                        a = x;
                    } else if (x > b) {
                        b = x;
                    }
                }
                rank[g] = method == 2 ? a + b : a;
            }
            for (int64_t t = 0; t < topk_group; t++) {
                int64_t best = -1;
                for (int64_t g = 0; g < groups; g++)
                    if (!keep[g] && (best < 0 || rank[g] > rank[best])) best = g;
                keep[best] = 1;
            }
            const float fill = method == 1 ? 0.0f : -INFINITY;
            for (int64_t g = 0; g < groups; g++)
                if (!keep[g])
                    for (int64_t i = 0; i < per; i++) choice[g * per + i] = fill;
        }
        unsigned char taken[MAX_EXPERTS];
        memset(taken, 0, (size_t)experts);
        int64_t *id = ids + r * top_k;
        float *w = weights + r * top_k, sum = 0.0f;
        for (int64_t j = 0; j < top_k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < experts; e++)
                if (!taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
            taken[best] = 1;
            id[j] = best;
            w[j] = s[best];
        }
        if (normalize) {
            for (int64_t j = 0; j < top_k; j++) sum += w[j];
            const float d = sum + 1e-20f;
            for (int64_t j = 0; j < top_k; j++) w[j] = w[j] / d;
        }
        for (int64_t j = 0; j < top_k; j++) w[j] = w[j] * scaling;
    }
}
