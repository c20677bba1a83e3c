/* O8's 8-bit codes (_kernels/blockquant.py) in C, for the kernels that keep 8-bit state: blocks of 256
   on the full parameter's flat index, a power-of-two scale per block, int8 linear and uint8 e4m4 codes,
   rounded up with probability the fraction from 24-bit counter draws. */
#ifndef AMPKIT_Q8_H
#define AMPKIT_Q8_H

#include "common.h"

#define Q8_BLOCK 256
#define Q8_TOP_E4M4 (1.8125f * 0x1p127f)  /* above this, a uint8 code is +inf */

static inline int64_t q8_cut(int64_t i, int64_t n, int64_t first) {  /* i moved down to a block boundary (0 and n stay) */
    if (i == 0 || i == n) return i;
    int64_t b = (first + i) / Q8_BLOCK * Q8_BLOCK - first;
    return b > 0 ? b : 0;
}

/* [0, n) cut into `threads` ranges at block boundaries of the full tensor (q8_cut), run on the OpenMP pool:
   BODY sees its range [lo, hi) (not empty), blk (its first block, counted from the call's) and count (an
   int64_t it adds its blocks with a non-finite weight to); the counts' sum goes to *bad. */
#define Q8_EACH_RANGE(n, first, bad, BODY)                                                               \
    do {                                                                                                 \
        int64_t total_ = 0;                                                                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1) reduction(+ : total_)") \
        for (int t_ = 0; t_ < threads; t_++) {                                                           \
            const int64_t lo = q8_cut((n) * t_ / threads, (n), (first));                                 \
            const int64_t hi = q8_cut((n) * (t_ + 1) / threads, (n), (first));                           \
            const int64_t blk = ((first) + lo) / Q8_BLOCK - (first) / Q8_BLOCK;                          \
            int64_t count = 0;                                                                           \
            if (hi > lo) { BODY }                                                                        \
            total_ += count;                                                                             \
        }                                                                                                \
        *(bad) = total_;                                                                                 \
    } while (0)

static inline float q8_e4m4(uint8_t c) {  /* a uint8 code's value in units of its scale */
    float v = c >= 16 ? q8_f((uint32_t)(c + (112 << 4)) << 19) : (float)c * 0x1p-18f;
    v = c == 254 ? NAN : v;
    return c == 255 ? INFINITY : v;
}
static inline float q8_pow2(int e) {  /* 2**e, e in [-149, 127] */
    return e >= -126 ? q8_f((uint32_t)(e + 127) << 23) : q8_f(1u << (e + 149));
}
/* The exponent of the least 2**e with absmax <= top 2**e: absmax = m 2**x (m in [0.5, 1), frexpf's),
   e = x - shift, plus 1 when m > half_top; in [-149, 127]. */
static inline int q8_scale_exponent(uint32_t absmax, int shift, float half_top) {
    if (absmax == 0) return -shift;
    int bias = 0;
    if (absmax < 0x00800000u) {  /* subnormal: normalized exactly */
        absmax = q8_u(q8_f(absmax) * 0x1p64f);
        bias = 64;
    }
    const int x = (int)(absmax >> 23) - 126 - bias;
    const float m = q8_f((absmax & 0x7FFFFFu) | (126u << 23));
    const int e = x - shift + (m > half_top);
    return e < -149 ? -149 : (e > 127 ? 127 : e);
}
/* x / 2**e as (x * a) * b: a power of two's reciprocal is exact, in two factors below 2**-126. */
typedef struct { float s, a, b; } q8_scale;
static inline q8_scale q8_scale_of(int e) {
    q8_scale q = {q8_pow2(e), q8_pow2(e >= -126 ? -e : 126), e >= -126 ? 1.0f : q8_pow2(-e - 126)};
    return q;
}
static inline uint32_t q8_absmax(const float *restrict x, int k) {  /* of the x that are not NaN, as bits */
    uint32_t most = 0;
    for (int j = 0; j < k; j++) {
        uint32_t u = q8_u(x[j]) & 0x7FFFFFFFu & -(uint32_t)(fabsf(x[j]) <= INFINITY);  /* NaN: 0 */
        most = u > most ? u : most;
    }
    return most;
}
/* The counter word of each element: the weight's 16-bit draw (bits 0..15), stream 1's 24 (16..39) and
   stream 2's (40..63), as lo = bits 0..31 and hi = 32..63. */
