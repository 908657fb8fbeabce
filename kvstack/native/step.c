/* CPU kernels of the decode step's small per-token ops, in C: the hyper-connections'
 * mixes (with their Sinkhorn iterations), collapse and spread, RoPE, RMSNorm, the
 * quantisation of new cache rows, the indexer's top-k and a float MoE sublayer. Torch
 * runs each as 5 to 120 ops on tensors of a few hundred floats, where the dispatch of an
 * op, not its arithmetic, is the cost (a decode step of bench/decode.py's model issued
 * over 6,000 of them). One call here does what those ops do, in the same order of float32
 * operations where the order is torch's own (elementwise steps, sums over the few
 * residual copies); reductions over a row (a norm's mean, a dot product) add in another
 * order than torch's vectorised ones, so results agree within float rounding. The
 * quantisation and the top-k are exact: the codecs' bytes, the sort's entries.
 *
 * Built with -std=c11, so the compiler contracts no a*b+c into a fused multiply-add:
 * each product and sum is rounded as torch rounds its separate ops.
 */
#include "kernels.h"
#include "vec.h"
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* The mixes of one sublayer's hyper-connection (kvstack.model.model.HyperConnection.mixes)
 * for n tokens of h residual copies of width dim:
 *   mix [m] = (fn [m, h*dim] . x) * rsqrt(mean(x^2) + norm_eps), m = (2 + h) * h
 *   pre [h] = sigmoid(mix[:h] * scale[0] + base[:h]) + hc_eps
 *   post [h] = 2 * sigmoid(mix[h:2h] * scale[1] + base[h:2h])
 *   comb [h, h] = softmax over i of (mix[2h:] * scale[2] + base[2h:]) + hc_eps, then
 *     columns normalised, then iters - 1 times rows and columns in turn. */
void kv_hc_mixes(const float *x, int64_t n, int64_t h, int64_t dim, const float *fn,
                 const float *scale, const float *base, float norm_eps, float hc_eps,
                 int64_t iters, float *pre, float *post, float *comb, int threads) {
    const int64_t width = h * dim, m = (2 + h) * h;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 64)
    for (int64_t t = 0; t < n; t++) {
        const float *row = x + t * width;
        float mix[64];  /* m <= 64: h <= 6 */
        const float norm = 1.0f / sqrtf(dot_lanes(row, row, width) / (float)width + norm_eps);
        for (int64_t k = 0; k < m; k++) mix[k] = dot_lanes(row, fn + k * width, width) * norm;
        float *p = pre + t * h, *q = post + t * h, *c = comb + t * h * h;
        for (int64_t i = 0; i < h; i++) {
            p[i] = sigmoid(mix[i] * scale[0] + base[i]) + hc_eps;
            q[i] = 2.0f * sigmoid(mix[h + i] * scale[1] + base[h + i]);
        }
        for (int64_t k = 0; k < h; k++) {  /* row k: softmax over its h entries */
            float *r = c + k * h, top = -INFINITY, total = 0.0f;
            for (int64_t i = 0; i < h; i++) {
                r[i] = mix[2 * h + k * h + i] * scale[2] + base[2 * h + k * h + i];
                top = fmaxf(top, r[i]);
            }
            for (int64_t i = 0; i < h; i++) total += (r[i] = expf(r[i] - top));
            for (int64_t i = 0; i < h; i++) r[i] = r[i] / total + hc_eps;
        }
        for (int64_t it = 0; it < (iters > 1 ? iters : 1); it++) {
            if (it > 0) {  /* rows */
                for (int64_t k = 0; k < h; k++) {
                    float total = 0.0f;
                    for (int64_t i = 0; i < h; i++) total += c[k * h + i];
                    total += hc_eps;
                    for (int64_t i = 0; i < h; i++) c[k * h + i] /= total;
                }
            }
            for (int64_t i = 0; i < h; i++) {  /* columns */
                float total = 0.0f;
                for (int64_t k = 0; k < h; k++) total += c[k * h + i];
                total += hc_eps;
                for (int64_t k = 0; k < h; k++) c[k * h + i] /= total;
            }
        }
    }
}

/* out [n, dim] = sum_i pre[t, i] * x[t, i, :] over the h copies, i in order. */
void kv_hc_collapse(const float *x, const float *pre, int64_t n, int64_t h, int64_t dim,
                    float *out) {
    for (int64_t t = 0; t < n; t++) {
        const float *p = pre + t * h, *copies = x + t * h * dim;
        float *o = out + t * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = p[0] * copies[d];
        for (int64_t i = 1; i < h; i++)
            for (int64_t d = 0; d < dim; d++) o[d] += p[i] * copies[i * dim + d];
    }
}

/* copy i of out [n, h, dim] = post[t, i] * y[t, :] + sum_k comb[t, k, i] * x[t, k, :]. */
void kv_hc_post(const float *y, const float *x, const float *post, const float *comb,
                int64_t n, int64_t h, int64_t dim, float *out) {
    for (int64_t t = 0; t < n; t++) {
        const float *yt = y + t * dim, *copies = x + t * h * dim, *c = comb + t * h * h;
        for (int64_t i = 0; i < h; i++) {
            float *o = out + (t * h + i) * dim;
            for (int64_t d = 0; d < dim; d++) {
                float mixed = c[i] * copies[d];
                for (int64_t k = 1; k < h; k++) mixed += c[k * h + i] * copies[k * dim + d];
                o[d] = post[t * h + i] * yt[d] + mixed;
            }
        }
    }
}

/* RoPE (kvstack.model.model.rotate) on rows of x [b, n, heads, width], out of place:
 * the last 2 * half values rotated in interleaved pairs at the row's position
 * (positions [pb, n], pb = 1 or b), the angle formed in double as torch forms it from
 * float64 frequencies, its cosine and sine rounded to float32; the rest copied. */
/* The cosines and sines of a position's angles (cs, sn [half]): double angles from the
 * float64 frequencies, rounded to float32 as torch rounds them; sines negated to undo. */
static void rope_angles(int64_t position, const double *freqs, int64_t half, int inverse,
                        float *cs, float *sn) {
    for (int64_t j = 0; j < half; j++) {
        const double angle = (double)position * freqs[j];
        cs[j] = (float)cos(angle);
        sn[j] = inverse ? -(float)sin(angle) : (float)sin(angle);
    }
}

/* heads rows of `width` values from x to out (in place when they are one), the last
 * 2 * half of each rotated in interleaved pairs by the angles (cs, sn). */
static void rope_rows(const float *x, int64_t heads, int64_t width, const float *cs,
                      const float *sn, int64_t half, float *out) {
    const int64_t rest = width - 2 * half;
    for (int64_t hd = 0; hd < heads; hd++) {
        const float *xr = x + hd * width;
        float *o = out + hd * width;
        for (int64_t d = 0; d < rest; d++) o[d] = xr[d];
        for (int64_t j = 0; j < half; j++) {
            const float even = xr[rest + 2 * j], odd = xr[rest + 2 * j + 1];
            o[rest + 2 * j] = even * cs[j] - odd * sn[j];
            o[rest + 2 * j + 1] = even * sn[j] + odd * cs[j];
        }
    }
}

void kv_rope(const float *x, int64_t b, int64_t n, int64_t heads, int64_t width,
             const int64_t *positions, int64_t pb, const double *freqs, int64_t half,
             int inverse, float *out) {
    float cs[512], sn[512];  /* half <= 512 */
    for (int64_t s = 0; s < b; s++) {
        for (int64_t t = 0; t < n; t++) {
            rope_angles(positions[(pb == 1 ? 0 : s) * n + t], freqs, half, inverse, cs, sn);
            const int64_t r = (s * n + t) * heads;
            rope_rows(x + r * width, heads, width, cs, sn, half, out + r * width);
        }
    }
}

/* RMSNorm: out [rows, dim] = (x * rsqrt(mean(x^2) + eps)) * weight (in place when out
 * is x). */
void kv_rmsnorm(const float *x, int64_t rows, int64_t dim, const float *weight, float eps,
                float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        const float norm = 1.0f / sqrtf(dot_lanes(xr, xr, dim) / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) o[d] = (xr[d] * norm) * weight[d];
    }
}

/* y [t, out] = x [t, in] W^T for W [out, in] (float32, or bf16 where `bf16` says so) and
 * a few tokens: each row of W is read once for all of them. Rows of W run in parallel over
 * `threads`. */
static void small_linear(const float *x, int64_t t, int64_t in, const void *w, int bf16,
                         int64_t out, float *y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && out >= 64)
    for (int64_t o = 0; o < out; o++)
        for (int64_t i = 0; i < t; i++) y[i * out + o] = dot_row(x + i * in, w, bf16, o, in);
}

