"""The packed-weight Triton kernels (kvstack/model/weight_kernels.py) against dequantise-then-
matmul, under Triton's interpreter (TRITON_INTERPRET=1 runs the kernels on the CPU, one
program at a time: small shapes, and small tiles where a test must reach the tile edges,
split-K or the tl.dot path)."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton")  # the `kernels` extra

from kvstack.formats import Quantized, dequantize, quantize
from kvstack.formats.weights import EXPERT_FORMAT, dequantize_fp8_blocks, quantize_fp8_blocks
from kvstack.model.weight_kernels import expert_pointers, fp4_grouped, fp8_linear, plan

# Tilings of x's rows: the size rule; small broadcast tiles with split-K; tl.dot tiles.
SMALL = {"blocks": (4, 16, 32), "split_k": 2}
DOT = {"blocks": (16, 16, 32), "split_k": 3}


def assert_matches(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got equals x @ w.T within float32 rounding, NaN exactly where it is NaN."""
    want = x @ w.T
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bound = 1e-5 * (x.abs() @ w.abs().T) + 1e-30
    assert torch.all((got - want).abs()[~nan] <= bound[~nan])


def fp8_weight(o: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # rows of different magnitudes, so the 32x32 blocks get different scales
    w = torch.randn(o, k, generator=g) * torch.logspace(-3, 3, o)[:, None]
    return quantize_fp8_blocks(w)


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("shape", [(64, 96), (70, 100), (33, 37)])
def test_fp8_linear_equals_dequantise_then_matmul(shape, n):
    """O and K off the 32-blocks and the tiles; one row (a GEMV), a few, and a prefill's
    many (tl.dot): the size rule's tiles, then small ones with split-K."""
    o, k = shape
    codes, scales = fp8_weight(o, k, seed=o + n)
    w = dequantize_fp8_blocks(codes, scales)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    assert_matches(fp8_linear(x, codes, scales), x, w)
    assert_matches(fp8_linear(x, codes, scales, **(DOT if n > 8 else SMALL)), x, w)


@pytest.mark.parametrize("n, tiles", [(2, SMALL), (17, DOT)])
def test_fp8_linear_groups_read_their_own_columns(n, tiles):
    """wo_a's block-diagonal weight: two groups of 20 output rows (tiles of 16 straddle
    the groups' boundary and the 32-row scale blocks span both), each reading its 37
    columns of x."""
    o, k, groups = 40, 37, 2
    codes, scales = fp8_weight(o, k, seed=3)
    w = dequantize_fp8_blocks(codes, scales)
    x = torch.randn(n, groups * k, generator=torch.Generator().manual_seed(4))
    block_diagonal = torch.zeros(o, groups * k)
    for g in range(groups):
        block_diagonal[g * 20:(g + 1) * 20, g * k:(g + 1) * k] = w[g * 20:(g + 1) * 20]
    assert_matches(fp8_linear(x, codes, scales, groups), x, block_diagonal)
    assert_matches(fp8_linear(x, codes, scales, groups, **tiles), x, block_diagonal)


@pytest.mark.parametrize("tiles", [{}, SMALL, DOT])
def test_fp8_nan_codes_and_scales_make_nan_where_the_reference_does(tiles):
    """E4M3 codes 0x7F and 0xFF, one under a zero of x, and a NaN scale byte (255) of one
    block: the NaN output columns are the reference's, the rest unchanged."""
    o, k = 70, 100
    codes, scales = fp8_weight(o, k, seed=5)
    codes[3, 7], codes[40, 99], codes[69, 0] = 0x7F, 0xFF, 0x7F
    scales[1, 2] = 255  # rows 32..63, columns 64..95
    w = dequantize_fp8_blocks(codes, scales)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(6))
    x[:, 0] = 0.0  # 0 * NaN is NaN
    rows = x[:1] if tiles is SMALL else x
    assert_matches(fp8_linear(rows, codes, scales, **tiles), rows, w)


