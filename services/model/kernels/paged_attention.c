/*
 * Attention over a paged KV cache, for CPUs, keys and values read in place from their blocks
 * (no gather): the per-block arithmetic both kernels share first, then decode (one query token
 * per sequence), then prefill (the chunks of prompts).
 *
 * For each block and KV head, the query rows sharing that KV head score the block's 16 tokens
 * (K is stored transposed, so a block's tokens lie contiguous along each head dimension and the
 * arithmetic runs along them), fold them into a running softmax (maximum, sum and output
 * rescaled as the maximum grows, as flash-decoding does, lazily: only when it grows by more
 * than 2^3; weights in base 2), and add the block's value rows to their outputs.
 *
 * Determinism: a query row's result depends on its own query and the blocks it attends to,
 * never on the rows computed with it, and the decode and prefill kernels run the same functions
 * (score, fold, values) on it, so a token gets the same bits decoded, in a prefill
 * chunk of any length (a cache hit that leaves one token, a migrated stream recomputing its
 * output), alone or in any batch. Every sum takes its terms in an order fixed by the code: the
 * library is built without -ffast-math (kernels/__init__.py), so the compiler reassociates
 * nothing; fused multiply-adds are allowed, and the shared functions contract the same way
 * wherever they are inlined (a product that must not fuse with the add after it goes through
 * rounded()). tests/services/model/test_attention.py checks it bit for bit.
 *
 * Arithmetic. float32: products and sums in float32. bfloat16: the products of scores and of
 * values take bfloat16 pairs (the query's, the weights' rounded to bfloat16) and sum them into
 * float32 two at a time (dot_pairs: one VDPBF16PS where the CPU has AVX512-BF16, two fused
 * multiply-adds elsewhere), at twice float32's rate and with no conversion of K and V. Where
 * AMX is switched on (paged_attention_use_amx), those two products of a block are tile
 * products instead, in both kernels (see "AMX" below).
 *
 * Layouts (contiguous; see services/model/kv_cache.py), all float32 or all bfloat16:
 *   q, out:  [T, H, D], a row per token of the forward pass
 *   k:       float32 [num_blocks, KVH, D, BLOCK] (one layer: a block's tokens along each
 *            dimension); bfloat16 [num_blocks, KVH, D/2, BLOCK, 2] (dimensions in pairs)
 *   v:       float32 [num_blocks, KVH, BLOCK, D]; bfloat16 [num_blocks, KVH, BLOCK/2, D, 2]
 *            (tokens in pairs)
 *   tables:  [B, W] int64 block ids
 * BLOCK is 16, pdserve's block size; D a multiple of LANES (a vector: 16 floats with AVX-512,
 * else 8), at most 256.
 * References: _decode and _prefill in services/model/attention.py; tests compare them.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "vectors.h"

#define BLOCK 16
#include "blocks.h"

#define MAX_GROUP 16
#define MAX_DIM 256
#define LINE 64 /* bytes in a cache line; a key row of a block (16 floats at most) fits one */

#ifdef __AVX512F__
#define TILE_ROWS 12 /* prefill: 12 score vectors + a key vector fit in 32 registers */
#else
#define TILE_ROWS 6
#endif
#define TILE_ROWS_AMX 16 /* prefill on AMX tiles: a tile holds 16 rows, registers none */
#define MAX_ROWS 16        /* >= TILE_ROWS, TILE_ROWS_AMX and MAX_GROUP */

/* the array p advanced by i elements */
INLINE void *advance(const void *p, int64_t i, int bf16) {
    return (char *)p + i * (bf16 ? 2 : 4);
}

/* acc + a * b lane by lane, where a lane of a and b holds a pair of bfloat16 (element 2i in
 * the low half): acc + a_odd * b_odd + a_even * b_even, each product exact in float32. b is
 * one pair for every lane. */
INLINE vf dot_pairs(vf acc, vu a, uint32_t b) {
#if defined(__AVX512BF16__) && LANES == 16
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32((int)b));
#else
    const vu high = (vu){0} + 0xFFFF0000u;
    const uint32_t b_odd = b & 0xFFFF0000u, b_even = b << 16;
    float odd, even;
    memcpy(&odd, &b_odd, sizeof odd);
    memcpy(&even, &b_even, sizeof even);
    acc = fmadd((vf)(a & high), (vf){0} + odd, acc);
    return fmadd((vf)(a << 16), (vf){0} + even, acc);
#endif
}

/* x, computed here: the compiler may not fuse the multiply that made it into the next add (a
 * fused multiply-add rounds once, and the kernels must round alike wherever they inline). */
INLINE vf rounded(vf x) {
    __asm__("" : "+v"(x));
    return x;
}

