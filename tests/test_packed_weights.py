"""Matmuls on packed checkpoint weights (kvstack.native.packed_linear, fp4_grouped) against
dequantise-then-matmul: equal within float32 rounding on every path, NaN where torch's
are NaN, and what the model runs by default on a CPU."""


import pytest
import torch
import torch.nn.functional as F

from kvstack import native
from kvstack.formats import dequantize, quantize
from kvstack.formats.quantized import Quantized
from kvstack.formats.weights import dequantize_fp8_blocks, quantize_fp8_blocks
from kvstack.model import packed as packed_module
from kvstack.model.model import swiglu
from kvstack.model.packed import PackedExpert, PackedExperts, PackedLinear

pytestmark = pytest.mark.skipif(not native.resolve("auto"), reason="no C compiler here")

PATHS = list(native.ISAS)
# Token counts that take each way through a tile: on the AVX-512 path up to eight tokens
# meet four rows at a time in one pass (from five, with accumulators spilled); on the AVX2
# path one and two meet four rows, three two rows, five and eight passes of four and what
# is left; nine spills into a second group of eight.
BATCHES = [1, 2, 3, 5, 8, 9]


def path(name: str):
    """Inside: the kernels on path `name` (a test of a path this CPU lacks is skipped)."""
    if native.ISAS.index(name) > native.ISAS.index(native.best_weights_isa()):
        pytest.skip(f"this CPU has no {name} path")
    return native.weights_path(name)


