"""Element and scale codecs: E2M1, E4M3 (the "fn" variant: no infinities) and UE8M0.

Everything is computed on float32 with integer bit manipulation where rounding must be
exact, so the bytes do not depend on the platform's libm (a GPU kernel or a checkpoint
written elsewhere must read and write the same bytes; design.md section 3).
"""

import math

import torch

# E2M1 magnitudes by code 0..7; bit 3 of a code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9

# Decision points between neighbouring E2M1 magnitudes. At a tie the even code wins:
# the lower neighbour for 0.25, 1.25, 2.5 and 5 (codes 0, 2, 4, 6), the upper one for
# 0.75, 1.75 and 3.5 (codes 2, 4, 6). A magnitude moves one code up per point it is above,
# or above-or-equal for the points where the tie goes up.
_E2M1_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_E2M1_TIE_UP = (0.75, 1.75, 3.5)

_E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
_E2M1_TABLE[8] = -0.0


def _sign_bits(x: torch.Tensor) -> torch.Tensor:
    """1 where the float's sign bit is set (including -0.0), as uint8."""
    return torch.signbit(x).to(torch.uint8)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values to E2M1 codes (uint8, 0..15), nearest with ties to the even
    code; magnitudes above 6 saturate to 6. The sign bit is copied."""
    m = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for point in _E2M1_TIE_DOWN:
        code += m > point
    for point in _E2M1_TIE_UP:
        code += m >= point
    return code | (_sign_bits(v) << 3)


# Each table's copy on every other device it was used on, made once: a lookup on a GPU
# then reads a resident table instead of copying it from the host every call.
_TABLE_COPIES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _resident(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    if table.device == device:
        return table
    if torch.compiler.is_compiling():  # a traced copy is a constant
        return table.to(device)
    key = (id(table), device)
    if key not in _TABLE_COPIES:
        _TABLE_COPIES[key] = table.to(device)
    return _TABLE_COPIES[key]


def _lookup(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """table[codes] for uint8 codes: the float32 value of each code, or, from an int64
    table, the pair of float32 it holds (one int64 per code) as a last dim of 2. The codes
    are read as int32 in one contiguous copy and looked up by a 1-D index_select: on CPU
    several times faster than selecting rows of two columns, and than advanced indexing,
    in a third of the ops of flattening each side (a decode step looks tables up hundreds
    of times). The tables are module constants, so their ids name them for as long as the
    process."""
    index = codes.to(torch.int32, memory_format=torch.contiguous_format).view(-1)
    picked = _resident(table, codes.device).index_select(0, index)
    if table.dtype == torch.int64:
        return picked.view(torch.float32).view(*codes.shape, 2)
    return picked.view(codes.shape)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits used) to float32."""
    return _lookup(_E2M1_TABLE, code & 0x0F)


# Both elements of every packed byte: code b's (value of the low nibble, of the high one),
# the two float32 as one int64.
_E2M1_PAIRS = torch.stack(
    (_E2M1_TABLE[torch.arange(256) & 15], _E2M1_TABLE[torch.arange(256) >> 4]), dim=-1
).view(torch.int64)[:, 0]


def e2m1_decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes [..., n] to float32 [..., 2n] (element 2i from the low nibble),
    with one table lookup per byte."""
    return _lookup(_E2M1_PAIRS, packed).flatten(-2)


def float32_exponent(x: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent field of positive normal float32 values (int32)."""
    return ((x.view(torch.int32) >> 23) & 0xFF) - 127


