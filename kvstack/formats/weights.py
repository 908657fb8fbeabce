"""Weight formats of DeepSeek's published V4.1 checkpoints, bit-exact.

- `fp8_e4m3_b32x32`: dense projections. One E4M3 byte per weight; one UE8M0 scale byte
  per 32x32 block of the [out, in] matrix (edge blocks cover what is left), the scale
  `2^ceil(log2(amax / 448))` of the block's largest magnitude.
- Routed experts are E2M1, two per byte (even element in the low nibble), one UE8M0 scale
  per 32 along each row: exactly the cache format `fp4_ue8m0_32`, so they use
  `kvstack.formats.quantize` / `dequantize` with that name.

Codes and scales are uint8 here; a checkpoint stores the same bytes as float8_e4m3fn
(codes), float8_e8m0fnu (scales) and int8 (E2M1 pairs).
"""

import torch
import torch.nn.functional as F

from kvstack.formats.codecs import (
    E4M3_MAX,
    ceil_log2_ratio,
    e4m3_decode,
    e4m3_encode,
    pow2,
    ue8m0_decode,
)

WEIGHT_BLOCK = 32  # rows and columns per scale of an FP8 weight
EXPERT_FORMAT = "fp4_ue8m0_32"


def fp8_block_scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    return -(-out_features // WEIGHT_BLOCK), -(-in_features // WEIGHT_BLOCK)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out blocks, 32, in blocks, 32], zero-padded at the edges."""
    out_f, in_f = w.shape
    rows, cols = fp8_block_scale_shape(out_f, in_f)
    padded = F.pad(w, (0, cols * WEIGHT_BLOCK - in_f, 0, rows * WEIGHT_BLOCK - out_f))
    return padded.view(rows, WEIGHT_BLOCK, cols, WEIGHT_BLOCK)


def quantize_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [out, in] -> (E4M3 codes uint8 [out, in], UE8M0 scales uint8
    [ceil(out/32), ceil(in/32)])."""
    if w.dim() != 2 or not torch.is_floating_point(w):
        raise ValueError(f"an FP8 block weight must be a float matrix, got {w.dtype} "
                         f"{list(w.shape)}")
    w = w.detach().to(torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("an FP8 block weight holds NaN or infinite values")
    blocks = _blocks(w)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    exponent = ceil_log2_ratio(amax.clamp(min=1e-4), E4M3_MAX)
    codes = e4m3_encode(blocks / pow2(exponent))
    out_f, in_f = w.shape
    codes = codes.flatten(2, 3).flatten(0, 1)[:out_f, :in_f].contiguous()
    return codes, (exponent + 127).to(torch.uint8).reshape(amax.shape[0], amax.shape[2])


def dequantize_fp8_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E4M3 codes uint8 [out, in] and their 32x32 UE8M0 scales -> float32 [out, in]."""
    out_f, in_f = codes.shape
    if tuple(scales.shape) != fp8_block_scale_shape(out_f, in_f):
        raise ValueError(f"an FP8 weight [{out_f}, {in_f}] needs scales "
                         f"{list(fp8_block_scale_shape(out_f, in_f))}, got {list(scales.shape)}")
    scale = ue8m0_decode(scales).repeat_interleave(WEIGHT_BLOCK, 0)[:out_f]
    scale = scale.repeat_interleave(WEIGHT_BLOCK, 1)[:, :in_f]
    return e4m3_decode(codes) * scale