/* A layer's attention inputs for t tokens x [t, dim] at positions [t], float weights
 * (kvstack.model.model.Attention.forward up to its attention):
 *   qr [t, rank] = q_norm(x wq_a^T)
 *   q [t, heads, d] = rope(qr wq_b^T)
 *   window [t, d] = rope(kv_norm(x wkv^T))
 * the rotation on each row's last 2 * half values (kv_rope's). wq_a, wq_b and wkv are
 * float32, or bf16 where wbf16 says so. */
void kv_attention_in(const float *x, int64_t t, int64_t dim, const void *wq_a,
                     const float *q_norm, int64_t rank, const void *wq_b, int64_t heads,
                     int64_t d, const void *wkv, const float *kv_norm, float eps,
                     const int64_t *positions, const double *freqs, int64_t half, float *qr,
                     float *q, float *window, int wbf16, int threads) {
    float cs[512], sn[512];  /* half <= 512 */
    small_linear(x, t, dim, wq_a, wbf16, rank, qr, threads);
    kv_rmsnorm(qr, t, rank, q_norm, eps, qr);
    small_linear(qr, t, rank, wq_b, wbf16, heads * d, q, threads);
    small_linear(x, t, dim, wkv, wbf16, d, window, threads);
    kv_rmsnorm(window, t, d, kv_norm, eps, window);
    for (int64_t i = 0; i < t; i++) {
        rope_angles(positions[i], freqs, half, 0, cs, sn);
        rope_rows(q + i * heads * d, heads, d, cs, sn, half, q + i * heads * d);
        rope_rows(window + i * d, 1, d, cs, sn, half, window + i * d);
    }
}

/* A layer's output projection for t tokens (kvstack.model.model.Attention.project_out):
 * the heads' outputs o [t, heads, d] at positions [t] rotated back (in place), then each
 * of the g groups of heads / g heads through its block of wo_a [g * rank, heads / g * d]
 * into low [t, g * rank], then y [t, dim] = low wo_b^T (wo_b [dim, g * rank]); both
 * weights float32, or bf16 where wbf16 says so. */
void kv_attention_out(float *o, int64_t t, int64_t heads, int64_t d,
                      const int64_t *positions, const double *freqs, int64_t half,
                      const void *wo_a, int64_t g, int64_t rank, const void *wo_b,
                      int64_t dim, float *low, float *y, int wbf16, int threads) {
    float cs[512], sn[512];  /* half <= 512 */
    const int64_t width = heads / g * d;  /* a group's inputs */
    for (int64_t i = 0; i < t; i++) {
        rope_angles(positions[i], freqs, half, 1, cs, sn);
        rope_rows(o + i * heads * d, heads, d, cs, sn, half, o + i * heads * d);
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < g * rank; r++) {
        const int64_t group = r / rank;
        for (int64_t i = 0; i < t; i++)
            low[i * g * rank + r] = dot_row(o + i * heads * d + group * width, wo_a, wbf16,
                                            r, width);
    }
    small_linear(low, t, g * rank, wo_b, wbf16, dim, y, threads);
}

/* ---- block-scaled quantisation (kvstack.formats.quantize), bit for bit ----------------
 * Integer bit manipulation as the torch codecs do it, so the bytes are theirs exactly. */

static inline uint32_t bits_of(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    return v.u;
}

static inline float float_of(uint32_t u) {
    union { uint32_t u; float f; } v = {.u = u};
    return v.f;
}

/* 2**e from the bits, for e in [-126, 127] (codecs.pow2). */
static inline float pow2i(int32_t e) { return float_of((uint32_t)(e + 127) << 23); }

static inline int32_t exponent_of(float x) { return (int32_t)((bits_of(x) >> 23) & 0xFF) - 127; }

/* ceil(log2(x / c)) for c = mc * 2^ec, c's mantissa bits given (codecs.ceil_log2_ratio). */
static inline int32_t ceil_log2_ratio(float x, int32_t ec, uint32_t c_mantissa_bits) {
    return exponent_of(x) - (ec - 1) + ((bits_of(x) & 0x7FFFFF) > c_mantissa_bits);
}

static inline uint8_t e2m1_encode(float v) {
    const float m = fabsf(v);
    const uint8_t code = (m > 0.25f) + (m > 1.25f) + (m > 2.5f) + (m > 5.0f)
                         + (m >= 0.75f) + (m >= 1.75f) + (m >= 3.5f);
    return code | (uint8_t)(signbit(v) ? 8 : 0);
}

static inline uint8_t e4m3_encode(float v) {
    float m = fabsf(v);
    if (m > 448.0f) m = 448.0f;  /* a NaN stays NaN, as torch's clamp leaves it */
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    if (m < 0.015625f) return (uint8_t)(int32_t)rintf(m * 512.0f) | sign;  /* 2^-6 */
    const uint32_t b = bits_of(m);
    const uint32_t rounded = (b + 0x7FFFFu + ((b >> 20) & 1u)) & ~0xFFFFFu;
    const int32_t exp_field = (int32_t)((rounded >> 23) & 0xFF) - 127 + 7;
    const int32_t mant = (int32_t)((rounded >> 20) & 0x7);
    return (uint8_t)((exp_field << 3) | mant) | sign;
}

/* E4M3 code of clamp(amax / 6, 2^-9, 448) from the exact quotient (codecs.e4m3_encode_sixth). */
static inline uint8_t e4m3_encode_sixth(float amax) {
    float a = amax;
    if (a < 6.0f * 0.001953125f) a = 6.0f * 0.001953125f;
    if (a > 6.0f * 448.0f) a = 6.0f * 448.0f;
    const int32_t below = (bits_of(a) & 0x7FFFFF) < 0x400000;
    int32_t exponent = exponent_of(a) - 2 - below;
    if (exponent < -6) exponent = -6;
    const float steps = a / pow2i(exponent - 3);
    float n = floorf(steps / 6.0f);
    n = n + (float)(steps - 6.0f * n >= 6.0f) - (float)(steps - 6.0f * n < 0.0f);
    const float rest = steps - 6.0f * n;
    n = n + (float)((rest > 3.0f) | ((rest == 3.0f) & (fmodf(n, 2.0f) == 1.0f)));
    /* A NaN amax converts as x86 converts it (INT32_MIN), in unsigned arithmetic. */
    const uint32_t whole = n != n ? 0x80000000u : (uint32_t)(int32_t)n;
    return (uint8_t)((uint32_t)(exponent + 7) * 8u + whole - 8u);
}

/* Quantise rows of x [rows, d] to a block-scaled format: E2M1 (element 0, two codes a
 * byte, element 2i in the low nibble) or E4M3 (element 1) codes, one UE8M0 (scale_kind 0)
 * or E4M3-of-amax/6 (scale_kind 1) scale per `block` values. out_rows [rows, bytes]:
 * codes then scales (pack_rows); values [rows, d]: what dequantize gives back,
 * elem[code] * scale_table[byte]. Either may be NULL. Returns max |x| (NaN if any is). */
float kv_quantize(const float *x, int64_t rows, int64_t d, int element, int scale_kind,
                  int64_t block, const float *elem, const float *scale_table,
                  uint8_t *out_rows, float *values) {
    const int64_t code_bytes = element == 0 ? d / 2 : d, row_bytes = code_bytes + d / block;
    float largest = 0.0f;
    int nan = 0;
    uint8_t codes[16384];  /* one row's codes, d <= 16384 */
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        uint8_t *row = out_rows ? out_rows + r * row_bytes : NULL;
        for (int64_t b = 0; b < d / block; b++) {
            const float *blk = xr + b * block;
            float amax = 0.0f;
            int blk_nan = 0;
            for (int64_t i = 0; i < block; i++) {
                const float m = fabsf(blk[i]);
                if (m != m) blk_nan = 1;
                else if (m > amax) amax = m;
            }
            if (blk_nan) { amax = NAN; nan = 1; }
            else if (amax > largest) largest = amax;
            uint8_t scale_byte;
            float scale;
            if (scale_kind == 1) {
                scale_byte = e4m3_encode_sixth(amax);
                scale = scale_table[scale_byte];
                for (int64_t i = 0; i < block; i++) {
                    float s = blk[i] / scale;  /* clamp(-6, 6), NaN kept */
                    if (s < -6.0f) s = -6.0f;
                    if (s > 6.0f) s = 6.0f;
                    codes[b * block + i] = element == 0 ? e2m1_encode(s) : e4m3_encode(s);
                }
            } else {
                float a = amax;
                int32_t exponent;
                if (element == 0) {  /* c = 6 = 0.75 * 2^3: mantissa bits 0x400000 */
                    if (a < 6.0f * 1.1754943508222875e-38f) a = 6.0f * 1.1754943508222875e-38f;
                    exponent = ceil_log2_ratio(a, 3, 0x400000);
                } else {  /* c = 448 = 0.875 * 2^9: mantissa bits 0x600000 */
                    if (a < 1e-4f) a = 1e-4f;
                    exponent = ceil_log2_ratio(a, 9, 0x600000);
                }
                scale_byte = (uint8_t)(exponent + 127);
                const float divisor = pow2i(exponent);
                for (int64_t i = 0; i < block; i++) {
                    const float s = blk[i] / divisor;
                    codes[b * block + i] = element == 0 ? e2m1_encode(s) : e4m3_encode(s);
                }
                scale = scale_table[scale_byte];
            }
            if (row) row[code_bytes + b] = scale_byte;
            if (values)
                for (int64_t i = 0; i < block; i++)
                    values[r * d + b * block + i] = elem[codes[b * block + i]] * scale;
        }
        if (row) {
            if (element == 0)
                for (int64_t i = 0; i < d / 2; i++)
                    row[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
            else
                for (int64_t i = 0; i < d; i++) row[i] = codes[i];
        }
    }
    return nan ? NAN : largest;
}

