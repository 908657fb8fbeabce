"""Bit-exact storage formats of the KV cache (design.md section 3). The format facts
(`FORMATS`, `get_format`, `bytes_per_entry`) need no torch; the codecs load it on use."""

from kvstack._lazy import lazy_exports
from kvstack.formats.spec import FORMATS, Format, bytes_per_entry, get_format

_CODECS = ("Quantized", "decode_tables", "dequantize", "fake_quantize", "pack_rows", "quantize",
           "straight_through", "unpack_rows")
__getattr__ = lazy_exports(__name__, dict.fromkeys(_CODECS, "kvstack.formats.quantized"))
__all__ = ["FORMATS", "Format", "bytes_per_entry", "get_format", *_CODECS]
