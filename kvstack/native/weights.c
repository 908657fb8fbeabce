/* Matmuls on weights as DeepSeek's V4.1 checkpoint stores them: y = x W^T, reading W's
 * packed bytes once and decoding them in registers, never into a float copy of W.
 *
 * Formats (kvstack.formats.weights):
 *   FMT_FP8  E4M3 codes [O, K], one UE8M0 scale per 32x32 block: scales [ceil(O/32), ceil(K/32)]
 *   FMT_FP4  E2M1 codes two a byte [O, K/2] (element 2i in the low nibble), one UE8M0 scale
 *            per row per 32: scales [O, K/32]
 *   FMT_BF16 raw bf16 [O, K]
 *
 * x and y are float32 and the products add in float32. A weight value is what the torch
 * codecs give (elem[code] * scale[byte], tables passed in by the caller), so the results
 * equal dequantise-then-matmul within float32 rounding (the sums add in another order).
 * Three paths, chosen per call (the best this build has unless the caller asks for a
 * lower one): ISA_PORTABLE, plain C every compiler builds; ISA_AVX2 (AVX2 + FMA + F16C,
 * compiled in where -march=native provides them); and ISA_AVX512 (AVX-512 F/BW/VL as
 * well), described where it is defined. The AVX2 path decodes sixteen weights at a time
 * in registers:
 *   - an E4M3 byte b becomes the fp16 number with bits s0eeeemmm0000000, exactly b's value
 *     times 2^-8 (the exponent biases differ by 8; subnormals map to subnormals), converted
 *     by F16C; the 2^8 and the block's power-of-two scale are folded into x once per
 *     32-row block, so a weight costs an unpack, a shift, a mask, a conversion and a
 *     multiply-add. The two NaN codes (s1111111) are caught by a running byte maximum and
 *     make their row's outputs NaN, as the NaN weight does in torch.
 *   - an E2M1 nibble becomes, by one byte shuffle through a table made for its block's
 *     scale byte, the high byte of the fp16 number equal to its value times the scale
 *     times 2^10 (a normal fp16 number for scales 2^-23 .. 2^3), so the scale costs no
 *     multiply; each sum is multiplied by 2^-10 once at the end.
 *   - bf16 widens by a 16-bit shift.
 * The power-of-two shortcuts are exact while the scales lie within 2^-100 .. 2^100 (FP8)
 * or 2^-23 .. 2^3 (FP4; checkpoint scales are about 2^-9 .. 2^-12); a tile with a scale
 * outside takes the portable path.
 *
 * Work: output rows in tiles of at most 32 (an FP8 scale block; never across a group of
 * the block-diagonal wo_a), threads over tiles. Within a tile, one or two tokens meet
 * four rows at a time (eight chains of multiply-adds hide their latency while the next
 * codes decode); three or four tokens meet two rows at a time on the AVX2 path and four
 * on the AVX-512 path, which takes up to eight tokens in one pass, so each decoded
 * weight serves up to eight multiply-adds. Decoding is the cost at batch 1, the
 * multiply-adds at larger batches.
 */
#include "kernels.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
#if HAVE_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum { TILE = 32, QUAD = 4, TOKENS = 8, CHUNK = 256 };

/* The best path this build has. */
int kv_weights_isa(void) { return HAVE_AVX512 ? ISA_AVX512 : HAVE_AVX2 ? ISA_AVX2 : ISA_PORTABLE; }

typedef struct {
    int fmt;
    const uint8_t *codes, *scales;
    int64_t O, K;
    const float *elem, *scale; /* decode tables: value by code, scale by byte */
    const float *fp4_values;   /* FP4 on the AVX-512 path: fp4_values(), else NULL */
} weight_t;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* n floats on a 64-byte boundary: the vectors' loads of x then never straddle two cache
 * lines (a straddling load costs two). */
static float *aligned_floats(size_t n) {
    return aligned_alloc(64, (n * sizeof(float) + 63) & ~(size_t)63);
}

/* values[b * 16 + n] = elem[n] * scale[b]: each E2M1 code's value under each scale byte,
 * the very products the codecs make (16 KB, made once a call), which the AVX-512 path
 * looks up instead of multiplying a table by the scale every 32 weights. */
static void fp4_values(const float *elem, const float *scale, float *values) {
    for (int b = 0; b < 256; b++)
        for (int n = 0; n < 16; n++) values[b * 16 + n] = elem[n] * scale[b];
}

