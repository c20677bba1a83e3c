/* SGD with momentum on remainder masters in one pass (_kernels/fused_sgd_remainder.py): each block's masters are
   combined from (w, r, the side table), stepped with torch.optim.SGD's arithmetic (sgd.h) and split back (remainder.h). */
#include "remainder.h"
#include "sgd.h"

/* Elements [first, first + n) of one tensor (remainder.h's REMAINDER_BLOCKS), the buffer mode a constant of each
   loop (always_inline'd three times); bufs NULL in mode NO_BUFFER. The new table's entries go to found (at most
   cap). Returns the elements done, n unless found filled up. */
INLINE int64_t range_in_mode(uint16_t *restrict w, int16_t *restrict r, const uint16_t *restrict grad,
                             float *restrict bufs, int64_t n, int64_t first, const int64_t *restrict table, int64_t ntable,
                             int64_t *restrict found, int64_t cap, int64_t *restrict nfound, const int mode, int flags,
                             const float *restrict c) {
#define STEP(I, B, X) {                                                                          \
        float p, b = mode == BUFFER ? bufs[I] : 0.0f;                                            \
        const uint32_t u_ = (B); memcpy(&p, &u_, 4);                                             \
        X = sgd_step(p, widen(grad[I]), &b, mode, flags, c);                                     \
        if (mode != NO_BUFFER) bufs[I] = b; }
    REMAINDER_BLOCKS(STEP)
#undef STEP
}

static int64_t sgd_remainder_range(uint16_t *w, int16_t *r, const uint16_t *grad, float *bufs, int64_t n, int64_t first,
                                   const int64_t *table, int64_t ntable, int64_t *found, int64_t cap, int64_t *nfound,
                                   int mode, int flags, const float *c) {
#define ARGS w, r, grad, bufs, n, first, table, ntable, found, cap, nfound
    switch (mode) {
        case NO_BUFFER: return range_in_mode(ARGS, NO_BUFFER, flags, c);
        case NEW_BUFFER: return range_in_mode(ARGS, NEW_BUFFER, flags, c);
        default: return range_in_mode(ARGS, BUFFER, flags, c);
    }
#undef ARGS
}

/* sgd_remainder_range over elements [first, first + n) of one tensor in `threads` ranges: range t's entries go to
   found + t * cap (nfound[t] of them), done[t] its elements done (less than its length if found filled up: the
   caller goes on from there, in the same mode). */
void sgd_remainder(uint16_t *w, int16_t *r, const uint16_t *grad, float *bufs, int64_t n, int64_t first,
                   const int64_t *table, int64_t ntable, int64_t *found, int64_t cap, int64_t *nfound, int64_t *done,
                   int mode, int flags, const float *c, int threads) {
    EACH_RANGE(n, lo, hi, done[t_] = sgd_remainder_range(w + lo, r + lo, grad + lo, bufs ? bufs + lo : NULL, hi - lo,
                                                         first + lo, table, ntable, found + t_ * cap, cap, nfound + t_,
                                                         mode, flags, c);)
}

/* sgd_remainder of count whole tensors of one param group (flags, c) in turn, as adamw_remainder_many. rows: each
   tensor's 12 words (the addresses of w, r, grad, bufs (0: none) and its side table; ntable, n, threads, cap, its
   ranges' first entry in found and first index in nfound and done, its mode). */
void sgd_remainder_many(int64_t count, const uint64_t *rows, int flags, const float *c, int64_t *found, int64_t *nfound,
                        int64_t *done) {
    for (int64_t i = 0; i < count; i++) {
        const uint64_t *q = rows + 12 * i;
        sgd_remainder(AT(uint16_t, q[0]), AT(int16_t, q[1]), AT(const uint16_t, q[2]), AT(float, q[3]), (int64_t)q[6], 0,
                      AT(const int64_t, q[4]), (int64_t)q[5], found + q[9], (int64_t)q[8], nfound + q[10], done + q[10],
                      (int)q[11], flags, c, (int)q[7]);
    }
}
