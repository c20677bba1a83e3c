/* Remainder masters' bits (_kernels/remainder.py, docs/design/memory-levels.md): the combine and the split of
   a block and the loop over the blocks, shared by the kernels that step them (adamw_master.c, sgd_remainder.c). */
#ifndef AMPKIT_REMAINDER_H
#define AMPKIT_REMAINDER_H

#include "common.h"

#define RBLOCK 512  /* elements per block; _kernels/fused_masters.py leaves room for a block's candidates */
typedef union { float f[RBLOCK]; uint32_t u[RBLOCK]; } rblock;

/* The index of the first entry of ascending t[0, n) that is >= key. */
static inline int64_t first_at_least(const int64_t *t, int64_t n, int64_t key) {
    int64_t lo = 0, hi = n;
    while (lo < hi) { int64_t mid = lo + (hi - lo) / 2; if (t[mid] < key) lo = mid + 1; else hi = mid; }
    return lo;
}

/* The master's float32 bits from (w, r) without the side table: code 32767 of an even w is d = +32768. */
static inline uint32_t combined(uint16_t w, int16_t r) {
    const uint32_t b = ((uint32_t)w << 16) + (uint32_t)(int32_t)r;
    return b + ((b & 0x1FFFFu) == 0x7FFFu);
}

/* Whether the side table lists an element of the block [at, at + len) (*t: the first entry not below it, moved
   past the block); if so, the block's masters are combined into x with the table: code 32766 of an even w,
   listed, is d = +32767. Otherwise nothing is written (the caller combines on the fly). */
static inline int combine_listed(const uint16_t *restrict w, const int16_t *restrict r, int64_t len, int64_t at,
                                 const int64_t *restrict table, int64_t ntable, int64_t *t, uint32_t *restrict x) {
    if (*t >= ntable || table[*t] >= at + len)
        return 0;
    for (int64_t j = 0; j < len; j++) x[j] = combined(w[j], r[j]);
    for (; *t < ntable && table[*t] < at + len; ++*t) {
        const int64_t j = table[*t] - at;
        x[j] += (x[j] & 0x1FFFFu) == 0x7FFEu;
    }
    return 1;
}

/* Split the block's new masters x into w (to nearest even) and r; the indices (from `at`) of those 16 bits cannot
   hold (32767 above an even w, not NaN) go to found. Returns how many. */
static inline int64_t split_block(uint16_t *restrict w, int16_t *restrict r, const uint32_t *restrict x, int64_t len,
                                  int64_t at, int64_t *restrict found) {
    uint32_t any = 0;
    for (int64_t j = 0; j < len; j++) {
        const uint32_t b = x[j], moved = ((b + 1u) & 0x1FFFEu) == 0x8000u;  /* d = +32767 or +32768 above even */
        w[j] = rne_bf16(b);
        r[j] = (int16_t)(uint16_t)(b - moved);
        any |= moved;
    }
    int64_t k = 0;
    if (any)
        for (int64_t j = 0; j < len; j++)
            if ((x[j] & 0x1FFFFu) == 0x7FFFu && (x[j] & 0x7FFFFFFFu) < 0x7F800000u) found[k++] = at + j;
    return k;
}

/* The body of a remainder range function with parameters w, r, n, first, table, ntable, found, cap, nfound (elements
   [first, first + n) of one tensor): each block's masters are combined from (w, r, the ascending side table),
   stepped by STEP(I, B, X) (element I's master, bits B, stepped into the float X; in one loop with the combine where
   the table lists none of the block) and split back; the new table's entries go to found (at most cap; it stops
   before a block that might not fit there), their count to *nfound. Returns the elements done, n unless found
   filled up. */
#define REMAINDER_BLOCKS(STEP)                                                                                   \
    {                                                                                                           \
        int64_t t = first_at_least(table, ntable, first), k = 0, lo = 0;                                        \
        rblock x;                                                                                               \
        for (; lo < n && cap - k >= RBLOCK; lo += RBLOCK) {                                                     \
            const int64_t len = n - lo < RBLOCK ? n - lo : RBLOCK;                                              \
            if (combine_listed(w + lo, r + lo, len, first + lo, table, ntable, &t, x.u))                        \
                for (int64_t j = 0; j < len; j++) STEP(lo + j, x.u[j], x.f[j])                                  \
            else                                                                                                \
                for (int64_t j = 0; j < len; j++) STEP(lo + j, combined(w[lo + j], r[lo + j]), x.f[j])          \
            k += split_block(w + lo, r + lo, x.u, len, first + lo, found + k);                                  \
        }                                                                                                       \
        *nfound = k;                                                                                            \
        return lo < n ? lo : n;                                                                                 \
    }

#endif