/* E2M1 decode tables, one per UE8M0 scale byte b: entry n is the high byte of the fp16
 * number nibble n's value times 2^(b - 127) times 2^10 (low byte 0). The value is
 * s * 2^E * (1 + m/2) with E in -1 .. 2 (0.5 .. 6), so its fp16 exponent field is
 * E + 15 + d, d = b - 117, normal for d in -13 .. 13; zero stays zero. Byte 255 (a NaN
 * scale) makes every entry NaN, as torch's product is. Other bytes have no table
 * (fp4_scale_fits). */
enum { FP4_FOLD_BIAS = 117, FP4_FOLD_SPAN = 13 };
static uint8_t fp4_tables[256][16];

static int fp4_scale_fits(uint8_t b) {
    return b == 255 || (b >= FP4_FOLD_BIAS - FP4_FOLD_SPAN && b <= FP4_FOLD_BIAS + FP4_FOLD_SPAN);
}

__attribute__((constructor)) static void make_fp4_tables(void) {
    for (int b = 0; b < 256; b++) {
        if (!fp4_scale_fits((uint8_t)b)) continue;
        for (int n = 0; n < 16; n++) {
            const int sign = (n & 8) << 4, ee = (n >> 1) & 3, m = n & 1;
            if (b == 255) fp4_tables[b][n] = 0x7E;
            else if (ee == 0 && !m) fp4_tables[b][n] = (uint8_t)sign;
            else if (ee == 0) fp4_tables[b][n] = (uint8_t)(sign | (14 + b - FP4_FOLD_BIAS) << 2);
            else fp4_tables[b][n] = (uint8_t)(sign | (14 + ee + b - FP4_FOLD_BIAS) << 2 | m << 1);
        }
    }
}

/* ---- decoding one row's columns [k0, k0 + n) into float32 ---------------------------- */

/* Portable: exactly the codecs' products. For FP8, `fold` multiplies instead by 2^-8 and
 * no scale (the AVX2 path's convention, where the scale is folded into x). */
static int decode_portable(const weight_t *w, int64_t row, int64_t k0, int64_t n, int fold,
                           float *out) {
    int nan = 0;
    if (w->fmt == FMT_FP8) {
        const uint8_t *c = w->codes + row * w->K;
        const uint8_t *s = w->scales + (row / TILE) * ((w->K + TILE - 1) / TILE);
        for (int64_t i = 0; i < n; i++) {
            const int64_t k = k0 + i;
            out[i] = fold ? w->elem[c[k]] * 0.00390625f : w->elem[c[k]] * w->scale[s[k / TILE]];
            nan |= (c[k] & 0x7F) == 0x7F;
        }
    } else if (w->fmt == FMT_FP4) {
        const uint8_t *c = w->codes + row * (w->K / 2);
        const uint8_t *s = w->scales + row * (w->K / 32);
        for (int64_t i = 0; i < n; i++) {
            const int64_t k = k0 + i;
            const uint8_t byte = c[k / 2];
            out[i] = w->elem[k % 2 ? byte >> 4 : byte & 15] * w->scale[s[k / 32]];
        }
    } else {
        const uint16_t *c = (const uint16_t *)w->codes + row * w->K;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t bits = (uint32_t)c[k0 + i] << 16;
            memcpy(out + i, &bits, 4);
        }
    }
    return nan;
}

#if HAVE_AVX2
/* Thirty-two weights of a row decoded into four vectors, in the layout x is given in:
 * column order for FP8 and bf16; for FP4, the even columns then the odd ones (x is
 * permuted to match once per tile, `fp4_permute`), which saves the shuffles that would
 * interleave the two nibbles of each byte. */
typedef struct {
    __m256 v[4];
} v32;

/* Sixteen FP8 codes -> their values times 2^-8; with `check`, `seen` keeps the largest
 * code & 0x7F, so that 0x7F there says a NaN code went by. */
static inline void fp8_16(const uint8_t *c, __m128i *seen, int check, __m256 *out) {
    const __m128i b = _mm_loadu_si128((const __m128i *)c), zero = _mm_setzero_si128();
    const __m128i keep = _mm_set1_epi16((short)0xBFFF);
    if (check) *seen = _mm_max_epu8(*seen, _mm_and_si128(b, _mm_set1_epi8(0x7F)));
    out[0] = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(zero, b), 1), keep));
    out[1] = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(zero, b), 1), keep));
}

/* Thirty-two E2M1 codes (sixteen bytes) -> their values times the block's scale times
 * 2^10 (`table`, from fp4_tables), even columns first. */
static inline v32 fp4_32(const uint8_t *c, __m128i table) {
    const __m128i nibble = _mm_set1_epi8(0x0F), zero = _mm_setzero_si128();
    const __m128i b = _mm_loadu_si128((const __m128i *)c);
    const __m128i even = _mm_shuffle_epi8(table, _mm_and_si128(b, nibble));
    const __m128i odd = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
    return (v32){{_mm256_cvtph_ps(_mm_unpacklo_epi8(zero, even)),
                  _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, even)),
                  _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, odd)),
                  _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, odd))}};
}