def test_fp8_decodes_every_code_and_scale_bit_for_bit():
    """Every non-NaN E4M3 code under scale bytes from 0 (2^-127) up, read out through
    x = I: the outputs are the torch codecs' weights exactly."""
    k = 254
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = torch.stack((codes, codes.flip(0)))  # [2, 254]
    scales = torch.tensor([[0, 1, 100, 127, 128, 150, 200, 3]], dtype=torch.uint8)
    got = fp8_linear(torch.eye(k), codes, scales)
    assert torch.equal(got.T, dequantize_fp8_blocks(codes, scales))


def fp4_experts(n: int, o: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n experts' (codes, scales), each in its own allocation."""
    g = torch.Generator().manual_seed(7)
    experts = []
    for e in range(n):
        q = quantize(torch.randn(o, k, generator=g) * 10.0**(e - 2), EXPERT_FORMAT)
        experts.append((q.codes.clone(), q.scales.clone()))
    return experts


def fp4_weight(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequantize(Quantized(EXPERT_FORMAT, codes, scales))


@pytest.mark.parametrize("tiles", [{}, {"blocks": (1, 16, 32)},
                                   {"blocks": (2, 16, 64), "split_k": 2},
                                   {"blocks": (16, 16, 32)}])
def test_fp4_grouped_equals_each_experts_product(tiles):
    """Groups of 0, 1, 3, 2 and 1 rows for experts 3, 0, 4, 1, 0 (out of order, one named
    twice, expert 2 never), then two rows past ends[-1]: each group's rows times its
    expert's dequantised weight, the rest zero. Expert 4 has a NaN scale (row 5, elements
    32..63) and expert 2 is all NaN: NaN in exactly expert 4's rows' column 5."""
    o, k, m = 40, 64, 9
    experts = fp4_experts(5, o, k)
    experts[4][1][5, 1] = 255
    experts[2][1].fill_(255)
    assert len({c.untyped_storage().data_ptr() for c, _ in experts}) == 5
    used = torch.tensor([3, 0, 4, 1, 0], dtype=torch.int32)
    ends = torch.tensor([0, 1, 4, 6, 7], dtype=torch.int32)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8))
    got = fp4_grouped(x, expert_pointers(experts), used, ends, o, **tiles)
    start = 0
    for e, end in zip(used.tolist(), ends.tolist(), strict=True):
        assert_matches(got[start:end], x[start:end], fp4_weight(*experts[e]))
        start = end
    assert torch.isnan(got[1:4, 5]).all() and torch.isnan(got).sum() == 3
    assert torch.all(got[start:] == 0)


def test_fp4_decodes_every_byte_bit_for_bit():
    """All 256 code bytes (both nibbles of each) under scale bytes 0 (2^-127), 127 and
    up, read out through x = I: the outputs are the torch codecs' weights exactly."""
    codes = torch.arange(256, dtype=torch.uint8).view(16, 16)  # [O 16, K/2 16]
    scales = torch.tensor([0, 1, 64, 126, 127, 128, 130, 200] * 2, dtype=torch.uint8)[:, None]
    pointers = expert_pointers([(codes, scales)])
    got = fp4_grouped(torch.eye(32), pointers, torch.tensor([0]), torch.tensor([32]), 16)
    assert torch.equal(got.T, fp4_weight(codes, scales))


