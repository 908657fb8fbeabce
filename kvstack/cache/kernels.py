"""Triton kernels of the decode step: a `DecodeBatch`'s backend on GPUs.

`sparse_attention` is a decode step's attention for one layer: each sequence's query heads
attend to the packed rows it selects where they lie -- the window ring's FP8 rows (E4M3
codes, one UE8M0 scale per 32) of the sequence's slot, and the selected compressed
entries' FP4 rows (E2M1 codes two per byte, one E4M3 scale per 16) through the block
table -- dequantised in registers, so no float copy of a row is ever written to memory.
It computes what `Attention._attend` computes from the torch backend's reads.

Its grid is (head blocks, splits, sequences), FlashDecoding's split-K. The one-program-
per-(sequence, head) kernel it replaces had batch x heads programs, each walking every
row serially and decoding it for its one head: 0.2 % of copy bandwidth on an H200.

- A row is one vector serving every head (keys and values alike: MQA), so a program
  takes a block of BLOCK_H heads and decodes each row once for all of them; logits and
  weighted sums are then matmuls (`tl.dot`, tensor cores) rather than a reduction per
  head. Head blocks vary fastest in the grid, so the blocks reading one chunk run
  together and all but the first find its rows in L2.
- A sequence's attended rows (its ring's W rows, then its k selections) are cut into
  `splits` chunks of `chunk` rows, one program each, so a small batch still fills the
  device. Each program runs an online softmax over its chunk and writes its partial --
  running max m, denominator l, weighted sum [D] -- to a float32 workspace [B, H,
  splits(, D)]; `_combine` merges a (sequence, head)'s partials with the sink logit,
  weighting each by exp(m_s - M) for the overall max M (the sink's logit included): the
  one-pass softmax's result up to float32 rounding. A chunk with no valid rows keeps m =
  -1e30 (finite, so its tiles' exp(s - m) are 0 rather than NaN, and so is its weight
  exp(m - M)), l = 0 and a zero sum: it adds nothing. With one split the program applies
  the sink itself and there is no workspace.
- `attention_plan` picks the split count: enough chunks for ATTENTION_PROGRAMS_PER_SM
  programs per SM, each a whole number of row tiles and at least MIN_CHUNK_TILES of them,
  since every split costs a partial (H x D floats per sequence written and read back,
  as much as the rows themselves at V4.1-Flash's shapes) that must not outgrow the rows
  it spreads. A batch that fills the device alone gets one split. Under the interpreter
  it is two splits, so the tests run the combine (`chunk=` forces more).

`index_scores` is an indexer's scoring of every entry of a stream for each sequence's
query, sum_h w_h relu(q_h . k_j): its grid is (runs of entries, sequences), a program
loading the query's heads once and walking its run a tile of BLOCK_N entries at a time,
decoding each entry's FP4 key (E2M1 codes, one UE8M0 scale per 32, through the block
table) once for all heads and scoring it against them by one matmul. `index_plan` cuts
each sequence's entries into enough runs for INDEX_PROGRAMS_PER_SM programs per SM: a run
costs only a reload of the small query, so there are more of them than attention's splits.
(The kernel it replaces had a program per tile of 64 entries, plenty, but reduced every
head separately on the CUDA cores: 2 % of copy bandwidth.)

Matmuls keep float32 accuracy on TF32 tensor cores: the decoded rows are exact in TF32
(at most 6 significant bits), so only the float32 operand (queries, probabilities) is
split as hi + lo, hi its top 11 bits, and multiplied twice; lo's own TF32 rounding costs
~2^-21 of the operand. (input_precision "tf32x3" would also split the exact operand, a
third of the work wasted.) Even so, at 64 heads of 512 a row costs 4 x 64 x 512 MACs for
its ~340 bytes, so sparse attention is bound by tensor-core throughput, not bandwidth: a
limit on the share of copy bandwidth it can reach that wider blocks cannot lift. The
interpreter multiplies in float32.

Tested under Triton's interpreter (`TRITON_INTERPRET=1` runs the kernels on the CPU, one
program at a time). The GPU tile sizes were checked only by compiling for sm_90 (see
HEAD_TILE_FLOATS); they and the programs per SM are untimed first guesses:
bench/sparse_kernels.py reports GB/s and the share of copy bandwidth.

The decoders are the formats' (design.md section 3) written with bit operations:
E4M3 (fn) = (-1)^s (1 + m/8) 2^(e-7), or m 2^-9 for e = 0; E2M1 magnitudes 0, 0.5, 1, 1.5,
2, 3, 4, 6 = (1 + m/2) 2^(e-1), or m/2 for e = 0; UE8M0 = 2^(b-127). Every product is
exact in float32, so the dequantised values are the torch codecs' bit for bit.
"""