static inline __m256 bf16_8(const uint8_t *c) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Weights [k, k + 32) of a row whose codes start at `row` (k a multiple of 32). */
static inline v32 decode32(int fmt, const uint8_t *row, int64_t k, __m128i *seen, int check,
                           __m128i table) {
    v32 out;
    if (fmt == FMT_FP8) {
        fp8_16(row + k, seen, check, out.v);
        fp8_16(row + k + 16, seen, check, out.v + 2);
    } else if (fmt == FMT_FP4) {
        out = fp4_32(row + k / 2, table);
    } else {
        for (int j = 0; j < 4; j++) out.v[j] = bf16_8(row + 2 * (k + 8 * j));
    }
    return out;
}

/* Bytes a row's codes take for its first k columns (k even for FP4). */
static inline int64_t column_bytes(int fmt, int64_t k) {
    return fmt == FMT_FP8 ? k : fmt == FMT_FP4 ? k / 2 : 2 * k;
}

static inline const uint8_t *row_codes(const weight_t *w, int64_t row) {
    return w->codes + row * column_bytes(w->fmt, w->K);
}

static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* R rows times T tokens (R * T <= 8 accumulators), decoding each 32 weights once in
 * registers for all T tokens, columns [0, kv) with kv a multiple of 32: sums[i][t]. The
 * products multiply-add straight into the sums (FP4's scale is in its decoded weights),
 * a lone token's in two chains: six or more independent chains hide the multiply-adds'
 * latency. */
static inline __attribute__((always_inline)) void rows_times_tokens(
    const weight_t *w, int fmt, int check, int R, int T, const int64_t *rows, int64_t kv,
    const float *const *x, float sums[QUAD][TOKENS], int nan[QUAD]) {
    const uint8_t *codes[QUAD], *scales[QUAD];
    __m128i seen[QUAD];
    __m256 acc[QUAD][4];
    for (int i = 0; i < R; i++) {
        codes[i] = row_codes(w, rows[i]);
        scales[i] = w->scales + rows[i] * (w->K / 32);
        seen[i] = _mm_setzero_si128();
        for (int t = 0; t < 4; t++) acc[i][t] = _mm256_setzero_ps();
    }
    /* The rows R below, which the next call reads: fetched while these decode, so that
     * short rows (wq_b's 1,280 bytes) do not wait on each new stream. */
    const int64_t ahead = R * column_bytes(fmt, w->K);
    for (int64_t k = 0; k < kv; k += 32) {
        for (int i = 0; i < R; i++) {
            if (column_bytes(fmt, k) % 64 == 0) /* as on the AVX-512 path (below) */
                _mm_prefetch((const char *)(codes[i] + ahead + column_bytes(fmt, k)), _MM_HINT_T1);
            const __m128i table = fmt == FMT_FP4
                ? _mm_loadu_si128((const __m128i *)fp4_tables[scales[i][k / 32]])
                : _mm_setzero_si128();
            const v32 v = decode32(fmt, codes[i], k, &seen[i], check, table);
            if (T == 1) { /* two chains, so that a row's adds overlap */
                const float *x0 = x[0] + k;
                acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x0), v.v[0], acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + 8), v.v[1], acc[i][1]);
                acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + 16), v.v[2], acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + 24), v.v[3], acc[i][1]);
            } else {
                for (int t = 0; t < T; t++)
                    for (int j = 0; j < 4; j++)
                        acc[i][t] = _mm256_fmadd_ps(_mm256_loadu_ps(x[t] + k + 8 * j), v.v[j],
                                                    acc[i][t]);
            }
        }
    }
    const float unfold = fmt == FMT_FP4 ? 0x1p-10f : 1.0f;
    for (int i = 0; i < R; i++) {
        if (T == 1) acc[i][0] = _mm256_add_ps(acc[i][0], acc[i][1]);
        for (int t = 0; t < T; t++) sums[i][t] += hsum(acc[i][t]) * unfold;
        if (fmt == FMT_FP8 && check)
            nan[i] |= _mm_movemask_epi8(_mm_cmpeq_epi8(seen[i], _mm_set1_epi8(0x7F))) != 0;
    }
}

/* The register kernel specialised by format, by whether NaN codes are looked for (FP8
 * weights whose codes are known to hold none skip the compare) and by shape: four rows
 * for one or two tokens, two rows for three or four. (One row for up to eight tokens,
 * decoding each weight once for all, measured slower: each row then streams eight
 * tokens' inputs from the second-level cache.) */
