/* O5's float32 masters and remainder masters (_kernels/fused_masters.py). */
#include "remainder.h"

/* The arithmetic of _kernels/fused_adamw.py on a float32 master P with a float32 gradient G;
   c as there; l2 != 0 adds Adam's L2 term (a select, so the loop stays vectorized). The
   pointers are restrict (the tensors never overlap): without it gcc leaves the loops scalar. */
#define MASTER_STEP(P, G, M, V)                                                      \
    G = G * c[9];                                                                     \
    G = l2 ? G + P * c[1] : G;                                                        \
    P = P * c[0];                                                                     \
    M = M * c[2] + G * c[3];                                                          \
    V = V * c[4] + (G * G) * c[5];                                                    \
    P = P - (M / (sqrtf(V) / c[6] + c[7])) * c[8];

/* O5: master x, its float32 grad, state m, v; w (may be NULL): the bf16 model weight, x rounded to nearest even */
static void adamw_master_range(float *restrict x, const float *restrict grad, float *restrict ms, float *restrict vs,
                               uint16_t *restrict w, int64_t n, const float *restrict c) {
    const int l2 = c[1] != 0.0f;
    if (w) {
        for (int64_t i = 0; i < n; i++) {
            float p = x[i], g = grad[i], m = ms[i], v = vs[i];
            MASTER_STEP(p, g, m, v)
            x[i] = p; ms[i] = m; vs[i] = v; w[i] = rne_bf16(bits32(p));
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float p = x[i], g = grad[i], m = ms[i], v = vs[i];
            MASTER_STEP(p, g, m, v)
            x[i] = p; ms[i] = m; vs[i] = v;
        }
    }
}

static void adamw_master(float *x, const float *grad, float *ms, float *vs, uint16_t *w, int64_t n, const float *c,
                         int threads) {
    EACH_RANGE(n, lo, hi, adamw_master_range(x + lo, grad + lo, ms + lo, vs + lo, w ? w + lo : NULL, hi - lo, c);)
}

/* adamw_master of count tensors (a param group's O5 masters; one call, not one a tensor). rows: each tensor's 7
   words (the addresses of x, grad, m, v, w (0: none); n, threads); consts: its 10 step constants. */
void adamw_master_many(int64_t count, const uint64_t *rows, const float *consts) {
    for (int64_t i = 0; i < count; i++) {
        const uint64_t *r = rows + 7 * i;
        adamw_master(AT(float, r[0]), AT(const float, r[1]), AT(float, r[2]), AT(float, r[3]), AT(uint16_t, r[4]),
                     (int64_t)r[5], consts + 10 * i, (int)r[6]);
    }
}

/* One remainder master's step: its float32 bits B stepped into X (m, v of element I written). */
#define REMAINDER_STEP(I, B, X) {                                                                 \
        float p, g = widen(grad[I]), m = ms[I], v = vs[I];                                        \
        const uint32_t b_ = (B); memcpy(&p, &b_, 4);                                              \
        MASTER_STEP(p, g, m, v)                                                                   \
        ms[I] = m; vs[I] = v; X = p; }

/* Remainder masters (remainder.h's REMAINDER_BLOCKS): elements [first, first + n) of one tensor stepped; the new
   table's entries of this range go to found (at most cap). Returns the elements done, n unless found filled up. */
static int64_t adamw_remainder_range(uint16_t *restrict w, int16_t *restrict r, const uint16_t *restrict grad, float *restrict ms,
                        float *restrict vs, int64_t n, int64_t first, const int64_t *restrict table, int64_t ntable,
                        int64_t *restrict found, int64_t cap, int64_t *restrict nfound, const float *restrict c) {
    const int l2 = c[1] != 0.0f;
    REMAINDER_BLOCKS(REMAINDER_STEP)
}

/* adamw_remainder_range over elements [first, first + n) of one tensor in `threads` ranges: range t's entries go to
   found + t * cap (nfound[t] of them), done[t] its elements done (less than its length if found
   filled up: the caller goes on from there). */
void adamw_remainder(uint16_t *w, int16_t *r, const uint16_t *grad, float *ms, float *vs, int64_t n, int64_t first,
                     const int64_t *table, int64_t ntable, int64_t *found, int64_t cap, int64_t *nfound, int64_t *done,
                     const float *c, int threads) {
    EACH_RANGE(n, lo, hi, done[t_] = adamw_remainder_range(w + lo, r + lo, grad + lo, ms + lo, vs + lo, hi - lo, first + lo,
                                                        table, ntable, found + t_ * cap, cap, nfound + t_, c);)
}

/* adamw_remainder of count whole tensors of one param group in turn (one call: the ctypes cost once, not per
   tensor). rows: each tensor's 12 words (the addresses of w, r, grad, ms, vs and its side table; ntable, n,
   threads, cap, its ranges' first entry in found and first index in nfound and done); consts: its 10 step
   constants. Each range's entries, counts and elements done as adamw_remainder's. */
void adamw_remainder_many(int64_t count, const uint64_t *rows, const float *consts, int64_t *found, int64_t *nfound,
                          int64_t *done) {
    for (int64_t i = 0; i < count; i++) {
        const uint64_t *q = rows + 12 * i;
        adamw_remainder(AT(uint16_t, q[0]), AT(int16_t, q[1]), AT(const uint16_t, q[2]), AT(float, q[3]), AT(float, q[4]),
                        (int64_t)q[7], 0, AT(const int64_t, q[5]), (int64_t)q[6], found + q[10], (int64_t)q[9],
                        nfound + q[11], done + q[11], consts + 10 * i, (int)q[8]);
    }
}
