/* Stochastic rounding of float32 to bfloat16 with counter bits (_kernels/rounding.py). */
#include "common.h"

static void round_bf16_range(const float *src, uint16_t *dst, int64_t n, int64_t first, uint64_t key, int shift) {
    for (int64_t i = 0; i < n; i++)
        dst[i] = narrow(src[i], (word(key, first + i) >> shift) & 0xFFFF);
}

void round_bf16(const float *src, uint16_t *dst, int64_t n, int64_t first, uint64_t key, int shift, int threads) {
    EACH_RANGE(n, lo, hi, round_bf16_range(src + lo, dst + lo, hi - lo, first + lo, key, shift);)
}
