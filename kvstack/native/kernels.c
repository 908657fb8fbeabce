/* CPU kernels of the decode step, in C: what torch does in several passes over float
 * copies, done in one pass over the packed bytes.
 *
 * The decode tables are the formats' own (kvstack.formats.codecs), passed in by the
 * caller, so a value here is table[code] * table[scale], the same float32 product the
 * torch codecs compute: reads are bit for bit the torch backend's. Scores and matmuls
 * add in another order than torch's BLAS does, so they agree within float rounding.
 *
 * A row is a cache entry's packed bytes: `width` codes (two E2M1 codes a byte, element
 * 2i in the low nibble, when `packed`; else one byte each), then one scale byte per
 * `block` elements. Built by kvstack/native/__init__.py (cc -O3 -march=native -fopenmp).
 */
#include "kernels.h"
#include "vec.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline void decode_row(const uint8_t *row, int64_t width, int64_t block, int packed,
                              const float *elem, const float *scale, float *out) {
    const uint8_t *scales = row + (packed ? width / 2 : width);
    for (int64_t b = 0; b < width / block; b++) {
        const float s = scale[scales[b]];
        float *o = out + b * block;
        if (packed) {
            const uint8_t *c = row + b * block / 2;
            for (int64_t i = 0; i < block / 2; i++) {
                o[2 * i] = elem[c[i] & 15] * s;
                o[2 * i + 1] = elem[c[i] >> 4] * s;
            }
        } else {
            const uint8_t *c = row + b * block;
            for (int64_t i = 0; i < block; i++) o[i] = elem[c[i]] * s;
        }
    }
}

/* out [n, width] = the values of rows data[index[i]] (rows of row_bytes). */
void kv_read_rows(const uint8_t *data, int64_t row_bytes, const int64_t *index, int64_t n,
                  int64_t width, int64_t block, int packed, const float *elem,
                  const float *scale, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 256)
    for (int64_t i = 0; i < n; i++)
        decode_row(data + index[i] * row_bytes, width, block, packed, elem, scale,
                   out + i * width);
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* Lane i of the result: the sum of v[i]'s eight lanes. */
static inline __m256 hsum8(const __m256 v[8]) {
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20),
                         _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* keys [8, D] = the values of eight packed E2M1 rows (D and block multiples of 32): each
 * code byte's two nibbles become twice their values as int8 by one shuffle (E2M1 values
 * times 2 are the integers 0..12), and each eight of them float32 times half the block's
 * scale -- exactly table[code] * table[scale], a power of two apart. */
static void decode_e2m1_8(const uint8_t *rows, int64_t row_bytes, int64_t D, int64_t block,
                          const __m128i twice, const float *scale, float *keys) {
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int i = 0; i < 8; i++) {
        const uint8_t *row = rows + i * row_bytes;
        float *key = keys + i * D;
        for (int64_t d = 0; d < D; d += 32) {
            const __m256 half = _mm256_set1_ps(scale[row[D / 2 + d / block]] * 0.5f);
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + d / 2));
            const __m128i lo = _mm_shuffle_epi8(twice, _mm_and_si128(bytes, low));
            const __m128i hi = _mm_shuffle_epi8(twice,
                                                _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
            const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);
            const __m128i parts[4] = {first, _mm_srli_si128(first, 8), second,
                                      _mm_srli_si128(second, 8)};
            for (int p = 0; p < 4; p++)
                _mm256_storeu_ps(key + d + 8 * p, _mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[p])), half));
        }
    }
}

/* Lane i: sum_h w[h] relu(q[h] . keys[i]) of eight decoded keys [8, D]. Eight keys a
 * pass, so each load of q serves eight independent multiply-add chains and one
 * transposing sum (hsum8) finishes eight dots. */
static __m256 scores_8(const float *keys, int64_t D, const float *q, const float *w,
                       int64_t H) {
    __m256 total = _mm256_setzero_ps();
    for (int64_t h = 0; h < H; h++) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qd = _mm256_loadu_ps(q + h * D + d);
            for (int i = 0; i < 8; i++)
                acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(keys + i * D + d), acc[i]);
        }
        /* max(0, x) returns x where x is NaN: relu keeps a NaN, as torch's does. */
        const __m256 relu = _mm256_max_ps(_mm256_setzero_ps(), hsum8(acc));
        total = _mm256_add_ps(total, _mm256_mul_ps(_mm256_set1_ps(w[h]), relu));
    }
    return total;
}
#endif

