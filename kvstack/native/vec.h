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

/* Sixteen bf16 values widened to floats (a bf16 number is a float's high half). */
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16f widen16(const uint16_t *p) {
    v16h h;
    __builtin_memcpy(&h, p, sizeof h);
    const v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f v;
    __builtin_memcpy(&v, &u, sizeof v);
    return v;
}

static inline float widen1(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

/* a . b in four vectors of sixteen running sums (independent adds, enough to hide their
 * latency; a loop of one sum is a chain the compiler may not reorder), added pairwise at
 * the end. The bf16 version reads b as bf16 and adds in the same order, so it gives what
 * the float32 one gives on b widened. */
#define DOT_LANES(name, B_TYPE, LOAD_B, ONE_B)                                            \
    static inline float name(const float *a, const B_TYPE *b, int64_t n) {               \
        v16f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                     \
        int64_t i = 0;                                                                   \
        for (; i + 64 <= n; i += 64) {                                                   \
            s0 += load16(a + i) * LOAD_B(b + i);                                         \
            s1 += load16(a + i + 16) * LOAD_B(b + i + 16);                               \
            s2 += load16(a + i + 32) * LOAD_B(b + i + 32);                               \
            s3 += load16(a + i + 48) * LOAD_B(b + i + 48);                               \
        }                                                                                \
        for (; i + 16 <= n; i += 16) s0 += load16(a + i) * LOAD_B(b + i);                \
        const v16f s = (s0 + s2) + (s1 + s3);                                            \
        float lane[16];                                                                  \
        __builtin_memcpy(lane, &s, sizeof lane);                                         \
        for (int l = 0; l < 8; l++) lane[l] += lane[l + 8];                              \
        float total = ((lane[0] + lane[4]) + (lane[1] + lane[5])) +                      \
                      ((lane[2] + lane[6]) + (lane[3] + lane[7]));                       \
        for (; i < n; i++) total += a[i] * ONE_B(b[i]);                                  \
        return total;                                                                    \
    }

#define KV_SAME(v) (v)
DOT_LANES(dot_lanes, float, load16, KV_SAME)
DOT_LANES(dot_lanes_bf16, uint16_t, widen16, widen1)
#undef KV_SAME
#undef DOT_LANES

/* a . row r of a matrix with n columns held as float32, or as bf16 where `bf16` says so
 * (a checkpoint's weights, multiplied as stored). */
static inline float dot_row(const float *a, const void *w, int bf16, int64_t r, int64_t n) {
    return bf16 ? dot_lanes_bf16(a, (const uint16_t *)w + r * n, n)
                : dot_lanes(a, (const float *)w + r * n, n);
}

#endif