/* ---- the indexer's top-k (kvstack.model.model.select_topk) ---------------------------
 * Per row of scores [rows, n]: the k best entries of a stable descending sort (ties to
 * the earlier entry; -0.0 as +0.0; a NaN above everything, as the float's bits order
 * it), those scoring -inf dropped, in ascending position, -1 after them: out [rows, k].
 * Each score becomes the int64 key the torch code builds (the float's order in the high
 * half, the reversed index in the low half), so the choice is the same entries. */

static inline void sift_down(int64_t *heap, int64_t size, int64_t i) {
    for (;;) {
        int64_t least = i, l = 2 * i + 1, r = l + 1;
        if (l < size && heap[l] < heap[least]) least = l;
        if (r < size && heap[r] < heap[least]) least = r;
        if (least == i) return;
        const int64_t t = heap[i];
        heap[i] = heap[least];
        heap[least] = t;
        i = least;
    }
}

static int ascending(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The order key of a score in a stable descending sort over n entries (entry i): the
 * float's bits made monotone in its high half, the reversed index in its low half, so
 * keys are unique and ties go to the earlier entry (-0.0 made +0.0 first). */
static inline int64_t order_key(float score, int64_t i, int64_t n) {
    const int32_t bits = (int32_t)bits_of(score + 0.0f);
    const int64_t ordered = bits >= 0 ? (int64_t)bits : (int64_t)(bits ^ 0x7FFFFFFF);
    return (int64_t)(((uint64_t)ordered << 32) | (uint64_t)(n - 1 - i));
}

/* key kept in a min-heap of the best k keys so far (size of them held). */
static inline void keep_best(int64_t *heap, int64_t *size, int64_t k, int64_t key) {
    if (*size < k) {  /* fill, then keep the heap's least on top */
        heap[(*size)++] = key;
        if (*size == k)
            for (int64_t j = k / 2 - 1; j >= 0; j--) sift_down(heap, k, j);
    } else if (key > heap[0]) {
        heap[0] = key;
        sift_down(heap, k, 0);
    }
}

void kv_select_topk(const float *scores, int64_t rows, int64_t n, int64_t k, int64_t *heap,
                    int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *s = scores + r * n;
        int64_t size = 0;
        for (int64_t i = 0; i < n; i++) keep_best(heap, &size, k, order_key(s[i], i, n));
        int64_t *o = out + r * k, kept = 0;
        for (int64_t j = 0; j < size; j++) {
            const int64_t i = n - 1 - (heap[j] & 0xFFFFFFFF);
            if (s[i] != -INFINITY) o[kept++] = i;
        }
        qsort(o, (size_t)kept, sizeof(int64_t), ascending);
        for (int64_t j = kept; j < k; j++) o[j] = -1;
    }
}

static int descending(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x < y) - (x > y);
}

/* Each query's candidate pool (kvstack.model.model.candidate_pool) from its scores
 * [rows, n] (rows = b * q queries, query t of sequence s at positions[(pb == 1 ? 0 : s)
 * * q + t]): spans of bs entries scored by their largest (NaN where any is NaN), the span
 * holding the newest visible entry ((position + 1) / ratio - 1, where there is one)
 * scored +inf, then the kb best spans in a stable descending order: out [rows, kb].
 * spans: n_spans floats of scratch; heap: kb int64. */
void kv_candidate_pool(const float *scores, int64_t b, int64_t q, int64_t n,
                       const int64_t *positions, int64_t pb, int64_t ratio, int64_t bs,
                       int64_t kb, float *spans, int64_t *heap, int64_t *out) {
    const int64_t n_spans = (n + bs - 1) / bs;
    for (int64_t r = 0; r < b * q; r++) {
        const float *sr = scores + r * n;
        for (int64_t j = 0; j < n_spans; j++) {
            float top = -INFINITY;
            const int64_t end = (j + 1) * bs < n ? (j + 1) * bs : n;
            for (int64_t i = j * bs; i < end; i++) {
                if (sr[i] != sr[i]) { top = sr[i]; break; }
                if (sr[i] > top) top = sr[i];
            }
            spans[j] = top;
        }
        const int64_t newest = (positions[(pb == 1 ? 0 : r / q) * q + r % q] + 1) / ratio - 1;
        if (newest >= 0 && newest / bs < n_spans) spans[newest / bs] = INFINITY;
        int64_t size = 0;
        for (int64_t j = 0; j < n_spans; j++)
            keep_best(heap, &size, kb, order_key(spans[j], j, n_spans));
        qsort(heap, (size_t)size, sizeof(int64_t), descending);
        for (int64_t j = 0; j < size; j++) out[r * kb + j] = n_spans - 1 - (heap[j] & 0xFFFFFFFF);
    }
}

/* A decode step's top-k inside each sequence's candidate pool
 * (kvstack.model.model.Indexer.select_in_pool): its kb spans [b, kb] in ascending order,
 * their kb * bs entries scored by kv_index_scores_at (query q [b, h, d], head weights w
 * [b, h]; entries at or past held[s] -inf), the best k (kv_select_topk: ties to the
 * earlier entry, ascending, -1 for none) as entries: out [b, k]. */
void kv_select_in_pool(const float *q, const float *w, const uint8_t *pool, int64_t per,
                       int64_t row_bytes, const int64_t *table, int64_t max_blocks,
                       const int64_t *held, const int64_t *spans, int64_t kb, int64_t bs,
                       int64_t b, int64_t h, int64_t d, int64_t block, int packed,
                       const float *elem, const float *scale, int64_t k, int64_t *out) {
    const int64_t n = kb * bs;
    int64_t *entries = malloc((size_t)(2 * n + k + kb) * sizeof(int64_t));
    float *scores = malloc((size_t)n * sizeof(float));
    if (!entries || !scores) abort();
    int64_t *heap = entries + n, *chosen = heap + n, *sorted = chosen + k;
    for (int64_t s = 0; s < b; s++) {
        memcpy(sorted, spans + s * kb, (size_t)kb * sizeof(int64_t));
        qsort(sorted, (size_t)kb, sizeof(int64_t), ascending);
        for (int64_t j = 0; j < kb; j++)
            for (int64_t i = 0; i < bs; i++) entries[j * bs + i] = sorted[j] * bs + i;
        kv_index_scores_at(q + s * h * d, w + s * h, pool, per, row_bytes,
                           table + s * max_blocks, max_blocks, held + s, entries, n, 1, h, d,
                           block, packed, elem, scale, scores, 1);
        kv_select_topk(scores, 1, n, k, heap, chosen);
        for (int64_t j = 0; j < k; j++) out[s * k + j] = chosen[j] >= 0 ? entries[chosen[j]] : -1;
    }
    free(entries);
    free(scores);
}

/* ---- a MoE sublayer whole (kvstack.model.model.MoE with float weights) -----------------
 * The router (logits / temp, scored by softmax (0), sigmoid (1) or sqrt(softplus) (2),
 * the top k of score + bias in descending order, ties to the lower expert, weights the
 * chosen scores, renormalised when asked, times route_scale); each (token, expert) pair's
 * w2[e] (silu(clamp(w1[e] x)) * clamp(w3[e] x) * weight), with w1, w3 [E, inter, dim] and
 * w2 [E, dim, inter] read where they lie; the pairs of a token added in its order; then
 * the shared expert (shared_inter > 0: s1, s3 [inter, dim], s2 [dim, inter], unweighted)
 * added: out [n, dim]. An expert's pairs run together, each weight row read once for all
 * the tokens that chose it. limit > 0 clamps the gate from above and the up branch to
 * +-limit. The experts' and shared expert's weights are float32, or bf16 where wbf16 says
 * so (the router's stay float32). scratch: 2 * E + 2 * n * k + n * k * (max(inter,
 * shared_inter) + 2 * dim) floats (with k >= 1); ints: 3 * n * k int64. */

