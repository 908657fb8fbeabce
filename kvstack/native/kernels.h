/* kernels.c's and weights.c's calls that step.c makes too: declared once, for all files. */
#ifndef KVSTACK_KERNELS_H
#define KVSTACK_KERNELS_H
#include <stdint.h>

void kv_index_scores_at(const float *q, const float *w, const uint8_t *pool, int64_t per,
                        int64_t row_bytes, const int64_t *table, int64_t max_blocks,
                        const int64_t *held, const int64_t *entries, int64_t K, int64_t B,
                        int64_t H, int64_t D, int64_t block, int packed, const float *elem,
                        const float *scale, float *out, int threads);

void kv_sparse_attention(const float *q, const float *sink, const uint8_t *ring,
                         int64_t ring_bytes, const int64_t *ring_pos, const int64_t *slots,
                         const int64_t *positions, int64_t w, int64_t window_size,
                         int64_t ring_block, int ring_packed, const float *ring_elem,
                         const float *ring_scale, const uint8_t *pool, int64_t per,
                         int64_t kv_bytes, const int64_t *block_table, int64_t max_blocks,
                         const int64_t *selected, int64_t k, int64_t kv_block, int kv_packed,
                         const float *kv_elem, const float *kv_scale, int64_t b, int64_t h,
                         int64_t d, float scale, float *rows, float *logits, float *out,
                         int threads);

void kv_sparse_attention_cached(
        const float *q, const float *sink, const uint8_t *ring, int64_t ring_bytes,
        const int64_t *ring_pos, const int64_t *slots, const int64_t *positions, int64_t w,
        int64_t window_size, int64_t ring_block, int ring_packed, const float *ring_elem,
        const float *ring_scale, const uint8_t *pool, int64_t per, int64_t kv_bytes,
        const int64_t *block_table, int64_t max_blocks, const int64_t *selected, int64_t k,
        int64_t kv_block, int kv_packed, const float *kv_elem, const float *kv_scale,
        int64_t b, int64_t h, int64_t d, float scale, float *rows, float *logits, float *out,
        int threads, float *ring_vals, uint8_t *have);

void kv_dense_attention(const float *q, const uint8_t *k_pool, const uint8_t *v_pool,
                        int64_t per, int64_t k_bytes, int64_t v_bytes,
                        const int64_t *block_table, int64_t max_blocks, const int64_t *lengths,
                        int64_t block, int packed, const float *elem, const float *scale_table,
                        int64_t b, int64_t h, int64_t kv_heads, int64_t d, float scale,
                        float *keys, float *values, float *logits, float *out);

void kv_draft_attention(const float *q, const float *window, const float *block,
                        const int64_t *pad, const float *sink, int64_t b, int64_t kq,
                        int64_t w, int64_t h, int64_t d, float scale, const float **seen,
                        float *probs, float *out, int threads);

/* weights.c's weight formats, and its y [N, O] = x W^T on a weight as stored (step.c's
 * compressor multiplies a checkpoint's bf16 weights by it). */
enum { FMT_FP8 = 0, FMT_FP4 = 1, FMT_BF16 = 2 };

void kv_packed_linear(const float *x, int64_t N, int fmt, const uint8_t *codes,
                      const uint8_t *scales, int64_t O, int64_t K, int64_t groups,
                      const float *elem, const float *scale, int nan_codes, float *y, int isa,
                      int threads);

#endif