from functools import cache

import torch
import triton
import triton.language as tl

# What the kernels decode: a layout's window rings, compressed kv and index streams.
WINDOW_FORMAT = "fp8_ue8m0_32"
KV_FORMAT = "fp4_e4m3_16"
INDEX_FORMAT = "fp4_ue8m0_32"

# Grid targets on a GPU (see the module docstring). Attention's splits each cost a
# partial in the workspace, so fewer programs per SM than index scoring's runs.
ATTENTION_PROGRAMS_PER_SM = 4
INDEX_PROGRAMS_PER_SM = 16
MIN_CHUNK_TILES = 4  # a split's rows, in tiles: bounds the workspace beside the rows
# Tile sizes in floats: the most of a [heads, BLOCK_D] tile (the query's and the running
# sum's) and of a [rows, BLOCK_D] tile (the decoded rows) a program holds. Set so that
# Triton 3.9 compiles the kernels for sm_90 with no or few register spills (checked with
# ptxas -v, not timed: 64 heads of 512 in one program spill heavily).
HEAD_TILE_FLOATS = 8192
ATTENTION_ROW_TILE_FLOATS = 2048  # its rows take 4 dots and their decode; index's take 2
INDEX_ROW_TILE_FLOATS = 8192


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
def _tf32_split(x):
    """x = hi + lo with hi exact in TF32 (the low 13 mantissa bits cleared)."""
    hi = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _split_dot(a, b):
    """a @ b to float32 accuracy on TF32 tensor cores where b is exact in TF32 (decoded
    rows): a's two halves each once, lo's own TF32 rounding ~2^-21 of a."""
    hi, lo = _tf32_split(a)
    return tl.dot(lo, b, acc=tl.dot(hi, b, input_precision="tf32"), input_precision="tf32")