static inline void route(const float *xt, int64_t dim, const float *gate_w, const float *bias,
                         int64_t n_experts, int score_func, float temp, int64_t k,
                         int renormalise, float route_scale, float *scores, float *ranked,
                         int64_t *chosen, float *weights) {
    float top = -INFINITY;
    for (int64_t e = 0; e < n_experts; e++) {
        scores[e] = dot_lanes(xt, gate_w + e * dim, dim) / temp;
        if (scores[e] > top) top = scores[e];
    }
    if (score_func == 0) {
        float total = 0.0f;
        for (int64_t e = 0; e < n_experts; e++) total += (scores[e] = expf(scores[e] - top));
        for (int64_t e = 0; e < n_experts; e++) scores[e] /= total;
    } else if (score_func == 1) {
        for (int64_t e = 0; e < n_experts; e++) scores[e] = 1.0f / (1.0f + expf(-scores[e]));
    } else {
        for (int64_t e = 0; e < n_experts; e++)
            scores[e] = sqrtf(scores[e] > 20.0f ? scores[e] : log1pf(expf(scores[e])));
    }
    for (int64_t e = 0; e < n_experts; e++) ranked[e] = scores[e] + bias[e];
    float total = 0.0f;
    for (int64_t j = 0; j < k; j++) {  /* k is small: a pass per pick */
        int64_t best = -1;
        for (int64_t e = 0; e < n_experts; e++)
            if (ranked[e] == ranked[e] && (best < 0 || ranked[e] > ranked[best])) best = e;
        if (best < 0) best = 0;
        ranked[best] = NAN;
        chosen[j] = best;
        weights[j] = scores[best];
        total += weights[j];
    }
    for (int64_t j = 0; j < k; j++)
        weights[j] = (renormalise && k > 1 ? weights[j] / (total + 1e-20f) : weights[j])
                     * route_scale;
}

/* SwiGLU of one expert (w1, w3 [inter, dim], w2 [dim, inter], float32 or, where wbf16
 * says so, bf16) for m inputs (rows of x [*, dim] at index[p], weight weights[p] or 1
 * without): ys [m, dim]. hidden: [m, inter]. */
static void expert_rows(const float *x, int64_t dim, const int64_t *index,
                        const float *weights, int64_t m, const void *w1, const void *w2,
                        const void *w3, int wbf16, int64_t inter, float limit, float *hidden,
                        float *ys) {
    for (int64_t i = 0; i < inter; i++) {
        for (int64_t p = 0; p < m; p++) {
            const float *xt = x + index[p] * dim;
            float gate = dot_row(xt, w1, wbf16, i, dim), up = dot_row(xt, w3, wbf16, i, dim);
            if (limit > 0) {
                if (gate > limit) gate = limit;
                up = up > limit ? limit : (up < -limit ? -limit : up);
            }
            const float h = (gate / (1.0f + expf(-gate))) * up;
            hidden[p * inter + i] = weights ? h * weights[p] : h;
        }
    }
    for (int64_t d = 0; d < dim; d++)
        for (int64_t p = 0; p < m; p++)
            ys[p * dim + d] = dot_row(hidden + p * inter, w2, wbf16, d, inter);
}

void kv_moe(const float *x, int64_t n, int64_t dim, const float *gate_w, const float *bias,
            int64_t n_experts, int score_func, float temp, int64_t k, int renormalise,
            float route_scale, const void *w1, const void *w2, const void *w3,
            int64_t inter, const void *s1, const void *s2, const void *s3,
            int64_t shared_inter, float limit, int wbf16, float *scratch, int64_t *ints,
            float *out) {
    const int64_t expert_bytes = inter * dim * (wbf16 ? 2 : 4);  /* one expert's w1, w2, w3 */
    const int64_t widest = inter > shared_inter ? inter : shared_inter, pairs = n * k;
    float *scores = scratch, *ranked = scores + n_experts, *weights = ranked + n_experts;
    float *pair_weights = weights + pairs, *hidden = pair_weights + pairs;
    float *rows = hidden + pairs * widest, *ys = rows + pairs * dim;
    int64_t *chosen = ints, *members = chosen + pairs, *tokens = members + pairs;
    for (int64_t t = 0; t < n; t++)
        route(x + t * dim, dim, gate_w, bias, n_experts, score_func, temp, k, renormalise,
              route_scale, scores, ranked, chosen + t * k, weights + t * k);
    for (int64_t e = 0; e < n_experts; e++) {  /* ys row t * k + j: pair (t, j)'s output */
        int64_t m = 0;
        for (int64_t q = 0; q < pairs; q++)
            if (chosen[q] == e) {
                members[m] = q;
                tokens[m] = q / k;
                pair_weights[m++] = weights[q];
            }
        if (m == 0) continue;
        expert_rows(x, dim, tokens, pair_weights, m, (const char *)w1 + e * expert_bytes,
                    (const char *)w2 + e * expert_bytes, (const char *)w3 + e * expert_bytes,
                    wbf16, inter, limit, hidden, rows);
        for (int64_t p = 0; p < m; p++)
            memcpy(ys + members[p] * dim, rows + p * dim, (size_t)dim * sizeof(float));
    }
    for (int64_t t = 0; t < n; t++) {  /* a token's pairs added in its order */
        float *o = out + t * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = k ? ys[t * k * dim + d] : 0.0f;
        for (int64_t j = 1; j < k; j++)
            for (int64_t d = 0; d < dim; d++) o[d] += ys[(t * k + j) * dim + d];
    }
    if (shared_inter > 0) {
        for (int64_t t = 0; t < n; t++) tokens[t] = t;
        expert_rows(x, dim, tokens, NULL, n, s1, s2, s3, wbf16, shared_inter, limit, hidden,
                    rows);
        for (int64_t i = 0; i < n * dim; i++) out[i] += rows[i];
    }
}

/* One new entry per sequence into its window ring (kvstack.cache.rows.WindowRings.write_at):
 * entry s of x [b, d] quantised (kv_quantize) straight into row positions[s] % w of ring
 * slot slots[s] (rings [n_slots, w, row bytes]), that row's position set in ring_pos
 * [n_slots, w], and the values a read gives back into values [b, d]. */
void kv_ring_write(const float *x, int64_t b, int64_t d, int element, int scale_kind,
                   int64_t block, const float *elem, const float *scale_table, uint8_t *rings,
                   int64_t *ring_pos, int64_t w, const int64_t *slots,
                   const int64_t *positions, float *values) {
    const int64_t row_bytes = (element == 0 ? d / 2 : d) + d / block;
    for (int64_t s = 0; s < b; s++) {
        const int64_t row = slots[s] * w + positions[s] % w;
        kv_quantize(x + s * d, 1, d, element, scale_kind, block, elem, scale_table,
                    rings + row * row_bytes, values + s * d);
        ring_pos[row] = positions[s];
    }
}

/* A decode step's window entries x [b, d] written into their rings (kv_ring_write, with
 * kv_quantize's element and scale_kind of the ring's block-scaled format), then
 * kernels.c's kv_sparse_attention over the rings with them: the two calls in one, row
 * by row, each row attending right after its own write. Rows of one sequence at
 * consecutive positions (a verify of several tokens) then see each other as sequential
 * steps would: a row's later neighbours have not yet overwritten the ring rows it still
 * reads. Such rows share their decoded ring rows (kv_sparse_attention_cached): each is
 * decoded once, and again only where a row of theirs wrote it. */
void kv_ring_write_attend(const float *x, int element, int scale_kind, const float *q,
                          const float *sink, uint8_t *ring, int64_t ring_bytes,
                          int64_t *ring_pos, const int64_t *slots, const int64_t *positions,
                          int64_t w, int64_t window_size, int64_t ring_block, int ring_packed,
                          const float *ring_elem, const float *ring_scale,
                          const uint8_t *pool, int64_t per, int64_t kv_bytes,
                          const int64_t *block_table, int64_t max_blocks,
                          const int64_t *selected, int64_t k, int64_t kv_block, int kv_packed,
                          const float *kv_elem, const float *kv_scale, int64_t b, int64_t h,
                          int64_t d, float scale, float *rows, float *logits, float *out,
                          int threads) {
    float *values = malloc((size_t)d * sizeof(float));
    float *ring_vals = malloc((size_t)(w * d) * sizeof(float));  /* a slot's decoded rows */
    uint8_t *have = malloc((size_t)w);
    if (!values || !ring_vals || !have) abort();
    for (int64_t s = 0; s < b; s++) {
        if (s == 0 || slots[s] != slots[s - 1]) memset(have, 0, (size_t)w);
        kv_ring_write(x + s * d, 1, d, element, scale_kind, ring_block, ring_elem, ring_scale,
                      ring, ring_pos, w, slots + s, positions + s, values);
        have[positions[s] % w] = 0;  /* rewritten: decoded again from its bytes */
        kv_sparse_attention_cached(
            q + s * h * d, sink, ring, ring_bytes, ring_pos, slots + s, positions + s, w,
            window_size, ring_block, ring_packed, ring_elem, ring_scale, pool, per, kv_bytes,
            block_table + s * max_blocks, max_blocks, selected ? selected + s * k : NULL, k,
            kv_block, kv_packed, kv_elem, kv_scale, 1, h, d, scale, rows, logits,
            out + s * h * d, threads, ring_vals, have);
    }
    free(have);
    free(ring_vals);
    free(values);
}

