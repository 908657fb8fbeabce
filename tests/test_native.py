"""The C kernels (kvstack.native) against the torch ops they stand in for."""

import os
import re
import shutil
import stat
from copy import deepcopy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvstack import LLM, SamplingParams, native
from kvstack.cache.batch import _scores
from kvstack.cache.contiguous import ContiguousCache
from kvstack.cache.rows import PackedRows, _rows_at
from kvstack.config import dense_control, preset
from kvstack.engine.config import EngineConfig
from kvstack.formats import dequantize, pack_rows, quantize, unpack_rows
from kvstack.model import Model
from kvstack.model.model import (
    HyperConnection,
    Layer,
    MoE,
    RMSNorm,
    StepContext,
    candidate_pool,
    grouped_mm_by_group,
    rotate,
    select_topk,
)

pytestmark = pytest.mark.skipif(not native.resolve("auto"), reason="no C compiler here")


@pytest.mark.parametrize(("fmt", "width"), [("fp4_e4m3_16", 64), ("fp4_ue8m0_32", 64),
                                             ("fp8_ue8m0_32", 96)])
def test_read_rows_equal_the_codecs_bit_for_bit(fmt, width):
    """Every code and scale byte, NaN scales included: the same float32 bits."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(300, width, generator=g) * torch.rand(300, 1, generator=g) * 50
    rows = pack_rows(quantize(values, fmt))
    rows = torch.cat([rows, torch.randint(0, 256, (256, rows.shape[1]), generator=g,
                                          dtype=torch.uint8)])  # any byte, NaN scales too
    index = torch.randint(0, rows.shape[0], (5, 70), generator=g)
    got = native.read_rows(rows, index, fmt, width)
    want = dequantize(unpack_rows(_rows_at(rows, index), fmt, width))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("ratio, heads, short", [(1, 4, 0), (2, 4, 0), (4, 4, 0), (1, 12, 3),
                                                  (2, 1, 5)])
def test_index_scores_equal_dequantise_then_score(ratio, heads, short):
    """Through a block table with the null block, at positions whose last group is
    incomplete, eight keys a pass and the `short` entries past the last whole eight one
    at a time: the same -inf entries, a NaN scale's NaN score, the scores within float
    rounding."""
    g = torch.Generator().manual_seed(ratio)
    fmt, b, width, per, blocks = "fp4_ue8m0_32", 3, 64, 16, 24
    pool = pack_rows(quantize(torch.randn(blocks * per, width, generator=g), fmt))
    pool = pool.view(blocks, per, -1).clone()
    pool[0] = 0  # the null block
    table = torch.randint(2, blocks, (b, 8), generator=g)
    table[0, 4:] = 0
    table[2, 0] = 1
    pool[1, 3, width // 2] = 0xFF  # a NaN scale (E8M0): sequence 2's entry 3
    positions = torch.tensor([6, 70, 127])
    q, w = torch.randn(b, heads, width, generator=g), torch.randn(b, heads, generator=g)
    n = 128 // ratio - short
    got = native.index_scores(q, w, pool, table, positions, n, ratio, fmt)
    want = _scores(q, w, pool, table, positions, n, ratio, fmt, width)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[2, 3])
    assert torch.isinf(want).any() and torch.isfinite(want).any()
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [4, 3])
def test_index_scores_at_chosen_entries_equal_gather_dequantise_then_score(heads):
    """Each sequence's own entries through its block table (eight a pass and the rest one
    at a time), entries past its count or outside the table -inf, a NaN scale's NaN
    score."""
    g = torch.Generator().manual_seed(heads)
    fmt, b, width, per, blocks, k = "fp4_ue8m0_32", 3, 64, 16, 24, 13
    pool = pack_rows(quantize(torch.randn(blocks * per, width, generator=g), fmt))
    pool = pool.view(blocks, per, -1).clone()
    table = torch.randint(1, blocks, (b, 8), generator=g)
    pool[table[1, 0], 3, width // 2] = 0xFF  # a NaN scale (E8M0): sequence 1's entry 3
    held = torch.tensor([40, 128, 100])
    entries = torch.randint(0, 128, (b, k), generator=g)
    entries[1, 5] = 3
    q, w = torch.randn(b, heads, width, generator=g), torch.randn(b, heads, generator=g)
    got = native.index_scores_at(q, w, pool, table, held, entries, fmt)
    rows = pool[table.gather(1, entries // per), entries % per]  # [B, K, bytes]
    keys = dequantize(unpack_rows(rows, fmt, width))
    want = (torch.einsum("bhd,bkd->bkh", q, keys).relu() * w[:, None]).sum(-1)
    want = want.masked_fill(entries >= held[:, None], float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(got).any()
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[1, 5])
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    outside = native.index_scores_at(q, w, pool, table, held, entries + 128, fmt)
    assert torch.isinf(outside).all()  # past the table: -inf, and nothing read


def test_a_decode_steps_choice_in_its_candidate_pool_equals_scoring_and_masking():
    """Unsorted spans, a span past a sequence's entries and one past the table, k above
    and below the pool's size: the entries `index_scores_at` then `select_topk` choose
    (ties to the earlier entry, ascending, -1 where fewer are visible)."""
    g = torch.Generator().manual_seed(9)
    fmt, b, width, per, blocks, heads, span = "fp4_ue8m0_32", 3, 64, 16, 24, 2, 8
    pool = pack_rows(quantize(torch.randn(blocks * per, width, generator=g), fmt))
    pool = pool.view(blocks, per, -1).clone()
    table = torch.randint(1, blocks, (b, 8), generator=g)
    held = torch.tensor([40, 128, 3])
    spans = torch.tensor([[4, 0, 2, 16], [15, 3, 9, 1], [0, 7, 2, 5]])  # 16: past the table
    q, w = torch.randn(b, heads, width, generator=g), torch.randn(b, heads, generator=g)
    for k in (5, 40):
        got = native.select_in_pool(q, w, pool, fmt, table, held, spans, span, k)
        entries = (spans.sort(dim=-1).values[..., None] * span + torch.arange(span)).flatten(1)
        scores = native.index_scores_at(q, w, pool, table, held, entries, fmt)
        chosen = select_topk(scores, k)
        want = torch.where(chosen >= 0, entries.gather(1, chosen.clamp(min=0)), -1)
        assert torch.equal(got, want), k
    assert (got[2, 3:] == -1).all() and (got[2, :3] >= 0).all()  # 3 entries held


def test_candidate_pools_equal_torchs():
    """Ties (to the earlier span), -0.0 against 0.0, spans of -inf, a NaN, a last span cut
    short, the newest visible span kept first, a query with no visible entry, positions
    shared by the batch and per sequence."""
    config = preset("tiny-v41")
    spec = next(s for s in config.layers if s.is_candidate_source)
    bs = config.candidate_block_size
    g = torch.Generator().manual_seed(10)
    n = 13 * bs + 3
    scores = torch.randint(-2, 3, (2, 3, n), generator=g).float()
    scores[0, 0, :bs] = -0.0
    scores[0, 1, 5 * bs :] = float("-inf")
    scores[1, 2, 2 * bs + 1] = float("nan")
    last = n * spec.ratio - 1  # the newest visible entry is the last scored
    for positions in (torch.tensor([[0, last // 2, last]]),
                      torch.tensor([[5, 9, last], [0, 1, 2]])):
        want = candidate_pool(scores, positions, spec, config)
        with torch.no_grad(), native.active(True):
            got = candidate_pool(scores, positions, spec, config)
        assert torch.equal(got, want), positions


@pytest.mark.parametrize("k, n", [(64, 32), (64, 96), (64, 36), (24, 32)])
def test_grouped_mm_equals_a_matmul_per_group(k, n):
    """Empty groups, odd group sizes, groups small (dots of rows) and large (weights
    packed in bands of 32 columns, rows eight at a time and a remainder), widths that take
    each path (36 columns: no whole band; 24 deep: no dot of sixteen), experts' [N, K]
    weights and a contiguous [K, N]."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(190, k, generator=g)
    w = torch.randn(7, n, k, generator=g).transpose(1, 2)  # [G, K, N], stored [N, K]
    ends = torch.tensor([3, 3, 10, 21, 30, 37, 190], dtype=torch.int32)  # last: 153 rows
    for weights in (w, w.contiguous()):
        got = native.grouped_mm(x, weights, ends)
        assert torch.allclose(got, grouped_mm_by_group(x, weights, ends), atol=1e-5)
        # bf16 weights widened as they are read: what the float32 call gives on their
        # values.
        narrow = weights.bfloat16()
        assert torch.equal(native.grouped_mm(x, narrow, ends),
                           native.grouped_mm(x, narrow.float(), ends))


