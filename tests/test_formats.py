"""Hand-computed vectors for the storage formats (design.md section 3)."""

import math
import struct

import pytest
import torch

from kvstack.formats import (
    FORMATS,
    bytes_per_entry,
    dequantize,
    pack_rows,
    quantize,
    unpack_rows,
)
from kvstack.formats.codecs import (
    E2M1_VALUES,
    ceil_log2_ratio,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e4m3_encode_sixth,
)
from kvstack.formats.quantized import Quantized


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def next_float32(x: float, toward: float) -> float:
    t = torch.tensor(x, dtype=torch.float32)
    return torch.nextafter(t, torch.tensor(toward, dtype=torch.float32)).item()


def next_up(x: float) -> float:
    return next_float32(x, math.inf)


def block(values: list[float], width: int) -> torch.Tensor:
    """One row of `width`, starting with `values`, rest zero."""
    row = torch.zeros(width)
    row[: len(values)] = torch.tensor(values)
    return row


def nibbles(codes: torch.Tensor) -> list[int]:
    flat = codes.flatten().tolist()
    return [n for byte in flat for n in (byte & 0xF, byte >> 4)]


# ---- E2M1 ------------------------------------------------------------------------------


def test_e2m1_every_tie_goes_to_the_even_code():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_encode(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]


def test_e2m1_just_off_the_ties_rounds_to_the_nearest():
    eps = 1e-3
    above = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) + eps
    below = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) - eps
    assert e2m1_encode(above).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert e2m1_encode(below).tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_e2m1_grid_points_and_saturation():
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 7.0, 100.0])
    assert e2m1_encode(grid).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7, 7]


def test_e2m1_sign_bit_is_copied_even_for_zero():
    x = torch.tensor([-0.5, -6.0, -0.1, -0.0, 0.0])
    assert e2m1_encode(x).tolist() == [9, 15, 8, 8, 0]


# ---- E4M3 ------------------------------------------------------------------------------


def test_e4m3_known_codes():
    x = torch.tensor([0.0, -0.0, 2.0**-9, 2.0**-6, 1.0, 1.125, 448.0, -448.0, 240.0])
    assert e4m3_encode(x).tolist() == [0x00, 0x80, 0x01, 0x08, 0x38, 0x39, 0x7E, 0xFE, 0x77]


def test_e4m3_ties_to_even():
    # Normal range: 1 + 1/16 is halfway between 1 (mantissa 0) and 1.125 (mantissa 1).
    # Subnormal range: 1.5 and 2.5 steps of 2^-9 go to 2 steps.
    x = torch.tensor([1.0625, 1.1875, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 0.5 * 2.0**-9, 232.0])
    assert e4m3_encode(x).tolist() == [0x38, 0x3A, 0x02, 0x02, 0x00, 0x76]


