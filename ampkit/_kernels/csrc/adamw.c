/* O7: AdamW / Adam on bf16 weights, float32 or bf16 state (_kernels/fused_adamw.py). */
#include "common.h"

/* c: decay, l2, beta1, 1 - beta1, beta2, 1 - beta2, sqrt(bias correction 2), eps, step size, sign */
#define ADAMW_BODY(LOAD_M, LOAD_V, STORE_M, STORE_V)                               \
    for (int64_t i = 0; i < n; i++) {                                               \
        float g = widen(grad[i]) * c[9];                                            \
        float p = widen(w[i]);                                                      \
        g = c[1] != 0.0f ? g + p * c[1] : g;  /* as the reference: no inf * 0 */    \
        p = p * c[0];                                                               \
        float m = LOAD_M * c[2] + g * c[3];                                         \
        float v = LOAD_V * c[4] + (g * g) * c[5];                                   \
        float denom = sqrtf(v) / c[6] + c[7];                                       \
        p = p - (m / denom) * c[8];                                                 \
        uint64_t a = word(key0, first + i);  /* quarters: w, m, v (counter_bits) */  \
        w[i] = narrow(p, a & 0xFFFF);                                               \
        STORE_M; STORE_V;                                                           \
    }

static void adamw_fp32_range(uint16_t *w, const uint16_t *grad, float *ms, float *vs, int64_t n, int64_t first,
                             uint64_t key0, const float *c) {
    ADAMW_BODY(ms[i], vs[i], ms[i] = m, vs[i] = v)
}

static void adamw_bf16_range(uint16_t *w, const uint16_t *grad, uint16_t *ms, uint16_t *vs, int64_t n, int64_t first,
                             uint64_t key0, const float *c) {
    ADAMW_BODY(widen(ms[i]), widen(vs[i]), ms[i] = narrow(m, (a >> 16) & 0xFFFF), vs[i] = narrow(v, (a >> 32) & 0xFFFF))
}

static void adamw_fp32_state(uint16_t *w, const uint16_t *grad, float *ms, float *vs, int64_t n, int64_t first,
                             uint64_t key0, const float *c, int threads) {
    EACH_RANGE(n, lo, hi, adamw_fp32_range(w + lo, grad + lo, ms + lo, vs + lo, hi - lo, first + lo, key0, c);)
}

static void adamw_bf16_state(uint16_t *w, const uint16_t *grad, uint16_t *ms, uint16_t *vs, int64_t n, int64_t first,
                             uint64_t key0, const float *c, int threads) {
    EACH_RANGE(n, lo, hi, adamw_bf16_range(w + lo, grad + lo, ms + lo, vs + lo, hi - lo, first + lo, key0, c);)
}

/* O7's step of count tensors (a param group's; one call, not one a tensor). rows: each tensor's 9 words (the
   addresses of w, grad, m, v; n, first, key0, whether m and v are bf16, threads); consts: its 10 step constants. */
void adamw_bf16_many(int64_t count, const uint64_t *rows, const float *consts) {
    for (int64_t i = 0; i < count; i++) {
        const uint64_t *r = rows + 9 * i;
        if (r[7])
            adamw_bf16_state(AT(uint16_t, r[0]), AT(const uint16_t, r[1]), AT(uint16_t, r[2]), AT(uint16_t, r[3]),
                             (int64_t)r[4], (int64_t)r[5], r[6], consts + 10 * i, (int)r[8]);
        else
            adamw_fp32_state(AT(uint16_t, r[0]), AT(const uint16_t, r[1]), AT(float, r[2]), AT(float, r[3]),
                             (int64_t)r[4], (int64_t)r[5], r[6], consts + 10 * i, (int)r[8]);
    }
}