@pytest.mark.parametrize("fmt", ["fp4_ue8m0_32", "fp8_ue8m0_32", "fp4_e4m3_16"])
def test_quantize_writes_the_codecs_bytes_and_values_bit_for_bit(fmt):
    """Every magnitude from subnormal to saturating, both zeros, the codes' tie points at
    several scales, NaN and infinity unchecked; checked, the codecs' own errors."""
    g = torch.Generator().manual_seed(0)
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 16).view(2, 64)
    parts = [torch.randn(64, 64, generator=g) * 10.0 ** torch.randint(-30, 31, (64, 1),
                                                                      generator=g),
             ties, -ties, ties * 3.7, ties * 2.0**-130, torch.zeros(1, 64), -torch.zeros(1, 64),
             torch.full((1, 64), float("nan")), torch.full((1, 64), float("inf"))]
    x = torch.cat(parts).view(-1, 2, 64)  # leading dims, as a batch's entries come
    rows, values = native.quantize(x, fmt, check=False)
    q = quantize(x, fmt, check=False)
    assert torch.equal(rows, pack_rows(q))
    assert torch.equal(values.view(torch.int32), dequantize(q).view(torch.int32))
    for bad in (torch.full((1, 64), float("nan")), torch.full((1, 64), 3e38)):
        if fmt == "fp4_e4m3_16" and bad.isfinite().all():
            continue  # this format saturates instead
        with pytest.raises(ValueError) as want:
            quantize(bad, fmt)
        with pytest.raises(ValueError, match=re.escape(str(want.value))):
            native.quantize(bad, fmt)


@pytest.mark.parametrize("fmt", ["fp8_ue8m0_32", "fp4_e4m3_16"])
def test_a_ring_write_leaves_the_bytes_and_positions_a_pack_and_scatter_leaves(fmt):
    """Three sequences' new entries into their slots' rings (one wrapping past the ring's
    end): the same ring bytes, positions and returned values as torch's pack and scatter."""
    g = torch.Generator().manual_seed(4)
    window, d = 8, 64
    rings = PackedRows(fmt, d, (4, window), torch.device("cpu"))
    rings.data[:], _ = rings.pack(torch.randn(4, window, d, generator=g))
    pos = torch.randint(0, 50, (4, window), generator=g)
    slots, positions = torch.tensor([2, 0, 3]), torch.tensor([17, 3, 40])
    entries = torch.randn(3, d, generator=g) * 5
    want_data, want_pos = rings.data.clone(), pos.clone()
    rows, want = rings.pack(entries, check=False)
    want_data[slots, positions % window] = rows
    want_pos[slots, positions % window] = positions
    got = native.ring_write(entries, fmt, rings.data, pos, slots, positions)
    assert torch.equal(rings.data, want_data) and torch.equal(pos, want_pos)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("fmt", ["fp8_ue8m0_32", "fp4_e4m3_16"])
def test_a_stream_write_leaves_the_bytes_a_pack_and_scatter_leaves(fmt):
    """Three sequences' new entries into their rows of a pool (two into one block): the
    same pool bytes and returned values as torch's pack and scatter."""
    g = torch.Generator().manual_seed(8)
    d = 64
    pool = PackedRows(fmt, d, (5, 4), torch.device("cpu"))
    pool.data[:], _ = pool.pack(torch.randn(5, 4, d, generator=g))
    blocks, offsets = torch.tensor([3, 0, 3]), torch.tensor([1, 2, 3])
    entries = torch.randn(3, d, generator=g) * 5
    want_data = pool.data.clone()
    rows, want = pool.pack(entries, check=False)
    want_data[blocks, offsets] = rows
    got = native.stream_write(entries, fmt, pool.data, blocks, offsets)
    assert torch.equal(pool.data, want_data)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("h", [2, 4])
def test_hyper_connection_ops_equal_torchs(h):
    """Mixes (Sinkhorn included), collapse and spread for a batch of tokens."""
    config = preset("tiny").replace(hc_mult=h)
    hc = HyperConnection(config)
    g = torch.Generator().manual_seed(h)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * 0.1)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g))
        hc.scale.copy_(torch.rand(3, generator=g) + 0.5)
    x = torch.randn(3, 2, h, config.dim, generator=g)
    out = torch.randn(3, 2, config.dim, generator=g)
    want = hc.mixes(x)  # outside an engine step: torch's ops
    with torch.no_grad(), native.active(True):
        got = hc.mixes(x)
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        pre, post, comb = want
        assert torch.allclose(HyperConnection.collapse(x, pre),
                              (pre.unsqueeze(-1) * x).sum(2), rtol=1e-5, atol=1e-5)
        spread = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.einsum("bnki,bnkd->bnid",
                                                                       comb, x)
        assert torch.allclose(HyperConnection.post(out, x, post, comb), spread, rtol=1e-5,
                              atol=1e-5)