/* One new entry per sequence into a stream's pool (kvstack.cache.batch.DecodeBatch's
 * append_stream): entry s of x [b, d] quantised (kv_quantize) straight into row
 * offsets[s] of block blocks[s] of pool [blocks, per, row bytes], and the values a read
 * gives back into values [b, d]. */
void kv_stream_write(const float *x, int64_t b, int64_t d, int element, int scale_kind,
                     int64_t block, const float *elem, const float *scale_table, uint8_t *pool,
                     int64_t per, const int64_t *blocks, const int64_t *offsets,
                     float *values) {
    const int64_t row_bytes = (element == 0 ? d / 2 : d) + d / block;
    for (int64_t s = 0; s < b; s++)
        kv_quantize(x + s * d, 1, d, element, scale_kind, block, elem, scale_table,
                    pool + (blocks[s] * per + offsets[s]) * row_bytes,
                    values ? values + s * d : NULL);
}

/* A layer's feed-forward half with its hyper-connection, for n tokens of h residual
 * copies x [n, h, dim] (kvstack.model.model.Layer.forward after the attention half):
 * the mixes (kv_hc_mixes), whose pre goes to pre [n, h]; the copies collapsed with
 * collapse_pre [n, h] (single-pass V4.1: the attention half's pre) or, NULL, with the
 * mixes' own pre; RMSNorm (norm_w, norm_eps); the float feed-forward (kv_moe: router,
 * routed and shared experts; n_experts = 0 and k = 0, a dense FFN of the shared weights
 * alone); spread back over the copies (kv_hc_post): out [n, h, dim]. Without a
 * hyper-connection (fn NULL, h = 1, pre untouched) the residual x [n, dim] goes into the
 * norm itself and out = x + the feed-forward's output. The same calls in
 * the same order as the separate ones the model otherwise makes, so the same floats.
 * wbf16: kv_moe's. scratch and ints: kv_moe's, or, dense, n * shared_inter floats and n
 * int64. */
void kv_ffn_block(const float *x, int64_t n, int64_t h, int64_t dim, const float *fn,
                  const float *scale, const float *base, float norm_eps, float hc_eps,
                  int64_t iters, const float *collapse_pre, const float *norm_w,
                  const float *gate_w, const float *bias, int64_t n_experts, int score_func,
                  float temp, int64_t k, int renormalise, float route_scale, const void *w1,
                  const void *w2, const void *w3, int64_t inter, const void *s1,
                  const void *s2, const void *s3, int64_t shared_inter, float limit,
                  int wbf16, float *scratch, int64_t *ints, float *pre, float *out,
                  int threads) {
    float *post = malloc((size_t)(n * h + n * h * h + 3 * n * dim) * sizeof(float));
    if (!post) abort();
    float *comb = post + n * h, *y = comb + n * h * h, *normed = y + n * dim;
    float *ffn = normed + n * dim;
    if (fn) {
        kv_hc_mixes(x, n, h, dim, fn, scale, base, norm_eps, hc_eps, iters, pre, post, comb,
                    threads);
        kv_hc_collapse(x, collapse_pre ? collapse_pre : pre, n, h, dim, y);
    } else {
        memcpy(y, x, (size_t)(n * dim) * sizeof(float));
    }
    kv_rmsnorm(y, n, dim, norm_w, norm_eps, normed);
    if (n_experts > 0) {
        kv_moe(normed, n, dim, gate_w, bias, n_experts, score_func, temp, k, renormalise,
               route_scale, w1, w2, w3, inter, s1, s2, s3, shared_inter, limit, wbf16, scratch,
               ints, ffn);
    } else {  /* dense: scratch holds the hidden rows [n, shared_inter] */
        for (int64_t t = 0; t < n; t++) ints[t] = t;
        expert_rows(normed, dim, ints, NULL, n, s1, s2, s3, wbf16, shared_inter, limit, scratch,
                    ffn);
    }
    if (fn)
        kv_hc_post(ffn, x, post, comb, n, h, dim, out);
    else
        for (int64_t i = 0; i < n * dim; i++) out[i] = x[i] + ffn[i];
    free(post);
}

/* A layer's attention half up to its attention, with its hyper-connection, for n tokens
 * of h residual copies x [n, h, dim]: the mixes (pre, post, comb: kv_hc_mixes), the copies
 * collapsed with collapse_pre (single-pass V4.1: the previous sublayer's pre) or, NULL,
 * the mixes' own pre, RMSNorm (norm_w) into y [n, dim], then kv_attention_in on y (qr, q,
 * window). The calls the model otherwise makes one by one, in the same order. wbf16:
 * kv_attention_in's. */
void kv_attention_block_in(const float *x, int64_t n, int64_t h, int64_t dim,
                           const float *fn, const float *scale, const float *base,
                           float norm_eps, float hc_eps, int64_t iters,
                           const float *collapse_pre, const float *norm_w, const void *wq_a,
                           const float *q_norm, int64_t rank, const void *wq_b,
                           int64_t heads, int64_t d, const void *wkv, const float *kv_norm,
                           const int64_t *positions, const double *freqs, int64_t half,
                           float *pre, float *post, float *comb, float *y, float *qr,
                           float *q, float *window, int wbf16, int threads) {
    kv_hc_mixes(x, n, h, dim, fn, scale, base, norm_eps, hc_eps, iters, pre, post, comb,
                threads);
    kv_hc_collapse(x, collapse_pre ? collapse_pre : pre, n, h, dim, y);
    kv_rmsnorm(y, n, dim, norm_w, norm_eps, y);
    kv_attention_in(y, n, dim, wq_a, q_norm, rank, wq_b, heads, d, wkv, kv_norm, norm_eps,
                    positions, freqs, half, qr, q, window, wbf16, threads);
}

/* kv_attention_out, then its output spread over the h residual copies x [t, h, dim]
 * (kv_hc_post with post [t, h], comb [t, h, h]) into out [t, h, dim]; y [t, dim] holds
 * the projection between. wbf16: kv_attention_out's. */
void kv_attention_out_spread(float *o, int64_t t, int64_t heads, int64_t d,
                             const int64_t *positions, const double *freqs, int64_t half,
                             const void *wo_a, int64_t g, int64_t rank, const void *wo_b,
                             int64_t dim, float *low, float *y, const float *x, int64_t h,
                             const float *post, const float *comb, float *out, int wbf16,
                             int threads) {
    kv_attention_out(o, t, heads, d, positions, freqs, half, wo_a, g, rank, wo_b, dim, low, y,
                     wbf16, threads);
    kv_hc_post(y, x, post, comb, t, h, dim, out);
}

/* A float's bf16 bits as torch's conversion of a float32 tensor makes them: to nearest,
 * ties to even; any NaN to 0xffff (its vectorised conversion's, at every length). */
