/* What every kernel shares: the counter bits (SplitMix64), the thread ranges, bfloat16 (stochastic and nearest even) and float32 bits. */
#ifndef AMPKIT_COMMON_H
#define AMPKIT_COMMON_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#define GAMMA 0x9E3779B97F4A7C15ULL
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
static inline uint64_t word(uint64_t key, int64_t i) { return mix64(key + (uint64_t)(i + 1) * GAMMA); }

/* [0, n) cut into `threads` ranges [lo, hi), run on the OpenMP pool: torch's own (the process loads one
   libgomp.so.1; a build without OpenMP runs them in turn). Every element is computed on its own. */
#define EACH_RANGE(n, lo, hi, BODY)                                                                      \
    _Pragma("omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)")               \
    for (int t_ = 0; t_ < threads; t_++) {                                                              \
        const int64_t lo = (n) * t_ / threads, hi = (n) * (t_ + 1) / threads;                            \
        BODY                                                                                            \
    }
/* The same ranges, OR-ing EXPR (a uint32_t of the range [lo, hi)) into the caller's `any`. */
#define ANY_RANGE(n, lo, hi, EXPR)                                                                       \
    _Pragma("omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1) reduction(| : any)") \
    for (int t_ = 0; t_ < threads; t_++) {                                                              \
        const int64_t lo = (n) * t_ / threads, hi = (n) * (t_ + 1) / threads;                            \
        any |= EXPR;                                                                                    \
    }
/* A tensor's address from a row of a kernel's `_many` entry (one call for a param group's tensors). */
#define AT(T, x) ((T *)(uintptr_t)(x))
static inline float widen(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t narrow(float f, uint64_t d16) {  /* + a uniform 16-bit integer, truncated */
    uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + (uint32_t)d16) >> 16);
}
static inline uint32_t bits32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline uint16_t rne_bf16(uint32_t u) {  /* torch's float -> bfloat16 (c10's scalar NaN) */
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float q8_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t q8_u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

#endif