def test_e4m3_saturates_above_448():
    assert e4m3_encode(torch.tensor([464.0, 1e6, -1e6])).tolist() == [0x7E, 0x7E, 0xFE]


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch has no float8_e4m3fn")
def test_e4m3_codec_matches_torch_float8():
    codes = torch.arange(256, dtype=torch.uint8)
    ours = e4m3_decode(codes)
    theirs = codes.view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(ours.isnan(), theirs.isnan())
    finite = ~ours.isnan()
    assert torch.equal(ours[finite], theirs[finite])
    assert torch.equal(torch.signbit(ours[finite]), torch.signbit(theirs[finite]))

    # Every representable value, every midpoint between neighbours, and a spread of
    # random values, all within range (torch does not saturate above 448).
    values = ours[finite & (ours >= 0)].sort().values
    mids = (values[1:] + values[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    rand = (torch.rand(200_000, generator=g) * 2 - 1) * 448 * torch.rand(200_000, generator=g) ** 6
    x = torch.cat((values, mids, -mids, rand))
    assert torch.equal(e4m3_encode(x), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_e4m3_of_a_sixth_rounds_the_exact_quotient():
    g = torch.Generator().manual_seed(1)
    amax = torch.cat(
        (
            torch.rand(100_000, generator=g) * 3000,
            torch.rand(100_000, generator=g) * 0.1,
            6 * e4m3_decode(torch.arange(1, 0x7F, dtype=torch.uint8)),  # exact grid points
        )
    )
    # Away from ties, a correctly rounded float32 quotient rounds the same way as the exact
    # one (an E4M3 tie needs amax = 6 * tie exactly), so it serves as the reference.
    expected = e4m3_encode((amax / 6).clamp(2.0**-9, 448))
    assert torch.equal(e4m3_encode_sixth(amax), expected)


def test_e4m3_of_a_sixth_at_every_tie():
    grid = e4m3_decode(torch.arange(0, 0x7F, dtype=torch.uint8))
    ties = (grid[1:] + grid[:-1]) / 2  # exact in float32, and so is 6 * tie
    assert torch.equal(e4m3_encode_sixth(6 * ties), e4m3_encode(ties.clamp(min=2.0**-9)))


# ---- exact ceil(log2) ------------------------------------------------------------------


def _ceil_log2_ratio_reference(x: float, c: float) -> int:
    # Exact with integers: the smallest k with c * 2^k >= x.
    from fractions import Fraction

    q = Fraction(x) / Fraction(c)
    k = math.floor(math.log2(q)) - 2
    while Fraction(2) ** k < q:
        k += 1
    return k


@pytest.mark.parametrize("c", [6.0, 448.0])
def test_ceil_log2_is_exact_at_and_just_above_powers_of_two(c):
    xs = []
    for k in range(-120, 127, 7):
        edge = f32(c * 2.0**k) if c * 2.0**k < 3e38 else None
        if edge is None:
            continue
        xs += [edge, next_up(edge), next_float32(edge, 0.0)]
    xs = [x for x in xs if x >= 2.0**-126]
    got = ceil_log2_ratio(torch.tensor(xs, dtype=torch.float32), c).tolist()
    assert got == [_ceil_log2_ratio_reference(x, c) for x in xs]


# ---- block scales ----------------------------------------------------------------------


def test_fp4_ue8m0_scale_bytes():
    # amax 6 -> scale 1 (byte 127); one ulp above 6 -> scale 2; 6*2^k -> byte 127+k.
    rows = torch.stack(
        [
            block([6.0], 32),
            block([next_up(6.0)], 32),
            block([6.0 * 2**-5], 32),
            block([6.0 * 2**20], 32),
            block([6 * 2.0**125], 32),  # the largest magnitude it stores
            torch.zeros(32),
        ]
    )
    q = quantize(rows, "fp4_ue8m0_32")
    # All-zero block: max(0, 6*2^-126)/6 = 2^-126, the smallest scale, byte 1.
    assert q.scales.flatten().tolist() == [127, 128, 122, 147, 252, 1]
    assert nibbles(q.codes[0])[0] == 7
    assert nibbles(q.codes[1])[0] == 5  # 6.0000005 / 2 = 3.0000002: nearest is 3, code 5
    assert nibbles(q.codes[5]) == [0] * 32


def test_fp4_ue8m0_value_codes_with_unit_scale():
    values = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, -0.0, -6.0]
    q = quantize(block(values, 32), "fp4_ue8m0_32")
    assert q.scales.tolist() == [127]
    assert nibbles(q.codes)[: len(values)] == [7, 0, 2, 2, 4, 4, 6, 6, 8, 8, 15]
    assert nibbles(q.codes)[len(values) :] == [0] * (32 - len(values))
    assert dequantize(q)[: len(values)].tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -0.0, -6]


def test_fp4_e4m3_scale_edges():
    rows = torch.stack(
        [
            block([6.0], 16),  # scale 1 -> 0x38
            block([2688.0], 16),  # amax/6 = 448, the largest scale
            block([1e6, -3.0], 16),  # above: scale saturates at 448, values clamp to 6
            torch.zeros(16),  # all-zero: clamp to 2^-9, the smallest subnormal scale
            block([6 * 3 * 2.0**-9], 16),  # subnormal scale 3 * 2^-9
            block([6 * 2.5 * 2.0**-9], 16),  # subnormal tie 2.5 -> 2
            block([6 * 1.0625], 16),  # normal tie 1.0625 -> 1.0
            block([6 * 1.1875], 16),  # normal tie 1.1875 -> 1.25
        ]
    )
    q = quantize(rows, "fp4_e4m3_16")
    assert q.scales.flatten().tolist() == [0x38, 0x7E, 0x7E, 0x01, 0x03, 0x02, 0x38, 0x3A]
    deq = dequantize(q)
    assert deq[2, 0].item() == 2688.0
    assert nibbles(q.codes[2])[1] == 8  # -3/448 rounds to zero and keeps its sign
    assert deq[2, 1].item() == 0.0 and torch.signbit(deq[2, 1])
    assert torch.all(deq[3] == 0)
    assert nibbles(q.codes[6])[0] == 7  # 6.375 clamps to 6


def test_fp8_ue8m0_scale_edges():
    rows = torch.stack(
        [
            block([448.0], 32),
            block([next_up(448.0)], 32),
            torch.zeros(32),
            block([1e-6], 32),  # below the 1e-4 floor: same scale as all-zero
            block([448.0 * 2**10, 1.0], 32),
        ]
    )
    q = quantize(rows, "fp8_ue8m0_32")
    # ceil(log2(1e-4 / 448)) = ceil(-22.09) = -22
    assert q.scales.flatten().tolist() == [127, 128, 105, 105, 137]
    assert q.codes[0, 0].item() == 0x7E
    assert q.codes[2].tolist() == [0] * 32
    # 1e-6 / 2^-22 = 4.19 -> 4.0 (E4M3 spacing 0.5 at 4) -> code 0x48
    assert q.codes[3, 0].item() == 0x48


def test_bf16_control_is_raw_bfloat16_bytes():
    x = torch.tensor([[1.0, -2.5, 3.0e5, 1.0 + 2**-9]])
    q = quantize(x, "bf16")
    assert q.scales.shape == (1, 0)
    assert torch.equal(q.codes, x.to(torch.bfloat16).view(torch.uint8))
    assert dequantize(q).tolist() == [[1.0, -2.5, 299008.0, 1.0]]


# ---- layout: nibble order, packing, sizes ----------------------------------------------


@pytest.mark.parametrize("fmt", ["fp4_e4m3_16", "fp4_ue8m0_32", "fp8_ue8m0_32"])
def test_dequantize_is_each_code_times_its_scale_for_every_byte_pair(fmt):
    """Every code byte under every scale byte, NaN scales and codes included: the element's
    value (E2M1 from its nibbles, E4M3 from its bits) times the scale's, as float32,
    bit for bit."""
    f = FORMATS[fmt]
    byte = torch.arange(256)
    code = byte[None, :].expand(256, 256)  # one row per scale byte, every code byte in it
    per = f.code_bytes(f.scale_block)  # code bytes per block: one scale each
    codes = code.repeat_interleave(per, dim=1).to(torch.uint8)  # [256, 256 * per]
    scales = byte[:, None].expand(256, 256).to(torch.uint8)  # [256, 256 blocks]
    got = dequantize(Quantized(fmt, codes, scales)).view(256, 256, per, -1)[:, :, 0]

    def e2m1(nibble: torch.Tensor) -> torch.Tensor:
        magnitude = torch.tensor(E2M1_VALUES)[nibble & 7]
        return torch.where(nibble >= 8, -magnitude, magnitude)

    def ue8m0(b: torch.Tensor) -> torch.Tensor:
        value = torch.pow(2.0, b.double() - 127).float()
        return torch.where(b == 255, float("nan"), value)

    if f.element == "e2m1":  # the block's first byte: elements 0 (low nibble) and 1
        elements = torch.stack((e2m1(code & 15), e2m1(code >> 4)), dim=-1)
    else:
        elements = code.to(torch.uint8).view(torch.float8_e4m3fn).float()[..., None]
    scale = (scales.view(torch.float8_e4m3fn).float() if f.scale == "e4m3"
             else ue8m0(scales.long()))[..., None]
    want = elements * scale
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0).view(torch.int32),
                       want.nan_to_num(0.0).view(torch.int32))