static inline uint16_t bf16_bits(float f) {
    const uint32_t u = bits_of(f);
    if (f != f) return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* n rows of `width` values into packed rows of the cache's format: bf16 (element < 0)
 * or a block-scaled one (kv_quantize's element, scale_kind, block and tables). */
static void pack_rows(const float *x, int64_t width, int element, int scale_kind,
                      int64_t block, const float *elem, const float *scale_table,
                      uint8_t *row) {
    if (element >= 0) {
        kv_quantize(x, 1, width, element, scale_kind, block, elem, scale_table, row, NULL);
        return;
    }
    for (int64_t i = 0; i < width; i++) {
        const uint16_t bits = bf16_bits(x[i]);
        row[2 * i] = (uint8_t)(bits & 0xff);
        row[2 * i + 1] = (uint8_t)(bits >> 8);
    }
}

/* One decode step of a dense layer's attention half (kvstack.model.model.DenseAttention,
 * the dense control's) for b sequences, one residual each, x [b, dim] at positions [b]:
 *   y = RMSNorm(x) (norm_w, eps)
 *   q [b, heads, d] = rope(y wq^T), k [b, kv_heads * d] = rope(y wk^T), v = y wv^T
 *   k and v packed (pack_rows) into row new_offset[s] of block new_block[s] of k_pool and
 *   v_pool [blocks, per, bytes]; causal GQA of q over each sequence's entries 0 ..
 *   lengths[s] - 1 through block_table [b, max_blocks] (kv_dense_attention: logits times
 *   `scale`, rows decoded with `block`, `packed` and the tables as kernels.c reads them)
 *   out [b, dim] = x + attention wo^T.
 * The RoPE turns each head's last 2 * half values. wq, wk, wv and wo are float32, or
 * bf16 where wbf16 says so. The steps torch takes one by one, in the same order. */
void kv_dense_attention_block(const float *x, int64_t b, int64_t dim, const float *norm_w,
                              float eps, const void *wq, const void *wk, const void *wv,
                              const void *wo, int wbf16, int64_t heads, int64_t kv_heads, int64_t d,
                              const int64_t *positions, const double *freqs, int64_t half,
                              uint8_t *k_pool, uint8_t *v_pool, int64_t per, int64_t k_bytes,
                              int64_t v_bytes, const int64_t *block_table, int64_t max_blocks,
                              const int64_t *new_block, const int64_t *new_offset,
                              const int64_t *lengths, int element, int scale_kind,
                              int64_t block, int packed, const float *elem,
                              const float *scale_table, float scale, float *out,
                              int threads) {
    const int64_t width = kv_heads * d;
    int64_t longest = 0;
    for (int64_t s = 0; s < b; s++) longest = lengths[s] > longest ? lengths[s] : longest;
    float *y = malloc((size_t)(b * dim + 2 * b * heads * d + 2 * b * width
                               + 2 * longest * width + longest) * sizeof(float));
    if (!y) abort();
    float *q = y + b * dim, *k = q + b * heads * d, *v = k + b * width;
    float *attended = v + b * width, *keys = attended + b * heads * d;
    float *values = keys + longest * width, *logits = values + longest * width;
    float cs[512], sn[512];  /* half <= 512 */
    kv_rmsnorm(x, b, dim, norm_w, eps, y);
    small_linear(y, b, dim, wq, wbf16, heads * d, q, threads);
    small_linear(y, b, dim, wk, wbf16, width, k, threads);
    small_linear(y, b, dim, wv, wbf16, width, v, threads);
    for (int64_t s = 0; s < b; s++) {
        rope_angles(positions[s], freqs, half, 0, cs, sn);
        rope_rows(q + s * heads * d, heads, d, cs, sn, half, q + s * heads * d);
        rope_rows(k + s * width, kv_heads, d, cs, sn, half, k + s * width);
        const int64_t row = new_block[s] * per + new_offset[s];
        pack_rows(k + s * width, width, element, scale_kind, block, elem, scale_table,
                  k_pool + row * k_bytes);
        pack_rows(v + s * width, width, element, scale_kind, block, elem, scale_table,
                  v_pool + row * v_bytes);
    }
    kv_dense_attention(q, k_pool, v_pool, per, k_bytes, v_bytes, block_table, max_blocks,
                       lengths, block, packed, elem, scale_table, b, heads, kv_heads, d,
                       scale, keys, values, logits, attended);
    small_linear(attended, b, heads * d, wo, wbf16, dim, out, threads);
    for (int64_t i = 0; i < b * dim; i++) out[i] = x[i] + out[i];
    free(y);
}

/* y [t, out] = x [t, in] W^T for W [out, in] float32, or bf16 where `bf16` says so (a
 * checkpoint's weights, multiplied as stored: weights.c widens each in registers). */
static void weight_linear(const float *x, int64_t t, int64_t in, const void *w, int bf16,
                          int64_t out, float *y, int isa, int threads) {
    if (bf16)
        kv_packed_linear(x, t, FMT_BF16, w, NULL, out, in, 1, NULL, NULL, 0, y, isa, threads);
    else
        small_linear(x, t, in, w, 0, out, y, threads);
}

/* A decode step's compressor (kvstack.model.model.Compressor._compress_step) for b
 * sequences x [b, dim] at positions [b], ratio r: values = x wkv^T [b, d]; for r > 1
 * also gates = x wgate^T, and the entry is the per-channel softmax of the gates over the
 * slot's partial group (partial_values / partial_gates [n_slots, r - 1, d], the rows of
 * slots[s]) and the new token, weighting their values, after which the new values and
 * gates go to row min(position % r, r - 2) of the slot's group (a sequence whose token
 * completes its group starts empty: where they land does not matter). The entry
 * RMS-normalised (norm_w, norm_eps) is kv [b, d]; its index key index_norm(entry
 * wk_index^T) (index_norm_w, index_eps) is keys [b, di]; both rotated at the group's first
 * position ((position + 1) / r - 1) * r. Rows pool in order, so rows of one sequence at
 * consecutive positions pool each other as sequential steps would; the projections, which
 * no row's pooling changes, run for all rows at once, each weight read once a call.
 * wkv, wgate and wk_index are float32, or bf16 where weights_bf16 says so (`isa`: the
 * path weights.c multiplies them by). group_rows (NULL: not asked for) gets each row's new
 * values and gates [b, 2, d] (r > 1): what a store that may take tokens back rebuilds its
 * partial group from. */
void kv_compress_step(const float *x, int64_t b, int64_t dim, const int64_t *positions,
                      const int64_t *slots, int64_t r, const void *wkv, const void *wgate,
                      int64_t d, float *partial_values, float *partial_gates,
                      const float *norm_w, float norm_eps, const void *wk_index, int64_t di,
                      const float *index_norm_w, float index_eps, const double *freqs,
                      int64_t half, float *kv, float *keys, float *group_rows,
                      int weights_bf16, int isa, int threads) {
    float cs[512], sn[512];  /* half <= 512 */
    /* r > 1: every row's new values and gate logits, [b, d] each; r = 1: the values are
     * the entries, made in kv. */
    float *fresh = r > 1 ? malloc((size_t)(2 * b * d) * sizeof(float)) : NULL;
    if (r > 1 && !fresh) abort();
    float *values = r > 1 ? fresh : kv, *gates = r > 1 ? fresh + b * d : NULL;
    weight_linear(x, b, dim, wkv, weights_bf16, d, values, isa, threads);
    if (r > 1) weight_linear(x, b, dim, wgate, weights_bf16, d, gates, isa, threads);
    for (int64_t s = 0; s < b; s++) {
        float *entry = kv + s * d;
        if (r > 1) {
            const float *new_values = values + s * d, *new_gates = gates + s * d;
            float *pv = partial_values + slots[s] * (r - 1) * d;
            float *pg = partial_gates + slots[s] * (r - 1) * d;
            for (int64_t c = 0; c < d; c++) {
                float top = new_gates[c], e[64], total = 0.0f;  /* r <= 64 */
                for (int64_t j = 0; j < r - 1; j++) top = fmaxf(top, pg[j * d + c]);
                for (int64_t j = 0; j < r - 1; j++) total += (e[j] = expf(pg[j * d + c] - top));
                total += (e[r - 1] = expf(new_gates[c] - top));
                float pooled = pv[c] * (e[0] / total);
                for (int64_t j = 1; j < r - 1; j++) pooled += pv[j * d + c] * (e[j] / total);
                entry[c] = pooled + new_values[c] * (e[r - 1] / total);
            }
            int64_t fill = positions[s] % r;
            if (fill > r - 2) fill = r - 2;
            memcpy(pv + fill * d, new_values, (size_t)d * sizeof(float));
            memcpy(pg + fill * d, new_gates, (size_t)d * sizeof(float));
            if (group_rows) {
                memcpy(group_rows + s * 2 * d, new_values, (size_t)d * sizeof(float));
                memcpy(group_rows + s * 2 * d + d, new_gates, (size_t)d * sizeof(float));
            }
        }
        kv_rmsnorm(entry, 1, d, norm_w, norm_eps, entry);
    }
    free(fresh);
    weight_linear(kv, b, d, wk_index, weights_bf16, di, keys, isa, threads);
    for (int64_t s = 0; s < b; s++) {
        float *entry = kv + s * d, *key = keys + s * di;
        kv_rmsnorm(key, 1, di, index_norm_w, index_eps, key);
        const int64_t first = ((positions[s] + 1) / r - 1) * r;
        rope_angles(first, freqs, half, 0, cs, sn);
        rope_rows(entry, 1, d, cs, sn, half, entry);
        rope_rows(key, 1, di, cs, sn, half, key);
    }
}

/* kv_compress_step, then its entries kv [b, d] and index keys [b, di] quantised straight
 * into their pools (kv_stream_write's, each with its format's element, scale kind, block
 * and tables; both pools of `per` entries a block) at row offsets[s] of block blocks[s]:
 * a decode step's compressor and its stream appends in one call. */
void kv_compress_write(const float *x, int64_t b, int64_t dim, const int64_t *positions,
                       const int64_t *slots, int64_t r, const void *wkv, const void *wgate,
                       int64_t d, float *partial_values, float *partial_gates,
                       const float *norm_w, float norm_eps, const void *wk_index, int64_t di,
                       const float *index_norm_w, float index_eps, const double *freqs,
                       int64_t half, float *kv, float *keys, uint8_t *kv_pool, int kv_element,
                       int kv_scale_kind, int64_t kv_block, const float *kv_elem,
                       const float *kv_scale, uint8_t *index_pool, int index_element,
                       int index_scale_kind, int64_t index_block, const float *index_elem,
                       const float *index_scale, int64_t per, const int64_t *blocks,
                       const int64_t *offsets, float *group_rows, int weights_bf16, int isa,
                       int threads) {
    kv_compress_step(x, b, dim, positions, slots, r, wkv, wgate, d, partial_values,
                     partial_gates, norm_w, norm_eps, wk_index, di, index_norm_w, index_eps,
                     freqs, half, kv, keys, group_rows, weights_bf16, isa, threads);
    kv_stream_write(kv, b, d, kv_element, kv_scale_kind, kv_block, kv_elem, kv_scale, kv_pool,
                    per, blocks, offsets, NULL);
    kv_stream_write(keys, b, di, index_element, index_scale_kind, index_block, index_elem,
                    index_scale, index_pool, per, blocks, offsets, NULL);
}

/* An indexer's queries and head weights for t tokens (kvstack.model.model.Indexer._queries):
 * q [t, heads, di] = rope(qr [t, rank] wq^T) at positions [t], then, where a query format
 * is given (element >= 0), q + (rounded - q) with rounded its values in that format
 * (kv_quantize's, per head row: the straight-through forward); w [t, heads] = (x [t, dim]
 * wweights^T) * scale. wq and wweights are float32, or bf16 where wbf16 says so. */
void kv_index_queries(const float *qr, const float *x, int64_t t, int64_t rank, int64_t dim,
                      const void *wq, const void *wweights, int wbf16, int64_t heads, int64_t di,
                      const int64_t *positions, const double *freqs, int64_t half,
                      int element, int scale_kind, int64_t block, const float *elem,
                      const float *scale_table, float scale, float *q, float *w,
                      int threads) {
    float cs[512], sn[512];  /* half <= 512 */
    small_linear(qr, t, rank, wq, wbf16, heads * di, q, threads);
    for (int64_t i = 0; i < t; i++) {
        rope_angles(positions[i], freqs, half, 0, cs, sn);
        rope_rows(q + i * heads * di, heads, di, cs, sn, half, q + i * heads * di);
    }
    if (element >= 0) {
        float *rounded = malloc((size_t)(t * heads * di) * sizeof(float));
        if (!rounded) abort();
        kv_quantize(q, t * heads, di, element, scale_kind, block, elem, scale_table, NULL,
                    rounded);
        for (int64_t i = 0; i < t * heads * di; i++) q[i] = q[i] + (rounded[i] - q[i]);
        free(rounded);
    }
    small_linear(x, t, dim, wweights, wbf16, heads, w, threads);
    for (int64_t i = 0; i < t * heads; i++) w[i] = w[i] * scale;
}

/* A decode layer's index selection (kvstack.model.model.Attention._select of a decode
 * step: b sequences, one query each) in one call. The indexer's queries q [b, heads, di]
 * and head weights w [b, heads] (kv_index_queries' arguments, qr [b, rank] and x [b, dim]
 * at positions [b]), then by mode:
 *   0: the scores of the first n entries of the index stream (kv_index_scores' pool of
 *      keys through table; entries not yet visible at a sequence's position -inf), and
 *      their best k in topk [b, k] (kv_select_topk);
 *   1: as 0, with the candidate pool of the same scores (kv_candidate_pool, kb spans of
 *      bs entries) in spans [b, kb] first: a candidate source;
 *   2: the best k inside each sequence's candidate pool, spans [b, kb] as given
 *      (kv_select_in_pool; held [b] each sequence's entries).
 * Each step is the function the separate calls make, in their order, so the selection is
 * theirs bit for bit. */
void kv_index_select(const float *qr, const float *x, int64_t b, int64_t rank, int64_t dim,
                     const void *wq, const void *wweights, int wbf16, int64_t heads,
                     int64_t di, const int64_t *positions, const double *freqs, int64_t half,
                     int element, int scale_kind, int64_t query_block, const float *query_elem,
                     const float *query_scale, float scale, float *q, float *w, int mode,
                     const uint8_t *keys, int64_t per, int64_t row_bytes, const int64_t *table,
                     int64_t max_blocks, int64_t block, int packed, const float *elem,
                     const float *key_scale, int64_t n, int64_t ratio, const int64_t *held,
                     int64_t *spans, int64_t kb, int64_t bs, int64_t k, int64_t *topk,
                     int threads) {
    kv_index_queries(qr, x, b, rank, dim, wq, wweights, wbf16, heads, di, positions, freqs,
                     half, element, scale_kind, query_block, query_elem, query_scale, scale, q,
                     w, threads);
    if (mode == 2) {
        kv_select_in_pool(q, w, keys, per, row_bytes, table, max_blocks, held, spans, kb, bs,
                          b, heads, di, block, packed, elem, key_scale, k, topk);
        return;
    }
    const int64_t n_spans = (n + bs - 1) / bs, most = k > kb ? k : kb;
    float *scores = malloc((size_t)(b * n + n_spans) * sizeof(float));
    int64_t *heap = malloc((size_t)(most > 0 ? most : 1) * sizeof(int64_t));
    if (!scores || !heap) abort();
    kv_index_scores(q, w, keys, per, row_bytes, table, max_blocks, positions, b, heads, di,
                    block, packed, elem, key_scale, n, ratio, scores, threads);
    if (mode == 1)
        kv_candidate_pool(scores, b, 1, n, positions, b, ratio, bs, kb, scores + b * n, heap,
                          spans);
    kv_select_topk(scores, b, n, k, heap, topk);
    free(scores);
    free(heap);
}

/* The hot calls of a decode step with their arguments in one block of int64 slots, in
 * the order of the function's parameters: pointers and integers as they are, floats as the
 * bits of a double. Python's ctypes converts each argument of a call anew (about 3 us for
 * thirty); a block a call site keeps is written once, and a call then passes one pointer
 * after setting the few slots that change (native.ArgBlock). */
static inline float slot_float(int64_t bits) {
    double value;
    memcpy(&value, &bits, sizeof value);
    return (float)value;
}
#define P(i) ((void *)(intptr_t)a[i])
#define F(i) slot_float(a[i])

void kv_ffn_block_args(const int64_t *a) {
    kv_ffn_block(P(0), a[1], a[2], a[3], P(4), P(5), P(6), F(7), F(8), a[9], P(10), P(11),
                 P(12), P(13), a[14], (int)a[15], F(16), a[17], (int)a[18], F(19), P(20),
                 P(21), P(22), a[23], P(24), P(25), P(26), a[27], F(28), (int)a[29], P(30),
                 P(31), P(32), P(33), (int)a[34]);
}

void kv_attention_block_in_args(const int64_t *a) {
    kv_attention_block_in(P(0), a[1], a[2], a[3], P(4), P(5), P(6), F(7), F(8), a[9], P(10),
                          P(11), P(12), P(13), a[14], P(15), a[16], a[17], P(18), P(19),
                          P(20), P(21), a[22], P(23), P(24), P(25), P(26), P(27), P(28),
                          P(29), (int)a[30], (int)a[31]);
}

void kv_attention_out_args(const int64_t *a) {
    kv_attention_out(P(0), a[1], a[2], a[3], P(4), P(5), a[6], P(7), a[8], a[9], P(10), a[11],
                     P(12), P(13), (int)a[14], (int)a[15]);
}

void kv_attention_out_spread_args(const int64_t *a) {
    kv_attention_out_spread(P(0), a[1], a[2], a[3], P(4), P(5), a[6], P(7), a[8], a[9], P(10),
                            a[11], P(12), P(13), P(14), a[15], P(16), P(17), P(18),
                            (int)a[19], (int)a[20]);
}

void kv_sparse_attention_args(const int64_t *a) {
    kv_sparse_attention(P(0), P(1), P(2), a[3], P(4), P(5), P(6), a[7], a[8], a[9], (int)a[10],
                        P(11), P(12), P(13), a[14], a[15], P(16), a[17], P(18), a[19], a[20],
                        (int)a[21], P(22), P(23), a[24], a[25], a[26], F(27), P(28), P(29),
                        P(30), (int)a[31]);
}

void kv_ring_write_attend_args(const int64_t *a) {
    kv_ring_write_attend(P(0), (int)a[1], (int)a[2], P(3), P(4), P(5), a[6], P(7), P(8), P(9),
                         a[10], a[11], a[12], (int)a[13], P(14), P(15), P(16), a[17], a[18],
                         P(19), a[20], P(21), a[22], a[23], (int)a[24], P(25), P(26), a[27],
                         a[28], a[29], F(30), P(31), P(32), P(33), (int)a[34]);
}
void kv_dense_attention_block_args(const int64_t *a) {
    kv_dense_attention_block(P(0), a[1], a[2], P(3), F(4), P(5), P(6), P(7), P(8), (int)a[9],
                             a[10], a[11], a[12], P(13), P(14), a[15], P(16), P(17), a[18],
                             a[19], a[20], P(21), a[22], P(23), P(24), P(25), (int)a[26],
                             (int)a[27], a[28], (int)a[29], P(30), P(31), F(32), P(33),
                             (int)a[34]);
}
void kv_index_select_args(const int64_t *a) {
    kv_index_select(P(0), P(1), a[2], a[3], a[4], P(5), P(6), (int)a[7], a[8], a[9], P(10),
                    P(11), a[12], (int)a[13], (int)a[14], a[15], P(16), P(17), F(18), P(19),
                    P(20), (int)a[21], P(22), a[23], a[24], P(25), a[26], a[27], (int)a[28],
                    P(29), P(30), a[31], a[32], P(33), P(34), a[35], a[36], a[37], P(38),
                    (int)a[39]);
}

void kv_compress_write_args(const int64_t *a) {
    kv_compress_write(P(0), a[1], a[2], P(3), P(4), a[5], P(6), P(7), a[8], P(9), P(10), P(11),
                      F(12), P(13), a[14], P(15), F(16), P(17), a[18], P(19), P(20), P(21),
                      (int)a[22], (int)a[23], a[24], P(25), P(26), P(27), (int)a[28],
                      (int)a[29], a[30], P(31), P(32), a[33], P(34), P(35), P(36), (int)a[37],
                      (int)a[38], (int)a[39]);
}
/* A DSpark draft stage without hyper-connections (kvstack.model.dspark.DraftStage) for
 * the draft block x [b, kq, dim] at positions [b * kq], the calls its modules make one by
 * one, in the same order, so the same floats:
 *   y = RMSNorm(x) (attn_norm); qr, q, block = kv_attention_in(y);
 *   block's entries rounded to the window's format (kv_quantize's values);
 *   kv_draft_attention of q over window [b, w, d] (pad: each sequence's left padding)
 *   and the block's entries; kv_attention_out of it (rotated back in place);
 *   mid = x + that; then `ffn`, a kv_ffn_block argument block whose input (slot 0) and
 *   output (slot 33) this call sets: out = mid + FFN(RMSNorm(mid)).
 * scratch: y, mid [n, dim], qr [n, rank], q, heads' outputs [n, heads * d], block [n, d]
 * twice, low [n, groups * o_rank], the projection [n, dim], then w + kq row pointers and
 * heads * (w + kq) probabilities. largest [1]: the largest magnitude the rounding saw
 * (for the caller's format check). */
void kv_draft_stage(const float *x, int64_t b, int64_t kq, int64_t dim,
                     const float *attn_norm, float eps, const void *wq_a, const float *q_norm,
                     int64_t rank, const void *wq_b, int64_t heads, int64_t d,
                     const void *wkv, const float *kv_norm, const int64_t *positions,
                     const double *freqs, int64_t half, int wbf16, int element,
                     int scale_kind, int64_t scale_block, const float *elem,
                     const float *scale_table, const float *window, int64_t w,
                     const int64_t *pad, const float *sink, float scale, const void *wo_a,
                     int64_t groups, int64_t o_rank, const void *wo_b, int64_t *ffn,
                     float *scratch, float *out, float *largest, int threads) {
    const int64_t n = b * kq;
    float *y = scratch, *mid = y + n * dim, *qr = mid + n * dim, *q = qr + n * rank;
    float *heads_out = q + n * heads * d, *raw = heads_out + n * heads * d;
    float *entries = raw + n * d, *low = entries + n * d, *projected = low + n * groups * o_rank;
    const float **seen = (const float **)(((uintptr_t)(projected + n * dim) + 7) & ~(uintptr_t)7);
    float *probs = (float *)(seen + w + kq);
    kv_rmsnorm(x, n, dim, attn_norm, eps, y);
    kv_attention_in(y, n, dim, wq_a, q_norm, rank, wq_b, heads, d, wkv, kv_norm, eps,
                    positions, freqs, half, qr, q, raw, wbf16, threads);
    *largest = kv_quantize(raw, n, d, element, scale_kind, scale_block, elem, scale_table,
                           NULL, entries);
    kv_draft_attention(q, window, entries, pad, sink, b, kq, w, heads, d, scale, seen, probs,
                       heads_out, threads);
    kv_attention_out(heads_out, n, heads, d, positions, freqs, half, wo_a, groups, o_rank,
                     wo_b, dim, low, projected, wbf16, threads);
    for (int64_t i = 0; i < n * dim; i++) mid[i] = x[i] + projected[i];
    ffn[0] = (int64_t)(intptr_t)mid;
    ffn[33] = (int64_t)(intptr_t)out;
    ffn[34] = threads;
    kv_ffn_block_args(ffn);
}

/* A draft block's tokens from its last stage's output x [b, k, dim] (greedy drafts,
 * kvstack.model.dspark.Draft.block): logits [b, k, vocab] = head(RMSNorm(x)) (norm_w,
 * eps; head [vocab, dim], float32 or, where wbf16 says so, bf16); then position by
 * position the Markov head's bias after the previous token (the first previous token
 * first[s]) added to its logits and the largest of them chosen (the first index of the
 * maximum over the finite logits; 0 if none is): tokens [b, k + 1], the given token
 * first. The bias is the token's markov_embed [vocab, rank] row times markov_columns
 * [rank, vocab], the head transposed: a sum of rank rows of vocab floats, where the
 * head's own rows are rank-long dot products. confidence [b, k]: conf_w [dim + rank] .
 * (x, the Markov embedding of the token before). scratch: k * dim + vocab floats. */
void kv_draft_head(const float *x, int64_t b, int64_t k, int64_t dim, const float *norm_w,
                   float eps, const void *head, int64_t vocab, const float *markov_embed,
                   const float *markov_columns, int64_t rank, const float *conf_w, int wbf16,
                   const int64_t *first, float *scratch, float *logits, int64_t *tokens,
                   float *confidence, int threads) {
    float *normed = scratch, *bias = scratch + k * dim;
    for (int64_t s = 0; s < b; s++) {
        const float *xs = x + s * k * dim;
        float *ls = logits + s * k * vocab;
        int64_t *ts = tokens + s * (k + 1);
        kv_rmsnorm(xs, k, dim, norm_w, eps, normed);
        small_linear(normed, k, dim, head, wbf16, vocab, ls, threads);
        ts[0] = first[s];
        for (int64_t i = 0; i < k; i++) {
            const float *embed = markov_embed + ts[i] * rank;
            float *row = ls + i * vocab;
            for (int64_t v = 0; v < vocab; v++) bias[v] = embed[0] * markov_columns[v];
            for (int64_t j = 1; j < rank; j++) {
                const float e = embed[j], *column = markov_columns + j * vocab;
                for (int64_t v = 0; v < vocab; v++) bias[v] += e * column[v];
            }
            int64_t best = -1;
            for (int64_t v = 0; v < vocab; v++) {
                row[v] += bias[v];
                if (isfinite(row[v]) && (best < 0 || row[v] > row[best])) best = v;
            }
            ts[i + 1] = best < 0 ? 0 : best;
            confidence[s * k + i] = dot_lanes(xs + i * dim, conf_w, dim) +
                                    dot_lanes(embed, conf_w + dim, rank);
        }
    }
}

void kv_draft_stage_args(const int64_t *a) {
    kv_draft_stage(P(0), a[1], a[2], a[3], P(4), F(5), P(6), P(7), a[8], P(9), a[10], a[11],
                   P(12), P(13), P(14), P(15), a[16], (int)a[17], (int)a[18], (int)a[19],
                   a[20], P(21), P(22), P(23), a[24], P(25), P(26), F(27), P(28), a[29],
                   a[30], P(31), P(32), P(33), P(34), P(35), (int)a[36]);
}
#undef P
#undef F


/* Each row's greedy token of logits [rows, vocab]: the first index of the row's maximum
 * (torch.argmax's), or -1 where the row holds a NaN or an infinity (a fault the engine
 * raises on). One pass over the logits, where torch made three ops and a host copy. */
void kv_greedy(const float *logits, int64_t rows, int64_t vocab, int64_t *ids) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * vocab;
        int64_t best = 0;
        for (int64_t j = 0; j < vocab; j++) {
            if (!isfinite(row[j])) {
                best = -1;
                break;
            }
            if (row[j] > row[best]) best = j;
        }
        ids[r] = best;
    }
}
