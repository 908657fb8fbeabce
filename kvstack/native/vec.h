/* What the C kernels share: a dot product whose sums a vector unit can keep. */
#ifndef KVSTACK_VEC_H
#define KVSTACK_VEC_H
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* Sixteen floats as one value (GNU C's vector extension: one 512-bit register with
 * AVX-512, two with AVX2, plain floats elsewhere). */
typedef float v16f __attribute__((vector_size(64)));

static inline v16f load16(const float *p) {
    v16f v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* a * b + c, fused where the CPU has FMA (the compiler, in ISO C mode, fuses no
 * multiply-add of its own accord). */
static inline v16f fma16(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
    return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    __m256 lo[3], hi[3];
    __builtin_memcpy(lo, &a, 32), __builtin_memcpy(hi, (const char *)&a + 32, 32);
    __builtin_memcpy(lo + 1, &b, 32), __builtin_memcpy(hi + 1, (const char *)&b + 32, 32);
    __builtin_memcpy(lo + 2, &c, 32), __builtin_memcpy(hi + 2, (const char *)&c + 32, 32);
    const __m256 r[2] = {_mm256_fmadd_ps(lo[0], lo[1], lo[2]),
                         _mm256_fmadd_ps(hi[0], hi[1], hi[2])};
    v16f out;
    __builtin_memcpy(&out, r, sizeof out);
    return out;
#else
    return a * b + c;
#endif
}

/* s in all sixteen lanes. */
static inline v16f splat16(float s) {
#if defined(__AVX512F__)
    return (v16f)_mm512_set1_ps(s);
#else
    const v16f zero = {0};
    return zero + s;
#endif
}

/* Sixteen bf16 values widened to floats (a bf16 number is a float's high half). */
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16f widen16(const uint16_t *p) {
#if defined(__AVX512F__)
    const __m512i u = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (v16f)_mm512_castsi512_ps(u);
#else
    v16h h;
    __builtin_memcpy(&h, p, sizeof h);
    const v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f v;
    __builtin_memcpy(&v, &u, sizeof v);
    return v;
#endif
}

static inline float widen1(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

/* The sum of sixteen lanes, added pairwise: lane l and l + 8, then l and l + 4, then
 * ((0 + 1) + (2 + 3)) of what is left. By shuffles where the CPU has AVX-512 (the same
 * adds in the same order as the plain C below). */
static inline float sum16(v16f s) {
#if defined(__AVX512F__)
    const __m512 v = (__m512)s;
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 eight = _mm256_add_ps(_mm512_castps512_ps256(v), high);
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight),
                                   _mm256_extractf128_ps(eight, 1));
    const __m128 two = _mm_hadd_ps(four, four);  /* (0 + 1), (2 + 3), ... */
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
#else
    float lane[16];
    __builtin_memcpy(lane, &s, sizeof lane);
    for (int l = 0; l < 8; l++) lane[l] += lane[l + 8];
    return ((lane[0] + lane[4]) + (lane[1] + lane[5])) +
           ((lane[2] + lane[6]) + (lane[3] + lane[7]));
#endif
}

/* a . b in four vectors of sixteen running sums (independent multiply-adds, fused, enough
 * to hide their latency; a loop of one sum is a chain the compiler may not reorder), added
 * pairwise at the end. The bf16 version reads b as bf16 and adds in the same order, so it gives what
 * the float32 one gives on b widened. */
#define DOT_LANES(name, B_TYPE, LOAD_B, ONE_B)                                            \
    static inline float name(const float *a, const B_TYPE *b, int64_t n) {               \
        v16f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                     \
        int64_t i = 0;                                                                   \
        for (; i + 64 <= n; i += 64) {                                                   \
            s0 = fma16(load16(a + i), LOAD_B(b + i), s0);                                \
            s1 = fma16(load16(a + i + 16), LOAD_B(b + i + 16), s1);                      \
            s2 = fma16(load16(a + i + 32), LOAD_B(b + i + 32), s2);                      \
            s3 = fma16(load16(a + i + 48), LOAD_B(b + i + 48), s3);                      \
        }                                                                                \
        for (; i + 16 <= n; i += 16) s0 = fma16(load16(a + i), LOAD_B(b + i), s0);       \
        float total = sum16((s0 + s2) + (s1 + s3));                                      \
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

/* x[j] = exp(x[j] - shift) for j < n: a softmax's weights from its logits and their
 * maximum. Sixteen at a time where the CPU has AVX-512 (Cephes' expf: the shift to
 * [-ln 2 / 2, ln 2 / 2] by n ln 2, a degree-5 polynomial, 2^n by vscalefps; within 2 ulp of
 * expf, -inf to 0, NaN kept), expf elsewhere and for the last few. */
static inline void exp_shifted(float *x, int64_t n, float shift) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 by = _mm512_set1_ps(shift);
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_sub_ps(_mm512_loadu_ps(x + j), by);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __m512 c = _mm512_max_ps(_mm512_min_ps(v, _mm512_set1_ps(88.7228394f)),
                                       _mm512_set1_ps(-104.0f));
        const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504f)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), c);
        r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
        __m512 y = _mm512_set1_ps(1.9875691500e-4f);
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
        y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
        _mm512_storeu_ps(x + j, _mm512_mask_blend_ps(nan, _mm512_scalef_ps(y, k), v));
    }
#endif
    for (; j < n; j++) x[j] = expf(x[j] - shift);
}

#endif
