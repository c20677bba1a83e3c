/* O8: SGD with momentum on bf16 weights with an 8-bit buffer (_kernels/fused_sgd_8bit.py). The
   buffer is int8 codes with a power-of-two scale per block of 256 on the full parameter's flat index
   (q8.h); torch's arithmetic (sgd.h) on buf = code * scale (mode BUFFER) or from the gradient (mode
   NEW_BUFFER); the weight rounded with bits 0..15 of the element's 32 counter bits (q8_halves: one word
   for two elements), the new buffer quantized per block with its 16-bit draw (bits 16..31) as the top
   of a 24-bit one. The old weight, codes and scales go to the backups bw, bb,
   bbs; *bad counts the blocks with a non-finite new weight. */
#include "q8.h"
#include "sgd.h"

/* q8_int8's codes without a limit, in its integers, with d the buffer's 16-bit draw (bits 16..31 of u) times
   256: a 24-bit draw whose low 8 bits are 0. The old code to the backup bb in the same loop: the codes stored
   as bytes here (4 float vectors a step) beat an int32 scratch and a narrowing loop. */
static void sgd_8bit_codes(int8_t *restrict q, const float *restrict mb, const uint32_t *restrict u, q8_scale sc,
                           int k, int8_t *restrict bb) {
    for (int j = 0; j < k; j++) {
        const float m = mb[j];
        const int fin = isfinite(m);
        const float y = fin ? (fabsf(m) * sc.a) * sc.b : 0.0f;
        const uint32_t up = 0xFFFFFFu - ((u[j] >> 16) << 8);
        const int32_t mag = (int32_t)(((uint32_t)(int32_t)ceilf(y * 0x1p24f) + up) >> 24);
        const int32_t sg = -(int32_t)(q8_u(m) >> 31);  /* m's sign: 0 or -1 */
        bb[j] = q[j];
        q[j] = (int8_t)(fin ? (mag ^ sg) - sg : -128);
    }
}

/* In mode BUFFER, buf = code * scale as floats (the int8 -> float widening, a loop of its own). */
static void sgd_8bit_load(const int8_t *restrict bq, float s, int k, float *restrict mb) {
    for (int j = 0; j < k; j++) {
        const float f = (float)bq[j];  /* code -128 (NaN) tested on the float: gcc folds f == -128 to a byte test */
        mb[j] = f < -127.5f ? NAN : f * s;
    }
}

/* The SGD step on the block (16- and 32-bit lanes): the new weight (rounded with u's bits 0..15; the
   old to bw) and the new buffer in mb, its absmax (q8_absmax's, in this loop); whether a new weight is not
   finite, as the greatest exponent field (a max, not a compare and an or). */
static uint32_t sgd_8bit_step(uint16_t *restrict w, const uint16_t *restrict grad, float *restrict mb,
                              const uint32_t *restrict u, int k, const int mode, int flags, const float *restrict c,
                              uint16_t *restrict bw, uint32_t *restrict absmax) {
    const float h[4] = {c[0], c[1], c[2], c[3]};  /* a local copy, read unconditionally: the loop vectorizes */
    uint32_t amax = 0, most = 0;
    for (int j = 0; j < k; j++) {
        const uint16_t wj = w[j];
        bw[j] = wj;
        float b = mode == BUFFER ? mb[j] : 0.0f;
        const float p = sgd_step(widen(wj), widen(grad[j]), &b, mode, flags, h);
        const uint32_t ex = q8_u(p) & 0x7F800000u;
        most = ex > most ? ex : most;
        w[j] = narrow(p, u[j] & 0xFFFF);
        mb[j] = b;
        const uint32_t u = q8_u(b) & 0x7FFFFFFFu & -(uint32_t)(fabsf(b) <= INFINITY);  /* q8_absmax's: NaN 0 */
        amax = u > amax ? u : amax;
    }
    *absmax = amax;
    return most == 0x7F800000u;
}

/* One block of k elements: loops without branches, each on one lane width where it can (so that they vectorize:
   the counter bits, the codes widened, the step, the new codes); mode is a constant of each instantiation. */
INLINE void sgd_8bit_block(uint16_t *restrict w, const uint16_t *restrict grad, int8_t *restrict bq,
                           float *restrict bs, int k, int64_t first, uint64_t key, const int mode, int flags,
                           const float *restrict c, uint16_t *restrict bw, int8_t *restrict bb, int64_t *restrict bad) {
    float mb[Q8_BLOCK];
    uint32_t u[Q8_BLOCK];
    q8_halves(u, key, first, k);
    if (mode == BUFFER) sgd_8bit_load(bq, *bs, k, mb);
    uint32_t amax;
    const uint32_t nbad = sgd_8bit_step(w, grad, mb, u, k, mode, flags, c, bw, &amax);
    const q8_scale sc = q8_scale_of(q8_scale_exponent(amax, 7, 0.9921875f));
    sgd_8bit_codes(bq, mb, u, sc, k, bb);
    *bs = sc.s;
    *bad += nbad;
}

static void sgd_8bit_range(uint16_t *w, const uint16_t *grad, int8_t *bq, float *bs, int64_t n, int64_t first,
                           uint64_t key, int mode, int flags, const float *c, uint16_t *bw, int8_t *bb, float *bbs,
                           int64_t *bad) {
    for (int64_t a = 0; a < n;) {
        const int64_t blk = (first + a) / Q8_BLOCK - first / Q8_BLOCK;
        int64_t b = ((first + a) / Q8_BLOCK + 1) * Q8_BLOCK - first;
        b = b > n ? n : b;
        bbs[blk] = bs[blk];
        if (mode == NEW_BUFFER)
            sgd_8bit_block(w + a, grad + a, bq + a, bs + blk, (int)(b - a), first + a, key, NEW_BUFFER, flags, c,
                           bw + a, bb + a, bad);
        else
            sgd_8bit_block(w + a, grad + a, bq + a, bs + blk, (int)(b - a), first + a, key, BUFFER, flags, c, bw + a,
                           bb + a, bad);
        a = b;
    }
}

/* Ranges cut at block boundaries (q8_cut), each with its own backups; mode NEW_BUFFER or BUFFER. */
static void sgd_8bit(uint16_t *w, const uint16_t *grad, int8_t *bq, float *bs, int64_t n, int64_t first, uint64_t key,
                     int mode, int flags, const float *c, uint16_t *bw, int8_t *bb, float *bbs, int64_t *bad,
                     int threads) {
    Q8_EACH_RANGE(n, first, bad, sgd_8bit_range(w + lo, grad + lo, bq + lo, bs + blk, hi - lo, first + lo, key, mode,
                                                 flags, c, bw + lo, bb + lo, bbs + blk, &count););
}

/* sgd_8bit of count tensors of one param group (flags, c) in turn, stopping at the first with a non-finite
   new weight (as adamw_8bit_many): how many had none. rows: each tensor's 12 words (the addresses of w,
   grad, bq, bs, bw, bb, bbs; n, first, key, mode, threads). */
int64_t sgd_8bit_many(int64_t count, const uint64_t *rows, int flags, const float *c) {
    for (int64_t i = 0; i < count; i++) {
        const uint64_t *r = rows + 12 * i;
        int64_t bad = 0;
        sgd_8bit(AT(uint16_t, r[0]), AT(const uint16_t, r[1]), AT(int8_t, r[2]), AT(float, r[3]), (int64_t)r[7],
                 (int64_t)r[8], r[9], (int)r[10], flags, c, AT(uint16_t, r[4]), AT(int8_t, r[5]), AT(float, r[6]), &bad,
                 (int)r[11]);
        if (bad) return i;
    }
    return count;
}