/* score(b, j) = sum_h w[b, h] relu(q[b, h] . key(b, j)) over entries j < n_entries of a
 * stream whose entry j of sequence b is row j % per of block table[b, j / per] of pool
 * [blocks, per, row_bytes]; entries of an incomplete group (j >= (positions[b] + 1) /
 * ratio) score -inf. q [B, H, D], w [B, H], out [B, n_entries]. relu keeps a NaN, as
 * torch's does. */
void kv_index_scores(const float *q, const float *w, const uint8_t *pool, int64_t per,
                     int64_t row_bytes, const int64_t *table, int64_t max_blocks,
                     const int64_t *positions, int64_t B, int64_t H, int64_t D,
                     int64_t block, int packed, const float *elem, const float *scale,
                     int64_t n_entries, int64_t ratio, float *out, int threads) {
    const int64_t n_blocks = (n_entries + per - 1) / per;
#ifdef __AVX2__
    const int fast = packed && D % 32 == 0 && block % 32 == 0;
    int8_t twice_values[16];
    for (int i = 0; i < 16; i++) twice_values[i] = (int8_t)(elem[i] * 2.0f);
    const __m128i twice = _mm_loadu_si128((const __m128i *)twice_values);
#endif
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = 0; t < n_blocks; t++) {
            const int64_t held = (positions[b] + 1) / ratio;
            const uint8_t *rows = pool + table[b * max_blocks + t] * per * row_bytes;
            const float *qb = q + b * H * D, *wb = w + b * H;
            float *ob = out + b * n_entries + t * per;
            const int64_t count = per < n_entries - t * per ? per : n_entries - t * per;
            int64_t e = 0;
#ifdef __AVX2__
            if (fast) {
                float keys[8 * D], scores[8];
                for (; e + 8 <= count; e += 8) {
                    decode_e2m1_8(rows + e * row_bytes, row_bytes, D, block, twice, scale, keys);
                    _mm256_storeu_ps(scores, scores_8(keys, D, qb, wb, H));
                    for (int i = 0; i < 8; i++)
                        ob[e + i] = t * per + e + i < held ? scores[i] : -INFINITY;
                }
            }
#endif
            float key[D], dots[H];
            for (; e < count; e++) {
                const int64_t j = t * per + e;
                if (j >= held) {
                    ob[e] = -INFINITY;
                    continue;
                }
                decode_row(rows + e * row_bytes, D, block, packed, elem, scale, key);
                for (int64_t h = 0; h < H; h++) {
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; d++) s += qb[h * D + d] * key[d];
                    dots[h] = s;
                }
                float total = 0.0f;
                for (int64_t h = 0; h < H; h++)
                    total += wb[h] * (dots[h] < 0.0f ? 0.0f : dots[h]);
                ob[e] = total;
            }
        }
    }
}

/* score(b, i) = sum_h w[b, h] relu(q[b, h] . key(b, entries[b, i])) of each sequence's
 * own entries (entries [B, K]: row e % per of block table[b, e / per] of pool [blocks,
 * per, row_bytes]), -inf for an entry at or past the sequence's count held[b] (or outside
 * the table, which is never read): a candidate pool's scores, read where its keys lie.
 * q [B, H, D], w [B, H], out [B, K]; relu keeps a NaN, as torch's does. */
void kv_index_scores_at(const float *q, const float *w, const uint8_t *pool, int64_t per,
                        int64_t row_bytes, const int64_t *table, int64_t max_blocks,
                        const int64_t *held, const int64_t *entries, int64_t K, int64_t B,
                        int64_t H, int64_t D,
                        int64_t block, int packed, const float *elem, const float *scale,
                        float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        const float *qb = q + b * H * D, *wb = w + b * H;
        /* Entries a sequence does not hold score -inf and are never read. */
        const int64_t count = held[b] < max_blocks * per ? held[b] : max_blocks * per;
        float keys[8 * D], dots[H];
        int64_t i = 0;
#ifdef __AVX2__
        if (D % 8 == 0)
            for (; i + 8 <= K; i += 8) {
                for (int r = 0; r < 8; r++) {
                    int64_t e = entries[b * K + i + r];
                    e = e >= 0 && e < count ? e : 0;  /* scored, then set to -inf below */
                    decode_row(pool + (table[b * max_blocks + e / per] * per + e % per) * row_bytes,
                               D, block, packed, elem, scale, keys + r * D);
                }
                _mm256_storeu_ps(out + b * K + i, scores_8(keys, D, qb, wb, H));
                for (int r = 0; r < 8; r++) {
                    const int64_t e = entries[b * K + i + r];
                    if (e < 0 || e >= count) out[b * K + i + r] = -INFINITY;
                }
            }
#endif
        for (; i < K; i++) {
            const int64_t e = entries[b * K + i];
            if (e < 0 || e >= count) {
                out[b * K + i] = -INFINITY;
                continue;
            }
            decode_row(pool + (table[b * max_blocks + e / per] * per + e % per) * row_bytes, D,
                       block, packed, elem, scale, keys);
            for (int64_t h = 0; h < H; h++) dots[h] = dot_lanes(qb + h * D, keys, D);
            float total = 0.0f;
            for (int64_t h = 0; h < H; h++) total += wb[h] * (dots[h] < 0.0f ? 0.0f : dots[h]);
            out[b * K + i] = total;
        }
    }
}

