"""The storage formats of the KV cache as facts (design.md section 3): names, element and
scale kinds, scale blocks, bytes per entry. No torch here, so that configs, plans and the
`kvstack` command read them without loading it; the codecs are in `quantized`."""

from dataclasses import dataclass

BF16_MAX = (2 - 2**-7) * 2.0**127  # the largest finite bfloat16


@dataclass(frozen=True)
class Format:
    name: str
    element: str  # "e2m1" | "e4m3" | "bf16"
    scale_block: int  # elements per scale; 1 for bf16, which has no scales
    scale: str | None  # "e4m3" | "ue8m0" | None
    # Largest magnitude stored without the dequantised value overflowing float32; None
    # when the format saturates instead (fp4_e4m3_16 clamps at 6 * 448 by its rule).
    max_magnitude: float | None

    def code_bytes(self, d: int) -> int:
        return {"e2m1": d // 2, "e4m3": d, "bf16": 2 * d}[self.element]

    def scale_bytes(self, d: int) -> int:
        return d // self.scale_block if self.scale else 0


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp4_e4m3_16", "e2m1", 16, "e4m3", None),
        # Above 6 * 2^125 the scale is 2^126 and codes 4 and 6 dequantise to infinity.
        Format("fp4_ue8m0_32", "e2m1", 32, "ue8m0", 6 * 2.0**125),
        # Above 448 * 2^119 the scale is 2^120 and 256 * 2^120 is infinity.
        Format("fp8_ue8m0_32", "e4m3", 32, "ue8m0", 448 * 2.0**119),
        Format("bf16", "bf16", 1, None, BF16_MAX),
    )
}


def get_format(fmt: str) -> Format:
    if fmt not in FORMATS:
        raise ValueError(f"unknown storage format {fmt!r}; known: {', '.join(FORMATS)}")
    return FORMATS[fmt]


def check_width(f: Format, d: int) -> None:
    if d <= 0 or d % f.scale_block or (f.element == "e2m1" and d % 2):
        raise ValueError(
            f"format {f.name}: width {d} is not a positive multiple of its scale block of "
            f"{f.scale_block}"
        )


def bytes_per_entry(fmt: str, d: int) -> int:
    """Bytes one cache entry of width d occupies in format fmt (codes + scales)."""
    f = get_format(fmt)
    check_width(f, d)
    return f.code_bytes(d) + f.scale_bytes(d)