#define SHAPES(FMT, CHECK)                                                                 \
    switch (T) {                                                                           \
    case 1: rows_times_tokens(w, FMT, CHECK, 4, 1, rows, kv, x, sums, nan); break;         \
    case 2: rows_times_tokens(w, FMT, CHECK, 4, 2, rows, kv, x, sums, nan); break;         \
    case 3: rows_times_tokens(w, FMT, CHECK, 2, 3, rows, kv, x, sums, nan); break;         \
    default: rows_times_tokens(w, FMT, CHECK, 2, 4, rows, kv, x, sums, nan);               \
    }

static void registers(const weight_t *w, int check, int T, const int64_t *rows, int64_t kv,
                      const float *const *x, float sums[QUAD][TOKENS], int nan[QUAD]) {
    if (w->fmt == FMT_FP8 && check) {
        SHAPES(FMT_FP8, 1)
    } else if (w->fmt == FMT_FP8) {
        SHAPES(FMT_FP8, 0)
    } else if (w->fmt == FMT_FP4) {
        SHAPES(FMT_FP4, 0)
    } else {
        SHAPES(FMT_BF16, 0)
    }
}
#undef SHAPES

#if HAVE_AVX512
/* The AVX-512 path: thirty-two weights decode into two 16-float vectors, and each
 * token's products take two multiply-adds.
 *   - E2M1: the codes' bytes widen to sixteen 32-bit lanes, and one permute each picks
 *     the low nibbles' values (even columns: the permute reads an index's low four bits)
 *     and, shifted, the high nibbles' (odd columns) from a sixteen-entry table: the
 *     codec's values times the block's scale (fp4_values), the very products the
 *     portable path makes, so every scale byte (NaN included) is exact and no tile
 *     needs a range check;
 *   - E4M3: the fp16 reading of the AVX2 path, thirty-two codes at a time (where the
 *     CPU has AVX512-VBMI, one byte permute puts each code in its 16-bit lane's high
 *     byte, where a widening and a shift would take two instructions);
 *   - bf16: a 16-bit shift. */
typedef struct {
    __m512 v[2];
} z32;

static inline z32 decode32_512(const weight_t *w, int fmt, const uint8_t *row,
                               const uint8_t *scales, int64_t k, __m256i *seen, int check) {
    z32 out;
    if (fmt == FMT_FP4) {
        const __m512 table = _mm512_loadu_ps(w->fp4_values + 16 * scales[k / 32]);
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k / 2)));
        out.v[0] = _mm512_permutexvar_ps(bytes, table);
        out.v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    } else if (fmt == FMT_FP8) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(row + k));
        if (check) *seen = _mm256_max_epu8(*seen, _mm256_and_si256(b, _mm256_set1_epi8(0x7F)));
#if defined(__AVX512VBMI__)
        const __m512i spread = _mm512_set_epi8(
            31, 0, 30, 0, 29, 0, 28, 0, 27, 0, 26, 0, 25, 0, 24, 0, 23, 0, 22, 0, 21, 0, 20, 0,
            19, 0, 18, 0, 17, 0, 16, 0, 15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7,
            0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
        const __m512i high = _mm512_maskz_permutexvar_epi8(0xAAAAAAAAAAAAAAAAull, spread,
                                                           _mm512_castsi256_si512(b));
#else
        const __m512i high = _mm512_slli_epi16(_mm512_cvtepu8_epi16(b), 8);
#endif
        const __m512i half = _mm512_and_si512(_mm512_srai_epi16(high, 1),
                                              _mm512_set1_epi16((short)0xBFFF));
        out.v[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
        out.v[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
    } else {
        for (int j = 0; j < 2; j++)
            out.v[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256((const __m256i *)(row + 2 * (k + 16 * j)))), 16));
    }
    return out;
}

/* rows_times_tokens on the AVX-512 path: four rows times T <= 8 tokens, every token in
 * one pass so that each weight decodes once. The four rows' decoded weights meet each
 * token's inputs, loaded once: a token's inputs stream from the second-level cache once
 * per four rows. From five tokens the accumulators outnumber the 32 vector registers and
 * some wait in the first-level cache, which still runs faster than two rows at a time
 * (FP4, eight tokens: 66 G multiply-adds a second against 52-54) or two passes of four
 * (55). */