/* w[i] as float32, stored so or as bf16. */
static inline float weight_at(const void *w, int64_t i, int wbf16) {
    if (!wbf16) return ((const float *)w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* out rows m0 .. m0 + rows - 1 (rows <= 4) and columns n0 .. n0 + 3 of x times w[g] stored
 * [N, K] (K a multiple of 16; float32, or bf16 where wbf16 says so): sixteen accumulators
 * of sixteen lanes, each load of x serving four multiply-adds and each load of w four. A
 * missing row repeats row m0 and is not stored. */
static inline void dots_4x4(const float *x, int64_t K, const void *wg, int wbf16, int64_t sn,
                            int64_t m0, int rows, int64_t n0, float *out, int64_t N) {
    v16f a[4][4] = {{{0}}};
    const float *xr[4];
    for (int r = 0; r < 4; r++) xr[r] = x + (m0 + (r < rows ? r : 0)) * K;
    for (int64_t k = 0; k < K; k += 16) {
        const v16f u[4] = {load16(xr[0] + k), load16(xr[1] + k), load16(xr[2] + k),
                           load16(xr[3] + k)};
        for (int c = 0; c < 4; c++) {
            const v16f wc = wbf16 ? widen16((const uint16_t *)wg + (n0 + c) * sn + k)
                                  : load16((const float *)wg + (n0 + c) * sn + k);
            for (int r = 0; r < 4; r++) a[r][c] = fma16(u[r], wc, a[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) out[(m0 + r) * N + n0 + c] = sum16(a[r][c]);
}

/* Eight rows m0 .. m0 + 7 of x [M, K] (rows past `rows` repeat row m0 and are not stored)
 * times a band of 32 columns packed k-major (panel [K, 32] float32): out columns n0 ..
 * n0 + 31. Each x value is broadcast once against two vectors of the panel: sixteen
 * accumulators, and each output is the sum over k in order, one fused multiply-add a
 * term. */
static inline void band_8x32(const float *x, int64_t K, const float *panel, int64_t m0,
                             int rows, int64_t n0, float *out, int64_t N) {
    v16f a[8][2] = {{{0}}};
    const float *xr[8];
    for (int r = 0; r < 8; r++) xr[r] = x + (m0 + (r < rows ? r : 0)) * K;
    for (int64_t k = 0; k < K; k++) {
        const v16f w0 = load16(panel + k * 32), w1 = load16(panel + k * 32 + 16);
        for (int r = 0; r < 8; r++) {
            const v16f b = splat16(xr[r][k]);
            a[r][0] = fma16(b, w0, a[r][0]);
            a[r][1] = fma16(b, w1, a[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        __builtin_memcpy(out + (m0 + r) * N + n0, &a[r][0], sizeof a[r][0]);
        __builtin_memcpy(out + (m0 + r) * N + n0 + 16, &a[r][1], sizeof a[r][1]);
    }
}

/* A group of at least PACKED_ROWS rows packs its weights; below, the packing costs more
 * than the register tile saves (bf16 experts 256 x 256, one thread: 24 rows a group ran
 * at 44-56 GFLOP/s packed against the dots' 72, 48 rows at 75 against 73, 96 at 90
 * against 74). */
enum { PACKED_ROWS = 48 };

/* out [M, N]: rows ends[g-1]..ends[g]-1 of x [M, K] times w[g] [K, N], where w[g][k][n]
 * lies at element g * sg + k * sk + n * sn of w (float32, or bf16 where wbf16 says so: a
 * checkpoint's or a narrowed engine's experts, widened as they are read, never copied
 * whole). A task is a group's band of 32 columns. A band of a large group is packed
 * k-major as float32 (K * 128 bytes, read again for every eight rows of x) and runs
 * band_8x32, as a GEMM library's packed panels and register tiles do; a small group's
 * outputs are dots of contiguous rows (sk == 1: experts stored [N, K]), sixteen at a time
 * (dots_4x4); any other layout one dot per output. */
void kv_grouped_mm(const float *x, int64_t K, const void *w, int64_t G, int64_t N,
                   int64_t sg, int64_t sk, int64_t sn, const int32_t *ends, float *out,
                   int wbf16, int threads) {
    const int64_t esize = wbf16 ? 2 : 4, bands = (N + 31) / 32;
    const int dots = sk == 1 && K % 16 == 0 && N % 4 == 0;
#pragma omp parallel num_threads(threads)
    {
        float *panel = N % 32 == 0 ? malloc((size_t)K * 32 * sizeof(float)) : NULL;
        if (N % 32 == 0 && !panel) abort();
#pragma omp for collapse(2) schedule(static)
        for (int64_t g = 0; g < G; g++) {
            for (int64_t band = 0; band < bands; band++) {
                const int64_t start = g ? ends[g - 1] : 0, n0 = band * 32;
                const int64_t n1 = n0 + 32 < N ? n0 + 32 : N;
                const void *wg = (const char *)w + g * sg * esize;
                if (panel && ends[g] - start >= PACKED_ROWS) {
                    for (int64_t j = 0; j < 32; j++)
                        for (int64_t k = 0; k < K; k++)
                            panel[k * 32 + j] = weight_at(wg, k * sk + (n0 + j) * sn, wbf16);
                    for (int64_t m = start; m < ends[g]; m += 8)
                        band_8x32(x, K, panel, m, ends[g] - m < 8 ? (int)(ends[g] - m) : 8,
                                  n0, out, N);
                } else if (dots) {
                    for (int64_t m = start; m < ends[g]; m += 4)
                        for (int64_t n = n0; n < n1; n += 4)
                            dots_4x4(x, K, wg, wbf16, sn, m,
                                     ends[g] - m < 4 ? (int)(ends[g] - m) : 4, n, out, N);
                } else {
                    for (int64_t m = start; m < ends[g]; m++)
                        for (int64_t n = n0; n < n1; n++) {
                            const float *xm = x + m * K;
                            float s = 0.0f;
                            for (int64_t k = 0; k < K; k++)
                                s += xm[k] * weight_at(wg, k * sk + n * sn, wbf16);
                            out[m * N + n] = s;
                        }
                }
            }
        }
        free(panel);
    }
}

/* A row of `width` values in any cache format: block-scaled (decode_row), or, block 0,
 * little-endian bf16 (the float32's high half). */
static inline void decode_any(const uint8_t *row, int64_t width, int64_t block, int packed,
                              const float *elem, const float *scale, float *out) {
    if (block) {
        decode_row(row, width, block, packed, elem, scale, out);
        return;
    }
    int64_t i = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (; i + 16 <= width; i += 16) {  /* sixteen at a time, widened as the weights are */
        const v16f v = widen16((const uint16_t *)(row + 2 * i));
        memcpy(out + i, &v, sizeof v);
    }
#endif
    for (; i < width; i++) {
        const uint32_t bits = (uint32_t)(row[2 * i] | (row[2 * i + 1] << 8)) << 16;
        memcpy(out + i, &bits, 4);
    }
}

#if defined(__AVX512F__)
/* attend_rows' logits on the AVX-512 path, d a multiple of 32: four heads times four rows
 * a pass, sixteen sums in flight, so each row's values are read once per four heads
 * (V4.1's 64 heads of 512 share each row: one head at a time read every row 64 times,
 * from the second-level cache). Rows past the last four are left to the caller. */
static int64_t logits_4x4(const float *q, const float *const *seen, int64_t r, int64_t hd,
                          int64_t d, float scale, float *probs) {
    int64_t j = 0;
    for (; j + 4 <= r; j += 4) {
        __m512 a[4][4];
        for (int i = 0; i < 4; i++)
            for (int u = 0; u < 4; u++) a[i][u] = _mm512_setzero_ps();
        for (int64_t e = 0; e < d; e += 16) {
            __m512 row[4];
            for (int u = 0; u < 4; u++) row[u] = _mm512_loadu_ps(seen[j + u] + e);
            for (int i = 0; i < 4; i++) {
                const __m512 qv = _mm512_loadu_ps(q + (hd + i) * d + e);
                for (int u = 0; u < 4; u++) a[i][u] = _mm512_fmadd_ps(qv, row[u], a[i][u]);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int u = 0; u < 4; u++)
                probs[(hd + i) * r + j + u] = _mm512_reduce_add_ps(a[i][u]) * scale;
    }
    return j;
}

/* attend_rows' weighted sum on the AVX-512 path, d a multiple of 32: eight heads times
 * thirty-two of a row's values a pass (sixteen sums in flight), so each row is read once
 * per eight heads. */
static void weighted_8x32(const float *const *seen, int64_t r, int64_t hd, int64_t d,
                          const float *probs, float *out) {
    for (int64_t e = 0; e < d; e += 32) {
        __m512 a[8][2];
        for (int i = 0; i < 8; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
        for (int64_t j = 0; j < r; j++) {
            const __m512 lo = _mm512_loadu_ps(seen[j] + e), hi = _mm512_loadu_ps(seen[j] + e + 16);
            for (int i = 0; i < 8; i++) {
                const __m512 p = _mm512_set1_ps(probs[(hd + i) * r + j]);
                a[i][0] = _mm512_fmadd_ps(p, lo, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(p, hi, a[i][1]);
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm512_storeu_ps(out + (hd + i) * d + e, a[i][0]);
            _mm512_storeu_ps(out + (hd + i) * d + e + 16, a[i][1]);
        }
    }
}
#endif

/* One query's softmax over the rows it sees (seen [r], each d values, keys their own
 * values) with the sink's logit [h] in the denominator, for its heads q [h, d]: out [h, d].
 * probs: [h, r] of scratch. The AVX-512 path (d a multiple of 32) takes four heads by four
 * rows in the logits and eight heads in the weighted sum at a time; the AVX2 path (d a
 * multiple of 16) keeps eight sums in flight in the logits (two heads by four rows a
 * pass) and eight in the weighted sum (two eights of a row's values by four heads). */
static void attend_rows(const float *q, const float *const *seen, int64_t r, int64_t h,
                        int64_t d, const float *sink, float scale, float *probs, float *out) {
    for (int64_t hd = 0; hd < h; hd++) {
        const float *qh = q + hd * d;
        float *logit = probs + hd * r;
        int64_t j = 0;
#if defined(__AVX512F__)
        /* The first of four heads fills all four's logits; the other three skip them. */
        if (d % 32 == 0 && hd % 4 == 0 && hd + 4 <= h) j = logits_4x4(q, seen, r, hd, d, scale, probs);
        else if (d % 32 == 0 && hd / 4 * 4 + 4 <= h) j = r - r % 4;
#endif
#if defined(__AVX2__) && defined(__FMA__)
        /* Two heads by four rows a pass where a pair of heads starts here (each row read
         * once per two heads); the second of the pair skips the rows the first filled. */
        if (d % 16 == 0 && j == 0 && hd % 2 == 0 && hd + 2 <= h)
            for (; j + 4 <= r; j += 4) {
                __m256 a[2][4];
                for (int i = 0; i < 2; i++)
                    for (int u = 0; u < 4; u++) a[i][u] = _mm256_setzero_ps();
                for (int64_t e = 0; e < d; e += 8) {
                    const __m256 q0 = _mm256_loadu_ps(qh + e), q1 = _mm256_loadu_ps(qh + d + e);
                    for (int u = 0; u < 4; u++) {
                        const __m256 row = _mm256_loadu_ps(seen[j + u] + e);
                        a[0][u] = _mm256_fmadd_ps(q0, row, a[0][u]);
                        a[1][u] = _mm256_fmadd_ps(q1, row, a[1][u]);
                    }
                }
                for (int u = 0; u < 4; u++) {
                    logit[j + u] = hsum(a[0][u]) * scale;
                    logit[r + j + u] = hsum(a[1][u]) * scale;
                }
            }
        else if (d % 16 == 0 && j == 0 && hd % 2 == 1)
            j = r - r % 4;
        if (d % 16 == 0)
            for (; j + 4 <= r; j += 4) {
                __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                               _mm256_setzero_ps()};
                for (int64_t e = 0; e < d; e += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + e);
                    for (int i = 0; i < 4; i++)
                        a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(seen[j + i] + e), a[i]);
                }
                for (int i = 0; i < 4; i++) logit[j + i] = hsum(a[i]) * scale;
            }
#endif
        for (; j < r; j++) logit[j] = dot_lanes(qh, seen[j], d) * scale;
        float top = sink[hd];
        for (j = 0; j < r; j++)
            if (logit[j] > top) top = logit[j];
        float total = expf(sink[hd] - top);
        exp_shifted(logit, r, top);
        for (j = 0; j < r; j++) total += logit[j];
        for (j = 0; j < r; j++) logit[j] /= total;
    }
    int64_t hd = 0;
#if defined(__AVX512F__)
    if (d % 32 == 0)
        for (; hd + 8 <= h; hd += 8) weighted_8x32(seen, r, hd, d, probs, out);
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (d % 16 == 0)
        for (; hd + 4 <= h; hd += 4)
            for (int64_t e = 0; e < d; e += 16) {
                __m256 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
                for (int64_t j = 0; j < r; j++) {
                    const __m256 lo = _mm256_loadu_ps(seen[j] + e);
                    const __m256 hi = _mm256_loadu_ps(seen[j] + e + 8);
                    for (int i = 0; i < 4; i++) {
                        const __m256 p = _mm256_set1_ps(probs[(hd + i) * r + j]);
                        a[2 * i] = _mm256_fmadd_ps(p, lo, a[2 * i]);
                        a[2 * i + 1] = _mm256_fmadd_ps(p, hi, a[2 * i + 1]);
                    }
                }
                for (int i = 0; i < 4; i++) {
                    _mm256_storeu_ps(out + (hd + i) * d + e, a[2 * i]);
                    _mm256_storeu_ps(out + (hd + i) * d + e + 8, a[2 * i + 1]);
                }
            }
#endif
    for (; hd < h; hd++) {
        float *o = out + hd * d;
        for (int64_t e = 0; e < d; e++) o[e] = 0.0f;
        for (int64_t j = 0; j < r; j++) {
            const float p = probs[hd * r + j], *row = seen[j];
            for (int64_t e = 0; e < d; e++) o[e] += p * row[e];
        }
    }
}

/* attend_rows over `threads`, the heads in runs of eight with AVX-512, else four (a
 * query's heads are independent, and that is what its vector path takes at a time): a
 * decode step of one or a few sequences has too few queries to spread. */
#if defined(__AVX512F__)
#define HEADS_A_RUN 8
#else
#define HEADS_A_RUN 4
#endif
static void attend_heads(const float *q, const float *const *seen, int64_t r, int64_t h,
                         int64_t d, const float *sink, float scale, float *probs, float *out,
                         int threads) {
    enum { HEADS = HEADS_A_RUN };
    const int64_t runs = (h + HEADS - 1) / HEADS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && runs > 1)
    for (int64_t c = 0; c < runs; c++) {
        const int64_t h0 = c * HEADS, hn = h - h0 < HEADS ? h - h0 : HEADS;
        attend_rows(q + h0 * d, seen, r, hn, d, sink + h0, scale, probs + h0 * r, out + h0 * d);
    }
}

/* kv_sparse_attention with a cache of decoded ring rows where ring_vals is not NULL:
 * ring_vals [w, d] holds ring row i decoded where have[i] is set (rows decoded here are
 * added), so that consecutive rows of one sequence (a verify's, in kv_ring_write_attend)
 * decode each ring row once. The same floats either way: a row is decoded from its bytes
 * by the same code. */
void kv_sparse_attention_cached(
        const float *q, const float *sink, const uint8_t *ring, int64_t ring_bytes,
        const int64_t *ring_pos, const int64_t *slots, const int64_t *positions, int64_t w,
        int64_t window_size, int64_t ring_block, int ring_packed, const float *ring_elem,
        const float *ring_scale, const uint8_t *pool, int64_t per, int64_t kv_bytes,
        const int64_t *block_table, int64_t max_blocks, const int64_t *selected, int64_t k,
        int64_t kv_block, int kv_packed, const float *kv_elem, const float *kv_scale,
        int64_t b, int64_t h, int64_t d, float scale, float *rows, float *logits, float *out,
        int threads, float *ring_vals, uint8_t *have) {
    const float **seen = malloc((size_t)(w + k + 1) * sizeof *seen);
    for (int64_t s = 0; s < b; s++) {
        const int64_t t = positions[s], slot = slots[s];
        int64_t n = 0;  /* rows attended */
        for (int64_t i = 0; i < w; i++) {
            const int64_t pos = ring_pos[slot * w + i];
            if (pos < 0 || pos > t || pos <= t - window_size) continue;
            float *row = ring_vals ? ring_vals + i * d : rows + n * d;
            if (!ring_vals || !have[i])
                decode_any(ring + (slot * w + i) * ring_bytes, d, ring_block, ring_packed,
                           ring_elem, ring_scale, row);
            if (ring_vals) have[i] = 1;
            seen[n++] = row;
        }
        for (int64_t j = 0; j < k; j++) {
            const int64_t entry = selected[s * k + j];
            if (entry < 0) continue;
            const int64_t block = block_table[s * max_blocks + entry / per];
            decode_any(pool + (block * per + entry % per) * kv_bytes, d, kv_block, kv_packed,
                       kv_elem, kv_scale, rows + n * d);
            seen[n] = rows + n * d;
            n++;
        }
        attend_heads(q + s * h * d, seen, n, h, d, sink, scale, logits, out + s * h * d,
                     threads);
    }
    free(seen);
}

/* One decode step's attention of one layer (what kvstack.cache.kernels.sparse_attention
 * computes on a GPU, and the model's own softmax over the window and the selected entries
 * on the rows the store hands back): q [b, h, d] at positions [b] over each sequence's
 * window ring (ring rows [slots, w, ring_bytes] and the positions they hold [slots, w],
 * the new token's row already written; slots [b]: the rows in window seen, those at
 * positions t - window_size + 1 .. t) and its selected compressed entries (selected
 * [b, k], -1 for none, rows of pool [blocks, per, kv_bytes] through block_table
 * [b, max_blocks]), with the sink's logit [h] in the softmax's denominator: out [b, h, d].
 * Logits are q . row times `scale`, as torch's; every row is decoded once for all heads. */
void kv_sparse_attention(const float *q, const float *sink, const uint8_t *ring,
                         int64_t ring_bytes, const int64_t *ring_pos, const int64_t *slots,
                         const int64_t *positions, int64_t w, int64_t window_size,
                         int64_t ring_block, int ring_packed, const float *ring_elem,
                         const float *ring_scale, const uint8_t *pool, int64_t per,
                         int64_t kv_bytes, const int64_t *block_table, int64_t max_blocks,
                         const int64_t *selected, int64_t k, int64_t kv_block, int kv_packed,
                         const float *kv_elem, const float *kv_scale, int64_t b, int64_t h,
                         int64_t d, float scale, float *rows, float *logits, float *out,
                         int threads) {
    kv_sparse_attention_cached(q, sink, ring, ring_bytes, ring_pos, slots, positions, w,
                               window_size, ring_block, ring_packed, ring_elem, ring_scale,
                               pool, per, kv_bytes, block_table, max_blocks, selected, k,
                               kv_block, kv_packed, kv_elem, kv_scale, b, h, d, scale, rows,
                               logits, out, threads, NULL, NULL);
}

/* One decode step's causal GQA of one dense layer (the dense control's attention): q
 * [b, h, d] over entries 0 .. lengths[s] - 1 of each sequence's "k" and "v" streams
 * (rows of kv_heads * d values, k_pool and v_pool [blocks, per, bytes] through
 * block_table [b, max_blocks]); query head i reads kv head i / (h / kv_heads); softmax of
 * q . k times `scale`, no sink: out [b, h, d]. keys, values: [max length, kv_heads * d]
 * of scratch (a sequence's rows decoded once for all heads); logits: [max length]. */
void kv_dense_attention(const float *q, const uint8_t *k_pool, const uint8_t *v_pool,
                        int64_t per, int64_t k_bytes, int64_t v_bytes,
                        const int64_t *block_table, int64_t max_blocks, const int64_t *lengths,
                        int64_t block, int packed, const float *elem, const float *scale_table,
                        int64_t b, int64_t h, int64_t kv_heads, int64_t d, float scale,
                        float *keys, float *values, float *logits, float *out) {
    const int64_t width = kv_heads * d, group = h / kv_heads;
    for (int64_t s = 0; s < b; s++) {
        const int64_t n = lengths[s];
        for (int64_t j = 0; j < n; j++) {
            const int64_t row = block_table[s * max_blocks + j / per] * per + j % per;
            decode_any(k_pool + row * k_bytes, width, block, packed, elem, scale_table,
                       keys + j * width);
            decode_any(v_pool + row * v_bytes, width, block, packed, elem, scale_table,
                       values + j * width);
        }
        for (int64_t hd = 0; hd < h; hd++) {
            const float *qh = q + (s * h + hd) * d;
            const int64_t kv = (hd / group) * d;
            float top = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                logits[j] = dot_lanes(qh, keys + j * width + kv, d) * scale;
                if (logits[j] > top) top = logits[j];
            }
            float *o = out + (s * h + hd) * d, total = 0.0f;
            exp_shifted(logits, n, top);
            for (int64_t j = 0; j < n; j++) total += logits[j];
            int64_t i = 0;
            for (; i + 64 <= d; i += 64) {  /* four vectors of o held over every row */
                v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int64_t j = 0; j < n; j++) {
                    const v16f p = (v16f){0} + logits[j];
                    const float *v = values + j * width + kv + i;
                    a0 = fma16(p, load16(v), a0);
                    a1 = fma16(p, load16(v + 16), a1);
                    a2 = fma16(p, load16(v + 32), a2);
                    a3 = fma16(p, load16(v + 48), a3);
                }
                memcpy(o + i, &a0, sizeof a0);
                memcpy(o + i + 16, &a1, sizeof a1);
                memcpy(o + i + 32, &a2, sizeof a2);
                memcpy(o + i + 48, &a3, sizeof a3);
            }
            for (; i < d; i++) {
                float sum = 0.0f;
                for (int64_t j = 0; j < n; j++) sum += logits[j] * values[j * width + kv + i];
                o[i] = sum;
            }
            for (int64_t i = 0; i < d; i++) o[i] /= total;
        }
    }
}

/* The rows query bq of kv_prefill_attention sees, into seen: its count. */
static int64_t prefill_seen(int64_t bq, const int64_t *positions, int64_t pos_stride,
                            const float *keys, const int64_t *key_pos, int64_t m,
                            int64_t window_size, const float *rows, int64_t u,
                            const int64_t *columns, int64_t k, int64_t n, int64_t d,
                            const float **seen) {
    const int64_t s = bq / n, i = bq % n, t = positions[s * pos_stride + i];
    int64_t r = 0;
    for (int64_t j = 0; j < m; j++) {
        const int64_t pos = key_pos[s * m + j];
        if (pos <= t && pos > t - window_size) seen[r++] = keys + (s * m + j) * d;
    }
    for (int64_t j = 0; j < k; j++) {
        const int64_t c = columns[bq * k + j];
        if (c >= 0) seen[r++] = rows + (s * u + c) * d;
    }
    return r;
}

/* A prefill chunk's attention of one layer (the model's own softmax over the window and
 * the selected entries, for many queries at once): queries q [b, n, h, d] at positions
 * (row s at positions + s * pos_stride, [n]) over the window keys (keys [b, m, d] at
 * key_pos [b, m]: those at t - window_size + 1 .. t are seen) and their selected entries
 * (columns [b, n, k] into rows [b, u, d], -1 for none), with the sink's logit [h] in the
 * softmax's denominator; keys are their own values (one shared KV): out [b, n, h, d].
 * Logits are q . row times `scale`, as torch's. Queries run in parallel over `threads`;
 * fewer queries than threads (a decode step's) spread their heads instead. */
void kv_prefill_attention(const float *q, const int64_t *positions, int64_t pos_stride,
                          const float *keys, const int64_t *key_pos, int64_t m,
                          int64_t window_size, const float *rows, int64_t u,
                          const int64_t *columns, int64_t k, const float *sink, int64_t b,
                          int64_t n, int64_t h, int64_t d, float scale, float *out,
                          int threads) {
    if (b * n < threads) {
        /* Too few queries to spread: each one's heads spread instead. (Not from inside a
         * one-thread region: a team nested in another is started anew every call.) */
        const float **seen = malloc((size_t)(m + k + 1) * sizeof *seen);
        float *probs = malloc((size_t)(m + k + 1) * (size_t)h * sizeof *probs);
        for (int64_t bq = 0; bq < b * n; bq++) {
            const int64_t r = prefill_seen(bq, positions, pos_stride, keys, key_pos, m,
                                           window_size, rows, u, columns, k, n, d, seen);
            attend_heads(q + bq * h * d, seen, r, h, d, sink, scale, probs, out + bq * h * d,
                         threads);
        }
        free(seen);
        free(probs);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        /* The rows one query reads (at most every key and every entry it selected), and
         * their logits, then probabilities, for each head. */
        const float **seen = malloc((size_t)(m + k + 1) * sizeof *seen);
        float *probs = malloc((size_t)(m + k + 1) * (size_t)h * sizeof *probs);
#pragma omp for schedule(static)
        for (int64_t bq = 0; bq < b * n; bq++) {
            const int64_t r = prefill_seen(bq, positions, pos_stride, keys, key_pos, m,
                                           window_size, rows, u, columns, k, n, d, seen);
            attend_rows(q + bq * h * d, seen, r, h, d, sink, scale, probs, out + bq * h * d);
        }
        free(seen);
        free(probs);
    }
}

/* A DSpark draft stage's attention (kvstack.model.dspark.DraftAttention): each
 * sequence's kq block queries q [b, kq, h, d] over its window entries window [b, w, d],
 * the first pad[s] of them left padding that no query reads, then the block's own
 * entries block [b, kq, d] (every query sees the whole block: no causal mask), with the
 * sink's logit [h] in the denominator: out [b, kq, h, d]. Entries are keys and values
 * alike, as in the trunk's layers. seen: [w + kq] row pointers, probs: [h, w + kq] of
 * scratch. */
void kv_draft_attention(const float *q, const float *window, const float *block,
                        const int64_t *pad, const float *sink, int64_t b, int64_t kq,
                        int64_t w, int64_t h, int64_t d, float scale, const float **seen,
                        float *probs, float *out, int threads) {
    for (int64_t s = 0; s < b; s++) {
        int64_t n = 0;
        for (int64_t i = pad[s]; i < w; i++) seen[n++] = window + (s * w + i) * d;
        for (int64_t i = 0; i < kq; i++) seen[n++] = block + (s * kq + i) * d;
        for (int64_t i = 0; i < kq; i++) {
            const int64_t row = (s * kq + i) * h * d;
            attend_heads(q + row, seen, n, h, d, sink, scale, probs, out + row, threads);
        }
    }
}
