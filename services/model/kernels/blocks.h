/*
 * A KV block's 16 tokens as float vectors (one with AVX-512, two with AVX2), and the masked
 * softmax arithmetic the attention kernels do on them. A struct of register-wide vectors, not
 * one 16-float vector type: GCC's code for the latter on AVX2 went through the stack.
 * Included by paged_attention.c after BLOCK is defined.
 */
#ifndef PDSERVE_BLOCKS_H
#define PDSERVE_BLOCKS_H

#include "vectors.h"

#define PER_BLOCK (BLOCK / LANES)
typedef struct {
    vf v[PER_BLOCK];
} vb;
typedef struct {
    vi v[PER_BLOCK];
} vbi;

INLINE vb load_block(const void *base, int64_t at, int bf16) {
    vb x;
    for (int i = 0; i < PER_BLOCK; i++) x.v[i] = load(base, at + i * LANES, bf16);
    return x;
}

INLINE vb zero_block(void) {
    vb x;
    for (int i = 0; i < PER_BLOCK; i++) x.v[i] = (vf){0};
    return x;
}

/* s += a * x */
INLINE void fma_block(vb *s, float a, vb x) {
    for (int i = 0; i < PER_BLOCK; i++) s->v[i] = fmadd((vf){0} + a, x.v[i], s->v[i]);
}

/* a + b - c */
INLINE vb add_sub(vb a, vb b, float c) {
    for (int i = 0; i < PER_BLOCK; i++) a.v[i] = a.v[i] + b.v[i] - c;
    return a;
}

INLINE vb vexp_block(vb x) {
    for (int i = 0; i < PER_BLOCK; i++) x.v[i] = vexp(x.v[i]);
    return x;
}

/* all ones for the block's tokens t <= last, else zeros */
INLINE vbi up_to(int64_t last) {
    static const int32_t index[BLOCK] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vbi seen;
    for (int i = 0; i < PER_BLOCK; i++) {
        vi lane;
        memcpy(&lane, index + i * LANES, sizeof lane);
        seen.v[i] = lane <= (vi){0} + (int32_t)(last < BLOCK ? last : BLOCK);
    }
    return seen;
}

/* x where seen, else `other` */
INLINE vb where(vbi seen, vb x, float other) {
    const vi fill = (vi)((vf){0} + other);
    for (int i = 0; i < PER_BLOCK; i++)
        x.v[i] = (vf)(((vi)x.v[i] & seen.v[i]) | (fill & ~seen.v[i]));
    return x;
}

/* x with lanes j + width (mod LANES) brought to lanes j */
INLINE vf lanes_down(vf x, int width) {
    static const int32_t index[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vi lane;
    memcpy(&lane, index, sizeof lane);
    return __builtin_shuffle(x, (lane + width) & (LANES - 1));
}

/* The horizontal reductions go pairwise, lane j with lane j + width, halving the width: an
 * order the code fixes (the kernels are built without reassociation), in a few vector steps. */
INLINE float hmax(vb x, float top) {
    vf m = x.v[0];
    for (int i = 1; i < PER_BLOCK; i++) m = select(m < x.v[i], m, x.v[i]);
    for (int width = LANES / 2; width > 0; width /= 2) {
        const vf other = lanes_down(m, width);
        m = select(m < other, m, other);
    }
    return m[0] > top ? m[0] : top;
}

INLINE float hsum(vb x) {
    vf t = x.v[0];
    for (int i = 1; i < PER_BLOCK; i++) t += x.v[i];
    for (int width = LANES / 2; width > 0; width /= 2) t += lanes_down(t, width);
    return t[0];
}

#endif