def test_plan_fills_the_gpu_and_keeps_dot_tiles_legal():
    """The size rule: a decode GEMV of a narrow projection is split along K until it
    makes at least twice the SMs' programs, a wide one is not split; tl.dot tiles are at
    least 16 each; overrides are checked."""
    def programs(o):
        return lambda block_o, block_n: -(-o // block_o)

    narrow = plan(1, programs(512), 7168, sms=132)
    assert not narrow.dot and narrow.split > 1
    assert -(-512 // narrow.block_o) * narrow.split >= 2 * 132
    assert narrow.k_chunk % narrow.block_k == 0 and narrow.k_chunk * narrow.split >= 7168
    assert narrow.k_chunk * (narrow.split - 1) < 7168  # every split has weights
    assert plan(1, programs(18432), 7168, sms=132).split == 1
    for rows in (9, 17, 64, 300):
        p = plan(rows, programs(7168), 7168, sms=132)
        assert p.dot and min(p.block_n, p.block_o, p.block_k) >= 16
    with pytest.raises(ValueError, match="powers of two"):
        plan(1, programs(64), 64, sms=1, blocks=(1, 24, 32))
    with pytest.raises(ValueError, match="at least 16"):
        plan(17, programs(64), 64, sms=1, blocks=(16, 8, 32))


def test_the_kernels_refuse_what_they_cannot_run(monkeypatch):
    codes, scales = fp8_weight(33, 37, seed=9)
    with pytest.raises(ValueError, match="needs scales"):
        fp8_linear(torch.randn(1, 37), codes, scales[:, :1])
    with pytest.raises(ValueError, match="groups"):
        fp8_linear(torch.randn(1, 74), codes, scales, groups=2)
    with pytest.raises(ValueError, match="multiple of 32"):
        fp4_grouped(torch.randn(2, 40), torch.zeros(1, 2, dtype=torch.int64),
                    torch.tensor([0]), torch.tensor([2]), 8)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        fp8_linear(torch.randn(1, 37), codes, scales)


def test_the_models_packed_modules_reach_the_triton_kernels(monkeypatch):
    """PackedLinear (a projection and wo_a's groups) and PackedExperts take the Triton
    kernels where `weight_backend` says "triton" (a CUDA device; here the interpreter):
    the same outputs as dequantise-then-matmul, every expert a group of its own."""
    from kvstack.model import packed
    from kvstack.model.model import swiglu

    codes, scales = fp8_weight(64, 96, seed=7)
    linear = packed.PackedLinear("fp8", codes, scales)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 96, generator=g)
    groups = torch.randn(2, 4, 96, generator=g)  # 4 groups of 16 rows
    experts = packed.PackedExperts([packed.PackedExpert(
        {n: q.codes for n, q in qs.items()}, {n: q.scales for n, q in qs.items()})
        for qs in ({"w1": quantize(torch.randn(32, 64, generator=g), EXPERT_FORMAT),
                    "w2": quantize(torch.randn(64, 32, generator=g), EXPERT_FORMAT),
                    "w3": quantize(torch.randn(32, 64, generator=g), EXPERT_FORMAT)}
                   for _ in range(4))])
    tokens = torch.randn(5, 64, generator=g)
    chosen = torch.tensor([[0, 2], [2, 3], [0, 3], [2, 0], [3, 2]])
    weights = torch.rand(5, 2, generator=g)

    want = (linear(x), linear.block_diagonal(groups))  # torch here: dequantised
    want_experts = torch.zeros(5, 64)
    for e in range(4):
        token, slot = torch.nonzero(chosen == e, as_tuple=True)
        if len(token):
            want_experts.index_add_(0, token, swiglu(tokens[token], *experts.projections(e),
                                                     10.0, weights[token, slot, None]))
    monkeypatch.setattr(packed, "weight_backend", lambda *_: "triton")
    assert linear.backend(x) == "triton" and experts.backend(tokens) == "triton"
    assert torch.allclose(linear(x), want[0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(linear.block_diagonal(groups), want[1], rtol=1e-5, atol=1e-5)
    got = experts.swiglu(tokens, weights, chosen, 10.0)
    assert torch.allclose(got, want_experts, rtol=1e-4, atol=1e-4)
    bf16 = packed.PackedLinear("bf16", torch.randn(8, 96, generator=g).bfloat16())
    assert bf16.backend(x) == "torch"  # no bf16 Triton kernel: dequantised on a GPU
