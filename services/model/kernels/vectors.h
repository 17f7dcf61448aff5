/*
 * What the C kernels share: float vectors as wide as the CPU's registers (16 floats with
 * AVX-512, else 8), loads and stores of float32 or bfloat16 arrays through them, and a vector
 * e^x. Included by each kernel's source; kernels/__init__.py hashes it with them.
 */
#ifndef PDSERVE_VECTORS_H
#define PDSERVE_VECTORS_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define LANES 16 /* floats in a vector register */
#else
#define LANES 8
#endif

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

#define INLINE static inline __attribute__((always_inline))

/* LANES consecutive elements at `at` as float32 (bfloat16 is float32's upper half). */
INLINE vf load(const void *base, int64_t at, int bf16) {
    vf x;
    if (bf16) {
        vh h;
        memcpy(&h, (const uint16_t *)base + at, sizeof h);
        vu u = __builtin_convertvector(h, vu) << 16;
        memcpy(&x, &u, sizeof x);
    } else {
        memcpy(&x, (const float *)base + at, sizeof x);
    }
    return x;
}

/* element i of a float32 or bfloat16 array, as float32 */
INLINE float scalar(const void *base, int64_t i, int bf16) {
    if (!bf16) return ((const float *)base)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* float32 to bfloat16, rounding to nearest even as torch does (no NaNs reach here). */
INLINE vh to_bf16(vf x) {
    vu u;
    memcpy(&u, &x, sizeof u);
    u += 0x7FFF + ((u >> 16) & 1);
    return __builtin_convertvector(u >> 16, vh);
}

/* LANES floats stored at `at` in the array's dtype. */
INLINE void store(void *base, int64_t at, vf x, int bf16) {
    if (bf16) {
        vh h = to_bf16(x);
        memcpy((uint16_t *)base + at, &h, sizeof h);
    } else {
        memcpy((float *)base + at, &x, sizeof x);
    }
}

/* a * b + c, rounded once where the CPU has fused multiply-adds (else twice). Kernels built
 * without contraction (-ffp-contract=off) fuse only here, so a sum rounds alike in every
 * function it is inlined into (with contraction left to GCC, the decode and the prefill
 * attention kernels once fused different products on an AVX2 CPU, and a token's attention
 * took other bits decoded than prefilled). */
INLINE vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* where mask (all ones or zeros per lane), b; elsewhere a */
INLINE vf select(vi mask, vf a, vf b) { return (vf)(((vi)a & ~mask) | ((vi)b & mask)); }

/* e^x to a few ulp for x in [-87, 88] (clamped to it): x = n ln2 + r, |r| <= ln2 / 2 (ln2 in
 * two parts, the first exact in n ln2, so r stays accurate for large n), e^r by its Taylor
 * polynomial to r^7, times 2^n built in the exponent bits. Below -87 it returns about e^-87,
 * not 0: callers zero what must be exactly 0. e[i] = e^x[i] for `count` vectors (at most
 * EXP_MAX), each step over all of them before the next: their chains side by side, not one
 * after another (a tile's twelve SiLUs took 8% of a dense MLP one by one). */
#define EXP_MAX 16
INLINE void vexp_n(vf *e, const vf *x, int count) {
    const vf lo = (vf){0} - 87.0f, hi = (vf){0} + 88.0f, half = (vf){0} + 0.5f;
    static const float taylor[] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    vi n[EXP_MAX];
    vf r[EXP_MAX];
    for (int i = 0; i < count; i++) {
        vf v = select(x[i] < lo, x[i], lo);
        v = select(v > hi, v, hi);
        const vf t = v * 1.44269504f;
        n[i] = __builtin_convertvector(t + select(t < 0, half, -half), vi); /* nearest */
        const vf nf = __builtin_convertvector(n[i], vf);
        r[i] = (v - nf * 0.693145752f) - nf * 1.42860677e-6f;
        e[i] = r[i] * (1.0f / 5040) + 1.0f / 720;
    }
    for (int step = 0; step < 6; step++)
        for (int i = 0; i < count; i++) e[i] = e[i] * r[i] + taylor[step];
    for (int i = 0; i < count; i++) e[i] = (vf)((vi)e[i] + (n[i] << 23));
}

INLINE vf vexp(vf x) {
    vf e;
    vexp_n(&e, &x, 1);
    return e;
}

#endif