def ceil_log2_ratio(x: torch.Tensor, c: float) -> torch.Tensor:
    """Exact ceil(log2(x / c)) for positive normal float32 x and a positive constant c
    (int32), without forming the quotient.

    With x = mx * 2^ex and c = mc * 2^ec (mantissas in [1, 2)), log2(x/c) lies in
    (ex-ec-1, ex-ec] when mx <= mc and in (ex-ec, ex-ec+1) when mx > mc. A floating-point
    log2 would lose a value one ulp above a power of two; the bits do not.
    """
    mc, ec = math.frexp(c)  # c = mc * 2^ec with mc in [0.5, 1)
    c_mantissa_bits = round((2 * mc - 1) * 2**23)
    above = (x.view(torch.int32) & 0x7FFFFF) > c_mantissa_bits
    return float32_exponent(x) - (ec - 1) + above.to(torch.int32)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as float32 for integer exponents in [-126, 127], built from the bits."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values to E4M3 (fn) codes, nearest with ties to even; magnitudes that
    round above 448 saturate to 448 (the encoder never emits the NaN code). The sign bit
    is copied."""
    m = v.abs().to(torch.float32).clamp(max=E4M3_MAX)
    sign = _sign_bits(v) << 7
    # Normal range (m >= 2^-6): keep 3 mantissa bits, round to nearest even on the bits.
    # The carry out of the mantissa correctly bumps the exponent.
    bits = m.view(torch.int32)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
    exp_field = ((rounded >> 23) & 0xFF) - 127 + 7
    mant = (rounded >> 20) & 0x7
    normal = (exp_field << 3) | mant
    # Subnormal range: a fixed grid of 2^-9. Scaling by 512 is exact in float32 and
    # torch.round rounds half to even; 8 lands on the smallest normal's code, 0x08.
    subnormal = torch.round(m * 512.0).to(torch.int32)
    code = torch.where(m < 2.0**-6, subnormal, normal)
    return code.to(torch.uint8) | sign


def e4m3_encode_sixth(amax: torch.Tensor) -> torch.Tensor:
    """E4M3 code of clamp(amax / 6, 2^-9, 448) for amax >= 0, rounded (ties to even) from
    the exact quotient.

    Dividing by 6 in floating point is not the same on every device (CUDA turns a division
    by a scalar into a multiplication by its rounded reciprocal), so the quotient is never
    formed: the E4M3 step u at amax/6 is read off amax's bits, and round(amax / (6u)) is
    found from an exact remainder.
    """
    a = amax.to(torch.float32).clamp(E2M1_MAX * E4M3_MIN_SUBNORMAL, E2M1_MAX * E4M3_MAX)
    # floor(log2(a/6)): a = m * 2^E with m in [1, 2); a/6 drops one more octave if m < 1.5.
    below_1_5 = (a.view(torch.int32) & 0x7FFFFF) < 0x400000
    exponent = (float32_exponent(a) - 2 - below_1_5.to(torch.int32)).clamp(min=-6)
    # Below 2^-6 the grid is the subnormal one, 2^-9, which is the step at exponent -6 too.
    steps = a / pow2(exponent - 3)  # exact; a/(6u) = steps/6 with steps < 96
    n = torch.floor(steps / 6.0)  # may be off by one; corrected from the exact remainder
    n = n + (steps - 6.0 * n >= 6.0).float() - (steps - 6.0 * n < 0.0).float()
    rest = steps - 6.0 * n  # exact: both terms are small multiples of the same fine grid
    n = n + ((rest > 3.0) | ((rest == 3.0) & (n % 2 == 1))).float()
    # n is 8..16 in the normal range (16 carries into the exponent) and 0..8 below it.
    return (((exponent + 7) << 3) + n.to(torch.int32) - 8).to(torch.uint8)


def _e4m3_table() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32)
    exp_field = (codes >> 3) & 0xF
    mant = (codes & 0x7).to(torch.float64)
    magnitude = torch.where(
        exp_field == 0,
        mant * 2.0**-9,
        (1.0 + mant / 8.0) * torch.pow(2.0, (exp_field - 7).to(torch.float64)),
    )
    magnitude[(codes & 0x7F) == 0x7F] = float("nan")
    values = torch.where(codes >= 128, -magnitude, magnitude).to(torch.float32)
    values[128] = -0.0
    return values


_E4M3_TABLE = _e4m3_table()


def e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) codes (uint8) to float32; 0x7F and 0xFF are NaN."""
    return _lookup(_E4M3_TABLE, code)


def _ue8m0_table() -> torch.Tensor:
    b = torch.arange(256, dtype=torch.int32)
    values = pow2(b.clamp(1, 254) - 127)  # exact powers of two, from the bits
    values[0] = 2.0**-127  # a subnormal, which pow2's bits cannot form
    values[255] = float("nan")
    return values


_UE8M0_TABLE = _ue8m0_table()


def ue8m0_decode(byte: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale bytes (biased exponents) to float32: 2**(byte-127); 255 is NaN and 0 is
    2**-127, as in the OCP microscaling formats."""
    return _lookup(_UE8M0_TABLE, byte)


def _e2m1_ue8m0_pairs() -> torch.Tensor:
    """Both elements of every packed E2M1 byte under every UE8M0 scale byte, the scale
    applied, at 256 * scale + byte: the two float32 as one int64. The products are the
    ones a multiplication at run time makes (the same float32 operands), so a lookup
    gives the same values bit for bit."""
    byte = torch.arange(256, dtype=torch.uint8)
    pairs = e2m1_decode_packed(byte[:, None])  # [byte, 2]
    return (ue8m0_decode(byte)[:, None, None] * pairs).view(torch.int64).reshape(-1)


_E2M1_UE8M0_PAIRS = _e2m1_ue8m0_pairs()  # 512 KiB


def e2m1_ue8m0_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 values [..., 32 n] of E2M1 codes packed two per byte, uint8 [..., 16 n]
    (element 2i from the low nibble), under one UE8M0 scale byte per 32 elements, uint8
    [..., n]: one table lookup per code byte, the scale applied by the table."""
    n = scales.shape[-1]
    index = codes.to(torch.int32, memory_format=torch.contiguous_format, copy=True)
    index = index.view(*scales.shape, codes.shape[-1] // n)  # [..., n, 16]
    index += (scales.to(torch.int32) << 8)[..., None]
    return _lookup(_E2M1_UE8M0_PAIRS, index).flatten(-3)
