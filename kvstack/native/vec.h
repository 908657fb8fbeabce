/* What the C kernels share: a dot product whose sums a vector unit can keep. */
#ifndef KVSTACK_VEC_H
#define KVSTACK_VEC_H
#include <stdint.h>

/* Sixteen floats as one value (GNU C's vector extension: one 512-bit register with
 * AVX-512, two with AVX2, plain floats elsewhere). */
typedef float v16f __attribute__((vector_size(64)));

static inline v16f load16(const float *p) {
    v16f v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* a . b in four vectors of sixteen running sums (independent adds, enough to hide their
 * latency; a loop of one sum is a chain the compiler may not reorder), added pairwise at
 * the end. */
static inline float dot_lanes(const float *a, const float *b, int64_t n) {
    v16f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        s0 += load16(a + i) * load16(b + i);
        s1 += load16(a + i + 16) * load16(b + i + 16);
        s2 += load16(a + i + 32) * load16(b + i + 32);
        s3 += load16(a + i + 48) * load16(b + i + 48);
    }
    for (; i + 16 <= n; i += 16) s0 += load16(a + i) * load16(b + i);
    const v16f s = (s0 + s2) + (s1 + s3);
    float lane[16];
    __builtin_memcpy(lane, &s, sizeof lane);
    for (int l = 0; l < 8; l++) lane[l] += lane[l + 8];
    float total = ((lane[0] + lane[4]) + (lane[1] + lane[5])) +
                  ((lane[2] + lane[6]) + (lane[3] + lane[7]));
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

#endif
