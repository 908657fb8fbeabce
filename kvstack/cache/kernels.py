"""Triton kernels of the decode step: a `DecodeBatch`'s backend on GPUs.

`index_scores` is an indexer's scoring of every entry of a stream for each sequence's
query: a program per (sequence, run of entries) reads the entries' FP4 index keys (E2M1
codes, one UE8M0 scale per 32) through the block table, dequantises them in registers and
sums the heads' weighted ReLU scores, so no float copy of the keys is made.

`sparse_attention` is a decode step's attention for one layer: each (sequence, head)
program reads the packed rows it attends to where they lie -- the window ring's FP8 rows
(E4M3 codes, one UE8M0 scale per 32) of the sequence's slot, and the selected compressed
entries' FP4 rows (E2M1 codes two per byte, one E4M3 scale per 16) through the block
table -- dequantises them in registers and attends with the sink in one pass (an online
softmax), so no float copy of a row is ever written to memory. It computes what
`Attention._attend` computes from the torch backend's reads (tested under Triton's
interpreter, `TRITON_INTERPRET=1`, which runs the kernel on the CPU).

The decoders are the formats' (design.md section 3) written with bit operations:
E4M3 (fn) = (-1)^s (1 + m/8) 2^(e-7), or m 2^-9 for e = 0; E2M1 magnitudes 0, 0.5, 1, 1.5,
2, 3, 4, 6 = (1 + m/2) 2^(e-1), or m/2 for e = 0; UE8M0 = 2^(b-127). Every product is
exact in float32, so the dequantised values are the torch codecs' bit for bit.
"""

import torch
import triton
import triton.language as tl

# What the kernels decode: a layout's window rings, compressed kv and index streams.
WINDOW_FORMAT = "fp8_ue8m0_32"
KV_FORMAT = "fp4_e4m3_16"
INDEX_FORMAT = "fp4_ue8m0_32"