static inline void q8_words(uint32_t *restrict lo, uint32_t *restrict hi, uint64_t key, int64_t first, int k) {
    uint64_t z = key + (uint64_t)(first + 1) * GAMMA;  /* word()'s argument, stepped by additions: no multiply */
    for (int j = 0; j < k; j++, z += GAMMA) {
        const uint64_t a = mix64(z);
        lo[j] = (uint32_t)a;
        hi[j] = (uint32_t)(a >> 32);
    }
}
/* The 32 counter bits of each element of a parameter with one 8-bit state (SGD's momentum): elements 2i
   and 2i + 1 (the full parameter's flat index) share word i, its low and high halves; bits 0..15 the
   weight's draw, 16..31 the state's. One hash for two elements. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "q8_halves reads a word's halves as two uint32s: little-endian only"
#endif
static inline void q8_halves(uint32_t *restrict u, uint64_t key, int64_t first, int k) {
    const int64_t p0 = first >> 1, np = ((first + k - 1) >> 1) - p0 + 1;
    uint64_t w[Q8_BLOCK / 2 + 1];
    uint64_t z = key + (uint64_t)(p0 + 1) * GAMMA;
    for (int64_t j = 0; j < np; j++, z += GAMMA) w[j] = mix64(z);
    memcpy(u, (const uint32_t *)w + (first & 1), 4 * (size_t)k);  /* element first's half first */
}

/* The low bytes of k int32 codes (in [-128, 255]): a loop of its own vectorizes as packs. */
static inline void q8_narrow8(uint8_t *restrict q, const int32_t *restrict c, int k) {
    for (int j = 0; j < k; j++) q[j] = (uint8_t)c[j];
}
/* Int8 codes of the block's mb (non-finite: -128) at scale sc, rounded up when the 24-bit draw d (stream 1:
   bits 16..39 of the word) is below frac(y) 2**24 (y = |m| / s <= 127), each magnitude at most floor(limit / s)
   (lb: >= 0, NaN for none). In integers: Y = y 2**24 is exact and below 2**31, and floor(y) + (d < frac(y)
   2**24) is (ceil(Y) + 0xFFFFFF - d) >> 24 (d an integer: d < F iff d < ceil(F)); the sign applied as
   (mag ^ -1) + 1 (no compares). Two loops of one lane width each (float and int32 codes, then int32 -> int8):
   one loop of both would run 64 lanes a step, four float vectors of each. */
static inline void q8_int8(int8_t *restrict q, const float *restrict mb, const float *restrict lb,
                           const uint32_t *restrict lo, const uint32_t *restrict hi, q8_scale sc, int k) {
    int32_t qc[Q8_BLOCK];
    for (int j = 0; j < k; j++) {
        const float m = mb[j];
        const int fin = isfinite(m);
        const float y = fin ? (fabsf(m) * sc.a) * sc.b : 0.0f;
        const uint32_t up = 0xFFFFFFu - ((lo[j] >> 16) | ((hi[j] & 0xFF) << 16));
        int32_t mag = (int32_t)(((uint32_t)(int32_t)ceilf(y * 0x1p24f) + up) >> 24);
        const float lim = floorf((lb[j] * sc.a) * sc.b);
        const int32_t most = lim < 128.0f ? (int32_t)lim : 128;  /* NaN: none */
        mag = most < mag ? most : mag;
        const int32_t sg = -(int32_t)(q8_u(m) >> 31);
        qc[j] = fin ? (mag ^ sg) - sg : -128;
    }
    q8_narrow8((uint8_t *)q, qc, k);
}
#endif