/* LANES pairs of bfloat16 at element `at` */
INLINE vu load_pairs(const uint16_t *base, int64_t at) {
    vu x;
    memcpy(&x, base + at, sizeof x);
    return x;
}

/* Query rows attending over one KV head together (a decode's G query heads, a prefill tile's
 * queries times G): each row's query (float32: scaled; bfloat16: as pairs, unscaled); its
 * running maximum and sum; the weights of the block last folded (float32, or bfloat16 pairs);
 * its output so far, scaled by 2^-max. Sized for the largest shape. */
typedef struct {
    float qs[MAX_ROWS][MAX_DIM], m[MAX_ROWS], rescale[MAX_ROWS + LANES], p[MAX_ROWS][BLOCK];
    uint32_t qp[MAX_ROWS][MAX_DIM / 2], pp[MAX_ROWS][BLOCK / 2];
    vb l[MAX_ROWS]; /* the sum of the weights, by offset in the block */
    vf acc[MAX_ROWS][MAX_DIM / LANES];
    float tile_s[MAX_ROWS][BLOCK]; /* AMX: a block's scores, as the tile stores them */
    int moved; /* whether the last fold moved any row's maximum (else every rescale is 1) */
} __attribute__((aligned(LINE))) rows_t;

/* ---- AMX (bfloat16 only, where the CPU and the kernel allow it; off unless
 * paged_attention_use_amx(1) switched it on). The score and value products of a block become
 * tile products (TDPBF16PS): the bfloat16 layouts are already the pair-interleaved operand
 * tiles take (K: 16 pair rows of a block's 16 tokens, 64 bytes each; V: 8 pair rows of 2 tokens
 * per dimension), and the queries' and the weights' pairs are rows of rows_t. Both kernels
 * take the same path, so a token keeps one set of bits decoded or prefilled; the fold between
 * the products is unchanged. Tiles: 0 scores, 1 a query chunk, 2 a K chunk, 3 the weights,
 * 4 a V column group, 5 an output column group. */
static int amx_on = 0;

/* whether a call takes the tile path: bfloat16, AMX on, whole 32-dimension chunks */
INLINE int tiles(int bf16, int64_t D) { return bf16 && amx_on && D % 32 == 0; }

#if HAVE_AMX
/* Configure this thread's tiles for R rows of queries (R <= 16). */
static void amx_configure(int64_t R) {
    const int rows[6] = {(int)R, (int)R, 16, (int)R, BLOCK / 2, (int)R};
    const int colsb[6] = {64, 64, 64, BLOCK * 2, 64, 64};
    amx_configure_tiles(6, rows, colsb);
}

/* score_pairs' sums as tile products: rows 0..R-1 (R as configured) against one block's keys
 * (K at k + at, D/2 pair rows of 64 bytes), 32 dimensions a product, then scaled as there. */
INLINE void score_tiles(vb *s, rows_t *w, const uint16_t *k, int64_t at, float scale,
                        const int64_t R, const int64_t D) {
    _tile_zero(0);
    for (int64_t c = 0; c < D / 32; c++) {
        _tile_loadd(1, &w->qp[0][c * 16], sizeof w->qp[0]);
        _tile_loadd(2, k + at + c * 32 * BLOCK, 2 * BLOCK * sizeof(uint16_t));
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, w->tile_s, sizeof w->tile_s[0]);
    for (int64_t r = 0; r < R; r++)
        for (int i = 0; i < PER_BLOCK; i++) {
            vf x;
            memcpy(&x, &w->tile_s[r][i * LANES], sizeof x);
            s[r].v[i] = rounded(x * scale);
        }
}

/* add_value_pairs as tile products: the outputs rescaled, then the block's 16 weights (8 pairs)
 * of each row times V (8 pair rows of D * 2 elements), 16 dimensions a product. A weight past
 * the block's last counted key is 0 and the cache's values are finite: it adds nothing. */
INLINE void value_tiles(rows_t *w, const uint16_t *v, int64_t at, const int64_t R,
                        const int64_t D) {
    if (w->moved) /* else every rescale is exactly 1, which changes nothing */
        for (int64_t r = 0; r < R; r++)
            for (int64_t c = 0; c < D / LANES; c++)
                w->acc[r][c] = rounded(w->acc[r][c] * w->rescale[r]);
    _tile_loadd(3, w->pp, sizeof w->pp[0]);
    for (int64_t c = 0; c < D / 16; c++) {
        _tile_loadd(5, &w->acc[0][c * 16 / LANES], sizeof w->acc[0]);
        _tile_loadd(4, v + at + c * 32, 2 * D * sizeof(uint16_t));
        _tile_dpbf16ps(5, 3, 4);
        _tile_stored(5, &w->acc[0][c * 16 / LANES], sizeof w->acc[0]);
    }
}
#endif

