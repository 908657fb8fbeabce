"""Bit-exact storage formats of the KV cache (DESIGN.md section 3)."""

from kvstack.formats.quantize import (
    FORMATS,
    Format,
    Quantized,
    bytes_per_entry,
    dequantize,
    fake_quantize,
    get_format,
    pack_rows,
    quantize,
    straight_through,
    unpack_rows,
)

__all__ = [
    "FORMATS",
    "Format",
    "Quantized",
    "bytes_per_entry",
    "dequantize",
    "fake_quantize",
    "get_format",
    "pack_rows",
    "quantize",
    "straight_through",
    "unpack_rows",
]