def test_rope_and_rmsnorm_equal_torchs():
    """RoPE with and without heads, positions shared by the batch or per sequence, both
    directions, a part left unrotated; RMSNorm over the last dim."""
    g = torch.Generator().manual_seed(0)
    freqs = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    cases = [(torch.randn(3, 5, 4, 64, generator=g), torch.randint(0, 70000, (3, 5))),
             (torch.randn(3, 1, 64, generator=g), torch.randint(0, 70000, (3, 1))),
             (torch.randn(2, 6, 2, 64, generator=g), torch.arange(6)[None])]
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    for x, positions in cases:
        for inverse in (False, True):
            want = rotate(x, positions, freqs, inverse)
            with torch.no_grad(), native.active(True):
                got = rotate(x, positions, freqs, inverse)
            assert torch.equal(got[..., :48], x[..., :48])
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
        want = norm(x)
        with torch.no_grad(), native.active(True):
            assert torch.allclose(norm(x), want, rtol=1e-5, atol=1e-6)
    x, positions = cases[0]
    with pytest.raises(ValueError, match="positions must be"):  # no read past them
        native.rope(x, positions[:, :2], freqs, False)
    with pytest.raises(ValueError, match="pre must be"):
        native.hc_collapse(x, x[..., 0, 0])


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Kernels run on this many threads (two spread a lone query's heads), then back."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(("ring_fmt", "kv_fmt"), [("fp8_ue8m0_32", "fp4_e4m3_16"),
                                                  ("fp4_ue8m0_32", "fp8_ue8m0_32")])