/* Whether the library was built with the AMX path. */
int paged_attention_amx_compiled(void) { return HAVE_AMX; }

/* Run a tile product once (a process that can survive it, a probe: an illegal instruction
 * kills it where the CPU lists AMX but the machine refuses it). 1 if it ran. */
int paged_attention_amx_probe(void) {
#if HAVE_AMX
    if (!amx_permitted()) return 0;
    amx_configure(1);
    float out[16][16];
    _tile_zero(0);
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0][0] == 0.0f;
#else
    return 0;
#endif
}

/* Switch the AMX path on (1) or off (0) for this process; returns whether it is on. */
int paged_attention_use_amx(int on) {
#if HAVE_AMX
    amx_on = on && LANES == 16 && amx_permitted();
#else
    (void)on;
#endif
    return amx_on;
}

/* A kernel call's thread: its tiles configured for R query rows, then released. */
INLINE void tiles_begin(int bf16, int64_t R, int64_t D) {
#if HAVE_AMX
    if (tiles(bf16, D)) amx_configure(R);
#else
    (void)bf16, (void)R, (void)D;
#endif
}

INLINE void tiles_end(int bf16, int64_t D) {
#if HAVE_AMX
    if (tiles(bf16, D)) _tile_release();
#else
    (void)bf16, (void)D;
#endif
}

/* Row r starts: its query (D elements at q + at), nothing summed yet. */
INLINE void start_row(rows_t *w, int64_t r, const void *q, int64_t at, float scale, int bf16,
                      const int64_t D) {
    if (bf16)
        memcpy(w->qp[r], (const uint16_t *)q + at, D * sizeof(uint16_t));
    else
        for (int64_t d = 0; d < D; d++) w->qs[r][d] = ((const float *)q)[at + d] * scale;
    for (int64_t c = 0; c < D / LANES; c++) w->acc[r][c] = (vf){0};
    w->m[r] = -FLT_MAX;
    w->l[r] = zero_block();
}

/* Scores of rows 0..R-1 against one block's keys (K at k + at): s[r][t] = the sum over
 * d = 0, 1, ..., D-1, in that order, of qs[r][d] * K[d][t]. With nk, nv (the K and V to be
 * read next; NULL for none), their lines are prefetched meanwhile into L2 (locality 1): into
 * L1 or non-temporal, decode read 14 GB/s on a Zen 4 EPYC; into L2, 24. Decode once summed
 * even and odd dimensions apart (more multiply-adds in flight), prefill did not: a token's
 * scores then took other bits decoded than prefilled. */
INLINE void score_block(vb *s, const rows_t *w, const float *k, int64_t at, const char *nk,
                        const char *nv, const int64_t R, const int64_t D) {
    const int64_t row_bytes = BLOCK * sizeof(float);
    for (int64_t r = 0; r < R; r++) s[r] = zero_block();
    for (int64_t d = 0; d < D; d++) {
        if (nk && d * row_bytes % LINE == 0) { /* key row d starts a line */
            __builtin_prefetch(nk + d * row_bytes, 0, 1);
            __builtin_prefetch(nv + d * row_bytes, 0, 1);
        }
        const vb kd = load_block(k, at + d * BLOCK, 0);
        for (int64_t r = 0; r < R; r++) fma_block(&s[r], w->qs[r][d], kd);
    }
}

/* The same in bfloat16 pairs: s[r][t] = scale times the sum over j = 0, 1, ..., D/2 - 1, in
 * that order, of dot_pairs of query pair j (dimensions 2j, 2j + 1) and key pair row j. A pair
 * row (the block's 16 tokens, two dimensions each) is one 64-byte line. */
