"""Block-scaled storage formats of the KV cache (design.md section 3), bit-exact.

A quantised tensor is two uint8 tensors: `codes` (two E2M1 codes per byte, element 2i in
the low nibble, or one E4M3 byte per element, or the raw little-endian bf16 bytes) and
`scales` (one raw scale byte per block of the last dimension). The cache stores both in
one packed row per entry: codes, then scales.
"""

import math
from dataclasses import dataclass

import torch

from kvstack.formats.codecs import (
    _E2M1_TABLE,
    _E4M3_TABLE,
    _UE8M0_TABLE,
    E2M1_MAX,
    E4M3_MAX,
    ceil_log2_ratio,
    e2m1_decode_packed,
    e2m1_encode,
    e2m1_ue8m0_decode,
    e4m3_decode,
    e4m3_encode,
    e4m3_encode_sixth,
    pow2,
    ue8m0_decode,
)
from kvstack.formats.spec import Format, bytes_per_entry, check_width, get_format


@dataclass(frozen=True)
class Quantized:
    fmt: str
    codes: torch.Tensor  # uint8 [..., code_bytes(d)]
    scales: torch.Tensor  # uint8 [..., d // block]; [..., 0] for bf16


def quantize(x: torch.Tensor, fmt: str, check: bool = True) -> Quantized:
    """Quantise a float tensor [..., d] along its last dimension (computed in float32).

    The values are checked first (finite, within the format's range), which reads one
    number back from the device; check=False leaves that to a caller that checks what it
    computes from the result (the engine's decode step checks its logits), and values out
    of range then come back non-finite."""
    f = get_format(fmt)
    if not torch.is_floating_point(x):
        raise ValueError(f"format {fmt}: expected a float tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"format {fmt}: expected a tensor [..., d], got a scalar")
    d = x.shape[-1]
    check_width(f, d)
    x = x.to(torch.float32)
    if check and x.numel():
        check_magnitude(f, x.abs().amax().item())  # NaN if any element is NaN
    if f.element == "bf16":
        codes = x.to(torch.bfloat16).contiguous().view(torch.uint8)
        return Quantized(fmt, codes, codes.new_empty((*x.shape[:-1], 0)))

    blocks = x.reshape(*x.shape[:-1], d // f.scale_block, f.scale_block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if f.scale == "e4m3":
        scale_bytes = e4m3_encode_sixth(amax)
        scale = e4m3_decode(scale_bytes)
        scaled = (blocks / scale).clamp(-E2M1_MAX, E2M1_MAX)
    else:
        if f.element == "e2m1":
            exponent = ceil_log2_ratio(amax.clamp(min=E2M1_MAX * 2.0**-126), E2M1_MAX)
        else:
            exponent = ceil_log2_ratio(amax.clamp(min=1e-4), E4M3_MAX)
        scale_bytes = (exponent + 127).to(torch.uint8)
        scaled = blocks / pow2(exponent)

    if f.element == "e2m1":
        nibbles = e2m1_encode(scaled).reshape(*x.shape[:-1], d // 2, 2)
        codes = nibbles[..., 0] | (nibbles[..., 1] << 4)
    else:
        codes = e4m3_encode(scaled).reshape(x.shape)
    return Quantized(fmt, codes, scale_bytes.reshape(*x.shape[:-1], d // f.scale_block))


def check_magnitude(f: Format, magnitude: float) -> None:
    """Raise naming the format when values of this largest magnitude (NaN where any value
    is NaN) cannot be stored."""
    if not math.isfinite(magnitude):
        raise ValueError(f"format {f.name}: input holds NaN or infinite values")
    if f.max_magnitude is not None and magnitude > f.max_magnitude:
        raise ValueError(
            f"format {f.name}: input magnitude {magnitude:.6g} is above {f.max_magnitude:.6g}, "
            "the largest this format stores without overflowing float32"
        )


def dequantize(q: Quantized) -> torch.Tensor:
    """Float32 values [..., d] of a quantised tensor."""
    f = get_format(q.fmt)
    if f.element == "bf16":
        return q.codes.contiguous().view(torch.bfloat16).to(torch.float32)
    if f.element == "e2m1" and f.scale == "ue8m0":  # fp4_ue8m0_32
        # One lookup per code byte with the scale applied: 1.2x as fast as decoding codes
        # and scales apart and multiplying (bench/formats.py, one thread), on the bulk of
        # a decode step's index scoring. Not for the others: fp8_ue8m0_32 gained 3 %, and
        # fp4_e4m3_16's blocks of 8 code bytes make adding the scale to the index a slow
        # broadcast (1.08x the time).
        return e2m1_ue8m0_decode(q.codes, q.scales)
    # The lookups hand back new contiguous values, so these reshapes are views and the
    # scale multiplies them in place (0.9x the time of a new product, same sizes).
    values = e2m1_decode_packed(q.codes) if f.element == "e2m1" else e4m3_decode(q.codes)
    values = values.view(*q.scales.shape, f.scale_block)
    scale = e4m3_decode(q.scales) if f.scale == "e4m3" else ue8m0_decode(q.scales)
    return values.mul_(scale[..., None]).flatten(-2)


def decode_tables(fmt: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The float32 tables `dequantize` decodes a block-scaled format by: (value by code,
    16 entries for E2M1 or 256 for E4M3; scale by scale byte, 256 entries), for a kernel
    that decodes rows itself; None for bf16. A value is element[code] * scale[byte]."""
    f = get_format(fmt)
    if f.element == "bf16":
        return None
    return (_E2M1_TABLE if f.element == "e2m1" else _E4M3_TABLE,
            _E4M3_TABLE if f.scale == "e4m3" else _UE8M0_TABLE)


def fake_quantize(x: torch.Tensor, fmt: str, check: bool = True) -> torch.Tensor:
    """The float32 values a store of format fmt hands back for x (check: as quantize's)."""
    return dequantize(quantize(x, fmt, check))


def straight_through(x: torch.Tensor, fmt: str, check: bool = True) -> torch.Tensor:
    """fake_quantize(x) in the forward, identity in the backward (quantisation-aware
    training learns the rounding noise without a zero gradient)."""
    rounded = fake_quantize(x.detach(), fmt, check).to(x.dtype)
    return x + (rounded - x).detach()


def pack_rows(q: Quantized) -> torch.Tensor:
    """One uint8 row per entry, [..., bytes_per_entry]: codes then scales."""
    return torch.cat((q.codes, q.scales), dim=-1)


def unpack_rows(rows: torch.Tensor, fmt: str, d: int) -> Quantized:
    """Split packed rows [..., bytes_per_entry(fmt, d)] back into codes and scales."""
    f = get_format(fmt)
    width = bytes_per_entry(fmt, d)
    if rows.dtype != torch.uint8 or rows.dim() == 0 or rows.shape[-1] != width:
        raise ValueError(
            f"format {fmt}: packed rows of width {d} must be uint8 [..., {width}], "
            f"got {rows.dtype} {list(rows.shape)}"
        )
    n_code = f.code_bytes(d)
    return Quantized(fmt, rows[..., :n_code], rows[..., n_code:])