def test_sparse_attention_equals_dequantise_then_attend(ring_fmt, kv_fmt, threads):
    """Rings with stale and empty rows, selections with holes and none at all, entries
    through a block table, a sink that dominates and one that vanishes, nine heads (runs
    of four spread over the threads, one short): the softmax over the torch codecs'
    dequantised rows."""
    g = torch.Generator().manual_seed(1)
    b, h, d, window, per, n_blocks, k = 4, 9, 64, 8, 4, 6, 5
    cpu = torch.device("cpu")
    ring = PackedRows(ring_fmt, d, (5, window), cpu)
    ring.data[:], _ = ring.pack(torch.randn(5, window, d, generator=g) * 3)
    slots, positions = torch.tensor([1, 3, 0, 4]), torch.tensor([30, 2, 0, 12])
    ring_positions = torch.full((5, window), -1)
    ring_positions[1, torch.arange(23, 31) % window] = torch.arange(23, 31)
    ring_positions[3] = torch.tensor([0, 1, 2, 13, 14, 15, 16, 17])  # 13..: stale
    ring_positions[4, torch.arange(5, 13) % window] = torch.arange(5, 13)
    pool = PackedRows(kv_fmt, d, (n_blocks + 1, per), cpu)
    pool.data[:n_blocks], _ = pool.pack(torch.randn(n_blocks, per, d, generator=g))
    block_table = torch.stack([torch.randperm(n_blocks, generator=g) for _ in range(b)])
    selected = torch.tensor([[0, 5, 9, -1, 22], [-1] * k, [3, -1, 1, 2, 7], [4, 8, -1, -1, 0]])
    q = torch.randn(b, h, d, generator=g) * 2
    sink = torch.tensor([0.5, 8.0, -40.0] * 3)
    out = native.sparse_attention(q, sink, ring.data, ring_fmt, ring_positions, slots,
                                  positions, pool.data, kv_fmt, block_table, selected, window)
    for i in range(b):
        t, held = int(positions[i]), ring_positions[int(slots[i])]
        keys = [ring.read(ring.data[int(slots[i]), (held >= 0) & (held <= t) & (held > t - 8)])]
        keys += [pool.read(pool.data[block_table[i, e // per], e % per])[None]
                 for e in selected[i][selected[i] >= 0].tolist()]
        rows = torch.cat(keys)
        logits = torch.cat((q[i] @ rows.T * d**-0.5, sink[:, None]), dim=1)
        want = logits.softmax(-1)[:, :-1] @ rows
        assert torch.allclose(out[i], want, atol=1e-5, rtol=1e-5), i


def _ring_and_pool(g: torch.Generator, slots: int, b: int, d: int = 64, window: int = 8,
                   per: int = 4, n_blocks: int = 5) -> tuple:
    """FP8 window rings of `slots` slots with random rows and positions, an FP4 pool of
    random rows, and a block table for b sequences: what a decode attention reads."""
    cpu = torch.device("cpu")
    rings = PackedRows("fp8_ue8m0_32", d, (slots, window), cpu)
    rings.data[:], _ = rings.pack(torch.randn(slots, window, d, generator=g))
    pool = PackedRows("fp4_e4m3_16", d, (n_blocks, per), cpu)
    pool.data[:], _ = pool.pack(torch.randn(n_blocks, per, d, generator=g))
    ring_pos = torch.randint(0, 20, (slots, window), generator=g)
    block_table = torch.stack([torch.randperm(n_blocks, generator=g) for _ in range(b)])
    return rings, pool, ring_pos, block_table


def test_an_attention_call_that_writes_the_window_first_equals_the_two_calls():
    """This step's window entries handed to the attention's call: the ring's bytes and
    positions and the output of `ring_write` then `sparse_attention`, bit for bit."""
    g = torch.Generator().manual_seed(7)
    b, h, d, window = 3, 2, 64, 8
    rings, pool, ring_pos, block_table = _ring_and_pool(g, 4, b)
    slots, positions = torch.tensor([2, 0, 3]), torch.tensor([17, 3, 20])
    selected = torch.tensor([[0, 5, -1], [-1, -1, -1], [3, 1, 2]])
    q, sink = torch.randn(b, h, d, generator=g), torch.tensor([0.5, -1.0])
    entries = torch.randn(b, d, generator=g) * 3
    want_rings, want_pos = rings.data.clone(), ring_pos.clone()
    native.ring_write(entries, rings.fmt, want_rings, want_pos, slots, positions)
    args = (pool.data, pool.fmt, block_table, selected, window)
    want = native.sparse_attention(q, sink, want_rings, rings.fmt, want_pos, slots, positions,
                                   *args)
    got = native.sparse_attention(q, sink, rings.data, rings.fmt, ring_pos, slots, positions,
                                  *args, new_entries=entries)
    assert torch.equal(rings.data, want_rings) and torch.equal(ring_pos, want_pos)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="in place"):
        native.sparse_attention(q, sink, rings.data, rings.fmt, ring_pos.int(), slots,
                                positions, *args, new_entries=entries)


@pytest.mark.parametrize("tokens", [1, 5])
def test_the_attention_projections_in_and_out_equal_torchs(tokens):
    """One token and a few, sequences at their own positions and one shared start, YaRN's
    frequencies: qr, the rotated queries and window entries, and the output projection
    through the grouped wo_a, within float rounding of the module's torch ops."""
    config = preset("tiny").replace(rope_factor=4.0, original_seq_len=64)
    torch.manual_seed(0)
    model = Model(config).eval()
    attention = next(layer.attn for layer in model.layers if layer.attn.spec.ratio)
    h, d = config.n_heads, config.head_dim
    x = torch.randn(tokens, 1, config.dim)
    out = torch.randn(tokens, 1, h, d)
    for positions in (torch.arange(tokens)[:, None] * 37 + 3, torch.tensor([[900]])):
        with torch.no_grad():
            qr = attention.q_norm(attention.wq_a(x))
            want = (qr, rotate(attention.wq_b(qr).unflatten(-1, (h, d)), positions,
                               attention.freqs),
                    rotate(attention.kv_norm(attention.wkv(x)), positions, attention.freqs))
            # Weights as strided views, as a sharded rank's columns are: the wrapper hands
            # C a contiguous copy of each.
            wq_b, wo_b = (w.t().contiguous().t() for w in (attention.wq_b.weight,
                                                           attention.wo_b.weight))
            got = native.attention_in(x, positions, attention.wq_a.weight,
                                      attention.q_norm.weight, wq_b, attention.wkv.weight,
                                      attention.kv_norm.weight, config.norm_eps,
                                      attention.freqs, h)
            for g, w in zip(got, want, strict=True):
                assert torch.allclose(g, w, atol=1e-5, rtol=1e-5)
            assert torch.allclose(
                native.attention_out(out, positions, attention.freqs, attention.wo_a.weight,
                                     config.o_groups, wo_b),
                attention.project_out(out, positions), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="attention_in"):
        native.attention_in(x, positions, attention.wq_b.weight, attention.q_norm.weight,
                            attention.wq_b.weight, attention.wkv.weight,
                            attention.kv_norm.weight, config.norm_eps, attention.freqs, h)
    with pytest.raises(ValueError, match="attention_out"):
        native.attention_out(out, positions, attention.freqs, attention.wo_a.weight,
                             config.o_groups + 1, attention.wo_b.weight)


@pytest.mark.parametrize("d", [40, 48, 64])
def test_prefill_attention_equals_the_masked_softmax_over_window_and_entries(threads, d):
    """Queries of two sequences (positions shared, then each its own), window keys too old,
    too new and never written, selections with holes and none at all, a sink that
    dominates and one that vanishes, nine heads (the AVX-512 path takes eight of them in
    groups at a head width of 64, the AVX2 path pairs of them at 48 or 64, neither at 40);
    and one query alone (its heads spread over the threads): torch's softmax over what
    each query sees."""
    g = torch.Generator().manual_seed(2)
    b, n, h, m, u, k, window = 2, 7, 9, 12, 9, 4, 5
    q = torch.randn(b, n, h, d, generator=g) * 2
    keys, rows = torch.randn(b, m, d, generator=g), torch.randn(b, u, d, generator=g)
    key_positions = torch.stack([torch.arange(m) - 3, torch.randperm(m, generator=g)])
    key_positions[1, 4] = -(1 << 40)  # never written
    columns = torch.randint(-1, u, (b, n, k), generator=g)
    columns[0, 2] = -1
    sink = torch.tensor([0.5, 8.0, -40.0] * 3)
    shared, own = torch.arange(n)[None] + 2, torch.stack([torch.arange(n), torch.arange(n) + 4])
    for positions in (shared, own):
        out = native.prefill_attention(q, positions, keys, key_positions, window, rows,
                                       columns, sink)
        alone = native.prefill_attention(q[:1, :1], positions[:1, :1], keys[:1],
                                         key_positions[:1], window, rows[:1], columns[:1, :1],
                                         sink)
        assert torch.equal(alone[0, 0], out[0, 0])
        for s in range(b):
            for i in range(n):
                t = int(positions[min(s, positions.shape[0] - 1), i])
                held = key_positions[s]
                seen = [keys[s, (held <= t) & (held > t - window)]]
                seen += [rows[s, c][None] for c in columns[s, i].tolist() if c >= 0]
                seen = torch.cat(seen)
                logits = torch.cat((q[s, i] @ seen.T * d**-0.5, sink[:, None]), dim=1)
                want = logits.softmax(-1)[:, :-1] @ seen
                assert torch.allclose(out[s, i], want, atol=1e-5, rtol=1e-5), (s, i)
    with pytest.raises(ValueError, match="prefill_attention"):
        native.prefill_attention(q, positions, keys, key_positions[:, :3], window, rows,
                                 columns, sink)


def test_a_prefill_with_the_c_kernels_gives_torchs_logits():
    """Chunks, tiles and a cache that already holds a prompt: the C prefill attention (and
    the step's other C ops) within float rounding of torch's."""
    config = preset("tiny")
    torch.manual_seed(0)
    model = Model(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 300))
    logits = {}
    for on in (False, True):
        cache = ContiguousCache(config, batch_size=1, max_tokens=400)
        with torch.no_grad(), native.active(on):
            first = model.prefill(ids[:, :200], cache, chunk_size=64)
            logits[on] = (first, model.prefill(ids[:, 200:], cache, chunk_size=64))
    for want, got in zip(logits[False], logits[True], strict=True):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("limit", "score_func", "shared"), [
    (0.0, "sqrtsoftplus", 1), (0.5, "softmax", 1), (0.5, "sigmoid", 0)])