INLINE void score_pairs(vb *s, const rows_t *w, const uint16_t *k, int64_t at, float scale,
                        const char *nk, const char *nv, const int64_t R, const int64_t D) {
    const int64_t row_bytes = 2 * BLOCK * sizeof(uint16_t);
    for (int64_t r = 0; r < R; r++) s[r] = zero_block();
    for (int64_t j = 0; j < D / 2; j++) {
        if (nk && j * row_bytes % LINE == 0) {
            __builtin_prefetch(nk + j * row_bytes, 0, 1);
            __builtin_prefetch(nv + j * row_bytes, 0, 1);
        }
        for (int i = 0; i < PER_BLOCK; i++) {
            const vu kj = load_pairs(k, at + 2 * (j * BLOCK + i * LANES));
            for (int64_t r = 0; r < R; r++) s[r].v[i] = dot_pairs(s[r].v[i], kj, w->qp[r][j]);
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int i = 0; i < PER_BLOCK; i++) s[r].v[i] = rounded(s[r].v[i] * scale);
}

/* Scores of one block (K at k + at, in the cache's dtype): score_block or score_pairs. */
INLINE void score(vb *s, rows_t *w, const void *k, int64_t at, int bf16, float scale,
                  const char *nk, const char *nv, const int64_t R, const int64_t D) {
#if HAVE_AMX
    if (tiles(bf16, D)) {
        if (nk)
            for (int64_t line = 0; line < D * BLOCK * 2; line += LINE) {
                __builtin_prefetch(nk + line, 0, 1);
                __builtin_prefetch(nv + line, 0, 1);
            }
        score_tiles(s, w, k, at, scale, R, D);
        return;
    }
#endif
    if (bf16)
        score_pairs(s, w, k, at, scale, nk, nv, R, D);
    else
        score_block(s, w, k, at, nk, nv, R, D);
}

/* Scores are kept in base 2 (the scale times log2 e folded into them), so a weight is 2^x. */
#define LOG2E 1.44269504f

/* 2^x lane by lane, for x <= LAZY: x = n + r, n the nearest integer, 2^r by its Taylor
 * polynomial (in r ln 2) of `degree`, times 2^n built in the exponent bits. Degree 7: a few
 * float32 ulp; degree 4 (bfloat16 weights, rounded to 8 bits after): within 5e-5. Below -125 it
 * returns about 2^-125, not 0: callers zero what must be exactly 0. */
INLINE vf vexp2(vf x, const int degree) {
    static const float c[8] = {1.0f,          0.693147181f,   0.240226507f,  0.0555041087f,
                               0.00961812911f, 0.00133335581f, 0.000154035304f, 1.52527338e-5f};
    const vf lo = (vf){0} - 125.0f, magic = (vf){0} + 12582912.0f; /* 1.5 * 2^23 */
    x = select(x < lo, x, lo);
    const vf t = x + magic; /* rounds x to the nearest integer, held in t's low bits */
    const vi n = (vi)t - (vi)magic;
    const vf r = x - (t - magic);
    vf p = (vf){0} + c[degree];
    for (int k = degree - 1; k >= 0; k--) p = fmadd(p, r, (vf){0} + c[k]);
    return (vf)((vi)p + (n << 23));
}

/* A row's running maximum moves only when a score passes it by more than LAZY: the weights
 * 2^(score - maximum) stay below 2^LAZY (far inside float32's range), and most blocks, their
 * scores under the maximum, skip the horizontal maximum and the rescale (FlashAttention-3's
 * lazy rescaling). 3 held float32 results as close to torch's as an exact maximum did (8 did
 * not: 2.3e-6 against 0.9e-6 at 512 keys).  */
#define LAZY 3.0f

/* whether any lane of x is above t */
INLINE int any_above(vb x, float t) {
    vi above = {0};
    for (int i = 0; i < PER_BLOCK; i++) above |= (vi)(x.v[i] > t);
#if defined(__AVX512F__)
    return _mm512_test_epi32_mask((__m512i)above, (__m512i)above) != 0;
#elif defined(__AVX2__)
    return !_mm256_testz_si256((__m256i)above, (__m256i)above);
#else
    for (int j = 0; j < LANES; j++)
        if (above[j]) return 1;
    return 0;
#endif
}

/* Weights (finite, normal or 0) to bfloat16, rounding to nearest even: to_bf16, in one
 * instruction where the CPU has AVX512-BF16 (it agrees with to_bf16 on such numbers). */
INLINE vh weights_to_bf16(vf x) {
#if defined(__AVX512BF16__) && LANES == 16
    return (vh)_mm512_cvtneps_pbh((__m512)x);
#else
    return to_bf16(x);
#endif
}

/* Fold rows 0..R-1's scores of one block into their running softmaxes, row r counting the
 * block's keys at offsets 0 to last[r] (none when last[r] < 0): a maximum passed by more than
 * LAZY moves to the block's and rescales what was summed so far (by `rescale`, which
 * values() applies to the outputs; exactly 1 for rows that did not move); the block's weights
 * go to p[r] (bfloat16: rounded, as pairs to pp[r], and the rounded weights are what the sum
 * counts), 0 for keys not counted. The rescales 2^(old max - new max) are computed a vector of
 * rows at a time (vexp2, lane by lane: a row's never depends on the others'). */
INLINE void fold(rows_t *w, const vb *s, const int64_t *last, int bf16, const int64_t R) {
    const int degree = bf16 ? 4 : 7;
    float top[MAX_ROWS + LANES], *rescale = w->rescale;
    vb counted[MAX_ROWS];
    int moved = 0;
    for (int64_t r = 0; r < R; r++) { /* a block wholly counted needs no mask (same bits) */
        counted[r] = last[r] >= BLOCK - 1 ? s[r] : where(up_to(last[r]), s[r], -FLT_MAX);
        top[r] = any_above(counted[r], w->m[r] + LAZY) ? hmax(counted[r], w->m[r]) : w->m[r];
        moved |= top[r] != w->m[r];
    }
    w->moved = moved;
    for (int64_t r0 = 0; r0 < R; r0 += LANES) {
        vf gap = {0}, e = (vf){0} + 1.0f;
        if (moved) {
            for (int64_t i = 0; i < LANES && r0 + i < R; i++) gap[i] = w->m[r0 + i] - top[r0 + i];
            e = vexp2(gap, degree); /* 2^0 is exactly 1 */
        }
        memcpy(rescale + r0, &e, sizeof e);
    }
    for (int64_t r = 0; r < R; r++) {
        vb e = add_sub(counted[r], zero_block(), top[r]);
        for (int i = 0; i < PER_BLOCK; i++) e.v[i] = vexp2(e.v[i], degree);
        if (last[r] < BLOCK - 1) e = where(up_to(last[r]), e, 0.0f);
        if (bf16) {
            for (int i = 0; i < PER_BLOCK; i++) {
                const vh h = weights_to_bf16(e.v[i]);
                memcpy((uint16_t *)w->pp[r] + i * LANES, &h, sizeof h);
                e.v[i] = (vf)(__builtin_convertvector(h, vu) << 16);
            }
        } else {
            memcpy(w->p[r], &e, sizeof e);
        }
        for (int i = 0; i < PER_BLOCK; i++)
            w->l[r].v[i] = rounded(w->l[r].v[i] * rescale[r]) + e.v[i];
        w->m[r] = top[r];
    }
}

/* acc[r] += the sum over t < n, in order, of p[r][t] * V[t] (V at v + at), for rows 0..R-1,
 * a vector of dimensions at a time. A weight of 0 adds exactly nothing (acc starts at +0 and
 * never becomes -0), so a row gets the same sums whatever n covers past its last key. */
INLINE void add_values(rows_t *w, const float *v, int64_t at, int64_t n, const int64_t R,
                       const int64_t D) {
    for (int64_t c = 0; c < D / LANES; c++) {
        vf a[MAX_ROWS];
        for (int64_t r = 0; r < R; r++) a[r] = rounded(w->acc[r][c] * w->rescale[r]);
        for (int64_t t = 0; t < n; t++) {
            const vf row = load(v, at + t * D + c * LANES, 0);
            for (int64_t r = 0; r < R; r++) a[r] = fmadd((vf){0} + w->p[r][t], row, a[r]);
        }
        for (int64_t r = 0; r < R; r++) w->acc[r][c] = a[r];
    }
}

/* The same in bfloat16 pairs: acc[r] += dot_pairs of weight pair j and value pair row j (tokens
 * 2j, 2j + 1), for j < n/2 rounded up, in order. Past n the weight is 0 and the cache holds
 * finite numbers (zeroed at allocation, or an earlier token's), so the token beside the last
 * adds exactly nothing. */
INLINE void add_value_pairs(rows_t *w, const uint16_t *v, int64_t at, int64_t n,
                            const int64_t R, const int64_t D) {
    for (int64_t c = 0; c < D / LANES; c++) {
        vf a[MAX_ROWS];
        for (int64_t r = 0; r < R; r++) a[r] = rounded(w->acc[r][c] * w->rescale[r]);
        for (int64_t j = 0; j < (n + 1) / 2; j++) {
            const vu row = load_pairs(v, at + 2 * (j * D + c * LANES));
            for (int64_t r = 0; r < R; r++) a[r] = dot_pairs(a[r], row, w->pp[r][j]);
        }
        for (int64_t r = 0; r < R; r++) w->acc[r][c] = a[r];
    }
}

/* The values of one block (V at v + at, in the cache's dtype): add_values or add_value_pairs. */
INLINE void values(rows_t *w, const void *v, int64_t at, int64_t n, int bf16, const int64_t R,
                   const int64_t D) {
#if HAVE_AMX
    if (tiles(bf16, D)) {
        value_tiles(w, v, at, R, D);
        return;
    }
#endif
    if (bf16)
        add_value_pairs(w, v, at, n, R, D);
    else
        add_values(w, v, at, n, R, D);
}

/* Row r's output (D elements at out + at): what it summed, over the sum of its weights. */
INLINE void finish_row(const rows_t *w, int64_t r, void *out, int64_t at, int bf16,
                       const int64_t D) {
    const float l = hsum(w->l[r]);
    for (int64_t c = 0; c < D / LANES; c++) store(out, at + c * LANES, w->acc[r][c] / l, bf16);
}

/* ---- Decode: one query token per sequence, over its first `len` tokens.
 *
 * Each sequence is one task, and it reads each of its blocks once, in the order they lie in
 * memory (a block's KV heads are adjacent), each KV head's next block prefetched while the
 * arithmetic runs. Its G query heads per KV head are the rows. */
INLINE int attend(const void *q, const void *k, const void *v, int bf16, const int64_t *table,
                  int64_t len, int64_t kv_heads, float scale, void *out, const int64_t G,
                  const int64_t D) {
    const int64_t elem = bf16 ? 2 : 4, head_elems = D * BLOCK;
    rows_t *heads = aligned_alloc(LINE, (size_t)kv_heads * sizeof *heads); /* vf: aligned */
    if (heads == NULL) return -1;
    for (int64_t kh = 0; kh < kv_heads; kh++)
        for (int64_t g = 0; g < G; g++)
            start_row(&heads[kh], g, q, (kh * G + g) * D, scale, bf16, D);
    const int64_t blocks = (len + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n = len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK;
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            const int64_t at = (table[b] * kv_heads + kh) * head_elems;
            const char *nk = NULL, *nv = NULL;
            if (b + 1 < blocks) {
                const int64_t next = (table[b + 1] * kv_heads + kh) * head_elems * elem;
                nk = (const char *)k + next;
                nv = (const char *)v + next;
            }
            vb s[MAX_GROUP];
            score(s, &heads[kh], k, at, bf16, scale, nk, nv, G, D);
            int64_t last[MAX_GROUP];
            for (int64_t g = 0; g < G; g++) last[g] = n - 1;
            fold(&heads[kh], s, last, bf16, G);
            values(&heads[kh], v, at, n, bf16, G, D);
        }
    }
    for (int64_t kh = 0; kh < kv_heads; kh++)
        for (int64_t g = 0; g < G; g++) finish_row(&heads[kh], g, out, (kh * G + g) * D, bf16, D);
    free(heads);
    return 0;
}

