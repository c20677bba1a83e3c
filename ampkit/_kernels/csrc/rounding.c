/* Stochastic rounding of float32 to bfloat16 with counter bits (_kernels/rounding.py). */
#include "common.h"
#include "q8.h"

static void round_bf16_range(const float *src, uint16_t *dst, int64_t n, int64_t first, uint64_t key, int shift) {
    for (int64_t i = 0; i < n; i++)
        dst[i] = narrow(src[i], (word(key, first + i) >> shift) & 0xFFFF);
}

void round_bf16(const float *src, uint16_t *dst, int64_t n, int64_t first, uint64_t key, int shift, int threads) {
    EACH_RANGE(n, lo, hi, round_bf16_range(src + lo, dst + lo, hi - lo, first + lo, key, shift);)
}

/* With q8_halves' bits (bits 0..15 of each element's 32: one word for two elements), as O8's SGD weights. */
static void round_bf16_paired_range(const float *src, uint16_t *dst, int64_t n, int64_t first, uint64_t key) {
    uint32_t u[Q8_BLOCK];
    for (int64_t a = 0; a < n; a += Q8_BLOCK) {
        const int k = n - a < Q8_BLOCK ? (int)(n - a) : Q8_BLOCK;
        q8_halves(u, key, first + a, k);
        for (int j = 0; j < k; j++) dst[a + j] = narrow(src[a + j], u[j] & 0xFFFF);
    }
}

void round_bf16_paired(const float *src, uint16_t *dst, int64_t n, int64_t first, uint64_t key, int threads) {
    EACH_RANGE(n, lo, hi, round_bf16_paired_range(src + lo, dst + lo, hi - lo, first + lo, key);)
}