def test_element_2i_is_the_low_nibble():
    x = block([1.0, 6.0, -0.5, 0.0], 32)
    q = quantize(x, "fp4_ue8m0_32")
    assert q.codes[0].item() == (7 << 4) | 2
    assert q.codes[1].item() == (0 << 4) | 9


@pytest.mark.parametrize(
    ("fmt", "d", "expected"),
    [
        ("fp4_e4m3_16", 512, 288),
        ("fp4_ue8m0_32", 128, 68),
        ("fp8_ue8m0_32", 512, 528),
        ("bf16", 512, 1024),
        ("fp4_e4m3_16", 32, 18),
    ],
)
def test_bytes_per_entry(fmt, d, expected):
    assert bytes_per_entry(fmt, d) == expected


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_pack_rows_is_codes_then_scales(fmt):
    d = 64
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(2))
    q = quantize(x, fmt)
    rows = pack_rows(q)
    assert rows.dtype == torch.uint8
    assert rows.shape == (3, 5, bytes_per_entry(fmt, d))
    assert torch.equal(rows[..., : q.codes.shape[-1]], q.codes)
    back = unpack_rows(rows, fmt, d)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scales, q.scales)
    assert torch.equal(dequantize(back), dequantize(q))


# ---- refusals --------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "d"), [("fp4_e4m3_16", 24), ("fp4_ue8m0_32", 48),
                                        ("fp8_ue8m0_32", 16)])