@triton.jit
def _e4m3(byte):
    b = byte.to(tl.int32)
    e = (b >> 3) & 0xF
    m = (b & 0x7).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.001953125,
                         (1.0 + m * 0.125) * tl.exp2((e - 7).to(tl.float32)))
    return tl.where((b & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _e2m1(nibble):
    c = (nibble & 0x7).to(tl.int32)  # signed: e - 1 below must not wrap
    e = c >> 1
    m = (c & 1).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((nibble & 0x8) != 0, -magnitude, magnitude)


@triton.jit
def _online_softmax(s, values, m_i, l_i, acc):
    """Fold logits s [N] (-inf for none) and their rows [N, D] into the running max,
    denominator and weighted sum."""
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * values, 0)


@triton.jit
def _sparse_attention(q_ptr, out_ptr, sink_ptr, ring_ptr, ring_pos_ptr, slots_ptr,
                      positions_ptr, pool_ptr, table_ptr, selected_ptr,
                      H, W, K, window_size, per, max_blocks, scale,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    in_d = d < D
    q = tl.load(q_ptr + (b * H + h) * D + d, mask=in_d, other=0.0)
    t = tl.load(positions_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    m_i = tl.full((), -1e30, tl.float32)  # finite: a block with nothing seen adds nothing
    l_i = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    ring_bytes = D + D // 32  # E4M3 codes, then one UE8M0 scale per 32
    for start in range(0, W, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        pos = tl.load(ring_pos_ptr + slot * W + n, mask=n < W, other=-1)
        seen = (n < W) & (pos >= 0) & (pos <= t) & (pos > t - window_size)
        row = (slot * W + n) * ring_bytes
        where = seen[:, None] & in_d[None, :]
        codes = tl.load(ring_ptr + row[:, None] + d[None, :], mask=where, other=0)
        scales = tl.load(ring_ptr + row[:, None] + D + d[None, :] // 32, mask=where, other=127)
        k = _e4m3(codes) * tl.exp2(scales.to(tl.float32) - 127.0)
        s = tl.where(seen, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_i, l_i, acc = _online_softmax(s, k, m_i, l_i, acc)
    kv_bytes = D // 2 + D // 16  # E2M1 codes two per byte, then one E4M3 scale per 16
    for start in range(0, K, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        entry = tl.load(selected_ptr + b * K + j, mask=j < K, other=-1)
        chosen = (j < K) & (entry >= 0)
        entry = tl.where(chosen, entry, 0).to(tl.int64)
        block = tl.load(table_ptr + b * max_blocks + entry // per, mask=chosen, other=0)
        row = (block.to(tl.int64) * per + entry % per) * kv_bytes
        where = chosen[:, None] & in_d[None, :]
        packed = tl.load(pool_ptr + row[:, None] + d[None, :] // 2, mask=where, other=0)
        nibble = tl.where((d % 2 == 0)[None, :], packed & 0xF, packed >> 4)
        scales = tl.load(pool_ptr + row[:, None] + D // 2 + d[None, :] // 16, mask=where,
                         other=0x38)
        v = _e2m1(nibble) * _e4m3(scales)
        s = tl.where(chosen, tl.sum(v * q[None, :], axis=1) * scale, float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc)
    sink = tl.load(sink_ptr + h)
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.exp(sink - m_new)
    tl.store(out_ptr + (b * H + h) * D + d, acc * alpha / l_i, mask=in_d)


@triton.jit
def _index_scores(q_ptr, w_ptr, out_ptr, pool_ptr, table_ptr, positions_ptr,
                  N, ratio, per, max_blocks,
                  HI: tl.constexpr, DI: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    in_d = d < DI
    t = tl.load(positions_ptr + b)
    visible = (j < N) & (j < (t + 1) // ratio)  # the entry's group is complete
    block = tl.load(table_ptr + b * max_blocks + j // per, mask=visible, other=0)
    row = (block.to(tl.int64) * per + j % per) * (DI // 2 + DI // 32)
    where = visible[:, None] & in_d[None, :]
    packed = tl.load(pool_ptr + row[:, None] + d[None, :] // 2, mask=where, other=0)
    nibble = tl.where((d % 2 == 0)[None, :], packed & 0xF, packed >> 4)
    scales = tl.load(pool_ptr + row[:, None] + DI // 2 + d[None, :] // 32, mask=where,
                     other=127)
    keys = _e2m1(nibble) * tl.exp2(scales.to(tl.float32) - 127.0)  # [BLOCK_N, BLOCK_D]
    total = tl.zeros((BLOCK_N,), tl.float32)
    for h in tl.static_range(HI):
        q = tl.load(q_ptr + (b * HI + h) * DI + d, mask=in_d, other=0.0)
        total += tl.load(w_ptr + b * HI + h) * tl.maximum(tl.sum(keys * q[None, :], 1), 0.0)
    tl.store(out_ptr + b * N + j, tl.where(visible, total, float("-inf")), mask=j < N)


def index_scores(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor,
                 block_table: torch.Tensor, positions: torch.Tensor, n_entries: int,
                 ratio: int) -> torch.Tensor:
    """score(j) = sum_h w_h relu(q_h . k_j) of each sequence's query (q [B, Hi, Di], head
    weights w [B, Hi], at positions [B]) over entries 0..n_entries-1 of a ratio-`ratio`
    stream (pool [blocks, entries per block, bytes] through block_table [B, max_blocks]),
    entries whose group is not complete -inf: [B, n_entries]."""
    b, hi, di = q.shape
    out = torch.empty(b, n_entries, dtype=torch.float32, device=q.device)
    block_n = 64
    _index_scores[(b, triton.cdiv(n_entries, block_n))](
        q.float().contiguous(), w.float().contiguous(), out, pool.contiguous(),
        block_table.contiguous(), positions.contiguous(), n_entries, ratio, pool.shape[1],
        block_table.shape[1], HI=hi, DI=di, BLOCK_D=triton.next_power_of_2(di),
        BLOCK_N=block_n)
    return out


def sparse_attention(q: torch.Tensor, sink: torch.Tensor, ring: torch.Tensor,
                     ring_positions: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                     selected: torch.Tensor, window_size: int) -> torch.Tensor:
    """One decode step's attention of one layer: q [B, H, D] at positions [B] over each
    sequence's window ring (ring [slots, window, bytes] and the positions its rows hold
    [slots, window], the new token's row already written; `slots` [B]) and its selected
    compressed entries (selected [B, k], -1 for none, read from pool [blocks, entries per
    block, bytes] through block_table [B, max_blocks]), with the sink [H]; out [B, H, D]."""
    b, h, d = q.shape
    k = selected.shape[1]
    out = torch.empty_like(q, dtype=torch.float32)
    _sparse_attention[(b, h)](
        q.float().contiguous(), out, sink.float().contiguous(), ring.contiguous(),
        ring_positions.contiguous(), slots.contiguous(), positions.contiguous(),
        pool.contiguous(), block_table.contiguous(), selected.contiguous(),
        h, ring.shape[1], k, window_size, pool.shape[1], block_table.shape[1], d**-0.5,
        D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_N=16)
    return out
