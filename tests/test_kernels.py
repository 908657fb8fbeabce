"""The Triton decode kernels against the torch backend, under Triton's interpreter
(TRITON_INTERPRET=1 runs the kernels on the CPU, one program at a time: small shapes)."""

import os
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined (triton
# comes with the `kernels` extra, which `make test` installs)

from kvstack import LLM, SamplingParams
from kvstack.cache.kernels import (
    ATTENTION_PROGRAMS_PER_SM,
    INDEX_FORMAT,
    INDEX_PROGRAMS_PER_SM,
    KV_FORMAT,
    WINDOW_FORMAT,
    attention_plan,
    index_plan,
    index_scores,
    sparse_attention,
)
from kvstack.cache.rows import PackedRows
from kvstack.config import preset
from kvstack.formats import bytes_per_entry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import sparse_kernels as kernel_bench  # bench/sparse_kernels.py


def test_sparse_attention_equals_dequantise_then_attend():
    """Window rings of three slots (one half empty), compressed entries through a block
    table with a null block, some selections missing (-1): the kernel's output equals the
    torch codecs' dequantised rows attended with the sink."""
    g = torch.Generator().manual_seed(0)
    b, h, d, window, per, n_blocks = 3, 2, 64, 8, 4, 6
    ring = PackedRows(WINDOW_FORMAT, d, (4, window), torch.device("cpu"))
    ring_values = torch.randn(4, window, d, generator=g) * 3
    ring.data[:], _ = ring.pack(ring_values)
    slots = torch.tensor([2, 0, 3])
    positions = torch.tensor([20, 5, 11])
    ring_positions = torch.full((4, window), -1)
    for slot, t in zip(slots.tolist(), positions.tolist(), strict=True):
        held = torch.arange(max(0, t - window + 1), t + 1)
        ring_positions[slot, held % window] = held
    pool = PackedRows(KV_FORMAT, d, (n_blocks + 1, per), torch.device("cpu"))
    pool.data[:n_blocks], _ = pool.pack(torch.randn(n_blocks, per, d, generator=g))
    block_table = torch.tensor([[4, 1, 0], [2, 6, 6], [5, 3, 6]])  # 6: the null block
    selected = torch.tensor([[0, 5, 9, -1], [1, 2, -1, -1], [7, 3, 0, 4]])
    q = torch.randn(b, h, d, generator=g)
    sink = torch.randn(h, generator=g)

    out = sparse_attention(q, sink, ring.data, ring_positions, slots, positions, pool.data,
                           block_table, selected, window)

    expected = attend(q, sink, ring, ring_positions, slots, positions, pool, block_table,
                      selected, window)
    for i in range(b):
        assert torch.allclose(out[i], expected[i], atol=1e-5, rtol=1e-5), i


def attend(q: torch.Tensor, sink: torch.Tensor, ring: PackedRows, ring_positions: torch.Tensor,
           slots: torch.Tensor, positions: torch.Tensor, pool: PackedRows,
           block_table: torch.Tensor, selected: torch.Tensor, window: int) -> torch.Tensor:
    """The torch codecs' dequantised rows attended with the sink, a sequence at a time:
    the ring's rows holding one of the last `window` positions, then the selections."""
    d, per = q.shape[-1], pool.data.shape[1]
    out = []
    for i in range(q.shape[0]):
        t, held = int(positions[i]), ring_positions[int(slots[i])]
        seen = (held >= 0) & (held <= t) & (held > t - window)
        keys = [ring.read(ring.data[int(slots[i]), seen])]
        for e in selected[i][selected[i] >= 0].tolist():
            keys.append(pool.read(pool.data[block_table[i, e // per], e % per])[None])
        rows = torch.cat(keys)  # [n, d], n may be 0
        logits = torch.cat((q[i] @ rows.T * d**-0.5, sink[:, None]), dim=1)  # [h, n + 1]
        out.append(logits.softmax(-1)[:, :-1] @ rows)
    return torch.stack(out)


@pytest.mark.parametrize(("heads", "width", "chunk"), [
    (3, 128, None),  # the interpreter's default: two splits
    (3, 128, 5),  # seven splits, most of some sequences' empty
    (3, 128, 25),  # a split's rows span the ring and the selections, two tiles of them
    (3, 128, 1000),  # one split: the program applies the sink itself
    (20, 512, None),  # two blocks of heads, the second part empty
])
def test_sparse_attention_split_into_chunks_equals_one_softmax(heads, width, chunk):
    """Each sequence's rows cut into chunks whose partial softmaxes are combined with the
    sink: the one-pass softmax's output, for a full ring and full selections, a ring of
    three rows (the rest stale rows of later positions) and no selections, no rows at all
    (all weight on the sink: zeros), and selections with holes and an empty tail."""
    g = torch.Generator().manual_seed(2)
    b, window, per, n_blocks, k = 4, 8, 4, 8, 24
    ring = PackedRows(WINDOW_FORMAT, width, (5, window), torch.device("cpu"))
    ring.data[:], _ = ring.pack(torch.randn(5, window, width, generator=g) * 3)
    slots = torch.tensor([1, 3, 0, 4])
    positions = torch.tensor([30, 2, 0, 12])
    ring_positions = torch.full((5, window), -1)
    ring_positions[1, torch.arange(23, 31) % window] = torch.arange(23, 31)
    ring_positions[3] = torch.tensor([0, 1, 2, 13, 14, 15, 16, 17])  # 13..: not yet, stale
    ring_positions[4, torch.arange(5, 13) % window] = torch.arange(5, 13)
    pool = PackedRows(KV_FORMAT, width, (n_blocks + 1, per), torch.device("cpu"))
    pool.data[:n_blocks], _ = pool.pack(torch.randn(n_blocks, per, width, generator=g))
    block_table = torch.stack([torch.randperm(n_blocks, generator=g) for _ in range(b)])
    selected = torch.full((b, k), -1)
    selected[0] = torch.randperm(n_blocks * per, generator=g)[:k]
    selected[3, :14:2] = torch.randperm(n_blocks * per, generator=g)[:7]
    q = torch.randn(b, heads, width, generator=g) * 2
    sink = torch.randn(heads, generator=g)
    sink[:3] = torch.tensor([0.5, 8.0, -40.0])  # one sink that dominates, one that vanishes

    out = sparse_attention(q, sink, ring.data, ring_positions, slots, positions, pool.data,
                           block_table, selected, window, chunk=chunk)

    assert torch.isfinite(out).all()
    expected = attend(q, sink, ring, ring_positions, slots, positions, pool, block_table,
                      selected, window)
    assert torch.all(out[2] == 0)
    for i in range(b):  # sums of up to `width` products, in another order than torch's
        assert torch.allclose(out[i], expected[i], atol=5e-5, rtol=1e-5), i


def test_index_scores_equal_dequantise_then_score():
    """Entries of a ratio-2 stream through a block table, three sequences at positions
    that see different numbers of complete groups (the rest -inf): the kernel's scores
    equal the torch codecs' keys scored head by head."""
    g = torch.Generator().manual_seed(1)
    b, hi, di, per, n_blocks, ratio, n = 3, 2, 64, 8, 5, 2, 70
    pool = PackedRows(INDEX_FORMAT, di, (n_blocks + 1, per), torch.device("cpu"))
    pool.data[:n_blocks], _ = pool.pack(torch.randn(n_blocks, per, di, generator=g))
    block_table = torch.tensor([[3, 0, 4, 1, 2, 5, 5, 5, 5], [1, 5, 5, 5, 5, 5, 5, 5, 5],
                                [4, 3, 2, 1, 0, 5, 5, 5, 5]])  # 5: the null block
    positions = torch.tensor([77, 9, 80])
    q = torch.randn(b, hi, di, generator=g)
    w = torch.randn(b, hi, generator=g)

    out = index_scores(q, w, pool.data, block_table, positions, n, ratio)

    assert_scores_match(out, q, w, pool, block_table, positions, ratio, per)


@pytest.mark.parametrize("run", [None, 7, 40, 1000])
def test_index_scores_in_runs_of_entries(run):
    """Each sequence's entries scored in runs by separate programs (runs of 7, runs that
    end mid-tile, one run of two tiles), at positions that see none, some and all of the
    entries: the same scores as the torch codecs' keys."""
    g = torch.Generator().manual_seed(3)
    b, hi, di, per, n_blocks, ratio, n = 4, 3, 64, 8, 10, 2, 70
    pool = PackedRows(INDEX_FORMAT, di, (n_blocks + 1, per), torch.device("cpu"))
    pool.data[:n_blocks], _ = pool.pack(torch.randn(n_blocks, per, di, generator=g))
    block_table = torch.stack([torch.randperm(n_blocks, generator=g)[:9] for _ in range(b)])
    positions = torch.tensor([77, 0, 150, 20])
    q = torch.randn(b, hi, di, generator=g)
    w = torch.randn(b, hi, generator=g)

    out = index_scores(q, w, pool.data, block_table, positions, n, ratio, run=run)

    assert_scores_match(out, q, w, pool, block_table, positions, ratio, per)


def test_the_plans_fill_a_gpu_and_split_under_the_interpreter():
    """At V4.1-Flash's shapes (64 heads of 512, 128 + 512 rows; 32 index heads of 128)
    on 132 SMs: enough programs for the targets per SM, in whole tiles of rows, down to a
    floor of rows a split; one split where the batch fills the device alone; two under
    the interpreter; a forced chunk as given."""
    chunk, splits, programs = attention_plan(640, 32, 64, 512, 132)
    assert splits > 1 and chunk % 16 == 0 and programs >= ATTENTION_PROGRAMS_PER_SM * 132
    assert attention_plan(640, 1, 64, 512, 132) == (64, 10, 40)  # the floor: 4 tiles
    assert attention_plan(640, 512, 64, 512, 132)[1] == 1
    assert attention_plan(12, 2, 4, 32, None) == (6, 2, 4)
    assert attention_plan(1, 2, 4, 32, None)[1] == 1
    assert attention_plan(32, 2, 3, 128, None, chunk=3) == (3, 11, 22)
    run, runs, programs = index_plan(131072, 32, 32, 128, 132)
    assert runs > 1 and run % 64 == 0 and programs >= INDEX_PROGRAMS_PER_SM * 132
    assert index_plan(10, 1, 32, 128, 132) == (64, 1, 1)
    assert index_plan(70, 3, 2, 32, None) == (35, 2, 6)
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        attention_plan(32, 2, 3, 128, None, chunk=0)


def llm(**settings) -> LLM:
    return LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16, **settings)


def test_decoding_with_the_kernel_gives_the_torch_backends_tokens():
    """The engine's decode steps with attention and index scores by the kernels: a batch
    of two at different positions, every layer mode of the tiny preset, the same greedy
    tokens as torch."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(200, 205))]
    kernel = llm(attention="triton")
    assert kernel.memory_report()["backend"]["attention"] == "triton"
    torch_backend = llm(attention="torch")
    assert torch_backend.memory_report()["backend"]["attention"] == "torch"
    assert ([o.token_ids for o in kernel.generate(prompts, params)]
            == [o.token_ids for o in torch_backend.generate(prompts, params)])


def test_the_kernel_is_refused_where_it_cannot_run(monkeypatch):
    assert llm().memory_report()["backend"]["attention"] == "torch"  # auto, on a CPU
    with pytest.raises(ValueError, match="dense control"):
        LLM("dense-tiny", random_init=True, kv_budget="2MiB", attention="triton")
    with pytest.raises(ValueError, match="window rings"):
        LLM(preset("tiny").replace(window_format="bf16"), random_init=True, kv_budget="2MiB",
            attention="triton")
    with pytest.raises(ValueError, match="choose one"):
        llm(attention="triton", compile_decode=True)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        llm(attention="triton")


def bench_args() -> Namespace:
    return Namespace(preset="tiny", contexts=[200], batch=2, ratio=2, block_entries=16,
                     repeat=1, device="cpu")


def test_the_kernel_benchmark_counts_the_layouts_bytes_and_checks_the_kernels(monkeypatch):
    """bench/sparse_kernels.py at tiny shapes: both kernels timed, the bytes they must move
    counted from the formats, and a kernel whose output is wrong stops the run."""
    _, results = kernel_bench.run(bench_args())
    c = preset("tiny")
    attention, index = results[:2]  # then the weight kernels' rows
    assert (attention.kernel, index.kernel) == ("sparse attention", "index scores")
    k = min(c.index_topk, 100)
    per_sequence = (c.window_size * bytes_per_entry(WINDOW_FORMAT, c.head_dim)
                    + k * bytes_per_entry(KV_FORMAT, c.head_dim)
                    + c.window_size * 8 + k * 8 + 2 * c.n_heads * c.head_dim * 4)
    assert attention.bytes == 2 * per_sequence
    assert index.bytes == 2 * (100 * bytes_per_entry(INDEX_FORMAT, c.index_head_dim)
                               + c.index_n_heads * (c.index_head_dim + 1) * 4 + 100 * 4)
    monkeypatch.setattr(kernel_bench, "sparse_attention",
                        lambda q, *rest: torch.zeros_like(q))
    with pytest.raises(SystemExit, match="sparse attention at context 200: the kernel's "
                                         "output differs"):
        kernel_bench.run(bench_args())


def assert_scores_match(out, q, w, pool, block_table, positions, ratio, per):
    """Each sequence's scores against the torch codecs' keys read through its table: the
    visible entries' within float rounding, the rest -inf."""
    entries = torch.arange(out.shape[1])
    for i in range(out.shape[0]):
        keys = pool.read(pool.data[block_table[i, entries // per], entries % per])  # [n, di]
        expected = ((q[i] @ keys.T).relu() * w[i, :, None]).sum(0)
        visible = entries < (positions[i] + 1) // ratio
        assert torch.allclose(out[i][visible], expected[visible], atol=1e-5, rtol=1e-5), i
        assert torch.all(out[i][~visible] == float("-inf")), i
