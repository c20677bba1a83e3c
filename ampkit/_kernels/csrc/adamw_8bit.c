/* O8: AdamW / Adam on bf16 weights with 8-bit state (_kernels/fused_adamw_8bit.py).
   Blocks of 256 on the full parameter's flat index: local element i (global first + i) is in
   local block (first + i) / 256 - first / 256. The arithmetic of ADAMW_BODY (adamw.c) on m = int8 code *
   scale and v = (e4m4 code * scale)**2; the new sqrt(v), then m (capped against the stored
   sqrt(v) times cap; cap NaN: none) quantized per block with the draws of streams 2 and 1, which
   share one counter word per element with the weight's (q8.h). The old weight, codes and scales go
   to the backups bw, bm, bv, bms, bvs (so a step that made a weight non-finite can be undone); *bad
   counts the blocks with a non-finite new weight. */
#include "q8.h"

/* The block's old codes to the backups, and m = code * scale, r = e4m4 code * scale (sqrt(v)) as floats
   (copies in the loops: no memcpy calls on 256 bytes; code -128 (NaN) tested on the float, a byte test). */
static void adamw_8bit_load(const int8_t *restrict mq, float sm, const uint8_t *restrict vq, float sv, int k,
                            int8_t *restrict bm, uint8_t *restrict bv, float *restrict mb, float *restrict rb) {
    for (int j = 0; j < k; j++) {
        bm[j] = mq[j];
        const float f = (float)mq[j];
        mb[j] = f < -127.5f ? NAN : f * sm;
    }
    for (int j = 0; j < k; j++) {
        bv[j] = vq[j];
        rb[j] = q8_e4m4(vq[j]) * sv;
    }
}

/* The AdamW step on the block's floats: the new weight (rounded with the word's low 16 bits; the old to
   bw), m and sqrt(v) in place of the old, the absmax of sqrt(v) up to Q8_TOP_E4M4 (as bits, in this loop);
   whether a new weight is not finite, as the greatest exponent field (a max, not a compare and an or). */
static uint32_t adamw_8bit_step(uint16_t *restrict w, const uint16_t *restrict grad, float *restrict mb,
                                float *restrict rb, const uint32_t *restrict lo, const float *restrict c, int k,
                                uint16_t *restrict bw, uint32_t *restrict rmax) {
    const float c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3], c4 = c[4], c5 = c[5], c6 = c[6], c7 = c[7], c8 = c[8],
                c9 = c[9];
    const int l2 = c1 != 0.0f;
    uint32_t most = 0, amax = 0;
    for (int j = 0; j < k; j++) {
        float g = widen(grad[j]) * c9;
        const uint16_t wj = w[j];
        bw[j] = wj;
        float p = widen(wj);
        g = l2 ? g + p * c1 : g;
        p = p * c0;
        float m = mb[j] * c2 + g * c3;
        float r0 = rb[j];
        float v = (r0 * r0) * c4 + (g * g) * c5;
        float r = sqrtf(v);
        float denom = r / c6 + c7;
        p = p - (m / denom) * c8;
        const uint32_t ex = q8_u(p) & 0x7F800000u;
        most = ex > most ? ex : most;
        w[j] = narrow(p, lo[j] & 0xFFFF);
        mb[j] = m; rb[j] = r;
        const uint32_t u = q8_u(r) & 0x7FFFFFFFu & -(uint32_t)(r <= Q8_TOP_E4M4);  /* q8_absmax's: NaN 0 */
        amax = u > amax ? u : amax;
    }
    *rmax = amax;
    return most == 0x7F800000u;
}

/* The e4m4 codes of sqrt(v) (rb) at scale sv into vc (int32 lanes, as the floats'), rounded up when the
   24-bit draw d of stream 2 (bits 40..63) is below frac 2**24, in integers: where y >= 2**-14 the code is
   y's bits >> 19 less 112 << 4, and d < frac 2**24 is d >> 5 < the 19 bits below (the carry of
   bits + 0x7FFFF - (d >> 5)); below, y 2**18 is linear and y 2**42 < 2**28 exact (the ceil of int8's codes,
   q8_int8). Each stored value times cap is the limit of m's code (lb), and m is 0 where it is infinite. */
