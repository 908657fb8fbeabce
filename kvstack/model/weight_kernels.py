"""Triton kernels that multiply V4.1 checkpoint weights packed: the GPU side of
`kvstack.native.packed_linear` (FP8) and `kvstack.native.fp4_grouped`.

`fp8_linear` is y = x W^T for a dense projection held as E4M3 codes (one byte per weight)
and UE8M0 scales (one byte per 32x32 block). `fp4_grouped` runs the routed experts a step
uses, each on its own run of rows, with E2M1 codes (two per byte) and one UE8M0 scale per
row per 32. Neither writes a float copy of a weight: a program loads a tile of code bytes
and the scale bytes that cover it, decodes them to float32 in registers and multiplies
them into a float32 accumulator, so a call reads the checkpoint's bytes once per row tile.

The grid (one program per output tile, `Plan` picks the tile sizes from the shapes):

- axis 0, output tiles: O / BLOCK_O tiles of output features. With `groups` > 1 (V4.1's
  wo_a, a block-diagonal weight) each group has its own tiles, so every tile reads one
  group's slice of x; for `fp4_grouped` this axis runs over (expert group, row tile)
  pairs instead (below).
- axis 1, row tiles of x: N / BLOCK_N.
- axis 2, split-K: a decode step's GEMV (N = 1) of a narrow projection has only O / BLOCK_O
  programs, too few to keep every SM streaming bytes, and a GEMV is bound by those bytes.
  When the first two axes give fewer programs than twice the SMs, K is cut into `split`
  chunks (a multiple of BLOCK_K each); each chunk's partial sums go to their own slice of
  a float32 workspace [split, N, O], summed by torch afterwards. That second pass, not an
  atomic add, so results are bit-reproducible run to run (a greedy decode gives the same
  tokens), at the price of split * N * O floats, small exactly when split-K is used.

Two ways to multiply a tile, picked by the rows per tile: up to 8 rows (decode) a
broadcast product summed over K (`tl.dot` needs 16 rows and would waste most of them), from
9 rows on `tl.dot` with `input_precision="ieee"`, so both are float32 multiply-adds: the
results equal dequantise-then-matmul within float32 rounding (TF32 would not).

`fp4_grouped` reaches every expert in one launch through their addresses: `pointers`
[E, 2] int64 holds each expert's codes and scales `data_ptr()`s (the model keeps one such
table per projection, `PackedExperts.addresses`); a program loads expert experts[g]'s pair
and casts it to a uint8 pointer. This works under Triton's interpreter too (the experts'
host tensors are read where they lie), so the tests exercise the same path. Row tiles
follow the groups: group g's rows ends[g-1]:ends[g] make cdiv(rows, BLOCK_M) tiles, the
tiles' running total is computed on the device (no host sync to read `ends`), and the grid
has cdiv(M, BLOCK_M) + G programs along axis 0, an upper bound on that total; a program
finds its group by counting the totals at or below its id, and the surplus ones do nothing.

Decoding, with bit operations (exact, NaN-preserving; the products are the ones the torch
codecs make, so each dequantised weight equals theirs bit for bit):
E4M3 (fn) = (-1)^s (1 + m/8) 2^(e-7), or m 2^-9 for e = 0, NaN for codes 0x7F and 0xFF;
E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; UE8M0 = 2^(b-127), 2^-127 for 0, NaN for 255.
A NaN code or scale therefore makes NaN in exactly the outputs the reference makes NaN.

Tested under `TRITON_INTERPRET=1` (tests/test_weight_kernels.py). The GPU block sizes in
`plan` are reasoned, not tuned: they have not been timed on a GPU yet.
"""

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvstack.formats.weights import WEIGHT_BLOCK, fp8_block_scale_shape

SCALE_BLOCK = 32  # weights per UE8M0 scale along K (FP8 blocks are 32x32, FP4 rows 1x32)
BROADCAST_ROWS = 8  # up to this many rows per tile: broadcast product; above: tl.dot


@triton.jit
def _e4m3(byte):
    b = byte.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) (1+m/8)
    magnitude = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    magnitude = tl.where((b & 0x7F) == 0x7F, float("nan"), magnitude)
    return tl.where(b >= 128, -magnitude, magnitude)