@triton.jit
def _fold(q_hi, q_lo, rows, seen, m_i, l_i, acc):
    """Fold a tile of rows [BLOCK_N, BLOCK_D] (keys and values both), those not `seen`
    masked out, into a block of heads' (q = q_hi + q_lo [BLOCK_H, BLOCK_D], the scale
    folded in) online softmax."""
    rows_t = tl.trans(rows)
    s = tl.dot(q_lo, rows_t, acc=tl.dot(q_hi, rows_t, input_precision="tf32"),
               input_precision="tf32")  # [BLOCK_H, BLOCK_N]
    s = tl.where(seen[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    acc = acc * alpha[:, None] + _split_dot(p, rows)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _sparse_attention(q_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, sink_ptr, ring_ptr,
                      ring_pos_ptr, slots_ptr, positions_ptr, pool_ptr, table_ptr,
                      selected_ptr, H, W, K, window_size, per, max_blocks, chunk, splits,
                      scale, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_N: tl.constexpr, FINAL: tl.constexpr):
    # Head blocks vary fastest, so the programs reading one chunk's rows run together and
    # all but the first find them in L2.
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    b = tl.program_id(2)
    in_h = heads < H
    d = tl.arange(0, BLOCK_D)
    in_d = d < D
    qd = in_h[:, None] & in_d[None, :]
    q = tl.load(q_ptr + (b * H + heads[:, None]) * D + d[None, :], mask=qd, other=0.0)
    q_hi, q_lo = _tf32_split(q * scale)  # split once for every tile's logits
    t = tl.load(positions_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    m_i = tl.full((BLOCK_H,), -1e30, tl.float32)  # finite: an all-masked tile adds nothing
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    # This chunk is rows lo..hi-1 of the sequence's W ring rows followed by its K
    # selections; either loop below may run no tile.
    lo = split * chunk
    hi = lo + chunk
    ring_hi = tl.minimum(hi, W)
    ring_bytes = D + D // 32  # E4M3 codes, then one UE8M0 scale per 32
    for start in range(lo, ring_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < ring_hi
        pos = tl.load(ring_pos_ptr + slot * W + n, mask=inside, other=-1)
        seen = inside & (pos >= 0) & (pos <= t) & (pos > t - window_size)
        row = (slot * W + n) * ring_bytes
        where = seen[:, None] & in_d[None, :]
        codes = tl.load(ring_ptr + row[:, None] + d[None, :], mask=where, other=0)
        scales = tl.load(ring_ptr + row[:, None] + D + d[None, :] // 32, mask=where, other=127)
        rows = _e4m3(codes) * tl.exp2(scales.to(tl.float32) - 127.0)
        m_i, l_i, acc = _fold(q_hi, q_lo, rows, seen, m_i, l_i, acc)
    kv_bytes = D // 2 + D // 16  # E2M1 codes two per byte, then one E4M3 scale per 16
    sel_hi = tl.minimum(hi, W + K) - W
    for start in range(tl.maximum(lo, W) - W, sel_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        inside = j < sel_hi
        entry = tl.load(selected_ptr + b * K + j, mask=inside, other=-1)
        chosen = inside & (entry >= 0)
        entry = tl.where(chosen, entry, 0).to(tl.int64)
        block = tl.load(table_ptr + b * max_blocks + entry // per, mask=chosen, other=0)
        row = (block.to(tl.int64) * per + entry % per) * kv_bytes
        where = chosen[:, None] & in_d[None, :]
        packed = tl.load(pool_ptr + row[:, None] + d[None, :] // 2, mask=where, other=0)
        nibble = tl.where((d % 2 == 0)[None, :], packed & 0xF, packed >> 4)
        scales = tl.load(pool_ptr + row[:, None] + D // 2 + d[None, :] // 16, mask=where,
                         other=0x38)
        rows = _e2m1(nibble) * _e4m3(scales)
        m_i, l_i, acc = _fold(q_hi, q_lo, rows, chosen, m_i, l_i, acc)
    if FINAL:  # the only split: the sink's logit joins here, no workspace
        sink = tl.load(sink_ptr + heads, mask=in_h, other=0.0)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        tl.store(out_ptr + (b * H + heads[:, None]) * D + d[None, :],
                 acc * (alpha / l_i)[:, None], mask=qd)
    else:
        part = (b * H + heads) * splits + split  # [B, H, splits] partials
        tl.store(m_ptr + part, m_i, mask=in_h)
        tl.store(l_ptr + part, l_i, mask=in_h)
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=qd)


@triton.jit
def _combine(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, H, splits, D: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(1)
    in_h = heads < H
    d = tl.arange(0, BLOCK_D)
    qd = in_h[:, None] & (d < D)[None, :]
    first = (b * H + heads) * splits
    sink = tl.load(sink_ptr + heads, mask=in_h, other=0.0)
    m_all = sink  # the overall max, the sink's logit among the maxima
    for s in range(splits):
        m_all = tl.maximum(m_all, tl.load(m_ptr + first + s, mask=in_h, other=-1e30))
    l_all = tl.exp(sink - m_all)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for s in range(splits):
        weight = tl.exp(tl.load(m_ptr + first + s, mask=in_h, other=-1e30) - m_all)
        l_all += weight * tl.load(l_ptr + first + s, mask=in_h, other=0.0)
        part = tl.load(acc_ptr + (first + s)[:, None] * D + d[None, :], mask=qd, other=0.0)
        acc += weight[:, None] * part
    tl.store(out_ptr + (b * H + heads[:, None]) * D + d[None, :], acc / l_all[:, None],
             mask=qd)


@triton.jit
def _index_scores(q_ptr, w_ptr, out_ptr, pool_ptr, table_ptr, positions_ptr,
                  N, ratio, per, max_blocks, run,
                  HI: tl.constexpr, DI: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = tl.program_id(0) * run
    b = tl.program_id(1)
    hi = tl.minimum(lo + run, N)
    d = tl.arange(0, BLOCK_D)
    in_d = d < DI
    heads = tl.arange(0, BLOCK_H)
    in_h = heads < HI
    # Loaded and split once for the run; padded heads have q = 0 and w = 0: they score 0.
    q = tl.load(q_ptr + (b * HI + heads[None, :]) * DI + d[:, None],
                mask=in_h[None, :] & in_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_H]
    q_hi, q_lo = _tf32_split(q)
    w = tl.load(w_ptr + b * HI + heads, mask=in_h, other=0.0)
    t = tl.load(positions_ptr + b)
    complete = (t + 1) // ratio  # entries whose group is complete
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        visible = (j < hi) & (j < complete)
        block = tl.load(table_ptr + b * max_blocks + j // per, mask=visible, other=0)
        row = (block.to(tl.int64) * per + j % per) * (DI // 2 + DI // 32)
        where = visible[:, None] & in_d[None, :]
        packed = tl.load(pool_ptr + row[:, None] + d[None, :] // 2, mask=where, other=0)
        nibble = tl.where((d % 2 == 0)[None, :], packed & 0xF, packed >> 4)
        scales = tl.load(pool_ptr + row[:, None] + DI // 2 + d[None, :] // 32, mask=where,
                         other=127)
        keys = _e2m1(nibble) * tl.exp2(scales.to(tl.float32) - 127.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(keys, q_lo, acc=tl.dot(keys, q_hi, input_precision="tf32"),
                   input_precision="tf32")  # [BLOCK_N, BLOCK_H]
        total = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)
        tl.store(out_ptr + b * N + j, tl.where(visible, total, float("-inf")), mask=j < hi)


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot's tiles are at least 16 a side


def _attention_blocks(width: int, heads: int) -> tuple[int, int, int, int]:
    """(BLOCK_D, BLOCK_H, BLOCK_N, num_warps) of sparse attention."""
    block_d = _pow2(width)
    block_h = min(_pow2(heads), max(16, HEAD_TILE_FLOATS // block_d))
    block_n = max(16, min(64, ATTENTION_ROW_TILE_FLOATS // block_d))
    return block_d, block_h, block_n, 8 if block_h * block_d >= HEAD_TILE_FLOATS else 4


def _index_blocks(width: int, heads: int) -> tuple[int, int, int, int]:
    """(BLOCK_D, BLOCK_H, BLOCK_N, num_warps) of index scoring: every head in one block
    (an indexer's heads x width is small), so each key is decoded once."""
    block_d = _pow2(width)
    block_n = max(16, min(64, INDEX_ROW_TILE_FLOATS // block_d))
    return block_d, _pow2(heads), block_n, 8 if block_n * block_d >= INDEX_ROW_TILE_FLOATS else 4


def _piece(length: int, pieces: int, tile: int, min_tiles: int) -> int:
    """Items per piece, cutting `length` items into at least `pieces` pieces where the
    floor allows: whole tiles (rounded down: a piece's last tile would run part empty), at
    least min_tiles of them."""
    per_piece = triton.cdiv(max(length, 1), max(pieces, 1))
    return max(min_tiles, per_piece // tile) * tile


def attention_plan(rows: int, batch: int, heads: int, width: int, sms: int | None,
                   chunk: int | None = None) -> tuple[int, int, int]:
    """(chunk, splits, programs) of sparse attention over `rows` attended rows a sequence
    (ring rows plus selections) for `batch` sequences of `heads` heads of `width`, on a
    GPU of `sms` SMs (None: the interpreter); `chunk` forces the rows a split takes."""
    _, block_h, block_n, _ = _attention_blocks(width, heads)
    programs = batch * triton.cdiv(heads, block_h)
    if chunk is None:
        if sms is None:  # two splits: the tests run the combine, and stay fast
            chunk = triton.cdiv(max(rows, 1), 2)
        else:
            wanted = triton.cdiv(ATTENTION_PROGRAMS_PER_SM * sms, programs)
            chunk = _piece(rows, wanted, block_n, MIN_CHUNK_TILES)
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    splits = max(1, triton.cdiv(rows, chunk))
    return chunk, splits, programs * splits


def index_plan(entries: int, batch: int, heads: int, width: int, sms: int | None,
               run: int | None = None) -> tuple[int, int, int]:
    """(run, runs, programs) of index scoring over `entries` entries a sequence for
    `batch` sequences of `heads` heads of `width`, on a GPU of `sms` SMs (None: the
    interpreter); `run` forces the entries a program scores."""
    if run is None:
        if sms is None:
            run = triton.cdiv(max(entries, 1), 2)
        else:
            _, _, block_n, _ = _index_blocks(width, heads)
            run = _piece(entries, triton.cdiv(INDEX_PROGRAMS_PER_SM * sms, batch), block_n, 1)
    if run < 1:
        raise ValueError(f"run must be at least 1, got {run}")
    runs = max(1, triton.cdiv(entries, run))
    return run, runs, batch * runs


def device_sms(device: torch.device) -> int | None:
    """The SM count the plans fill on `device`, or None where the kernels run under
    Triton's interpreter."""
    if not isinstance(_sparse_attention, triton.runtime.JITFunction) or device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def index_scores(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor,
                 block_table: torch.Tensor, positions: torch.Tensor, n_entries: int,
                 ratio: int, *, run: int | None = None) -> torch.Tensor:
    """score(j) = sum_h w_h relu(q_h . k_j) of each sequence's query (q [B, Hi, Di], head
    weights w [B, Hi], at positions [B]) over entries 0..n_entries-1 of a ratio-`ratio`
    stream (pool [blocks, entries per block, bytes] through block_table [B, max_blocks]),
    entries whose group is not complete -inf: [B, n_entries]. `run`: the entries a
    program scores (default: `index_plan`'s; tests set it small)."""
    b, hi, di = q.shape
    out = torch.empty(b, n_entries, dtype=torch.float32, device=q.device)
    if b == 0 or n_entries == 0:
        return out
    run, runs, _ = index_plan(n_entries, b, hi, di, device_sms(q.device), run)
    block_d, block_h, block_n, num_warps = _index_blocks(di, hi)
    _index_scores[(runs, b)](
        q.float().contiguous(), w.float().contiguous(), out, pool.contiguous(),
        block_table.contiguous(), positions.contiguous(), n_entries, ratio, pool.shape[1],
        block_table.shape[1], run, HI=hi, DI=di, BLOCK_D=block_d, BLOCK_H=block_h,
        BLOCK_N=block_n, num_warps=num_warps)
    return out


def sparse_attention(q: torch.Tensor, sink: torch.Tensor, ring: torch.Tensor,
                     ring_positions: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                     selected: torch.Tensor, window_size: int, *,
                     chunk: int | None = None) -> torch.Tensor:
    """One decode step's attention of one layer: q [B, H, D] at positions [B] over each
    sequence's window ring (ring [slots, window, bytes] and the positions its rows hold
    [slots, window], the new token's row already written; `slots` [B]) and its selected
    compressed entries (selected [B, k], -1 for none, read from pool [blocks, entries per
    block, bytes] through block_table [B, max_blocks]), with the sink [H]; out [B, H, D].
    `chunk`: the attended rows a split takes (default: `attention_plan`'s; tests set it
    small to force many splits)."""
    b, h, d = q.shape
    w, k = ring.shape[1], selected.shape[1]
    out = torch.empty_like(q, dtype=torch.float32)
    if b == 0:
        return out
    chunk, splits, _ = attention_plan(w + k, b, h, d, device_sms(q.device), chunk)
    block_d, block_h, block_n, num_warps = _attention_blocks(d, h)
    head_blocks = triton.cdiv(h, block_h)
    if splits == 1:
        m = denominators = acc = out  # unused: the program writes the output itself
    else:
        m = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
        denominators = torch.empty_like(m)
        acc = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
    sink = sink.float().contiguous()
    _sparse_attention[(head_blocks, splits, b)](
        q.float().contiguous(), out, m, denominators, acc, sink, ring.contiguous(),
        ring_positions.contiguous(), slots.contiguous(), positions.contiguous(),
        pool.contiguous(), block_table.contiguous(), selected.contiguous(),
        h, w, k, window_size, pool.shape[1], block_table.shape[1], chunk, splits, d**-0.5,
        D=d, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_N=block_n, FINAL=splits == 1,
        num_warps=num_warps)
    if splits > 1:
        _combine[(head_blocks, b)](m, denominators, acc, sink, out, h, splits, D=d,
                                   BLOCK_D=block_d, BLOCK_H=block_h, num_warps=num_warps)
    return out