static void adamw_8bit_vcodes(int32_t *restrict vc, float *restrict lb, float *restrict mb,
                              const float *restrict rb, const uint32_t *restrict hi, q8_scale sv, float cap, int k) {
    for (int j = 0; j < k; j++) {
        float r = rb[j];
        int nan = !(r >= 0.0f), inf = r > Q8_TOP_E4M4;
        float y = (nan | inf) ? 0.0f : (r * sv.a) * sv.b;
        const uint32_t d = hi[j] >> 8, t = q8_u(y) + 0x7FFFFu - (d >> 5);  /* its bits >> 19: the code + (112 << 4) */
        const float lin = (y < 0x1p-14f ? y : 0x1p-14f) * 0x1p42f;  /* <= 2**28: no conversion out of range */
        const int32_t small = (int32_t)(((uint32_t)(int32_t)ceilf(lin) + 0xFFFFFFu - d) >> 24);
        const int normal = y >= 0x1p-14f;
        const int32_t code = normal ? (int32_t)(t >> 19) - (112 << 4) : small;  /* <= 253 */
        float val = normal ? q8_f(t & ~0x7FFFFu) : (float)small * 0x1p-18f;  /* code 16: 2**-14 either way */
        val = nan ? NAN : (inf ? INFINITY : val);
        vc[j] = nan ? 254 : (inf ? 255 : code);
        float limit = (val * sv.s) * cap;
        mb[j] = isinf(limit) ? 0.0f : mb[j];  /* exact Adam's update there is 0 */
        lb[j] = limit;
    }
}

/* One block of k elements: loops without branches, each on one lane width where it can (so that they vectorize). */
static void adamw_8bit_block(uint16_t *restrict w, const uint16_t *restrict grad, int8_t *restrict mq,
                             float *restrict ms, uint8_t *restrict vq, float *restrict vs, int k, int64_t first,
                             uint64_t key, const float *restrict c, float cap, uint16_t *restrict bw,
                             int8_t *restrict bm, uint8_t *restrict bv, int64_t *restrict bad) {
    float mb[Q8_BLOCK], rb[Q8_BLOCK], lb[Q8_BLOCK];
    uint32_t lo[Q8_BLOCK], hi[Q8_BLOCK];
    int32_t vc[Q8_BLOCK];
    q8_words(lo, hi, key, first, k);
    adamw_8bit_load(mq, *ms, vq, *vs, k, bm, bv, mb, rb);
    uint32_t rmax;
    const uint32_t nbad = adamw_8bit_step(w, grad, mb, rb, lo, c, k, bw, &rmax);
    const q8_scale sv = q8_scale_of(q8_scale_exponent(rmax, 1, 0.90625f));
    adamw_8bit_vcodes(vc, lb, mb, rb, hi, sv, cap, k);
    q8_narrow8(vq, vc, k);
    const q8_scale sm1 = q8_scale_of(q8_scale_exponent(q8_absmax(mb, k), 7, 0.9921875f));
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
static void adamw_8bit(uint16_t *w, const uint16_t *grad, int8_t *mq, float *ms, uint8_t *vq, float *vs, int64_t n,
                       int64_t first, uint64_t key, const float *c, float cap, uint16_t *bw, int8_t *bm,
                       uint8_t *bv, float *bms, float *bvs, int64_t *bad, int threads) {
    Q8_EACH_RANGE(n, first, bad, adamw_8bit_range(w + lo, grad + lo, mq + lo, ms + blk, vq + lo, vs + blk, hi - lo,
                                                   first + lo, key, c, cap, bw + lo, bm + lo, bv + lo, bms + blk,
                                                   bvs + blk, &count););
}

/* adamw_8bit of count tensors in turn, stopping at the first with a non-finite new weight (its old values
   are in its backups; the tensors after it are not touched): how many had none. rows: each tensor's 15
   words (the addresses of w, grad, mq, ms, vq, vs, bw, bm, bv, bms, bvs; n, first, key, threads); consts:
   its 10 step constants and its cap. One call steps a param group. */
int64_t adamw_8bit_many(int64_t count, const uint64_t *rows, const float *consts) {
    for (int64_t i = 0; i < count; i++) {
        const uint64_t *r = rows + 15 * i;
        const float *c = consts + 11 * i;
        int64_t bad = 0;
        adamw_8bit(AT(uint16_t, r[0]), AT(const uint16_t, r[1]), AT(int8_t, r[2]), AT(float, r[3]), AT(uint8_t, r[4]),
                   AT(float, r[5]), (int64_t)r[11], (int64_t)r[12], r[13], c, c[10], AT(uint16_t, r[6]),
                   AT(int8_t, r[7]), AT(uint8_t, r[8]), AT(float, r[9]), AT(float, r[10]), &bad, (int)r[14]);
        if (bad) return i;
    }
    return count;
}