def assert_rounding_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got equals x @ w.T up to float32 rounding: NaN exactly where the product is, and
    each finite sum within a few ulps of the sum of |x||w| it adds up."""
    want = x @ w.T
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    bound = 1e-6 * (x.abs() @ w.abs().T) + 1e-30
    assert ((got - want).abs()[finite] <= bound[finite]).all(), \
        ((got - want).abs() / bound)[finite].max()


@pytest.mark.parametrize("path_name", PATHS)
@pytest.mark.parametrize("n", BATCHES)
@pytest.mark.parametrize(("out_f", "in_f"), [(64, 96), (70, 100), (33, 37), (96, 1040)])
def test_fp8_weights_equal_dequantise_then_matmul(path_name, n, out_f, in_f):
    """Shapes that are not multiples of the 32x32 scale block, of the four rows a pass or
    of the sixteen columns a vector: the same products."""
    g = torch.Generator().manual_seed(out_f * in_f + n)
    codes, scales = quantize_fp8_blocks(torch.randn(out_f, in_f, generator=g))
    x = torch.randn(n, in_f, generator=g) * 3
    with path(path_name):
        got = native.packed_linear(x, "fp8", codes, scales)
    assert_rounding_close(got, x, dequantize_fp8_blocks(codes, scales))


@pytest.mark.parametrize("path_name", PATHS)
@pytest.mark.parametrize("n", [1, 2, 5])
def test_fp8_nan_codes_and_scales_make_the_rows_torch_makes_nan(path_name, n):
    """E4M3 0x7F and 0xFF are NaN (that row's outputs), a UE8M0 0xFF scale is NaN (its
    32 rows'); scales far outside a checkpoint's (2^-120, 2^108) still multiply exactly."""
    g = torch.Generator().manual_seed(n)
    codes, scales = quantize_fp8_blocks(torch.randn(100, 160, generator=g))
    codes[5, 17], codes[40, 130] = 0x7F, 0xFF
    scales[2, 1] = 0xFF  # rows 64..95
    scales[1, 3], scales[0, 0] = 7, 235
    x = torch.randn(n, 160, generator=g)
    with path(path_name):
        got = native.packed_linear(x, "fp8", codes, scales)
    w = dequantize_fp8_blocks(codes, scales)
    assert torch.isnan(got[:, 5]).all() and torch.isnan(got[:, 40]).all()
    assert torch.isnan(got[:, 64:96]).all() and torch.isfinite(got[:, 96:]).all()
    finite = torch.isfinite(w).all(1)
    assert_rounding_close(got[:, finite], x, w[finite])


@pytest.mark.parametrize("path_name", PATHS)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_bf16_weights_multiply_as_their_float32_values(path_name, n):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(77, 200, generator=g).bfloat16()
    x = torch.randn(n, 200, generator=g)
    with path(path_name):
        got = native.packed_linear(x, "bf16", w)
    assert_rounding_close(got, x, w.float())


@pytest.mark.parametrize("path_name", PATHS)
@pytest.mark.parametrize("n", [1, 3])
def test_block_diagonal_fp8_equals_a_product_per_group(path_name, n):
    """wo_a: four groups of 48 rows (a group ends inside a 32-row scale block), group g
    reading columns g*64 .. g*64 + 63 of x."""
    g = torch.Generator().manual_seed(n)
    codes, scales = quantize_fp8_blocks(torch.randn(4 * 48, 64, generator=g))
    x = torch.randn(n, 4, 64, generator=g)
    with path(path_name):
        got = native.packed_linear(x.flatten(1), "fp8", codes, scales, groups=4)
    w = dequantize_fp8_blocks(codes, scales).unflatten(0, (4, 48))
    for group in range(4):
        assert_rounding_close(got[:, group * 48:(group + 1) * 48], x[:, group], w[group])


def packed_experts(n: int, out_f: int, in_f: int, g: torch.Generator) -> list:
    return [quantize(torch.randn(out_f, in_f, generator=g), "fp4_ue8m0_32") for _ in range(n)]


@pytest.mark.parametrize("path_name", PATHS)
def test_fp4_grouped_equals_each_experts_dequantised_product(path_name):
    """Groups of 0, 1, 2, 3, 9 and 6 rows, experts named out of order, a NaN scale."""
    g = torch.Generator().manual_seed(0)
    experts = packed_experts(6, 72, 96, g)
    experts[4].scales[10, 1] = 0xFF
    pointers = torch.tensor([[q.codes.data_ptr(), q.scales.data_ptr()] for q in experts])
    used, rows = torch.tensor([3, 0, 5, 4, 1, 2]), torch.tensor([1, 0, 2, 3, 9, 6])
    ends = rows.cumsum(0)
    x = torch.randn(int(ends[-1]), 96, generator=g)
    with path(path_name):
        got = native.fp4_grouped(x, pointers, used, ends, 72)
    start = 0
    for e, end in zip(used.tolist(), ends.tolist(), strict=True):
        assert_rounding_close(got[start:end], x[start:end], dequantize(experts[e]))
        start = end
    assert torch.isnan(got[3:6, 10]).all() and torch.isfinite(got[:3]).all()


@pytest.mark.parametrize("path_name", PATHS)
def test_fp4_every_code_under_every_scale_byte_multiplies_exactly(path_name):
    """Each of the 16 E2M1 codes under each UE8M0 scale byte (32 rows a byte, so that every
    tile holds one byte: those whose decode table the vectors use, 2^-23 .. 2^3, those
    outside it, which take the portable path, and the NaN byte): x = I picks out each
    weight, so the product must equal the dequantised weight exactly."""
    scale_bytes = torch.tensor([*range(0, 251), 255], dtype=torch.uint8)
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # 32 columns
    packed = (codes[0::2] | codes[1::2] << 4).repeat(32 * len(scale_bytes), 1)
    scales = scale_bytes.repeat_interleave(32)[:, None].contiguous()
    pointers = torch.tensor([[packed.data_ptr(), scales.data_ptr()]])
    with path(path_name):
        got = native.fp4_grouped(torch.eye(32), pointers, torch.tensor([0]), torch.tensor([32]),
                                 packed.shape[0])
    want = dequantize(Quantized("fp4_ue8m0_32", packed, scales)).T
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.isnan(got[:, -32:]).all()


@pytest.mark.parametrize("path_name", PATHS)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_fp4_tiles_with_far_scales_equal_dequantise_then_matmul(path_name, n):
    """Scale bytes beyond the vectors' decode tables (2^-120, 2^108) in some tiles of an
    expert whose other tiles take the vectors."""
    g = torch.Generator().manual_seed(n)
    q = quantize(torch.randn(96, 64, generator=g), "fp4_ue8m0_32")
    q.scales[3, 1], q.scales[70, 0] = 7, 235
    pointers = torch.tensor([[q.codes.data_ptr(), q.scales.data_ptr()]])
    x = torch.randn(n, 64, generator=g)
    with path(path_name):
        got = native.fp4_grouped(x, pointers, torch.tensor([0]), torch.tensor([n]), 96)
    assert_rounding_close(got, x, dequantize(q))


def make_packed_experts(n: int, dim: int, inter: int, seed: int) -> PackedExperts:
    g = torch.Generator().manual_seed(seed)
    experts = []
    for _ in range(n):
        qs = {"w1": quantize(torch.randn(inter, dim, generator=g), "fp4_ue8m0_32"),
              "w2": quantize(torch.randn(dim, inter, generator=g) * 0.1, "fp4_ue8m0_32"),
              "w3": quantize(torch.randn(inter, dim, generator=g), "fp4_ue8m0_32")}
        experts.append(PackedExpert({k: q.codes for k, q in qs.items()},
                                    {k: q.scales for k, q in qs.items()}))
    return PackedExperts(experts)


@pytest.mark.parametrize("round_inputs", [False, True])
def test_packed_experts_in_three_calls_equal_each_expert_dequantised(round_inputs):
    """The MoE's routed sum: all experts a step routes to in three grouped calls, against
    each chosen expert dequantised and run on its tokens (DeepSeek's activation rounding
    on or off)."""
    experts = make_packed_experts(5, 64, 96, seed=1)
    experts.round_inputs = round_inputs
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 64, generator=g)
    chosen = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=g)
    got = experts.swiglu(x, weights, chosen, limit=7.0)
    want = torch.zeros(7, 64)
    for e in torch.unique(chosen).tolist():
        token, slot = torch.nonzero(chosen == e, as_tuple=True)
        want.index_add_(0, token, swiglu(x[token], *experts.projections(e), 7.0,
                                         weights[token, slot, None]))
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_packed_linear_runs_the_kernels_by_default_and_keeps_no_float_copy(monkeypatch):
    """No flag: on a CPU the module's forward never dequantises its weight (which would
    make a float32 copy of it); under an engine step that chose torch it does."""
    g = torch.Generator().manual_seed(3)
    codes, scales = quantize_fp8_blocks(torch.randn(40, 64, generator=g))
    linear = PackedLinear("fp8", codes, scales)
    x = torch.randn(2, 3, 64, generator=g)
    want = F.linear(x, linear.weight)
    calls = []
    real = packed_module.dequantize_fp8_blocks
    monkeypatch.setattr(packed_module, "dequantize_fp8_blocks",
                        lambda *a: calls.append(1) or real(*a))
    got = linear(x)
    assert not calls and got.shape == (2, 3, 40)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    with native.active(False):
        assert torch.equal(linear(x), want) and calls
    assert native.weights_isa() == native.best_weights_isa() in native.ISAS


def test_a_path_the_build_lacks_or_does_not_know_is_refused():
    with pytest.raises(ValueError, match="unknown packed-weight path 'sse'"), \
            native.weights_path("sse"):
        pass
    with native.weights_path("portable"):
        assert native.weights_isa() == "portable"
    assert native.weights_isa() == native.best_weights_isa()
    if native.best_weights_isa() != "avx512":
        with pytest.raises(ValueError, match="no avx512 path"), native.weights_path("avx512"):
            pass


@pytest.mark.parametrize("path_name", PATHS)
def test_a_nan_code_written_after_a_first_call_is_still_seen(path_name):
    """The kernel skips looking for NaN codes in weights found to hold none; a weight
    changed in place is looked at again."""
    g = torch.Generator().manual_seed(4)
    codes, scales = quantize_fp8_blocks(torch.randn(40, 64, generator=g))
    linear = PackedLinear("fp8", codes, scales)
    x = torch.randn(3, 64, generator=g)
    with path(path_name):
        assert torch.isfinite(linear(x)).all()
        linear.stored[7, 9] = 0xFF
        got = linear(x)
    assert torch.isnan(got[:, 7]).all() and torch.isfinite(got[:, :7]).all()
    assert native.fp8_has_nan(linear.stored) and not native.fp8_has_nan(codes[8:])


@pytest.mark.parametrize("groups", [1, 4])
def test_a_prefill_chunk_multiplies_a_bf16_weight_widened(groups, monkeypatch):
    """From BF16_GEMM_TOKENS tokens a bf16 weight is widened once and multiplied by torch:
    the same values as the kernel's below it, within float32 rounding, group by group."""
    g = torch.Generator().manual_seed(10 + groups)
    w = torch.randn(4 * 24, 72, generator=g).bfloat16()
    x = torch.randn(6, groups, 72, generator=g)
    below = native.packed_linear(x.flatten(1), "bf16", w, groups=groups)
    monkeypatch.setattr(native, "BF16_GEMM_TOKENS", 5)

    def no_kernel() -> None:
        raise AssertionError("a call of BF16_GEMM_TOKENS tokens reached the C kernel")

    monkeypatch.setattr(native, "_load", no_kernel)
    out = native.packed_linear(x.flatten(1), "bf16", w, groups=groups)
    wide = w.float().view(groups, -1, 72)
    for group in range(groups):
        rows = slice(group * wide.shape[1], (group + 1) * wide.shape[1])
        assert_rounding_close(out[:, rows], x[:, group], wide[group])
        assert_rounding_close(below[:, rows], x[:, group], wide[group])
    # A weight past BF16_GEMM_ELEMENTS stays in the kernel, however many tokens.
    monkeypatch.setattr(native, "BF16_GEMM_ELEMENTS", w.numel() - 1)
    with pytest.raises(AssertionError, match="reached the C kernel"):
        native.packed_linear(x.flatten(1), "bf16", w, groups=groups)