typedef int (*attend_fn)(const void *, const void *, const void *, int, const int64_t *,
                         int64_t, int64_t, float, void *, int64_t, int64_t);

/* attend() for shapes of common models, G and D fixed at compile time, and for any other. */
#define SHAPES(X) \
    X(1, 64) X(2, 64) X(3, 64) X(4, 64) X(1, 128) X(2, 128) X(4, 128) X(7, 128) X(8, 128)
#define DEFINE(g, d)                                                                          \
    static int attend_##g##_##d(const void *q, const void *k, const void *v, int bf16,      \
                                const int64_t *table, int64_t len, int64_t kv_heads,         \
                                float scale, void *out, int64_t G, int64_t D) {             \
        (void)G, (void)D;                                                                     \
        return attend(q, k, v, bf16, table, len, kv_heads, scale, out, g, d);                \
    }
SHAPES(DEFINE)

static int attend_any(const void *q, const void *k, const void *v, int bf16,
                      const int64_t *table, int64_t len, int64_t kv_heads, float scale,
                      void *out, int64_t G, int64_t D) {
    return attend(q, k, v, bf16, table, len, kv_heads, scale, out, G, D);
}

static attend_fn pick(int64_t G, int64_t D) {
#define PICK(g, d) \
    if (G == g && D == d) return attend_##g##_##d;
    SHAPES(PICK)
    return attend_any;
}

