/* The gradient check and the unscaling widen of half gradients (_kernels/unscale.py). */
#include "common.h"

/* Whether any of n elements of 2 or 4 bytes has its exponent bits exp all set (inf or NaN). */
static uint32_t nonfinite16(const uint16_t *restrict x, int64_t n, uint16_t exp) {
    uint32_t any = 0;
    for (int64_t i = 0; i < n; i++) any |= (x[i] & exp) == exp;
    return any;
}
static uint32_t nonfinite32(const uint32_t *restrict x, int64_t n, uint32_t exp) {
    uint32_t any = 0;
    for (int64_t i = 0; i < n; i++) any |= (x[i] & exp) == exp;
    return any;
}

int any_nonfinite(const void *x, int64_t n, int bytes, uint32_t exp, int threads) {
    uint32_t any = 0;
    ANY_RANGE(n, lo, hi, bytes == 2 ? nonfinite16((const uint16_t *)x + lo, hi - lo, (uint16_t)exp)
                                    : nonfinite32((const uint32_t *)x + lo, hi - lo, exp))
    return any != 0;
}

static inline float half_to_float(uint16_t h) {  /* IEEE float16 to float32, exact (F16C's, without it) */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    const uint32_t normal = sign | ((e + 112u) << 23) | (m << 13), special = sign | 0x7F800000u | (m << 13);
    const uint32_t subnormal = sign | q8_u((float)m * 0x1p-24f);
    return q8_f(e == 0 ? subnormal : (e == 31 ? special : normal));
}

/* dst = half src (bfloat16, or float16 when fp16) widened to float32 and multiplied by inv (kept
   as it is when inv is 1), in one pass; whether any src is inf or NaN: torch's copy, then its
   unscale-and-check, which checks the values before it scales them. */
#define WIDEN_LOOP(TO_FLOAT, MASK)                                                   \
    for (int64_t i = 0; i < n; i++) {                                               \
        const float v = TO_FLOAT(src[i]);                                           \
        dst[i] = inv == 1.0f ? v : v * inv;                                         \
        any |= (src[i] & MASK) == MASK;                                             \
    }
static uint32_t widen_range(const uint16_t *restrict src, float *restrict dst, int64_t n, int fp16, float inv) {
    uint32_t any = 0;
    if (fp16)
        WIDEN_LOOP(half_to_float, 0x7C00)
    else
        WIDEN_LOOP(widen, 0x7F80)
    return any;
}

int widen_scaled(const uint16_t *src, float *dst, int64_t n, int fp16, float inv, int threads) {
    uint32_t any = 0;
    ANY_RANGE(n, lo, hi, widen_range(src + lo, dst + lo, hi - lo, fp16, inv))
    return any != 0;
}