static inline __attribute__((always_inline)) void rows_times_tokens_512(
    const weight_t *w, int fmt, int check, int T, const int64_t *rows, int64_t kv,
    const float *const *x, float sums[QUAD][TOKENS], int nan[QUAD]) {
    const uint8_t *codes[QUAD], *scales[QUAD];
    __m256i seen[QUAD];
    __m512 acc[QUAD][TOKENS];
    for (int i = 0; i < QUAD; i++) {
        codes[i] = row_codes(w, rows[i]);
        scales[i] = w->scales + rows[i] * (w->K / 32);
        seen[i] = _mm256_setzero_si256();
        for (int t = 0; t < TOKENS; t++) acc[i][t] = _mm512_setzero_ps();
    }
    /* The rows four below, which the next call reads: fetched while these decode, so
     * that short rows (wq_b's 1,280 bytes) do not wait on each new stream. One request a
     * 64 bytes, into the second-level cache: requests into the first level hold one of
     * its few miss buffers each until the line arrives, which capped how many lines a
     * core had in flight (FP4 experts from memory, one or two tokens: 5-6 % faster). */
    const int64_t ahead = QUAD * column_bytes(fmt, w->K);
    for (int64_t k = 0; k < kv; k += 32) {
        z32 v[QUAD];
        for (int i = 0; i < QUAD; i++) {
            if (column_bytes(fmt, k) % 64 == 0)
                _mm_prefetch((const char *)(codes[i] + ahead + column_bytes(fmt, k)), _MM_HINT_T1);
            v[i] = decode32_512(w, fmt, codes[i], scales[i], k, &seen[i], check);
        }
        for (int t = 0; t < T; t++) {
            __m512 even = _mm512_loadu_ps(x[t] + k), odd = _mm512_loadu_ps(x[t] + k + 16);
            /* Held in registers: left alone, the compiler folds the loads into each
             * row's multiply-adds, loading them four times. */
            __asm__("" : "+v"(even), "+v"(odd));
            for (int i = 0; i < QUAD; i++) {
                if (T == 1) { /* two chains, so that a row's adds overlap */
                    acc[i][0] = _mm512_fmadd_ps(even, v[i].v[0], acc[i][0]);
                    acc[i][1] = _mm512_fmadd_ps(odd, v[i].v[1], acc[i][1]);
                } else {
                    acc[i][t] = _mm512_fmadd_ps(even, v[i].v[0], acc[i][t]);
                    acc[i][t] = _mm512_fmadd_ps(odd, v[i].v[1], acc[i][t]);
                }
            }
        }
    }
    for (int i = 0; i < QUAD; i++) {
        if (T == 1) acc[i][0] = _mm512_add_ps(acc[i][0], acc[i][1]);
        for (int t = 0; t < T; t++) sums[i][t] += _mm512_reduce_add_ps(acc[i][t]);
        if (fmt == FMT_FP8 && check)
            nan[i] |= _mm256_movemask_epi8(_mm256_cmpeq_epi8(seen[i], _mm256_set1_epi8(0x7F))) != 0;
    }
}

#define SHAPES(FMT, CHECK)                                                                 \
    switch (T) {                                                                           \
    case 1: rows_times_tokens_512(w, FMT, CHECK, 1, rows, kv, x, sums, nan); break;        \
    case 2: rows_times_tokens_512(w, FMT, CHECK, 2, rows, kv, x, sums, nan); break;        \
    case 3: rows_times_tokens_512(w, FMT, CHECK, 3, rows, kv, x, sums, nan); break;        \
    case 4: rows_times_tokens_512(w, FMT, CHECK, 4, rows, kv, x, sums, nan); break;        \
    case 5: rows_times_tokens_512(w, FMT, CHECK, 5, rows, kv, x, sums, nan); break;        \
    case 6: rows_times_tokens_512(w, FMT, CHECK, 6, rows, kv, x, sums, nan); break;        \
    case 7: rows_times_tokens_512(w, FMT, CHECK, 7, rows, kv, x, sums, nan); break;        \
    default: rows_times_tokens_512(w, FMT, CHECK, 8, rows, kv, x, sums, nan);              \
    }

static void registers_512(const weight_t *w, int check, int T, const int64_t *rows, int64_t kv,
                          const float *const *x, float sums[QUAD][TOKENS], int nan[QUAD]) {
    if (w->fmt == FMT_FP8 && check) {
        SHAPES(FMT_FP8, 1)
    } else if (w->fmt == FMT_FP8) {
        SHAPES(FMT_FP8, 0)
    } else if (w->fmt == FMT_FP4) {
        SHAPES(FMT_FP4, 0)
    } else {
        SHAPES(FMT_BF16, 0)
    }
}
#undef SHAPES
#endif
#endif

/* ---- one tile: rows [r0, r0 + nr) of W times nt token rows of x ----------------------- */