def test_a_float_moe_sublayer_equals_torchs(limit, score_func, shared):
    """The router (each score function), the routed experts and the shared one, the clamp
    on and off, one token and many: what torch's ops compute."""
    config = preset("tiny").replace(swiglu_limit=limit, score_func=score_func,
                                    n_shared_experts=shared, gate_temp=1.5, route_scale=2.0)
    torch.manual_seed(0)
    moe = MoE(config)
    with torch.no_grad():
        for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3, moe.gate.weight):
            w.normal_(0, 0.3)
        for tokens in (1, 9):
            x = torch.randn(tokens, 1, config.dim)
            want = moe(x)
            with native.active(True):
                assert torch.allclose(moe(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("routed", "residual"), [
    (8, "single_pass"), (0, "single_pass"), (8, "per_site")])
def test_a_layers_feed_forward_half_in_one_call_equals_torchs(routed, residual):
    """The hyper-connection's mixes, the collapse (with the attention half's pre or the
    mixes' own), the norm, the MoE or a dense FFN and the spread back, as one C call: what
    the separate torch ops compute, for one token and several."""
    config = preset("tiny-v41").replace(n_routed_experts=routed, hc_residual=residual,
                                        n_activated_experts=min(2, routed), inter_dim=48)
    torch.manual_seed(0)
    layer = Layer(config, config.layers[2])
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
        for b, n in ((1, 1), (3, 2)):
            x = torch.randn(b, n, config.hc_mult, config.dim)
            attn_pre = torch.rand(b, n, config.hc_mult)
            given = attn_pre if config.single_pass_hc else None
            assert layer._ffn_in_c(x, given) is None  # outside an engine step: torch
            hc = layer.hc_ffn
            pre, post, comb = hc.mixes(x)
            y = hc.collapse(x, pre if given is None else given)
            want = hc.post(layer.ffn(layer.ffn_norm(y)), x, post, comb)
            with native.active(True):
                got, got_pre = layer._ffn_in_c(x, given)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
            assert torch.allclose(got_pre, pre, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("routed", [8, 0])
def test_a_feed_forward_half_without_hyper_connections_in_one_call_equals_torchs(routed):
    """A layer of one residual (the dense control's): the norm, the MoE or a dense FFN
    and the residual added, as one C call."""
    config = dense_control(preset("tiny")).replace(
        n_routed_experts=routed, n_activated_experts=min(2, routed), inter_dim=48)
    torch.manual_seed(0)
    layer = Layer(config, config.layers[1])
    assert layer.hc_ffn is None
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
        for b, n in ((1, 1), (3, 2)):
            x = torch.randn(b, n, config.dim)
            assert layer._ffn_in_c(x, None) is None  # outside an engine step: torch
            want = x + layer.ffn(layer.ffn_norm(x))
            with native.active(True):
                got, pre = layer._ffn_in_c(x, None)
            assert pre is None
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def _dense_block_inputs(fmt: str, g: torch.Generator, dim: int = 48, h: int = 4,
                       kv_heads: int = 2, d: int = 32) -> dict:
    """Pools of random rows, three sequences at their own positions through a block table,
    and where each one's new row goes."""
    b, per, n_blocks = 3, 4, 9
    pools = {kind: PackedRows(fmt, kv_heads * d, (n_blocks, per), torch.device("cpu"))
             for kind in ("k", "v")}
    for rows in pools.values():
        rows.data[:], _ = rows.pack(torch.randn(n_blocks, per, kv_heads * d, generator=g))
    positions = torch.tensor([8, 0, 13])
    block_table = torch.stack([torch.randperm(n_blocks, generator=g)[:4] for _ in range(b)])
    new_rows = (block_table.gather(1, (positions // per)[:, None])[:, 0], positions % per)
    return dict(pools=pools, positions=positions, block_table=block_table, new_rows=new_rows,
                lengths=positions + 1, h=h, kv_heads=kv_heads, d=d, dim=dim,
                freqs=1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))


def _dense_block(x, norm, eps, wq, wk, wv, wo, fmt, i) -> torch.Tensor:
    return native.dense_attention_block(
        x, norm, eps, wq, wk, wv, wo, i["h"], i["positions"], i["freqs"],
        i["pools"]["k"].data, i["pools"]["v"].data, fmt, i["block_table"], i["new_rows"],
        i["lengths"])


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ue8m0_32"])
def test_a_dense_decode_steps_attention_half_in_one_call_equals_torchs(fmt):
    """Norm, projections, RoPE, the new key and value rows packed into the pools, GQA over
    each sequence's rows and the output projection with the residual, for three sequences
    at their own positions through a block table: the bytes `PackedRows.pack` writes, and
    the output of the separate ops within float rounding."""
    g = torch.Generator().manual_seed(5)
    i = _dense_block_inputs(fmt, g)
    dim, h, kv, d, pools = i["dim"], i["h"], i["kv_heads"] * i["d"], i["d"], i["pools"]
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = torch.rand(dim, generator=g) + 0.5
    wq, wo = torch.randn(h * d, dim, generator=g) * 0.2, torch.randn(dim, h * d, generator=g) * 0.2
    wk, wv = torch.randn(kv, dim, generator=g) * 0.2, torch.randn(kv, dim, generator=g) * 0.2
    x = torch.randn(3, dim, generator=g)
    y, at = norm(x)[:, None], i["positions"][:, None]
    q = rotate((y @ wq.T).unflatten(-1, (h, d)), at, i["freqs"])
    new = {"k": rotate((y @ wk.T).unflatten(-1, (kv // d, d)), at, i["freqs"]).flatten(2),
           "v": y @ wv.T}
    want_pools = {kind: rows.data.clone() for kind, rows in pools.items()}
    for kind, values in new.items():
        want_pools[kind][i["new_rows"]] = pools[kind].pack(values[:, 0])[0]
    attended = native.dense_attention(q[:, 0], want_pools["k"], want_pools["v"], fmt, kv,
                                      i["block_table"], i["lengths"])
    want = x + attended.flatten(1) @ wo.T
    got = _dense_block(x, norm.weight, 1e-6, wq, wk, wv, wo, fmt, i)
    for kind in ("k", "v"):
        assert torch.equal(pools[kind].data, want_pools[kind]), kind
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_dense_decode_step_rounds_its_bf16_rows_as_torch_does():
    """Values on bf16 ties (to even, both ways, either sign) and NaN: the bytes torch's
    conversion gives. The inputs make the projections exact (a residual of ones and no eps:
    the norm is its weight; one-hot weights: each value is one of them)."""
    g = torch.Generator().manual_seed(6)
    i = _dense_block_inputs("bf16", g, dim=64, h=2, kv_heads=1, d=64)
    i["positions"][:] = 0  # no rotation: cos 0 = 1, sin 0 = 0
    i["lengths"] = i["positions"] + 1
    i["new_rows"] = (i["block_table"][:, 0], torch.zeros(3, dtype=torch.long))
    ties = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), -(2 + 3 * 2.0**-7)])
    weight = torch.cat([ties, torch.randn(60, generator=g)])
    eye = torch.eye(64)
    for nan in (False, True):
        w = weight.clone()
        if nan:
            w[10] = float("nan")
        rows = i["pools"]["v"]
        _dense_block(torch.ones(3, 64), w, 0.0, torch.randn(128, 64, generator=g), eye, eye,
                     torch.randn(64, 128, generator=g), "bf16", i)
        written = rows.data[i["new_rows"]]
        want = pack_rows(quantize(w.expand(3, 64) if not nan else
                                  torch.full((3, 64), float("nan")), "bf16", check=False))
        assert torch.equal(written, want)
        assert torch.equal(i["pools"]["k"].data[i["new_rows"]], want)


def test_a_kept_plan_is_reused_and_a_copied_one_makes_its_own_buffers():
    """A second call of one shape reuses the kept output buffer; a deep copy of the keep
    (a deep-copied model's, over the same cache) writes into buffers of its own, leaving
    the original's output alone, and gives the fresh result."""
    g = torch.Generator().manual_seed(12)
    b, h, d, window = 2, 2, 64, 8
    rings, pool, ring_pos, block_table = _ring_and_pool(g, 3, b)
    args = (rings.data, rings.fmt, ring_pos, torch.tensor([2, 0]), torch.tensor([11, 3]),
            pool.data, pool.fmt, block_table, torch.tensor([[0, 5], [-1, 2]]), window)
    sink = torch.tensor([0.5, -1.0])
    q1, q2 = torch.randn(b, h, d, generator=g), torch.randn(b, h, d, generator=g)
    keep: dict = {}
    first = native.sparse_attention(q1, sink, *args, keep=keep)
    again = native.sparse_attention(q2, sink, *args, keep=keep)
    assert again is first  # the kept buffer, now q2's output
    held = again.clone()
    copied = deepcopy(keep)
    got = native.sparse_attention(q1, sink, *args, keep=copied)
    assert got is not again and torch.equal(again, held)
    assert torch.equal(got, native.sparse_attention(q1, sink, *args))


def test_plans_of_shapes_that_take_turns_are_kept_whatever_their_weights_bytes():
    """A verify's rows change from step to step, so a call site keeps a few recent plans
    beside the last one. What a plan is held to is the size of its own buffers: the
    weights it points at (named by address in its key) are the model's, so a feed-forward
    of more than RECENT_PLAN_BYTES of weights keeps its plans too. Shapes taking turns
    then make no new call blocks, and each gives what a fresh call gives."""
    g = torch.Generator().manual_seed(13)
    dim, inter = 128, 384  # 590 KB of float32 weights
    shared = tuple(torch.randn(*shape, generator=g) * 0.05
                   for shape in ((inter, dim), (dim, inter), (inter, dim)))
    assert sum(w.numel() * 4 for w in shared) > native.RECENT_PLAN_BYTES
    norm = torch.rand(dim, generator=g) + 0.5
    xs = {rows: torch.randn(rows, dim, generator=g) for rows in (1, 5, 3)}
    keep: dict = {}
    with native.active(True):
        def call(rows: int) -> torch.Tensor:
            return native.ffn_block(xs[rows], None, 1e-6, 0.0, 0, None, norm, None, shared,
                                    0.0, keep)[0]

        first = {rows: call(rows) for rows in xs}
        blocks = {key: plan[1][0] for key, plan in keep["ffn_block#recent"].items()}
        again = {rows: call(rows) for rows in (3, 1, 5, 1)}
        fresh = {rows: native.ffn_block(xs[rows], None, 1e-6, 0.0, 0, None, norm, None,
                                        shared, 0.0)[0] for rows in xs}
    assert len(blocks) == 3
    assert {key: plan[1][0] for key, plan in keep["ffn_block#recent"].items()} == blocks
    for rows in xs:
        assert torch.equal(first[rows], fresh[rows]) and torch.equal(again[rows], fresh[rows])


@pytest.mark.parametrize("residual", ["single_pass", "per_site"])
def test_a_layers_attention_half_ends_in_one_call_each_equal_torchs(residual):
    """Before the attention: the hyper-connection's mixes, the collapse (the previous
    sublayer's pre or the mixes' own), the norm and the projections in, as one call; after
    it: the projections out and the spread over the copies, as one call. What the separate
    torch ops compute, for one token and several at their own positions."""
    config = preset("tiny-v41").replace(hc_residual=residual)
    torch.manual_seed(0)
    layer = Layer(config, config.layers[2])
    attn, hc = layer.attn, layer.hc_attn
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
        for b, n in ((1, 1), (3, 2)):
            x = torch.randn(b, n, config.hc_mult, config.dim)
            start = torch.tensor([5, 40, 77][:b])
            positions = start[:, None] + torch.arange(n)
            mix = torch.rand(b, n, config.hc_mult)
            given = mix if config.single_pass_hc else None
            assert layer._attention_in_c(x, given, start, StepContext()) is None  # torch
            pre, post, comb = hc.mixes(x)
            y = layer.attn_norm(hc.collapse(x, pre if given is None else given))
            qr = attn.q_norm(attn.wq_a(y))
            q = rotate(attn.wq_b(qr).unflatten(-1, (config.n_heads, config.head_dim)),
                       positions, attn.freqs)
            window = attn._window_entries(y, positions)
            heads = torch.randn(b, n, config.n_heads, config.head_dim)
            want_out = hc.post(attn.project_out(heads, positions), x, post, comb)
            with native.active(True):
                got = layer._attention_in_c(x, given, start, StepContext())
                held = heads.clone()
                got_out = native.attention_out(heads, positions, attn.freqs, attn.wo_a.weight,
                                               attn.local_groups, attn.wo_b.weight,
                                               (x, post, comb))
                assert torch.equal(heads, held)  # not spent: the caller's values stay
                # Spent: rotated back in place, the same output.
                spent_out = native.attention_out(heads, positions, attn.freqs,
                                                 attn.wo_a.weight, attn.local_groups,
                                                 attn.wo_b.weight, (x, post, comb), spent=True)
            for g, w in zip((*got[:4], *got[4][1:4]), (pre, post, comb, y, qr, q, window),
                            strict=True):
                assert torch.allclose(g, w, rtol=1e-5, atol=1e-5)
            assert torch.allclose(got_out, want_out, rtol=1e-5, atol=1e-5)
            assert torch.equal(spent_out, got_out)


@pytest.mark.parametrize("stored", ["float32", "bf16"])
def test_a_decode_steps_compressor_in_one_call_equals_torchs(stored):
    """Ratio 1 and 2 sources, one sequence whose token ends its group and one whose does
    not: the entries and index keys appended and the partial groups left as torch's. bf16:
    the projections held as a checkpoint's bf16 (`PackedLinear`), against torch on their
    values in float32."""
    from kvstack.cache.batch import DecodeBatch
    from kvstack.model.packed import PackedLinear

    config = preset("tiny")
    llm = LLM(config, random_init=True, kv_budget="8MiB", max_num_seqs=2, cpu_kernels="c")
    g = torch.Generator().manual_seed(0)
    stores = []
    for n in (41, 34):  # the next tokens at 41 (a group's first) and 34 (its last)
        store = llm.cache.open_sequence()
        assert store.reserve(n + 1)
        with torch.no_grad():
            llm.runner.prefill_store(store, torch.randint(0, 256, (n,), generator=g).tolist())
        stores.append(store)
    batch = DecodeBatch(stores)
    partials = llm.cache.partials
    compressors = {layer.attn.compressor.ratio: layer.attn.compressor
                   for layer in llm.model.layers if layer.attn.compressor is not None}
    assert set(compressors) == {1, 2}
    for ratio, compressor in compressors.items():
        x = torch.randn(2, 1, config.dim, generator=g)
        before = {k: (v.clone(), partials.gates[k].clone()) for k, v in partials.values.items()}
        projections = ("wkv", "wk_index") + (("wgate",) if ratio > 1 else ())
        float_modules = {name: getattr(compressor, name) for name in projections}
        if stored == "bf16":
            with torch.no_grad():
                for m in float_modules.values():
                    m.weight.copy_(m.weight.bfloat16())
        result = {}
        for on in (False, True):
            for name, m in float_modules.items():
                setattr(compressor, name, PackedLinear("bf16", m.weight.detach().bfloat16())
                        if on and stored == "bf16" else m)
            for k, (values, gates) in before.items():
                partials.values[k].copy_(values)
                partials.gates[k].copy_(gates)
            appended = {}
            batch.append_stream = lambda layer, entries, out=appended: out.update(entries)
            with torch.no_grad(), native.active(on):
                assert (compressor._weights_in_c(x, batch) is not None) is on
                compressor._compress_step(x, batch.positions, batch)
            result[on] = (appended, {k: (v.clone(), partials.gates[k].clone())
                                     for k, v in partials.values.items()})
        for kind in ("kv", "index"):
            assert torch.allclose(result[True][0][kind], result[False][0][kind], rtol=1e-5,
                                  atol=1e-5), (ratio, kind)
        for k, (values, gates) in result[False][1].items():
            assert torch.allclose(result[True][1][k][0], values, rtol=1e-6, atol=1e-6)
            assert torch.allclose(result[True][1][k][1], gates, rtol=1e-6, atol=1e-6)
        if ratio > 1:
            layer = compressor.layer
            assert not torch.equal(result[True][1][layer][0], before[layer][0])  # written


def test_a_compressor_step_that_writes_its_entries_equals_the_two_calls():
    """Entries and index keys quantised into their pools by the compressor's own call: the
    bytes `stream_write` leaves after a call without, and the same partial groups."""
    g = torch.Generator().manual_seed(11)
    b, dim, d, di, ratio, slots = 3, 48, 64, 32, 2, 5
    x = torch.randn(b, dim, generator=g)
    positions, slot = torch.tensor([7, 2, 10]), torch.tensor([4, 0, 2])
    wkv, wgate = torch.randn(d, dim, generator=g), torch.randn(d, dim, generator=g)
    wk_index = torch.randn(di, d, generator=g)
    norm, index_norm = torch.rand(d, generator=g) + 0.5, torch.rand(di, generator=g) + 0.5
    freqs = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    partial = (torch.randn(slots, ratio - 1, d, generator=g),
               torch.randn(slots, ratio - 1, d, generator=g))
    pools = {"kv": PackedRows("fp4_ue8m0_32", d, (6, 4), torch.device("cpu")),
             "index": PackedRows("fp8_ue8m0_32", di, (6, 4), torch.device("cpu"))}
    blocks, offsets = torch.tensor([3, 0, 5]), torch.tensor([1, 0, 3])
    got = {}
    for write in (False, True):
        for rows in pools.values():
            rows.data.zero_()
        groups = tuple(t.clone() for t in partial)
        args = (x, positions, slot, ratio, wkv, wgate, groups, norm, 1e-6, wk_index,
                index_norm, 1e-6, freqs)
        if write:
            kv, keys = native.compress_step(*args, (pools["kv"].data, pools["kv"].fmt,
                                                    pools["index"].data, pools["index"].fmt,
                                                    blocks, offsets))
        else:
            kv, keys = native.compress_step(*args)
            for kind, values in (("kv", kv), ("index", keys)):
                native.stream_write(values, pools[kind].fmt, pools[kind].data, blocks, offsets)
        got[write] = (kv, keys, groups, {k: r.data.clone() for k, r in pools.items()})
    assert all(torch.equal(a, b) for a, b in zip(got[True][:2], got[False][:2], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got[True][2], got[False][2], strict=True))
    for kind in pools:
        assert torch.equal(got[True][3][kind], got[False][3][kind]), kind
        assert got[True][3][kind].any()


@pytest.mark.parametrize("query_format", ["fp4_ue8m0_32", "none"])
def test_an_indexers_queries_in_one_call_equal_torchs(query_format):
    """The query projection, RoPE, the rounding through the query format (or none) and the
    head weights with their scale, for one token and several at their own positions."""
    config = preset("tiny-v41").replace(index_query_format=query_format)
    torch.manual_seed(0)
    layer = next(layer for layer in Model(config).layers if layer.attn.indexer is not None)
    indexer = layer.attn.indexer
    with torch.no_grad():
        for b, n in ((1, 1), (3, 2)):
            x, qr = torch.randn(b, n, config.dim), torch.randn(b, n, config.q_lora_rank)
            positions = torch.tensor([7, 300, 41][:b])[:, None] + torch.arange(n)
            want_q, want_w = indexer._queries(x, qr, positions)
            with native.active(True):
                q, w = indexer._queries(x, qr, positions)
            assert torch.allclose(q, want_q, rtol=1e-5, atol=1e-5)
            assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-6)


def test_select_topk_chooses_torchs_entries():
    """Ties (to the earlier entry), both zeros, -inf entries dropped (fewer visible than
    k), NaN, k equal to the width: the same indices, ascending, -1 after them."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(-3, 4, (4, 3, 40), generator=g).float()
    scores[0, 0, ::2] = -0.0
    scores[0, 1] = 0.0
    scores[1, :, 10:] = float("-inf")  # 10 visible, k 16
    scores[2, 0, 7] = float("nan")
    scores[3] = torch.randn(3, 40, generator=g)
    for k in (16, 40):
        want = select_topk(scores, k)
        with torch.no_grad(), native.active(True):
            assert torch.equal(select_topk(scores, k), want)
    assert (select_topk(scores, 16)[1, :, 10:] == -1).all()


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ue8m0_32"])
def test_dense_attention_equals_sdpa_over_the_stored_rows(fmt):
    """Two KV heads of four query heads, sequences of different lengths through a block
    table: causal softmax attention over the rows as the store decodes them."""
    g = torch.Generator().manual_seed(3)
    b, h, kv_heads, d, per, n_blocks = 3, 4, 2, 32, 4, 7
    cpu = torch.device("cpu")
    pools = {}
    for kind in ("k", "v"):
        pools[kind] = PackedRows(fmt, kv_heads * d, (n_blocks, per), cpu)
        pools[kind].data[:], _ = pools[kind].pack(
            torch.randn(n_blocks, per, kv_heads * d, generator=g) * 2)
    block_table = torch.stack([torch.randperm(n_blocks, generator=g)[:3] for _ in range(b)])
    lengths = torch.tensor([9, 1, 12])
    q = torch.randn(b, h, d, generator=g)
    out = native.dense_attention(q, pools["k"].data, pools["v"].data, fmt, kv_heads * d,
                                 block_table, lengths)
    for i in range(b):
        rows = block_table[i, torch.arange(int(lengths[i])) // per] * per \
            + torch.arange(int(lengths[i])) % per
        kv = {kind: pools[kind].read(pools[kind].data.view(-1, pools[kind].data.shape[-1])[rows])
              .view(-1, kv_heads, d).transpose(0, 1).repeat_interleave(h // kv_heads, dim=0)
              for kind in ("k", "v")}
        want = F.scaled_dot_product_attention(q[i][:, None], kv["k"], kv["v"])[:, 0]
        assert torch.allclose(out[i], want, atol=1e-5, rtol=1e-5), i


@pytest.mark.parametrize("dense", [False, True])
def test_the_engine_decodes_the_same_tokens_with_the_c_kernels_as_with_torch(dense):
    """The compressed stack and its dense control (whose attention is another kernel)."""
    config = dense_control(preset("tiny")) if dense else preset("tiny")
    prompts = [[5, 9, 2, 7] * 20, [3, 1] * 33]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = {}
    for choice in ("c", "torch"):
        llm = LLM(config, random_init=True, kv_budget="8MiB", max_num_seqs=2,
                  cpu_kernels=choice)
        assert llm.memory_report()["backend"]["cpu_kernels"] == choice
        outputs[choice] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["c"] == outputs["torch"]


def test_a_required_c_kernel_that_cannot_build_is_an_error_naming_why(monkeypatch):
    with pytest.raises(ValueError, match="cpu_kernels must be one of auto, c, torch"):
        EngineConfig(cpu_kernels="fast")
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_why_not", None)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(native.NativeUnavailable, match="/nonexistent/cc"):
        native.resolve("c")
    assert native.resolve("auto") is False  # the same reason, logged, and torch runs


def test_the_library_is_built_and_loaded_only_from_a_folder_this_user_owns(tmp_path,
                                                                           monkeypatch):
    """The per-user cache folder is made 0700; one that is a symlink, writable by others or
    another user's is passed over, and a library planted there under the expected name is
    never loaded: the build goes to a fresh private temporary folder instead."""
    # Built unoptimised: which folder a build goes to does not depend on the flags, and
    # the four builds below at -O3 take half a minute.
    monkeypatch.setattr(native, "FLAGS", tuple("-O0" if f == "-O3" else f
                                               for f in native.FLAGS))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    built = native._build()
    folder = tmp_path / "home" / "kvstack" / "native"
    assert built.parent == folder and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert native._build() == built  # found, not rebuilt

    def plant(home: str) -> Path:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / home))
        planted = tmp_path / home / "kvstack" / "native" / built.name
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.write_bytes(b"not the kernels")
        return planted

    cases = {"open": lambda p: p.parent.chmod(0o777)}
    if os.getuid() == 0:  # only root can hand a folder to another user
        cases["foreign"] = lambda p: os.chown(p.parent, 65534, 65534)
    for home, spoil in cases.items():
        planted = plant(home)
        spoil(planted)
        got = native._build()
        assert got.parent != planted.parent and got.read_bytes() == built.read_bytes()
        assert stat.S_IMODE(got.parent.stat().st_mode) == 0o700
        shutil.rmtree(got.parent)
    # A symlink where the folder should be is passed over too.
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "linked" / "kvstack").mkdir(parents=True)
    (tmp_path / "linked" / "kvstack" / "native").symlink_to(target)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "linked"))
    got = native._build()
    assert got.parent not in (target, tmp_path / "linked" / "kvstack" / "native")
    shutil.rmtree(got.parent)


def test_an_engine_steps_choice_is_its_own_threads():
    """A server's engine thread steps inside `active(True)` while other threads may run
    the same model outside any step: they must keep the torch code (before, the choice was
    one global, and a model run beside a stepping engine could take the C kernels)."""
    import threading

    inside, seen = threading.Event(), []
    release = threading.Event()

    def step() -> None:
        with native.active(True):
            inside.set()
            release.wait(10)

    engine = threading.Thread(target=step)
    engine.start()
    try:
        assert inside.wait(10)
        seen.append(native.enabled())
        with native.active(False):
            seen.append(native.enabled())
    finally:
        release.set()
        engine.join()
    assert seen == [False, False] and not native.enabled()
    with native.active(True):
        assert native.enabled()


def test_greedy_rows_take_the_first_maximum_and_mark_non_finite_rows():
    """`native.greedy`: torch.argmax's token on every finite row (ties to the first index,
    -0.0 equal to 0.0), -1 on a row with a NaN, +inf or -inf anywhere."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 50, generator=g)
    logits[1, [4, 9, 30]] = 5.0  # a three-way tie
    logits[2] = 0.0
    logits[2, 7] = -0.0
    logits[3, 11], logits[4, 0], logits[5, 49] = float("nan"), float("inf"), float("-inf")
    got = native.greedy(logits)
    want = logits.argmax(-1).tolist()
    assert got[1] == 4 and got[2] == 0
    for row in (0, 1, 2, 6):
        assert got[row] == want[row]
    assert got[3] == got[4] == got[5] == -1
