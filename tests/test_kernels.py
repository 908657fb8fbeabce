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
    INDEX_FORMAT,
    KV_FORMAT,
    WINDOW_FORMAT,
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

    for i in range(b):
        t, slot = int(positions[i]), int(slots[i])
        seen = (ring_positions[slot] >= 0) & (ring_positions[slot] > t - window)
        keys = [ring.read(ring.data[slot, seen])]
        for e in selected[i][selected[i] >= 0].tolist():
            keys.append(pool.read(pool.data[block_table[i, e // per], e % per])[None])
        rows = torch.cat(keys)  # [n, d]
        logits = torch.cat((q[i] @ rows.T * d**-0.5, sink[:, None]), dim=1)  # [h, n + 1]
        expected = logits.softmax(-1)[:, :-1] @ rows
        assert torch.allclose(out[i], expected, atol=1e-5, rtol=1e-5), i


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

    entries = torch.arange(n)
    for i in range(b):
        keys = pool.read(pool.data[block_table[i, entries // per], entries % per])  # [n, di]
        expected = ((q[i] @ keys.T).relu() * w[i, :, None]).sum(0)
        visible = entries < (positions[i] + 1) // ratio
        assert torch.allclose(out[i][visible], expected[visible], atol=1e-5, rtol=1e-5), i
        assert torch.all(out[i][~visible] == float("-inf")), i


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
    attention, index = results
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