/* Whether the AVX2 path's power-of-two shortcuts are exact for this tile: FP8 scales
 * (NaN aside) within 2^-100 .. 2^100, so folding them into x neither overflows nor leaves
 * float32's normal range; FP4 scales with a decode table (fp4_scale_fits). */
static int scales_in_range(const weight_t *w, int64_t r0, int64_t nr) {
    const int64_t per_row = (w->K + TILE - 1) / TILE;
    const uint8_t *s;
    int64_t n;
    if (w->fmt == FMT_FP8) {
        s = w->scales + (r0 / TILE) * per_row, n = per_row;
    } else if (w->fmt == FMT_FP4) {
        int ok = 1;
        s = w->scales + r0 * (w->K / 32), n = nr * (w->K / 32);
        for (int64_t i = 0; i < n; i++) ok &= fp4_scale_fits(s[i]);
        return ok;
    } else {
        return 1;
    }
    int ok = 1;
    for (int64_t i = 0; i < n; i++) ok &= (s[i] >= 27 && s[i] <= 227) || s[i] == 255;
    return ok;
}

/* pt [K] = xt times 2^8 and the FP8 scale of each 32 columns in the tile at row r0: the
 * AVX2 path's decoded weights are the codes' values times 2^-8. Made per tile and token,
 * so in vectors (a scalar loop here cost eight tokens a tenth of their time). */
static void fold_scales(const weight_t *w, int64_t r0, const float *restrict xt,
                        float *restrict pt) {
    const int64_t K = w->K;
    const uint8_t *s = w->scales + (r0 / TILE) * ((K + TILE - 1) / TILE);
    int64_t k = 0;
#if HAVE_AVX2
    for (; k + TILE <= K; k += TILE) {
        const __m256 m = _mm256_set1_ps(w->scale[s[k / TILE]] * 256.0f);
        for (int j = 0; j < TILE; j += 8)
            _mm256_storeu_ps(pt + k + j, _mm256_mul_ps(_mm256_loadu_ps(xt + k + j), m));
    }
#endif
    for (; k < K; k++) pt[k] = xt[k] * (w->scale[s[k / TILE]] * 256.0f);
}

/* y[t * y_stride + r] = sum_k x[t * x_stride + x_col + k] * W[r, k] for the tile's rows
 * (nr <= TILE, one FP8 scale block and one group) and tokens t < nt; `check`: whether
 * the FP8 codes may hold NaNs. scratch: TOKENS * K floats (FP8 only) then QUAD * CHUNK floats. */
