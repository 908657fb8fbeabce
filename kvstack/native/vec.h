/* What the C kernels share: a dot product whose sums a vector unit can keep. */
#ifndef KVSTACK_VEC_H
#define KVSTACK_VEC_H
#include <stdint.h>

/* a . b in sixteen running sums (enough independent adds to hide their latency; a loop
 * of one sum is a chain the compiler may not reorder), added pairwise at the end. */
static inline float dot_lanes(const float *a, const float *b, int64_t n) {
    float lane[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lane[l] += a[i + l] * b[i + l];
    for (int l = 0; l < 8; l++) lane[l] += lane[l + 8];
    float total = ((lane[0] + lane[4]) + (lane[1] + lane[5])) +
                  ((lane[2] + lane[6]) + (lane[3] + lane[7]));
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

#endif