/* The vector width the kernels were built for: head dims must be multiples of it. */
int paged_attention_lanes(void) { return LANES; }

/* Decode rows: sequence b's query at row rows[b] of q, attending over its first lens[b] (>= 1)
 * tokens, through block table tables[b]; its output to the same row of out. Returns 0, or -1
 * if a size is out of range or memory ran out. */
int paged_decode_attention(const void *q, const void *k, const void *v, int bf16,
                           const int64_t *tables, const int64_t *lens, const int64_t *rows,
                           void *out,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                           int64_t block_size, int64_t width, float scale) {
    const int64_t G = heads / kv_heads;
    if (block_size != BLOCK || G > MAX_GROUP || G * kv_heads != heads || dim > MAX_DIM ||
        dim % LANES != 0)
        return -1;
    const attend_fn fn = pick(G, dim);
    scale *= LOG2E; /* scores in base 2 */
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        tiles_begin(bf16, G, dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++)
            failed |= fn(advance(q, rows[b] * heads * dim, bf16), k, v, bf16,
                         tables + b * width, lens[b], kv_heads, scale,
                         advance(out, rows[b] * heads * dim, bf16), G, dim);
        tiles_end(bf16, dim);
    }
    return failed ? -1 : 0;
}

/* ---- Prefill: the new tokens of a sequence (a chunk of its prompt) attend causally over its
 * cached tokens and themselves, all read from the blocks (written before the call).
 *
 * A task is one KV head of one tile of QT consecutive queries (TILE_ROWS / G; TILE_ROWS_AMX / G
 * on AMX tiles): their G * QT query heads share every K and V vector the tile loads. Block by
 * block up to the tile's last position: scores for all rows, keys past a row's position not
 * counted, the running softmax, then the values. */