@pytest.mark.parametrize("groups", [1, 4])
def test_a_prefill_chunk_multiplies_a_transient_float_copy_equal_to_the_codecs(groups,
                                                                               monkeypatch):
    """From GEMM_TOKENS tokens on an FP8 weight is decoded whole, bit for bit the codecs'
    values (NaN codes and scales, scales out of the fast range), and multiplied by torch."""
    g = torch.Generator().manual_seed(groups)
    codes, scales = quantize_fp8_blocks(torch.randn(4 * 40, 72, generator=g)
                                        * torch.logspace(-3, 3, 160)[:, None])
    codes[3, 4], scales[2, 1], scales[0, 0] = 0x7F, 0xFF, 5
    want = dequantize_fp8_blocks(codes, scales)
    got = native.fp8_dequantize(codes, scales)
    assert torch.equal(got.nan_to_num(7.0).view(torch.int32),
                       want.nan_to_num(7.0).view(torch.int32))
    monkeypatch.setattr(native, "GEMM_TOKENS", 5)
    x = torch.randn(6, groups, 72, generator=g)
    out = native.packed_linear(x.flatten(1), "fp8", codes, scales, groups=groups)
    w = want.view(groups, -1, 72)
    for group in range(groups):
        rows = slice(group * w.shape[1], (group + 1) * w.shape[1])
        assert_rounding_close(out[:, rows], x[:, group], w[group])


def test_packed_linear_names_a_format_it_does_not_multiply():
    """FP4 weights are routed experts (fp4_grouped); packed_linear takes fp8 or bf16 and
    says so, where its kernels would read a decode table FP4 calls alone make."""
    weight = quantize(torch.randn(8, 64), "fp4_ue8m0_32")
    with pytest.raises(ValueError, match="fp8 or bf16 weights, not 'fp4'"):
        native.packed_linear(torch.randn(1, 64), "fp4", weight.codes, weight.scales)
