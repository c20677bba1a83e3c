/* O8: AdamW / Adam on bf16 weights with 8-bit state (_kernels/fused_adamw_8bit.py).
   Blocks of 256 on the full parameter's flat index: local element i (global first + i) is in
   local block (first + i) / 256 - first / 256. The arithmetic of ADAMW_BODY (adamw.c) on m = int8 code *
   scale and v = (e4m4 code * scale)**2; the new sqrt(v), then m (capped against the stored
   sqrt(v) times cap; cap NaN: none) quantized per block with the draws of streams 2 and 1, which
   share one counter word per element with the weight's (q8.h). The old weight, codes and scales go
   to the backups bw, bm, bv, bms, bvs (so a step that made a weight non-finite can be undone); *bad
   counts the blocks with a non-finite new weight. */
#include "q8.h"

/* One block of k elements (loops without branches, so that they vectorize). */
static void adamw_8bit_block(uint16_t *restrict w, const uint16_t *restrict grad, int8_t *restrict mq,
                             float *restrict ms, uint8_t *restrict vq, float *restrict vs, int k, int64_t first,
                             uint64_t key, const float *restrict c, float cap, uint16_t *restrict bw,
                             int8_t *restrict bm, uint8_t *restrict bv, int64_t *restrict bad) {
    float mb[Q8_BLOCK], rb[Q8_BLOCK], lb[Q8_BLOCK];
    uint32_t lo[Q8_BLOCK], hi[Q8_BLOCK];
    const float sm = *ms, sv0 = *vs, c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3], c4 = c[4], c5 = c[5], c6 = c[6],
                c7 = c[7], c8 = c[8], c9 = c[9];
    const int l2 = c1 != 0.0f;
    uint32_t nbad = 0;  /* a flag, not a count: 32-bit lanes in the vector loop */
    q8_words(lo, hi, key, first, k);  /* first: fewer live registers in the step below */
    for (int j = 0; j < k; j++) {
        int8_t qm = mq[j]; uint8_t qv = vq[j]; uint16_t wj = w[j];
        bw[j] = wj; bm[j] = qm; bv[j] = qv;
        float r0 = q8_e4m4(qv) * sv0;
        float g = widen(grad[j]) * c9;
        float p = widen(wj);
        g = l2 ? g + p * c1 : g;
        p = p * c0;
        float m = (qm == -128 ? NAN : (float)qm * sm) * c2 + g * c3;
        float v = (r0 * r0) * c4 + (g * g) * c5;
        float r = sqrtf(v);
        float denom = r / c6 + c7;
        p = p - (m / denom) * c8;
        nbad |= !isfinite(p);
        w[j] = narrow(p, lo[j] & 0xFFFF);
        mb[j] = m; rb[j] = r;
    }
    const q8_scale sv = q8_scale_of(q8_scale_exponent(q8_absmax(rb, k, Q8_TOP_E4M4), 1, 0.90625f));
    for (int j = 0; j < k; j++) {
        float r = rb[j];
        int nan = !(r >= 0.0f), inf = r > Q8_TOP_E4M4;
        float y = (nan | inf) ? 0.0f : (r * sv.a) * sv.b;
        uint32_t u = q8_u(y);
        float lin = y * 0x1p18f, flin = floorf(lin);
        int normal = y >= 0x1p-14f;
        float low = normal ? (float)((int32_t)(u >> 19) - (112 << 4)) : flin;
        float frac = normal ? (float)(u & 0x7FFFF) * 0x1p-19f : lin - flin;
        uint8_t code = (uint8_t)(int32_t)(low + (float)(q8_draw2(hi[j]) < frac * 0x1p24f));
        code = nan ? 254 : (inf ? 255 : code);
        vq[j] = code;
        float limit = (q8_e4m4(code) * sv.s) * cap;
        mb[j] = isinf(limit) ? 0.0f : mb[j];  /* exact Adam's update there is 0 */
        lb[j] = limit;
    }
    const q8_scale sm1 = q8_scale_of(q8_scale_exponent(q8_absmax(mb, k, INFINITY), 7, 0.9921875f));
    q8_int8(mq, mb, lb, lo, hi, sm1, k);
    *ms = sm1.s; *vs = sv.s;
    *bad += nbad;
}

static void adamw_8bit_range(uint16_t *w, const uint16_t *grad, int8_t *mq, float *ms, uint8_t *vq, float *vs,
                             int64_t n, int64_t first, uint64_t key, const float *c, float cap,
                             uint16_t *bw, int8_t *bm, uint8_t *bv, float *bms, float *bvs, int64_t *bad) {
    for (int64_t a = 0; a < n;) {
        int64_t blk = (first + a) / Q8_BLOCK - first / Q8_BLOCK;
        int64_t b = ((first + a) / Q8_BLOCK + 1) * Q8_BLOCK - first;
        b = b > n ? n : b;
        bms[blk] = ms[blk]; bvs[blk] = vs[blk];
        adamw_8bit_block(w + a, grad + a, mq + a, ms + blk, vq + a, vs + blk, (int)(b - a), first + a, key,
                         c, cap, bw + a, bm + a, bv + a, bad);
        a = b;
    }
}

/* Ranges cut at block boundaries, each with its own backups of the old values; *bad: the blocks with a non-finite new weight. */
void adamw_8bit(uint16_t *w, const uint16_t *grad, int8_t *mq, float *ms, uint8_t *vq, float *vs, int64_t n,
                int64_t first, uint64_t key, const float *c, float cap, uint16_t *bw, int8_t *bm,
                uint8_t *bv, float *bms, float *bvs, int64_t *bad, int threads) {
    int64_t total = 0;
    #pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1) reduction(+ : total)
    for (int t = 0; t < threads; t++) {
        const int64_t lo = q8_cut(n * t / threads, n, first), hi = q8_cut(n * (t + 1) / threads, n, first);
        const int64_t blk = (first + lo) / Q8_BLOCK - first / Q8_BLOCK;
        int64_t count = 0;
        if (hi > lo)
            adamw_8bit_range(w + lo, grad + lo, mq + lo, ms + blk, vq + lo, vs + blk, hi - lo, first + lo, key, c,
                             cap, bw + lo, bm + lo, bv + lo, bms + blk, bvs + blk, &count);
        total += count;
    }
    *bad = total;
}