/* Rows r = i * G + g: query q0 + i of the chunk (position first + q0 + i), head kh * G + g.
 * A tile always computes QT queries (G, D and so its rows known at compile time, its scores
 * held in registers); past the chunk's `qt` the last query is repeated and not written. */
INLINE void prefill_rows(rows_t *w, const void *q, const void *k, const void *v, int bf16,
                         const int64_t *table, int64_t first, int64_t q0, int64_t qt,
                         int64_t kh, int64_t kv_heads, float scale, void *out, const int64_t G,
                         const int64_t D, const int64_t QT) {
    const int64_t rows = QT * G;
    const int64_t heads = kv_heads * G, head_elems = D * BLOCK;
    int64_t query[MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        query[r] = q0 + (r / G < qt ? r / G : qt - 1);
        start_row(w, r, q, (query[r] * heads + kh * G + r % G) * D, scale, bf16, D);
    }
    const int64_t last = first + q0 + qt - 1; /* the tile's last position */
    for (int64_t b = 0; b <= last / BLOCK; b++) {
        const int64_t at = (table[b] * kv_heads + kh) * head_elems, start = b * BLOCK;
        const int64_t n = last + 1 - start < BLOCK ? last + 1 - start : BLOCK;
        vb s[MAX_ROWS];
        score(s, w, k, at, bf16, scale, NULL, NULL, rows, D);
        int64_t lasts[MAX_ROWS];
        for (int64_t r = 0; r < rows; r++) lasts[r] = first + query[r] - start;
        fold(w, s, lasts, bf16, rows);
        values(w, v, at, n, bf16, rows, D);
    }
    for (int64_t r = 0; r < qt * G; r++)
        finish_row(w, r, out, (query[r] * heads + kh * G + r % G) * D, bf16, D);
}

/* Queries of G heads each that fit `rows` rows (at least one). */
INLINE int64_t queries_in(const int64_t rows, const int64_t G) {
    return rows / G > 0 ? rows / G : 1;
}

/* Queries a prefill tile computes: TILE_ROWS' worth, or TILE_ROWS_AMX's on tiles. A row's bits
 * do not depend on the rows beside it, so the tile's height is free to follow the path. */
INLINE int64_t tile_queries(int bf16, const int64_t G, const int64_t D) {
    return queries_in(tiles(bf16, D) ? TILE_ROWS_AMX : TILE_ROWS, G);
}

INLINE void prefill_tile(rows_t *w, const void *q, const void *k, const void *v, int bf16,
                         const int64_t *table, int64_t first, int64_t q0, int64_t qt,
                         int64_t kh, int64_t kv_heads, float scale, void *out, const int64_t G,
                         const int64_t D) {
    if (tiles(bf16, D)) /* each height a constant where G is */
        prefill_rows(w, q, k, v, bf16, table, first, q0, qt, kh, kv_heads, scale, out, G, D,
                     queries_in(TILE_ROWS_AMX, G));
    else
        prefill_rows(w, q, k, v, bf16, table, first, q0, qt, kh, kv_heads, scale, out, G, D,
                     queries_in(TILE_ROWS, G));
}

typedef void (*tile_fn)(rows_t *, const void *, const void *, const void *, int,
                        const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                        void *, int64_t, int64_t);

#define DEFINE_TILE(g, d)                                                                     \
    static void tile_##g##_##d(rows_t *w, const void *q, const void *k, const void *v,       \
                               int bf16, const int64_t *table, int64_t first, int64_t q0,    \
                               int64_t qt, int64_t kh, int64_t kv_heads, float scale,        \
                               void *out, int64_t G, int64_t D) {                           \
        (void)G, (void)D;                                                                     \
        prefill_tile(w, q, k, v, bf16, table, first, q0, qt, kh, kv_heads, scale, out, g, d); \
    }
SHAPES(DEFINE_TILE)

static void tile_any(rows_t *w, const void *q, const void *k, const void *v, int bf16,
                     const int64_t *table, int64_t first, int64_t q0, int64_t qt, int64_t kh,
                     int64_t kv_heads, float scale, void *out, int64_t G, int64_t D) {
    prefill_tile(w, q, k, v, bf16, table, first, q0, qt, kh, kv_heads, scale, out, G, D);
}