static void tile_rows(const weight_t *w, int isa, int check, int64_t r0, int64_t nr,
                      const float *x, const float *x_split, int64_t x_stride, int64_t x_col,
                      int64_t nt, float *y, int64_t y_stride, float *scratch) {
    const int64_t K = w->K;
#if HAVE_AVX2
    /* FP4 on the AVX-512 path decodes every scale exactly: no range to check. */
    const int vector = isa >= ISA_AVX2 && !(w->fmt == FMT_FP4 && !x_split) &&
                       ((w->fmt == FMT_FP4 && isa == ISA_AVX512) || scales_in_range(w, r0, nr));
#else
    const int vector = 0;
    (void)isa, (void)check, (void)scales_in_range;
#endif
    const int fold = w->fmt == FMT_FP8 && vector;
    float *prepared = scratch, *decoded = scratch + TOKENS * K;
    const int64_t kv = vector ? K & ~(int64_t)31 : 0; /* columns the vectors take */
    for (int64_t t0 = 0; t0 < nt; t0 += TOKENS) {
        const int64_t tn = min64(TOKENS, nt - t0);
        /* The tokens' inputs as the vectors take them: for FP8, x times the tile's scale
         * per 32 columns and 2^8; for FP4, x_split; else (and on the portable path) x as
         * it is. */
        const float *xin[TOKENS];
        for (int64_t t = 0; t < tn; t++) {
            const float *xt = x + (t0 + t) * x_stride + x_col;
            float *pt = prepared + t * K;
            xin[t] = xt;
            if (fold) {
                fold_scales(w, r0, xt, pt);
                xin[t] = pt;
            } else if (w->fmt == FMT_FP4 && vector) {
                xin[t] = x_split + (t0 + t) * x_stride + x_col;
            }
        }
        /* The vectors' share: on the AVX-512 path every token in one pass over four rows
         * at a time; on the AVX2 path up to four tokens a pass, one or two meeting four
         * rows at a time, three or four two rows. */
        float sums[TILE][TOKENS] = {{0}};
        int nan[TILE] = {0};
#if HAVE_AVX2
        for (int64_t t = 0; vector && t < tn;) {
            const int T = (int)min64(isa == ISA_AVX512 ? TOKENS : 4, tn - t);
            const int R = T <= 2 || isa == ISA_AVX512 ? QUAD : 2;
            for (int64_t q = 0; q < nr; q += QUAD) {
                int64_t rows[QUAD]; /* a short quad repeats its last row, not stored */
                for (int i = 0; i < QUAD; i++) rows[i] = r0 + q + min64(i, nr - q - 1);
                for (int p = 0; p < QUAD; p += R) {
                    float part[QUAD][TOKENS] = {{0}};
#if HAVE_AVX512
                    if (isa == ISA_AVX512)
                        registers_512(w, check, T, rows + p, kv, xin + t, part, nan + q + p);
                    else
#endif
                        registers(w, check, T, rows + p, kv, xin + t, part, nan + q + p);
                    for (int i = 0; i < R; i++)
                        for (int u = 0; u < T; u++) sums[q + p + i][t + u] += part[i][u];
                }
            }
            t += T;
        }
#endif
        /* What the vectors left (all of it on the portable path), a chunk at a time. */
        for (int64_t q = 0; q < nr && kv < K; q += QUAD) {
            int64_t rows[QUAD];
            for (int i = 0; i < QUAD; i++) rows[i] = r0 + q + min64(i, nr - q - 1);
            for (int64_t k0 = kv; k0 < K; k0 += CHUNK) {
                const int64_t kn = min64(CHUNK, K - k0);
                for (int i = 0; i < QUAD; i++)
                    nan[q + i] |= decode_portable(w, rows[i], k0, kn, fold, decoded + i * CHUNK);
                for (int64_t u = 0; u < tn; u++) {
                    const float *a = xin[u] + k0;
                    for (int i = 0; i < QUAD; i++) {
                        const float *d = decoded + i * CHUNK;
                        float s = 0.0f;
                        for (int64_t k = 0; k < kn; k++) s += a[k] * d[k];
                        sums[q + i][u] += s;
                    }
                }
            }
        }
        for (int64_t i = 0; i < nr; i++)
            for (int64_t u = 0; u < tn; u++)
                y[(t0 + u) * y_stride + r0 + i] = nan[i] ? NAN : sums[i][u];
    }
}

/* x [N, width] with each 32 columns' even ones first, then the odd ones: the order FP4's
 * vectors decode a byte's two nibbles in (fp4_32), made once a call; NULL where no tile
 * can take the vectors (a width not a multiple of 32, or the portable path). */
static float *split_columns(const float *x, int64_t N, int64_t width, int isa, int threads) {
    if (isa < ISA_AVX2 || !HAVE_AVX2 || width % 32) return NULL;
    float *out = aligned_floats((size_t)(N * width));
    if (!out) return NULL;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < N; r++)
        for (int64_t k = 0; k < width; k += 32)
            for (int j = 0; j < 16; j++) {
                out[r * width + k + j] = x[r * width + k + 2 * j];
                out[r * width + k + 16 + j] = x[r * width + k + 2 * j + 1];
            }
    return out;
}

static size_t scratch_floats(const weight_t *w) {
    return (size_t)TOKENS * w->K + (size_t)QUAD * CHUNK;
}

/* The tiles of O rows: 32-row blocks, cut where a group of `group_rows` rows ends. */
static void tile_bounds(int64_t block, int64_t O, int64_t group_rows, int64_t *starts,
                        int64_t *count) {
    int64_t n = 0, r = block * TILE;
    const int64_t end = min64(O, r + TILE);
    while (r < end) {
        starts[n++] = r;
        r = min64(end, (r / group_rows + 1) * group_rows);
    }
    starts[n] = end;
    *count = n;
}

/* out [O, K] float32 = the FP8 weight's values, the codecs' products bit for bit, threads
 * over rows: for a prefill chunk of many tokens, where a float32 GEMM on a transient copy
 * outruns decoding each weight once per few tokens. */
