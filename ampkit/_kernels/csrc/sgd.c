/* SGD with momentum in one pass: O5's float32 masters and O7's bf16 weights (_kernels/fused_sgd.py). */
#include "sgd.h"

/* The mode as a constant of each loop (CALL(mode) is always_inline'd three times). */
#define BY_MODE(mode, CALL) \
    switch (mode) { case NO_BUFFER: CALL(NO_BUFFER); break; case NEW_BUFFER: CALL(NEW_BUFFER); break; default: CALL(BUFFER); }

/* O5: master x, its float32 grad, buffer bufs (NULL in mode NO_BUFFER); w (NULL for none): x rounded to nearest even */
INLINE void master_range(float *restrict x, const float *restrict grad, float *restrict bufs, uint16_t *restrict w,
                         int64_t n, const int mode, int flags, const float *restrict c) {
    const float k[4] = {c[0], c[1], c[2], c[3]};  /* a local copy: read unconditionally, the loops stay vectorized */
    for (int64_t i = 0; i < n; i++) {
        float b = mode == BUFFER ? bufs[i] : 0.0f;
        const float p = sgd_step(x[i], grad[i], &b, mode, flags, k);
        x[i] = p;
        if (mode != NO_BUFFER) bufs[i] = b;
        if (w) w[i] = rne_bf16(bits32(p));
    }
}

static void sgd_master_range(float *x, const float *grad, float *bufs, uint16_t *w, int64_t n, int mode, int flags,
                             const float *c) {
#define MASTER(M) if (w) master_range(x, grad, bufs, w, n, M, flags, c); else master_range(x, grad, bufs, NULL, n, M, flags, c)
    BY_MODE(mode, MASTER)
#undef MASTER
}

static void sgd_master(float *x, const float *grad, float *bufs, uint16_t *w, int64_t n, int mode, int flags,
                       const float *c, int threads) {
    EACH_RANGE(n, lo, hi, sgd_master_range(x + lo, grad + lo, bufs ? bufs + lo : NULL, w ? w + lo : NULL, hi - lo, mode,
                                           flags, c);)
}

/* O7: bf16 w and grad, the buffer float32 or bf16; w and a bf16 buffer rounded with quarters 0 and 1 of one word
   per element (counter_bits: streams 0 and 1 of the tensor's key0). */
#define BF16_LOOP(BUF_T, LOAD, STORE)                                                                        \
    INLINE void loop_##BUF_T(uint16_t *restrict w, const uint16_t *restrict grad, BUF_T *restrict bufs,      \
                             int64_t n, int64_t first, uint64_t key0, const int mode, int flags,             \
                             const float *restrict c) {                                                      \
        const float k[4] = {c[0], c[1], c[2], c[3]};                                                         \
        for (int64_t i = 0; i < n; i++) {                                                                    \
            const uint64_t a = word(key0, first + i);                                                        \
            float b = mode == BUFFER ? LOAD : 0.0f;                                                          \
            const float p = sgd_step(widen(w[i]), widen(grad[i]), &b, mode, flags, k);                       \
            w[i] = narrow(p, a & 0xFFFF);                                                                    \
            if (mode != NO_BUFFER) STORE;                                                                    \
        }                                                                                                    \
    }
BF16_LOOP(float, bufs[i], bufs[i] = b)
BF16_LOOP(uint16_t, widen(bufs[i]), bufs[i] = narrow(b, (a >> 16) & 0xFFFF))

static void fp32_state_range(uint16_t *w, const uint16_t *grad, float *bufs, int64_t n, int64_t first, uint64_t key0,
                             int mode, int flags, const float *c) {
#define FP32(M) loop_float(w, grad, bufs, n, first, key0, M, flags, c)
    BY_MODE(mode, FP32)
#undef FP32
}

static void bf16_state_range(uint16_t *w, const uint16_t *grad, uint16_t *bufs, int64_t n, int64_t first, uint64_t key0,
                             int mode, int flags, const float *c) {
#define BF16(M) loop_uint16_t(w, grad, bufs, n, first, key0, M, flags, c)
    BY_MODE(mode, BF16)
#undef BF16
}

static void sgd_fp32_state(uint16_t *w, const uint16_t *grad, float *bufs, int64_t n, int64_t first, uint64_t key0,
                           int mode, int flags, const float *c, int threads) {
    EACH_RANGE(n, lo, hi, fp32_state_range(w + lo, grad + lo, bufs ? bufs + lo : NULL, hi - lo, first + lo, key0, mode,
                                           flags, c);)
}

static void sgd_bf16_state(uint16_t *w, const uint16_t *grad, uint16_t *bufs, int64_t n, int64_t first, uint64_t key0,
                           int mode, int flags, const float *c, int threads) {
    EACH_RANGE(n, lo, hi, bf16_state_range(w + lo, grad + lo, bufs ? bufs + lo : NULL, hi - lo, first + lo, key0, mode,
                                           flags, c);)
}

/* sgd_master of count tensors of one param group (flags, c; one call, not one a tensor). rows: each tensor's 7
   words (the addresses of x, grad, buf (0: none), w (0: none); n, mode, threads). */
void sgd_master_many(int64_t count, const uint64_t *rows, int flags, const float *c) {
    for (int64_t i = 0; i < count; i++) {
        const uint64_t *r = rows + 7 * i;
        sgd_master(AT(float, r[0]), AT(const float, r[1]), AT(float, r[2]), AT(uint16_t, r[3]), (int64_t)r[4], (int)r[5],
                   flags, c, (int)r[6]);
    }
}

/* O7's SGD step of count tensors of one param group (flags, c). rows: each tensor's 9 words (the addresses of w,
   grad, buf (0: none); n, first, key0, mode, whether the buffer is bf16, threads). */
void sgd_bf16_many(int64_t count, const uint64_t *rows, int flags, const float *c) {
    for (int64_t i = 0; i < count; i++) {
        const uint64_t *r = rows + 9 * i;
        if (r[7])
            sgd_bf16_state(AT(uint16_t, r[0]), AT(const uint16_t, r[1]), AT(uint16_t, r[2]), (int64_t)r[3],
                           (int64_t)r[4], r[5], (int)r[6], flags, c, (int)r[8]);
        else
            sgd_fp32_state(AT(uint16_t, r[0]), AT(const uint16_t, r[1]), AT(float, r[2]), (int64_t)r[3], (int64_t)r[4],
                           r[5], (int)r[6], flags, c, (int)r[8]);
    }
}
