/* torch.optim.SGD's arithmetic (sgd.c, sgd_8bit.c): flags, buffer modes and one step of one element. */
#ifndef AMPKIT_SGD_H
#define AMPKIT_SGD_H

#include "common.h"

enum { SGD_MAXIMIZE = 1, SGD_DECAY = 2, SGD_NESTEROV = 4 };  /* flags */
enum { NO_BUFFER, NEW_BUFFER, BUFFER };  /* momentum 0; the buffer made on this step; a buffer to carry on */
#define INLINE static inline __attribute__((always_inline))

/* torch.optim.SGD's arithmetic, one rounding per operation, in its order; c: weight decay,
   momentum, 1 - dampening, lr. *b: the buffer (read in mode BUFFER, written unless NO_BUFFER). */
INLINE float sgd_step(float p, float g, float *b, const int mode, const int flags, const float *restrict c) {
    g = (flags & SGD_MAXIMIZE) ? -g : g;
    g = (flags & SGD_DECAY) ? g + p * c[0] : g;  /* a select: the loop stays vectorized */
    if (mode != NO_BUFFER) {
        *b = mode == NEW_BUFFER ? g : *b * c[1] + g * c[2];
        g = (flags & SGD_NESTEROV) ? g + *b * c[1] : *b;
    }
    return p - g * c[3];
}

#endif