void kv_fp8_dequantize(const uint8_t *codes, const uint8_t *scales, int64_t O, int64_t K,
                       const float *elem, const float *scale, float *out, int threads) {
    const weight_t w = {FMT_FP8, codes, scales, O, K, elem, scale, NULL};
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < O; r++) {
        float *row = out + r * K;
        int64_t done = 0;
#if HAVE_AVX2
        /* Sixteen codes at a time, times the block's scale and 2^8 (exact for scales in
         * range); a row holding a NaN code is decoded again below, where it is NaN. */
        if (scales_in_range(&w, r - r % TILE, 1)) {
            const uint8_t *c = codes + r * K, *s = scales + (r / TILE) * ((K + TILE - 1) / TILE);
            __m128i seen = _mm_setzero_si128();
            for (; done + 16 <= K; done += 16) {
                const __m256 m = _mm256_set1_ps(scale[s[done / TILE]] * 256.0f);
                __m256 v[2];
                fp8_16(c + done, &seen, 1, v);
                _mm256_storeu_ps(row + done, _mm256_mul_ps(v[0], m));
                _mm256_storeu_ps(row + done + 8, _mm256_mul_ps(v[1], m));
            }
            if (_mm_movemask_epi8(_mm_cmpeq_epi8(seen, _mm_set1_epi8(0x7F)))) done = 0;
        }
#endif
        decode_portable(&w, r, done, K - done, 0, row + done);
    }
}

/* Whether FP8 codes hold a NaN (s1111111) anywhere: asked once per weight, so that the
 * matmuls of one that holds none skip looking. */
int kv_fp8_has_nan(const uint8_t *codes, int64_t n) {
    int64_t i = 0;
    int found = 0;
#if HAVE_AVX2
    __m128i seen = _mm_setzero_si128();
    for (; i + 16 <= n; i += 16)
        seen = _mm_max_epu8(seen, _mm_and_si128(_mm_loadu_si128((const __m128i *)(codes + i)),
                                                _mm_set1_epi8(0x7F)));
    found = _mm_movemask_epi8(_mm_cmpeq_epi8(seen, _mm_set1_epi8(0x7F))) != 0;
#endif
    for (; i < n; i++) found |= (codes[i] & 0x7F) == 0x7F;
    return found;
}

/* y [N, O] = x W^T for a dense FP8 or bf16 weight W [O, K]; with groups > 1, W is
 * block-diagonal (V4.1's wo_a): output rows of group g = o / (O / groups) read columns
 * g*K .. g*K + K - 1 of x [N, groups * K]. nan_codes: whether FP8 codes may be NaN
 * (kv_fp8_has_nan); 0 for one known to hold none. */
void kv_packed_linear(const float *x, int64_t N, int fmt, const uint8_t *codes,
                      const uint8_t *scales, int64_t O, int64_t K, int64_t groups,
                      const float *elem, const float *scale, int nan_codes, float *y, int isa,
                      int threads) {
    const weight_t w = {fmt, codes, scales, O, K, elem, scale, NULL};
    const int64_t group_rows = O / groups, blocks = (O + TILE - 1) / TILE;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = aligned_floats(scratch_floats(&w));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t starts[TILE + 1], count;
            tile_bounds(b, O, group_rows, starts, &count);
            for (int64_t i = 0; i < count; i++) {
                const int64_t r0 = starts[i], group = r0 / group_rows;
                tile_rows(&w, isa, nan_codes, r0, starts[i + 1] - r0, x, NULL, groups * K,
                          group * K, N, y, O, scratch);
            }
        }
        free(scratch);
    }
}

/* Routed experts in one call: rows ends[g-1] .. ends[g]-1 of x [M, K] times expert
 * experts[g]'s FP4 weight [O, K] -> the same rows of y [M, O]. pointers [E, 2] holds every
 * expert's code and scale addresses (this projection), so only the experts a step routes
 * to are read. */
void kv_fp4_grouped(const float *x, int64_t K, const int64_t *pointers, const int32_t *experts,
                    const int32_t *ends, int64_t G, int64_t O, const float *elem,
                    const float *scale, float *y, int isa, int threads) {
    const int64_t blocks = (O + TILE - 1) / TILE;
    float values[256 * 16];
    fp4_values(elem, scale, values);
    const weight_t shape = {FMT_FP4, 0, 0, O, K, elem, scale, values};
    float *x_split = split_columns(x, G ? ends[G - 1] : 0, K, isa, threads);
#pragma omp parallel num_threads(threads)
    {
        float *scratch = aligned_floats(scratch_floats(&shape));
#pragma omp for collapse(2) schedule(static)
        for (int64_t g = 0; g < G; g++) {
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t start = g ? ends[g - 1] : 0, rows = ends[g] - start;
                if (rows <= 0) continue;
                const int64_t *p = pointers + 2 * experts[g];
                weight_t w = shape;
                w.codes = (const uint8_t *)(intptr_t)p[0];
                w.scales = (const uint8_t *)(intptr_t)p[1];
                const int64_t r0 = b * TILE;
                tile_rows(&w, isa, 0, r0, min64(TILE, O - r0), x + start * K,
                          x_split ? x_split + start * K : NULL, K, 0, rows, y + start * O, O,
                          scratch);
            }
        }
        free(scratch);
    }
    free(x_split);
}
