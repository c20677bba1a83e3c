/* O8: SGD with momentum on bf16 weights with an 8-bit buffer (_kernels/fused_sgd_8bit.py). The
   buffer is int8 codes with a power-of-two scale per block of 256 on the full parameter's flat index
   (q8.h); torch's arithmetic (sgd.h) on buf = code * scale (mode BUFFER) or from the gradient (mode
   NEW_BUFFER); the weight rounded with the counter word's bits 0..15, the new buffer quantized per
   block with its 24-bit draws of stream 1. The old weight, codes and scales go to the backups bw, bb,
   bbs; *bad counts the blocks with a non-finite new weight. */
#include "q8.h"
#include "sgd.h"

INLINE void sgd_8bit_block(uint16_t *restrict w, const uint16_t *restrict grad, int8_t *restrict bq,
                           float *restrict bs, int k, int64_t first, uint64_t key, const int mode, int flags,
                           const float *restrict c, uint16_t *restrict bw, int8_t *restrict bb, int64_t *restrict bad) {
    float mb[Q8_BLOCK];
    uint32_t lo[Q8_BLOCK], hi[Q8_BLOCK];
    const float s = *bs, h[4] = {c[0], c[1], c[2], c[3]};  /* a local copy, read unconditionally: the loop vectorizes */
    uint32_t nbad = 0;
    q8_words(lo, hi, key, first, k);
    for (int j = 0; j < k; j++) {
        int8_t q = bq[j]; uint16_t wj = w[j];
        bw[j] = wj; bb[j] = q;
        float b = mode == BUFFER ? (q == -128 ? NAN : (float)q * s) : 0.0f;
        const float p = sgd_step(widen(wj), widen(grad[j]), &b, mode, flags, h);
        nbad |= !isfinite(p);
        w[j] = narrow(p, lo[j] & 0xFFFF);
        mb[j] = b;
    }
    const q8_scale sc = q8_scale_of(q8_scale_exponent(q8_absmax(mb, k, INFINITY), 7, 0.9921875f));
    q8_int8(bq, mb, NULL, lo, hi, sc, k);
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
void sgd_8bit(uint16_t *w, const uint16_t *grad, int8_t *bq, float *bs, int64_t n, int64_t first, uint64_t key,
              int mode, int flags, const float *c, uint16_t *bw, int8_t *bb, float *bbs, int64_t *bad, int threads) {
    int64_t total = 0;
    #pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1) reduction(+ : total)
    for (int t = 0; t < threads; t++) {
        const int64_t lo = q8_cut(n * t / threads, n, first), hi = q8_cut(n * (t + 1) / threads, n, first);
        const int64_t blk = (first + lo) / Q8_BLOCK - first / Q8_BLOCK;
        int64_t count = 0;
        if (hi > lo)
            sgd_8bit_range(w + lo, grad + lo, bq + lo, bs + blk, hi - lo, first + lo, key, mode, flags, c, bw + lo,
                           bb + lo, bbs + blk, &count);
        total += count;
    }
    *bad = total;
}