static tile_fn pick_tile(int64_t G, int64_t D) {
#define PICK_TILE(g, d) \
    if (G == g && D == d) return tile_##g##_##d;
    SHAPES(PICK_TILE)
    return tile_any;
}

/* Prefill chunks of `spans` sequences. Chunk s: queries q[rows[s] .. rows[s] + qlens[s]),
 * the last at position lens[s] - 1, its blocks tables[s]. q, out: [T, H, D]; only the
 * chunks' rows of out are written. Returns 0, or -1 if a size is out of range or memory ran
 * out. */
int paged_prefill_attention(const void *q, const void *k, const void *v, int bf16,
                            const int64_t *tables, const int64_t *rows, const int64_t *qlens,
                            const int64_t *lens, void *out, int64_t spans, int64_t heads,
                            int64_t kv_heads, int64_t dim, int64_t block_size, int64_t width,
                            float scale) {
    const int64_t G = heads / kv_heads;
    if (block_size != BLOCK || G > MAX_GROUP || G * kv_heads != heads || dim > MAX_DIM ||
        dim % LANES != 0)
        return -1;
    const int64_t qt = tile_queries(bf16, G, dim);
    int64_t count = 0;
    for (int64_t s = 0; s < spans; s++) count += kv_heads * ((qlens[s] + qt - 1) / qt);
    int64_t(*tasks)[3] = malloc((size_t)(count > 0 ? count : 1) * sizeof *tasks);
    if (tasks == NULL) return -1;
    count = 0;
    for (int64_t s = 0; s < spans; s++) /* the longest tiles (last queries) first */
        for (int64_t t = (qlens[s] + qt - 1) / qt - 1; t >= 0; t--)
            for (int64_t kh = 0; kh < kv_heads; kh++) {
                tasks[count][0] = s, tasks[count][1] = t * qt, tasks[count][2] = kh;
                count++;
            }
    const tile_fn fn = pick_tile(G, dim);
    scale *= LOG2E; /* scores in base 2 */
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        rows_t *w = aligned_alloc(LINE, sizeof *w);
        failed |= w == NULL;
        tiles_begin(bf16, qt * G, dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++) {
            if (w == NULL) continue;
            const int64_t s = tasks[i][0], q0 = tasks[i][1], kh = tasks[i][2];
            const int64_t n = qlens[s] - q0 < qt ? qlens[s] - q0 : qt;
            fn(w, advance(q, rows[s] * heads * dim, bf16), k, v, bf16, tables + s * width,
               lens[s] - qlens[s], q0, n, kh, kv_heads, scale,
               advance(out, rows[s] * heads * dim, bf16), G, dim);
        }
        tiles_end(bf16, dim);
        free(w);
    }
    free(tasks);
    return failed ? -1 : 0;
}

/* Store the K and V rows of T new tokens at their slots (block * BLOCK + offset) of one layer's
 * cache, in the layouts above; services/model/kv_cache.py's write() is the reference.
 * k: [T, KVH, D] contiguous; v: rows of [KVH, D] contiguous, `v_stride` elements apart (a view
 * of the qkv projection). */
void write_kv(const void *k, const void *v, int64_t v_stride, const int64_t *slots,
              void *k_cache, void *v_cache, int64_t rows, int64_t kv_heads, int64_t dim,
              int bf16) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t block = slots[r] / BLOCK, offset = slots[r] % BLOCK;
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t head = block * kv_heads + h, from = (r * kv_heads + h) * dim;
            const int64_t vs = r * v_stride + h * dim;
            if (bf16) { /* pairs: K (d, t) at (d / 2, t, d % 2), V (t, d) at (t / 2, d, t % 2) */
                const int64_t kp = head * dim * BLOCK + 2 * offset;
                const int64_t vp = head * BLOCK * dim + offset / 2 * 2 * dim + offset % 2;
                for (int64_t d = 0; d < dim; d++) {
                    ((uint16_t *)k_cache)[kp + d / 2 * 2 * BLOCK + d % 2] =
                        ((const uint16_t *)k)[from + d];
                    ((uint16_t *)v_cache)[vp + 2 * d] = ((const uint16_t *)v)[vs + d];
                }
            } else { /* K transposed within its block: a dimension every BLOCK elements */
                const int64_t kt = head * dim * BLOCK + offset, vt = (head * BLOCK + offset) * dim;
                for (int64_t d = 0; d < dim; d++)
                    ((float *)k_cache)[kt + d * BLOCK] = ((const float *)k)[from + d];
                memcpy((float *)v_cache + vt, (const float *)v + vs, dim * 4);
            }
        }
    }
}