def test_width_not_a_multiple_of_the_block_is_refused(fmt, d):
    with pytest.raises(ValueError, match=rf"{fmt}.*width {d}"):
        quantize(torch.ones(2, d), fmt)
    with pytest.raises(ValueError, match=rf"{fmt}.*width {d}"):
        bytes_per_entry(fmt, d)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused(fmt, bad):
    x = torch.ones(2, 32)
    x[1, 3] = bad
    with pytest.raises(ValueError, match=rf"{fmt}.*NaN or infinite"):
        quantize(x, fmt)


@pytest.mark.parametrize("fmt", ["fp4_ue8m0_32", "fp8_ue8m0_32", "bf16"])
def test_magnitudes_that_would_dequantise_to_infinity_are_refused(fmt):
    limit = FORMATS[fmt].max_magnitude
    x = torch.zeros(2, 32)
    x[1, 0] = -limit
    assert torch.isfinite(dequantize(quantize(x, fmt))).all()
    x[1, 0] = -next_up(limit)
    with pytest.raises(ValueError, match=rf"{fmt}: input magnitude .* above"):
        quantize(x, fmt)


def test_unknown_format_and_bad_rows_are_refused():
    with pytest.raises(ValueError, match="unknown storage format 'fp3'"):
        quantize(torch.ones(32), "fp3")
    with pytest.raises(ValueError, match=r"fp4_e4m3_16.*uint8 \[\.\.\., 288\]"):
        unpack_rows(torch.zeros(4, 287, dtype=torch.uint8), "fp4_e4m3_16", 512)
    with pytest.raises(ValueError, match="float tensor"):
        quantize(torch.ones(32, dtype=torch.int32), "fp8_ue8m0_32")


def test_input_precision_does_not_matter_beyond_float32():
    x = torch.randn(4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for fmt in FORMATS:
        a, b = quantize(x, fmt), quantize(x.float(), fmt)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