@triton.jit
def _e2m1(nibble):
    c = nibble & 0x7
    # codes 2..7: 2^(e-1) (1 + m/2) from the bits; code 1 is 0.5 (2^-1), code 0 is 0
    bits = tl.where(c >= 2, (((c >> 1) + 126) << 23) | ((c & 1) << 22), c * (126 << 23))
    return (bits | ((nibble & 0x8) << 28)).to(tl.float32, bitcast=True)  # bit 3: the sign


@triton.jit
def _ue8m0(byte):
    b = byte.to(tl.int32)
    bits = tl.where(b == 0, 0x400000, b << 23)  # byte 0: 2^-127, a subnormal
    return tl.where(b == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _accumulate(acc, x, w, DOT: tl.constexpr):
    """acc [BN, BO] + x [BN, BK] w[BO, BK]^T, in float32."""
    if DOT:
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    else:
        return acc + tl.sum(x[:, None, :] * w[None, :, :], axis=2)


@triton.jit
def _fp8_linear(x_ptr, codes_ptr, scales_ptr, out_ptr, N, OUT, K, x_stride, group_rows,
                group_tiles, k_chunk, scale_cols,
                BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT: tl.constexpr):
    tile = tl.program_id(0)
    g = tile // group_tiles  # every tile lies in one group: the x columns it reads
    o = g * group_rows + (tile % group_tiles) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_in = o < (g + 1) * group_rows
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = n < N
    k_start = tl.program_id(2) * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    x_rows = x_ptr + n.to(tl.int64)[:, None] * x_stride + g * K
    w_rows = codes_ptr + o.to(tl.int64)[:, None] * K
    s_rows = scales_ptr + (o // 32)[:, None] * scale_cols
    acc = tl.zeros((BLOCK_N, BLOCK_O), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_in = k < k_end
        x = tl.load(x_rows + k[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0)
        w_in = o_in[:, None] & k_in[None, :]
        # outside the weight: code 0 under scale 2^0, a zero that cannot make NaN
        codes = tl.load(w_rows + k[None, :], mask=w_in, other=0)
        scales = tl.load(s_rows + (k // 32)[None, :], mask=w_in, other=127)
        acc = _accumulate(acc, x, _e4m3(codes) * _ue8m0(scales), DOT)
    out = out_ptr + (tl.program_id(2) * N + n.to(tl.int64))[:, None] * OUT + o[None, :]
    tl.store(out, acc, mask=n_in[:, None] & o_in[None, :])


@triton.jit
def _fp4_grouped(x_ptr, pointers_ptr, experts_ptr, ends_ptr, tile_ends_ptr, out_ptr,
                 M, OUT, K, G, b_chunk,
                 BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr,
                 BLOCK_B: tl.constexpr, DOT: tl.constexpr):
    t = tl.program_id(0)
    gs = tl.arange(0, BLOCK_G)
    tile_ends = tl.load(tile_ends_ptr + gs, mask=gs < G, other=0x7FFFFFFF)
    g = tl.sum((tile_ends <= t).to(tl.int32), axis=0)  # the first group ending after t
    live = g < G  # false for the surplus programs of the grid's bound
    g = tl.minimum(g, G - 1)
    tile_start = tl.load(tile_ends_ptr + g - 1, mask=g > 0, other=0)
    row_start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
    # no rows for a surplus program: live folded into the bound, as and-ing the scalar
    # into the mask makes int32 mask data under Triton 3.9's interpreter, which loads refuse
    row_end = tl.where(live, tl.minimum(tl.load(ends_ptr + g), M), 0)
    m = row_start + (t - tile_start) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_in = m < row_end
    e = tl.load(experts_ptr + g).to(tl.int64)
    codes_ptr = tl.load(pointers_ptr + 2 * e).to(tl.pointer_type(tl.uint8))
    scales_ptr = tl.load(pointers_ptr + 2 * e + 1).to(tl.pointer_type(tl.uint8))
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_in = o < OUT
    row_bytes = K // 2
    b_start = tl.program_id(2) * b_chunk
    b_end = tl.where(live, tl.minimum(b_start + b_chunk, row_bytes), b_start)  # none: 0 trips
    x_rows = x_ptr + m.to(tl.int64)[:, None] * K
    w_rows = codes_ptr + o.to(tl.int64)[:, None] * row_bytes
    s_rows = scales_ptr + o.to(tl.int64)[:, None] * (K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_O), tl.float32)
    for b0 in range(b_start, b_end, BLOCK_B):
        j = b0 + tl.arange(0, BLOCK_B)  # code bytes: elements 2j (low nibble) and 2j + 1
        j_in = j < b_end
        w_in = o_in[:, None] & j_in[None, :]
        packed = tl.load(w_rows + j[None, :], mask=w_in, other=0).to(tl.int32)
        scale = _ue8m0(tl.load(s_rows + (j // 16)[None, :], mask=w_in, other=127))
        # even and odd elements apart: two products instead of interleaving the nibbles
        x_in = m_in[:, None] & j_in[None, :]
        x_even = tl.load(x_rows + 2 * j[None, :], mask=x_in, other=0.0)
        x_odd = tl.load(x_rows + 2 * j[None, :] + 1, mask=x_in, other=0.0)
        acc = _accumulate(acc, x_even, _e2m1(packed & 0xF) * scale, DOT)
        acc = _accumulate(acc, x_odd, _e2m1(packed >> 4) * scale, DOT)
    out = out_ptr + (tl.program_id(2) * M + m.to(tl.int64))[:, None] * OUT + o[None, :]
    tl.store(out, acc, mask=m_in[:, None] & o_in[None, :])


@dataclass(frozen=True)
class Plan:
    """A launch's tiles: rows of x per program (block_n), output features (block_o),
    weights along K per loop trip (block_k), whether tiles multiply by tl.dot, and split-K
    (k_chunk weights of K per program, `split` programs along K)."""

    block_n: int
    block_o: int
    block_k: int
    dot: bool
    split: int = 1
    k_chunk: int = 0
    num_warps: int = 4


def _tiles(rows: int) -> tuple[int, int, int, bool]:
    """GPU tile sizes for tiles of `rows` rows: (block_n, block_o, block_k, dot).

    Broadcast tiles keep block_n * block_o * block_k at 8192 floats (64 registers a thread
    at 4 warps): a GEMV reads 128 code bytes of each of 64 rows per trip. tl.dot tiles
    grow with the rows so a weight tile, decoded once, serves as many rows as possible."""
    if rows <= BROADCAST_ROWS:
        block_n = triton.next_power_of_2(max(rows, 1))
        block_k = 128 if block_n <= 4 else 64
        return block_n, max(16, 8192 // (block_n * block_k)), block_k, False
    if rows <= 32:
        return triton.next_power_of_2(rows), 64, 32, True
    return 64, 128 if rows >= 128 else 64, 32, True


def plan(rows: int, out_tiles_of: Callable[[int, int], int], in_features: int, sms: int,
         blocks: tuple[int, int, int] | None = None, split_k: int | None = None,
         k_step: int = 1) -> Plan:
    """The tiles and split-K of a launch: tiles of `rows` rows of x (1 for a GEMV), K of
    `in_features` weights, on a GPU of `sms` SMs.

    out_tiles_of(block_o, block_n): the programs the first two grid axes make with those
    tiles. Where they are fewer than 2 * sms, K is split until there are at least 2 * sms
    (or one loop trip per program). blocks: (block_n, block_o, block_k) instead of the size
    rule (powers of two; at least 16 each where block_n > 8, the tl.dot tiles). split_k: at
    least this many programs along K (as K's trips allow) instead of the rule. k_step:
    block_k must be a multiple of it (2 for FP4: whole code bytes)."""
    if blocks is None:
        block_n, block_o, block_k, dot = _tiles(rows)
    else:
        block_n, block_o, block_k = blocks
        dot = block_n > BROADCAST_ROWS
        for b in blocks:
            if b < 1 or b & (b - 1):
                raise ValueError(f"block sizes must be powers of two, got {blocks}")
        if dot and min(blocks) < 16:
            raise ValueError(f"tl.dot tiles (block_n > {BROADCAST_ROWS}) need blocks of at "
                             f"least 16, got {blocks}")
    block_k = max(block_k, k_step)
    if block_k % k_step:
        raise ValueError(f"block_k must be a multiple of {k_step}, got {block_k}")
    trips = max(1, triton.cdiv(in_features, block_k))
    if split_k is None:
        programs = out_tiles_of(block_o, block_n)
        split_k = triton.cdiv(2 * sms, programs) if programs < 2 * sms else 1
    split_k = max(1, min(split_k, trips))
    k_chunk = max(1, trips // split_k) * block_k  # rounded down: at least split_k programs
    return Plan(block_n, block_o, block_k, dot, triton.cdiv(max(in_features, 1), k_chunk),
                k_chunk, 4 if block_n * block_o * block_k <= 8192 or dot else 8)


def _check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"the tensors lie on different devices: {sorted(map(str, devices))}")
    (device,) = devices
    if device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        raise ValueError(f"the weight kernels run on CUDA (or under TRITON_INTERPRET=1), "
                         f"got tensors on {device}")


def _sms(device: torch.device) -> int:
    """SMs to fill; 1 under the interpreter, where more programs only cost time."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _finish(out: torch.Tensor) -> torch.Tensor:
    """The split-K workspace [split, rows, O] summed in a fixed order (reproducible)."""
    return out[0] if out.shape[0] == 1 else out.sum(0)


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, groups: int = 1,
               *, blocks: tuple[int, int, int] | None = None,
               split_k: int | None = None) -> torch.Tensor:
    """y = x W^T for an FP8 weight W [O, K] held packed: E4M3 codes uint8 [O, K] and UE8M0
    scales uint8 [ceil(O/32), ceil(K/32)]. x [N, groups * K] (float32; other floats are
    converted) -> [N, O] float32, equal to `x @ dequantize_fp8_blocks(codes, scales).T`
    within float32 rounding, NaN where it is NaN. groups > 1: W is block-diagonal, the
    O / groups output rows of group g reading x's columns g*K .. g*K + K - 1 (V4.1's wo_a).

    blocks (block_n, block_o, block_k) and split_k override `plan`'s choice (tests use
    them to reach every path at small shapes)."""
    o, k = codes.shape
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"fp8_linear: codes and scales must be uint8, got {codes.dtype} "
                         f"and {scales.dtype}")
    if tuple(scales.shape) != fp8_block_scale_shape(o, k):
        raise ValueError(f"fp8_linear: a weight [{o}, {k}] needs scales "
                         f"{list(fp8_block_scale_shape(o, k))}, got {list(scales.shape)}")
    if groups < 1 or o % groups:
        raise ValueError(f"fp8_linear: a weight of {o} rows does not split into {groups} "
                         "groups")
    if x.dim() != 2 or x.shape[1] != groups * k:
        raise ValueError(f"fp8_linear: x must be [N, {groups * k}], got {list(x.shape)}")
    _check_device(x, codes, scales)
    n = x.shape[0]
    if n == 0 or o == 0 or k == 0:
        return torch.zeros(n, o, dtype=torch.float32, device=x.device)
    x = x.to(torch.float32).contiguous()
    group_rows = o // groups

    def programs(block_o: int, block_n: int) -> int:
        return groups * triton.cdiv(group_rows, block_o) * triton.cdiv(n, block_n)

    p = plan(n, programs, k, _sms(x.device), blocks, split_k)
    group_tiles = triton.cdiv(group_rows, p.block_o)
    out = torch.empty(p.split, n, o, dtype=torch.float32, device=x.device)
    grid = (groups * group_tiles, triton.cdiv(n, p.block_n), p.split)
    _fp8_linear[grid](x, codes.contiguous(), scales.contiguous(), out, n, o, k, groups * k,
                      group_rows, group_tiles, p.k_chunk, scales.shape[1],
                      BLOCK_N=p.block_n, BLOCK_O=p.block_o, BLOCK_K=p.block_k, DOT=p.dot,
                      num_warps=p.num_warps)
    return _finish(out)


def expert_pointers(experts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """int64 [E, 2]: each expert's (codes, scales) addresses, for `fp4_grouped`, on the
    experts' device. The caller keeps the tensors alive and in place while it is used."""
    for codes, scales in experts:
        if not (codes.is_contiguous() and scales.is_contiguous()):
            raise ValueError("expert_pointers: an expert's codes and scales must be "
                             "contiguous (the kernel reads them as [O, K/2] and [O, K/32])")
    device = experts[0][0].device if experts else None
    return torch.tensor([[c.data_ptr(), s.data_ptr()] for c, s in experts],
                        dtype=torch.int64, device=device).view(-1, 2)


def fp4_grouped(x: torch.Tensor, pointers: torch.Tensor, experts: torch.Tensor,
                ends: torch.Tensor, out_features: int, *,
                blocks: tuple[int, int, int] | None = None,
                split_k: int | None = None) -> torch.Tensor:
    """Rows ends[g-1]:ends[g] of x [M, K] (float32; ends[-1] of the first) times the FP4
    weight [out_features, K] of expert experts[g] (E2M1 codes uint8 [O, K/2], element 2i
    in the low nibble, and UE8M0 scales uint8 [O, K/32], both contiguous), whose addresses
    are row experts[g] of pointers [E, 2] (int64: codes, scales; see `expert_pointers`):
    [M, out_features] float32, rows past ends[-1] zero. experts [G] and ends [G]
    (non-decreasing) are integer tensors; the same call as `kvstack.native.fp4_grouped`.

    One launch for every group, each expert's tensors read where they lie (separate
    allocations are fine): the kernel loads the pair of addresses and casts them to
    pointers. So neither the addresses nor experts / ends are checked against the
    experts' tensors (that would need a host sync): the caller passes valid ones, on x's
    device, and keeps the tensors alive. blocks (block_m, block_o, block_k in weights,
    block_k >= 2) and split_k override `plan`'s choice, as for `fp8_linear`."""
    m, k = x.shape if x.dim() == 2 else (-1, -1)
    if m < 0 or k % SCALE_BLOCK:
        raise ValueError(f"fp4_grouped: x must be [M, K] with K a multiple of {SCALE_BLOCK}, "
                         f"got {list(x.shape)}")
    if pointers.dtype != torch.int64 or pointers.dim() != 2 or pointers.shape[1] != 2:
        raise ValueError(f"fp4_grouped: pointers must be int64 [E, 2], got {pointers.dtype} "
                         f"{list(pointers.shape)}")
    if experts.dim() != 1 or experts.shape != ends.shape:
        raise ValueError(f"fp4_grouped: experts and ends must be [G] each, got "
                         f"{list(experts.shape)} and {list(ends.shape)}")
    _check_device(x, pointers, experts, ends)
    g = experts.numel()
    if m == 0 or g == 0 or out_features == 0 or k == 0:
        return torch.zeros(m, out_features, dtype=torch.float32, device=x.device)
    x = x.to(torch.float32).contiguous()
    experts = experts.to(torch.int32).contiguous()
    ends = ends.to(torch.int32).contiguous()
    # Row tiles per group: a group of c rows makes cdiv(c, block_m), so at most
    # cdiv(M, block_m) + G in all. Group sizes are unknown on the host; a step's mean
    # (M / G rows per expert) picks the tile shape, and the split-K rule counts the
    # cdiv(M, block_m) tiles the rows make at least.
    mean = max(1, math.ceil(m / g))

    def programs(block_o: int, block_m: int) -> int:
        return triton.cdiv(m, block_m) * triton.cdiv(out_features, block_o)

    p = plan(mean, programs, k, _sms(x.device), blocks, split_k, k_step=2)
    if p.dot and p.block_k < 32:  # a trip's products are over block_k / 2 code bytes
        raise ValueError(f"fp4_grouped: tl.dot tiles need block_k >= 32, got {p.block_k}")
    sizes = torch.diff(ends, prepend=ends.new_zeros(1)).clamp(min=0)
    tile_ends = torch.cumsum(torch.div(sizes + p.block_n - 1, p.block_n, rounding_mode="floor"),
                             0, dtype=torch.int32)
    out = torch.zeros(p.split, m, out_features, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, p.block_n) + g, triton.cdiv(out_features, p.block_o), p.split)
    _fp4_grouped[grid](x, pointers.contiguous(), experts, ends, tile_ends, out, m,
                       out_features, k, g, p.k_chunk // 2,
                       BLOCK_G=triton.next_power_of_2(g), BLOCK_M=p.block_n,
                       BLOCK_O=p.block_o, BLOCK_B=p.block_k // 2, DOT=p.dot,
                       num_warps=p.num_warps)
    return _finish(out)


__all__ = ["SCALE_BLOCK", "WEIGHT_BLOCK", "Plan", "expert_pointers", "fp4_grouped",
           "fp8_linear", "plan"]
