"""Decode throughput and cache bytes per token of the compressed stack, its dense control
and a Hugging Face Llama, side by side, at long contexts.

For each context length this times batch-1 decode steps of three systems on one CPU-sized
model (the one bench/prefill.py uses): (a) kvstack with the compressed stack, (b) kvstack's
dense control of the same model through the same engine (per-layer GQA keys and values in
bf16), and (c) transformers' `LlamaForCausalLM` of the same width, depth, KV heads and
active FFN width with its default `DynamicCache` in float32. Beside tokens/s it reports the
cache bytes per token: measured from the allocated pools for (a) and (b), from the
DynamicCache's tensors for (c).

(a) and (b) hold their weight matrices in bf16 (`--dtype`, default bfloat16: what kvstack
holds a bf16 checkpoint in by default, and 16-bit weights as llama.cpp's f16 GGUF below),
their activations and the norms, routers and hyper-connections in float32; `--dtype
float32` runs them as built. (c) is float32.

The contexts are synthetic: each system's cache is filled with random values of the right
shapes through its own storage (for kvstack, the store's real quantise-and-pack write path;
for transformers, `DynamicCache.update`), as vLLM's dummy-weight benchmarks do, instead of
prefilling. Prefilling 32K tokens three times would take many minutes on a 2-core CPU, and
a decode step's cost depends on how much cache it reads, not on what the values are.

The numbers that matter are the ratios measured in the same run, (a)/(b) and (a)/(c) for
tokens/s and (b)/(a), (c)/(a) for bytes per token, because the machines are shared and
noisy: absolute tokens/s drift between runs, the ratios much less. So that the drift
within a run falls on every system alike, the systems take turns: each of `--repeat`
rounds times every system for `--steps` steps, and each system keeps its best round.
transformers and matplotlib come with the `bench` extra; without transformers, (c) is
skipped.

With `--batches B [B ...]` it also decodes a batch of B sequences at once, each with
`--batch-context` tokens of context (default 2048), for every B given, and reports the total
tokens/s over the batch (B × steps / time) of the three systems side by side, (a)/(b),
(a)/(c), and each system's scaling from the smallest batch (tokens/s at B over tokens/s at
the smallest B). For (a) and (b) the engine's budget holds exactly B such sequences
(window rings for B and blocks for B sequences) with max_num_seqs=B, and one decode step
is `ModelRunner.decode` on all B sequences; (c) keeps its cache in a `StaticCache` of batch
B (filled with `StaticCache.update`), or in a DynamicCache, labelled so, where the installed
transformers cannot run a StaticCache. Beside tokens/s, at the smallest and the largest
batch, it counts the aten ops one decode step issues: `torch.profiler` (CPU activity)
around one step after the warm-up and the timed steps, counting every event whose name
starts with "aten::", nested ones (an op another op calls) included, and separately the
top-level ones (no aten op above them). The count is what the host dispatches per step,
the overhead that batching amortises; it does not depend on the machine's noise.

With `--torch-ops` the context and batch tables gain (t): (a) with `cpu_kernels="torch"`,
the same engine running torch's ops where (a) runs the C kernels of `kvstack.native`
(packed reads, index scoring, the experts' grouped matmul), so the kernels' gain is a
ratio of one run.

With `--peer llama.cpp` the context tables gain (l): llama.cpp (llama-cpp-python, built by
bench/peers/setup_llamacpp.sh into bench/.peers/llamacpp, skipped with a message where that
venv is missing) decoding (c)'s very Llama: the same random weights saved as an HF
directory with the bundled tokenizer (its first vocab_size ids), converted to GGUF (f16
weights by default, `--gguf-type`) by bench/peers/hf_to_gguf.py, and driven by
bench/peers/llamacpp_decode.py in that venv over a pipe. One row per KV cache type
(`--peer-kv`: f16, q8_0, q4_0) and flash attention setting (`--peer-flash`: on, off);
llama.cpp quantises the V cache only with flash attention on, so q8_0 and q4_0 run with it
on only. Unlike (a), (b) and (c), its context is a real prefill of the context's tokens
(llama.cpp's cache cannot be written from outside); a step is `Llama.eval` of one token and
the argmax of its logits. Its bytes per token are computed, 2 (K and V) × n_layers ×
n_kv_heads × head_dim × the type's bytes per element (f16 2, q8_0 34/32, q4_0 18/32: a
block of 32 values and its f16 scale), and checked against the KV size llama.cpp logs. Its
steps are timed inside the worker (no pipe round trip per step) and take their turn in each
round with the other systems. The row's "(a) ÷ step" is (a)'s step time over llama.cpp's
(below 1: kvstack faster). Threads: with --peer and no `--threads`, torch runs one thread,
and llama.cpp always runs as many as torch (n_threads = n_threads_batch).
"""

import argparse
import dataclasses
import gc
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from prefill import bench_config  # bench/ is on the path: the same model in both
from rich.console import Console
from rich.table import Table

from kvstack import LLM, SamplingParams
from kvstack.cache.layout import CacheLayout, decode_step_reads
from kvstack.cache.paged import PagedSequenceStore, block_bytes
from kvstack.config import ModelConfig, dense_control
from kvstack.engine.sequence import Sequence
from kvstack.model.model import MoE
from kvstack.model.packed import PackedLinear

DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768)
WARMUP_STEPS = 3
BLOCK_TOKENS = 64
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
SKIPPED_HF = "(c) skipped: transformers is not installed (pip install -e '.[bench]')"
PEERS = Path(__file__).resolve().parent / "peers"
LLAMACPP_PYTHON = Path(__file__).resolve().parent / ".peers" / "llamacpp" / "bin" / "python"
# KV cache types llama.cpp's Python binding takes, and their bytes per element: q8_0 and
# q4_0 store blocks of 32 values with one f16 scale (32 + 2 and 16 + 2 bytes).
PEER_KV_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


@dataclass(frozen=True)
class PeerMeasured:
    name: str  # e.g. "llama.cpp q8_0 KV, FA on"
    type_k: str
    type_v: str
    flash_attn: bool
    tok_s: float
    bytes_per_token: float  # computed from the shape and the type
    logged_bytes_per_token: float | None  # llama.cpp's own KV size over its cells
    prefill_s: float  # the real prefill that filled the context (not timed as decode)
    stack_step_over_peer_step: float  # (a)'s step time ÷ this system's


@dataclass(frozen=True)
class Measured:
    tok_s: float
    bytes_per_token: float


@dataclass(frozen=True)
class OpCount:
    aten_ops: int  # every aten:: event of one step, nested ones included
    top_level_ops: int  # the aten:: events with no aten:: event above them
    # The top-level ops' own time over the profiled step's wall time: the rest of a step
    # is the host's Python and dispatch between ops.
    in_ops: float = 0.0


@dataclass(frozen=True)
class Row:
    context: int
    stack_tok_s: float
    dense_tok_s: float
    hf_tok_s: float | None
    stack_bytes_per_token: float
    dense_bytes_per_token: float
    hf_bytes_per_token: float | None
    speedup_vs_dense: float  # (a)/(b) tokens/s
    speedup_vs_hf: float | None  # (a)/(c) tokens/s
    bytes_saving_vs_dense: float  # (b)/(a) bytes per token
    bytes_saving_vs_hf: float | None  # (c)/(a) bytes per token
    compiled_tok_s: float | None = None  # (a') with --compile
    compiled_speedup_vs_eager: float | None = None  # (a')/(a) tokens/s
    compiled_speedup_vs_hf: float | None = None  # (a')/(c) tokens/s
    stack_floor_bytes: int = 0  # what one step must read: weights used and cache
    hf_floor_bytes: int | None = None
    torch_ops_tok_s: float | None = None  # (t) with --torch-ops
    c_kernels_speedup: float | None = None  # (a)/(t) tokens/s
    peers: tuple[PeerMeasured, ...] = ()  # (l) with --peer llama.cpp
    stack_ops: OpCount | None = None  # one step of (a), counted after the timed ones
    dense_ops: OpCount | None = None


@dataclass(frozen=True)
class BatchMeasured:
    tok_s: float  # total over the batch: batch × steps / time
    ops: OpCount | None  # counted at the smallest and the largest batch only


@dataclass(frozen=True)
class BatchRow:
    batch: int
    context: int  # tokens of context of each sequence
    stack_tok_s: float
    dense_tok_s: float
    hf_tok_s: float | None
    hf_cache: str | None  # "StaticCache", or "DynamicCache" where StaticCache failed
    speedup_vs_dense: float  # (a)/(b) tokens/s
    speedup_vs_hf: float | None  # (a)/(c) tokens/s
    stack_scaling: float  # tokens/s at this batch over tokens/s at the smallest batch
    dense_scaling: float
    hf_scaling: float | None
    stack_aten_ops: int | None  # per decode step; None where not counted
    dense_aten_ops: int | None
    hf_aten_ops: int | None
    stack_top_level_ops: int | None
    dense_top_level_ops: int | None
    hf_top_level_ops: int | None
    compiled_tok_s: float | None = None  # (a') with --compile
    compiled_speedup_vs_hf: float | None = None
    compiled_aten_ops: int | None = None
    compiled_top_level_ops: int | None = None
    torch_ops_tok_s: float | None = None  # (t) with --torch-ops
    torch_ops_aten_ops: int | None = None
    torch_ops_top_level_ops: int | None = None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS),
                        help="context lengths in tokens")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs; the best is kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--plot", default="bench/decode.png", help="where to write the PNG")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="also decode batches of these sizes at --batch-context")
    parser.add_argument("--batch-context", type=int, default=2048,
                        help="tokens of context of each sequence of a batch")
    parser.add_argument("--compile", action="store_true",
                        help="also measure (a') = (a) with compile_decode (torch.compile)")
    parser.add_argument("--torch-ops", action="store_true",
                        help="also measure (t) = (a) with cpu_kernels='torch': torch's ops "
                             "where (a) runs the C kernels (kvstack.native)")
    parser.add_argument("--layer-contexts", type=int, nargs="+", default=None,
                        help="also time each layer of (a)'s decode step at these contexts")
    parser.add_argument("--peer", choices=["llama.cpp"], action="append", default=[],
                        help="also measure llama.cpp (bench/peers/setup_llamacpp.sh) on (c)'s "
                             "Llama")
    parser.add_argument("--peer-kv", nargs="+", choices=sorted(PEER_KV_BYTES),
                        default=["f16", "q8_0", "q4_0"],
                        help="llama.cpp KV cache types (type_k = type_v)")
    parser.add_argument("--peer-flash", nargs="+", choices=["on", "off"], default=["off", "on"],
                        help="llama.cpp flash attention settings")
    parser.add_argument("--gguf-type", choices=["f16", "f32"], default="f16",
                        help="llama.cpp's weight type")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="(a) and (b)'s weight matrices (EngineConfig.dtype): bfloat16, "
                             "16-bit weights as llama.cpp's f16 GGUF and as kvstack holds a "
                             "bf16 checkpoint by default; activations float32 either way")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (and llama.cpp's); default torch's, or 1 with --peer")
    args = parser.parse_args()
    # Even contexts: the ratio-2 streams then hold whole groups and no partial one.
    if min(args.contexts) <= 0 or any(c % 2 for c in args.contexts):
        parser.error("--contexts must be positive and even")
    if args.steps < 1 or args.repeat < 1:
        parser.error("--steps and --repeat must be at least 1")
    if args.batches is not None:
        if min(args.batches) < 1:
            parser.error("--batches must be at least 1")
        args.batches = sorted(set(args.batches))
    if args.batch_context <= 0 or args.batch_context % 2:
        parser.error("--batch-context must be positive and even")
    if args.layer_contexts is not None:
        if min(args.layer_contexts) <= 0 or any(c % 2 for c in args.layer_contexts):
            parser.error("--layer-contexts must be positive and even")
        args.layer_contexts = sorted(set(args.layer_contexts))
    return args


def time_interleaved(systems: dict[str, Callable[[], None]], steps: int,
                     repeat: int,
                     blocks: dict[str, Callable[[int], float]] | None = None
                     ) -> dict[str, float]:
    """Decode steps/s of each system: warm-up steps of each first (lazy initialisation,
    allocator growth, a compiled step's compile), then `repeat` rounds in which each system
    runs `steps` steps in turn, and each system's best round (its least disturbed one).
    Interleaved, a change in the machine's load between rounds reaches every system alike:
    timed one after another, each system had its own stretch of a shared machine, and a
    peer's figure moved by a third between runs while the ratio rode on it.

    `blocks` are systems in another process that run and time n steps themselves (the
    seconds they return), so a pipe round trip per step does not count against them."""
    blocks = blocks or {}
    for step in systems.values():
        for _ in range(WARMUP_STEPS):
            step()
    for block in blocks.values():
        block(WARMUP_STEPS)
    best = dict.fromkeys([*systems, *blocks], float("inf"))
    for _ in range(repeat):
        for name, step in systems.items():
            start = time.perf_counter()
            for _ in range(steps):
                step()
            best[name] = min(best[name], time.perf_counter() - start)
        for name, block in blocks.items():
            best[name] = min(best[name], block(steps))
    return {name: steps / seconds for name, seconds in best.items()}


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: kineto prints a line to it at every profiler start
    and stop, whatever its log level."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def count_ops(step: Callable[[], None]) -> OpCount:
    """The aten ops one step issues, from torch.profiler's CPU events: all of them (an op
    another op calls included), and the top-level ones (no aten op above them)."""
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        step()
        wall = time.perf_counter() - started
    aten = [e for e in prof.events() if e.name.startswith("aten::")]

    def top_level(event: Any) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    top = [e for e in aten if top_level(e)]
    return OpCount(len(aten), len(top), sum(e.cpu_time_total for e in top) / 1e6 / wall)


# ---- (a) and (b): kvstack's engine ---------------------------------------------------------
def engine(config: ModelConfig, max_tokens: int, dtype: str, batch: int = 1,
           compile_decode: bool = False, cpu_kernels: str = "auto") -> LLM:
    """An LLM whose budget holds `batch` sequences of max_tokens and nothing more (a
    window-ring slot and the blocks of each, and a compiled step's pad slot; no window
    checkpoints, as it makes no prefix hits), so the benchmark allocates what it uses; its
    weight matrices in dtype (EngineConfig.dtype)."""
    layout = CacheLayout.from_config(config)
    budget = ((batch + compile_decode) * layout.window_bytes_per_sequence
              + batch * block_bytes(layout, BLOCK_TOKENS) * -(-max_tokens // BLOCK_TOKENS))
    return LLM(config, random_init=True, kv_budget=budget, max_num_seqs=batch,
               block_tokens=BLOCK_TOKENS, compile_decode=compile_decode,
               cpu_kernels=cpu_kernels, window_checkpoints=0, dtype=dtype)


def fill(store: PagedSequenceStore, config: ModelConfig, context: int,
         g: torch.Generator) -> list[int]:
    """Put `context` tokens of random cache into the store through its real write path
    (quantise, pack, place in its blocks): every stream of the layout ("kv" and "index"
    per kv source, or the dense control's "k" and "v" per layer) and the window rings over
    the last window_size positions. Returns the token ids it recorded."""
    layout = store.pools.layout
    if not store.reserve(context + 1):
        raise RuntimeError(f"the cache pools cannot hold {context + 1} tokens")
    ids = torch.randint(0, config.vocab_size, (1, context), generator=g)
    store.append_tokens(ids)
    for layer in sorted({s.layer for s in layout.streams}):
        store.append_stream(layer, {
            s.kind: torch.randn(1, context // s.ratio, s.width, generator=g)
            for s in layout.streams if s.layer == layer})
    for ring in layout.window_rings:
        n = min(ring.slots, context)
        store.write_window(ring.layer, torch.randn(1, n, ring.width, generator=g), context - n)
    return ids[0].tolist()


@contextmanager
def engine_step(llm: LLM, context: int, batch: int = 1) -> Iterator[Callable[[], None]]:
    """One decode step of `batch` sequences of `context` tokens each, as one batch of the
    engine; the sequences are closed on exit."""
    stores = [llm.cache.open_sequence() for _ in range(batch)]
    try:
        greedy = SamplingParams(temperature=0, ignore_eos=True)
        seqs = []
        for i, store in enumerate(stores):
            ids = fill(store, llm.config, context, torch.Generator().manual_seed(context + i))
            # ModelRunner.decode feeds output_ids[-1]: seed it with the context's last token.
            seqs.append(Sequence(f"bench-{i}", ids, greedy, output_ids=[ids[-1]], store=store))

        def step() -> None:
            for seq in seqs:
                if not seq.store.reserve(seq.num_tokens):
                    raise RuntimeError("the cache pools are full")
            for seq, sample in zip(seqs, llm.runner.decode(seqs), strict=True):
                seq.output_ids.append(sample.token)

        yield step
    finally:
        for store in stores:
            llm.cache.close_sequence(store)


def measure_layers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each layer's share of (a)'s batch-1 decode step at every --layer-contexts length:
    the median over the timed steps of the wall time between the layer's forward pre-hook
    and its forward hook (a CPU runs the step synchronously, so that is the layer's own
    time). Rows: layer, mode, ms per context, the longest context's ms over the shortest's."""
    contexts = args.layer_contexts
    max_tokens = max(contexts) + max(64, 1 + WARMUP_STEPS + args.steps)
    config = bench_config(max_tokens)
    llm = engine(config, max_tokens, args.dtype)
    layers = llm.model.layers
    spent: list[list[float]] = [[] for _ in layers]
    started = [0.0]

    def before(*_: Any) -> None:
        started[0] = time.perf_counter()

    def after(layer: int) -> Callable[..., None]:
        return lambda *_: spent[layer].append(time.perf_counter() - started[0])

    hooks = [h for i, block in enumerate(layers)
             for h in (block.register_forward_pre_hook(before),
                       block.register_forward_hook(after(i)))]
    ms: dict[int, list[float]] = {}
    try:
        for context in contexts:
            store = llm.cache.open_sequence()
            try:
                ids = fill(store, config, context, torch.Generator().manual_seed(context))
                seq = Sequence("layers", ids, SamplingParams(temperature=0, ignore_eos=True),
                               output_ids=[ids[-1]], store=store)
                for i in range(WARMUP_STEPS + args.steps):
                    if i == WARMUP_STEPS:
                        for times in spent:
                            times.clear()
                    if not store.reserve(seq.num_tokens):
                        raise RuntimeError("the cache pools are full")
                    seq.output_ids.append(llm.runner.decode([seq])[0].token)
            finally:
                llm.cache.close_sequence(store)
            ms[context] = [1e3 * sorted(t)[len(t) // 2] for t in spent]
    finally:
        for h in hooks:
            h.remove()
    def mode(spec: Any) -> str:
        return spec.mode.value + (" in pool" if spec.uses_candidates and spec.ratio else "")

    return [{"layer": i, "mode": mode(config.layers[i]),
             "ms": {c: ms[c][i] for c in contexts},
             "growth": ms[contexts[-1]][i] / ms[contexts[0]][i]} for i in range(len(layers))]


def render_layers(console: Console, rows: list[dict[str, Any]], steps: int) -> None:
    contexts = list(rows[0]["ms"])
    table = Table(title="(a)'s decode step per layer, batch 1")
    table.add_column("layer", justify="right")
    table.add_column("mode")
    for c in contexts:
        table.add_column(f"ms @ {c // 1024}K" if c >= 1024 else f"ms @ {c}", justify="right")
    table.add_column(f"{contexts[-1] // 1024}K ÷ {contexts[0] // 1024}K", justify="right")
    for r in rows:
        table.add_row(str(r["layer"]), r["mode"], *(f"{r['ms'][c]:.2f}" for c in contexts),
                      f"{r['growth']:.2f}×")
    console.print(table)
    console.print(f"median over {steps} steps after {WARMUP_STEPS} warm-up of each layer's "
                  f"forward (pre-hook to hook); torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads")


# ---- the floor: bytes a step must read, at the machine's copy bandwidth ----------------
def copy_bandwidth(repeat: int = 5) -> float:
    """Bytes read per second by a copy of 256 MiB of float32 (best of `repeat`): what one
    thread streams from memory here, measured in the same run as the steps."""
    src = torch.ones(1 << 26)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return src.nbytes / best


def weight_reads(model: torch.nn.Module, embedding: torch.nn.Embedding) -> int:
    """Weight bytes one batch-1 decode step reads, in the dtype they are held in: every
    parameter and bf16 matrix (a `PackedLinear`'s), except that the embedding gives one
    row and each MoE layer runs only its activated routed experts."""
    total = sum(p.nbytes for p in model.parameters()) + sum(
        m.stored.nbytes for m in model.modules() if isinstance(m, PackedLinear))
    total -= embedding.weight.nbytes - embedding.weight[0].nbytes
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        routed = sum(w.nbytes for w in moe.experts.parameters())
        total -= routed * (1 - moe.gate.config.n_activated_experts / len(moe.experts.w1))
    return int(total)


def hf_reads(model: Any, context: int) -> int:
    """The same for the Llama: its weights (one embedding row) and every key and value of
    its float32 cache."""
    hf = model.config
    weights = sum(p.nbytes for p in model.parameters())
    embed = model.get_input_embeddings().weight
    kv = 2 * hf.num_hidden_layers * hf.num_key_value_heads * hf.head_dim * context * 4
    return weights - embed.nbytes + embed[0].nbytes + kv


def render_floor(console: Console, rows: list[Row], bandwidth: float) -> None:
    table = Table(title="bytes one batch-1 decode step must read, against its time")
    table.add_column("context", justify="right")
    for name in ("(a) MB", "floor ms", "(a) ms", "×floor", "(a') ms", "×floor",
                 "(c) MB", "floor ms", "(c) ms", "×floor"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        floor = r.stack_floor_bytes / bandwidth * 1e3
        cells = [f"{r.context // 1024}K" if r.context >= 1024 else str(r.context),
                 f"{r.stack_floor_bytes / 1e6:.1f}", f"{floor:.2f}",
                 f"{1e3 / r.stack_tok_s:.1f}", f"{1e3 / r.stack_tok_s / floor:.1f}×"]
        if r.compiled_tok_s is not None:
            cells += [f"{1e3 / r.compiled_tok_s:.1f}", f"{1e3 / r.compiled_tok_s / floor:.1f}×"]
        else:
            cells += ["", ""]
        if r.hf_tok_s is not None and r.hf_floor_bytes is not None:
            hf_floor = r.hf_floor_bytes / bandwidth * 1e3
            cells += [f"{r.hf_floor_bytes / 1e6:.1f}", f"{hf_floor:.2f}",
                      f"{1e3 / r.hf_tok_s:.1f}", f"{1e3 / r.hf_tok_s / hf_floor:.1f}×"]
        table.add_row(*cells)
    console.print(table)
    console.print(f"floor ms = MB / {bandwidth / 1e9:.1f} GB/s, the bytes a copy of 256 MiB "
                  "reads per second on this thread, measured in this run. (a)'s MB: the "
                  "weights used, as held (one embedding row, the activated experts) and the "
                  "cache "
                  "it must read (kvstack.cache.layout.decode_step_reads); (c)'s: its "
                  "weights and its whole float32 KV cache. ×floor = measured ms / floor ms")


# ---- (c): transformers' Llama --------------------------------------------------------------
def hf_model(config: ModelConfig, max_tokens: int) -> Any:
    """LlamaForCausalLM as wide and deep as the model, with the dense control's KV heads
    and the MoE's active FFN width (routed plus shared experts), random init, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=dense_control(config).n_kv_heads, head_dim=config.head_dim,
        intermediate_size=config.moe_inter_dim * (
            config.n_activated_experts + config.n_shared_experts),
        max_position_embeddings=max_tokens,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(hf_config).to(torch.float32).eval()


def hf_step(model: Any, context: int) -> tuple[Callable[[], None], float]:
    """One batch-1 decode step of the Llama after `context` tokens of random cache in a
    DynamicCache, and the cache's bytes per token."""
    from transformers import DynamicCache

    hf = model.config
    g = torch.Generator().manual_seed(context)
    cache = DynamicCache()
    nbytes = 0
    shape = (1, hf.num_key_value_heads, context, hf.head_dim)
    for layer in range(hf.num_hidden_layers):
        keys, values = cache.update(torch.randn(*shape, generator=g),
                                    torch.randn(*shape, generator=g), layer)
        nbytes += keys.nbytes + values.nbytes
    # transformers 5 renamed past_key_values to cache and dropped cache_position.
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    token = torch.randint(0, hf.vocab_size, (1, 1), generator=g)

    def step() -> None:
        nonlocal token
        position = cache.get_seq_length()
        extra = ({"cache_position": torch.tensor([position])}
                 if "cache_position" in params else {})
        with torch.no_grad():
            out = model(input_ids=token, position_ids=torch.tensor([[position]]),
                        use_cache=True, **{cache_arg: cache}, **extra)
        token = out.logits[:, -1].argmax(-1, keepdim=True)

    return step, nbytes / context


def hf_batch_cache(model: Any, batch: int, context: int, max_cache_len: int,
                   static: bool) -> Any:
    """A StaticCache (static=True) or a DynamicCache of `batch` sequences, each holding
    `context` tokens of random keys and values in every layer."""
    from transformers import DynamicCache, StaticCache

    hf = model.config
    if static:
        # transformers 4 took the batch size, device and dtype up front; 5 allocates on the
        # first update, from the tensors it is given.
        params = inspect.signature(StaticCache.__init__).parameters
        extra = ({"max_batch_size": batch, "dtype": torch.float32, "device": "cpu"}
                 if "max_batch_size" in params else {})
        cache = StaticCache(config=hf, max_cache_len=max_cache_len, **extra)
    else:
        cache = DynamicCache()
    g = torch.Generator().manual_seed(context)
    shape = (batch, hf.num_key_value_heads, context, hf.head_dim)
    # transformers 4's StaticCache writes at cache_position; 5's ignores it.
    where = {"cache_position": torch.arange(context)}
    for layer in range(hf.num_hidden_layers):
        cache.update(torch.randn(*shape, generator=g), torch.randn(*shape, generator=g), layer,
                     where)
    return cache


def hf_decode_step(model: Any, cache: Any, batch: int, context: int) -> Callable[[], None]:
    """One batched greedy decode step of the Llama on `cache`, all sequences at the same
    position (the next after `context`, and on)."""
    hf = model.config
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    token = torch.randint(0, hf.vocab_size, (batch, 1),
                          generator=torch.Generator().manual_seed(context))
    position = context

    def step() -> None:
        nonlocal token, position
        extra = ({"cache_position": torch.tensor([position])}
                 if "cache_position" in params else {})
        with torch.no_grad():
            out = model(input_ids=token, position_ids=torch.full((batch, 1), position),
                        use_cache=True, **{cache_arg: cache}, **extra)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        position += 1

    return step


def static_cache_works(model: Any, context: int) -> str | None:
    """None if a StaticCache decodes what a DynamicCache of the same contents does (two
    sequences, two steps, same next tokens and close logits); else why not."""
    try:
        logits = []
        for static in (True, False):
            cache = hf_batch_cache(model, 2, context, context + 2, static)
            step = hf_decode_step(model, cache, 2, context)
            step()
            params = inspect.signature(model.forward).parameters
            cache_arg = "cache" if "cache" in params else "past_key_values"
            extra = ({"cache_position": torch.tensor([context + 1])}
                     if "cache_position" in params else {})
            token = torch.zeros(2, 1, dtype=torch.long)
            with torch.no_grad():
                out = model(input_ids=token, position_ids=torch.full((2, 1), context + 1),
                            use_cache=True, **{cache_arg: cache}, **extra)
            logits.append(out.logits[:, -1])
    except Exception as e:  # any failure of the StaticCache path: fall back
        return f"{type(e).__name__}: {e}"
    if not torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4):
        diff = (logits[0] - logits[1]).abs().max().item()
        return f"its logits differ from DynamicCache's by up to {diff:.3g}"
    return None


def batch_rows(batches: list[int], context: int,
               a: dict[int, BatchMeasured], b: dict[int, BatchMeasured],
               c: dict[int, BatchMeasured] | None, hf_cache: str | None) -> list[BatchRow]:
    base = batches[0]

    def ops(m: BatchMeasured | None, field: str) -> int | None:
        return None if m is None or m.ops is None else getattr(m.ops, field)

    rows = []
    for n in batches:
        cn = None if c is None else c[n]
        rows.append(BatchRow(
            batch=n, context=context,
            stack_tok_s=a[n].tok_s, dense_tok_s=b[n].tok_s,
            hf_tok_s=None if cn is None else cn.tok_s, hf_cache=hf_cache,
            speedup_vs_dense=a[n].tok_s / b[n].tok_s,
            speedup_vs_hf=None if cn is None else a[n].tok_s / cn.tok_s,
            stack_scaling=a[n].tok_s / a[base].tok_s,
            dense_scaling=b[n].tok_s / b[base].tok_s,
            hf_scaling=None if c is None else cn.tok_s / c[base].tok_s,
            stack_aten_ops=ops(a[n], "aten_ops"), dense_aten_ops=ops(b[n], "aten_ops"),
            hf_aten_ops=ops(cn, "aten_ops"),
            stack_top_level_ops=ops(a[n], "top_level_ops"),
            dense_top_level_ops=ops(b[n], "top_level_ops"),
            hf_top_level_ops=ops(cn, "top_level_ops"),
        ))
    return rows


def measure_batches(args: argparse.Namespace) -> tuple[list[BatchRow], list[str]]:
    """The batch axis: rows, and lines to print about it (a StaticCache fallback). At each
    batch size the systems are timed interleaved (`time_interleaved`)."""
    context = args.batch_context
    # The warm-up, the timed steps and the profiled one, past the context.
    extra = 1 + WARMUP_STEPS + args.steps * args.repeat + 1
    max_tokens = context + max(64, extra)
    config = bench_config(max_tokens)
    dense = dense_control(config)
    counted = {args.batches[0], args.batches[-1]}
    notes, llama, hf_cache = [], None, None
    if HAVE_TRANSFORMERS:
        llama = hf_model(config, max_tokens)
        failure = static_cache_works(llama, context)
        hf_cache = "StaticCache" if failure is None else "DynamicCache"
        if failure is not None:
            notes.append(f"(c) StaticCache did not work ({failure}); (c) of the batch table "
                         "uses a DynamicCache instead")
    measured: dict[str, dict[int, BatchMeasured]] = {}
    for n in args.batches:
        with ExitStack() as open_steps:
            def engine_batch(c: ModelConfig, compiled: bool = False, kernels: str = "auto",
                             n: int = n) -> Callable[[], None]:
                return open_steps.enter_context(
                    engine_step(engine(c, max_tokens, args.dtype, n, compiled, kernels),
                                context, n))

            systems = {"a": engine_batch(config)}
            if args.compile:
                systems["a'"] = engine_batch(config, compiled=True)
            if args.torch_ops:
                systems["t"] = engine_batch(config, kernels="torch")
            systems["b"] = engine_batch(dense)
            if llama is not None:
                # A StaticCache attends over all its slots (masked): size it to what is used.
                cache = hf_batch_cache(llama, n, context, context + extra,
                                       hf_cache == "StaticCache")
                systems["c"] = hf_decode_step(llama, cache, n, context)
            tok_s = time_interleaved(systems, args.steps, args.repeat)
            for name, step in systems.items():
                measured.setdefault(name, {})[n] = BatchMeasured(
                    n * tok_s[name], count_ops(step) if n in counted else None)
        gc.collect()
    rows = batch_rows(args.batches, context, measured["a"], measured["b"], measured.get("c"),
                      hf_cache)
    if args.compile:
        rows = [with_compiled_batch(r, measured["a'"][r.batch]) for r in rows]
    if args.torch_ops:
        rows = [dataclasses.replace(
            r, torch_ops_tok_s=(m := measured["t"][r.batch]).tok_s,
            torch_ops_aten_ops=None if m.ops is None else m.ops.aten_ops,
            torch_ops_top_level_ops=None if m.ops is None else m.ops.top_level_ops)
            for r in rows]
    return rows, notes


def with_compiled_batch(r: BatchRow, m: BatchMeasured) -> BatchRow:
    return dataclasses.replace(
        r, compiled_tok_s=m.tok_s,
        compiled_speedup_vs_hf=None if r.hf_tok_s is None else m.tok_s / r.hf_tok_s,
        compiled_aten_ops=None if m.ops is None else m.ops.aten_ops,
        compiled_top_level_ops=None if m.ops is None else m.ops.top_level_ops)


# ---- (l): llama.cpp, in its own venv -------------------------------------------------------
def peer_specs(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """The llama.cpp systems to run, and notes on the combinations left out."""
    specs, notes = [], []
    for kv in args.peer_kv:
        for flash in args.peer_flash:
            if flash == "off" and kv not in ("f16", "f32"):
                notes.append(f"llama.cpp {kv} KV with FA off left out: llama.cpp quantises "
                             "the V cache only with flash attention on")
                continue
            specs.append({"name": f"llama.cpp {kv} KV, FA {flash}", "type_k": kv,
                          "type_v": kv, "flash_attn": flash == "on"})
    return specs, notes


class LlamaCpp:
    """(c)'s Llama in llama.cpp: written as an HF directory, converted to GGUF, and decoded
    by bench/peers/llamacpp_decode.py in the llama.cpp venv, a JSON line a request."""

    def __init__(self, llama: Any, gguf_type: str, threads: int, log: Path) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="kvstack-llamacpp-")
        hf_dir, gguf = Path(self.tmp.name) / "hf", Path(self.tmp.name) / "model.gguf"
        llama.save_pretrained(hf_dir)
        # The bundled tokenizer; the converter keeps its first vocab_size ids (a closed
        # BPE: every merge's parts have lower ids than its result).
        from kvstack.engine.loading import bundled_model

        (hf_dir / "tokenizer.json").write_bytes((bundled_model() / "tokenizer.json")
                                                .read_bytes())
        subprocess.run([str(LLAMACPP_PYTHON), str(PEERS / "hf_to_gguf.py"), str(hf_dir),
                        str(gguf), "--outtype", gguf_type], check=True,
                       stdout=subprocess.DEVNULL)
        self.log = log.open("w")
        # OMP_NUM_THREADS too: ggml's CPU backend is built with OpenMP.
        env = os.environ | {"OMP_NUM_THREADS": str(threads)}
        self.process = subprocess.Popen(
            [str(LLAMACPP_PYTHON), str(PEERS / "llamacpp_decode.py"), "--model", str(gguf),
             "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, env=env)
        hello = self.request(None)
        self.version, self.system_info = hello["llama_cpp"], hello["system_info"]

    def request(self, msg: dict[str, Any] | None) -> dict[str, Any]:
        if msg is not None:
            self.process.stdin.write(json.dumps(msg) + "\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker exited; its log: {self.log.name} "
                               "(is bench/peers/setup_llamacpp.sh's build finished?)")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"llama.cpp: {reply['error']}\n{reply.get('log_tail', '')}")
        return reply

    def open(self, context: int, n_ctx: int,
             specs: list[dict[str, Any]]) -> tuple[dict[str, Callable[[int], float]],
                                                  dict[str, Any]]:
        """Prefill `context` tokens into one llama.cpp context per spec; returns a block
        timer per spec (n steps -> seconds, timed in the worker) and what `open` told."""
        opened = self.request({"op": "open", "context": context, "n_ctx": n_ctx,
                               "systems": specs})["systems"]

        def block(name: str) -> Callable[[int], float]:
            return lambda n: self.request({"op": "steps", "name": name, "steps": n})["seconds"]

        return {s["name"]: block(s["name"]) for s in specs}, opened

    def close_contexts(self) -> None:
        self.request({"op": "close"})

    def quit(self) -> None:
        try:
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.close()
            self.process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
        self.log.close()
        self.tmp.cleanup()


def peer_row(spec: dict[str, Any], tok_s: float, stack_tok_s: float, opened: dict[str, Any],
             config: ModelConfig) -> PeerMeasured:
    dense = dense_control(config)
    kv_log = opened.get("kv_log")
    return PeerMeasured(
        name=spec["name"], type_k=spec["type_k"], type_v=spec["type_v"],
        flash_attn=spec["flash_attn"], tok_s=tok_s,
        bytes_per_token=config.n_layers * dense.n_kv_heads * config.head_dim
        * (PEER_KV_BYTES[spec["type_k"]] + PEER_KV_BYTES[spec["type_v"]]),
        logged_bytes_per_token=None if kv_log is None else kv_log["bytes_per_token"],
        prefill_s=opened["prefill_s"], stack_step_over_peer_step=tok_s / stack_tok_s)


# ---- report ----------------------------------------------------------------------------------
def row(context: int, a: Measured, b: Measured, c: Measured | None) -> Row:
    return Row(
        context=context,
        stack_tok_s=a.tok_s, dense_tok_s=b.tok_s, hf_tok_s=None if c is None else c.tok_s,
        stack_bytes_per_token=a.bytes_per_token, dense_bytes_per_token=b.bytes_per_token,
        hf_bytes_per_token=None if c is None else c.bytes_per_token,
        speedup_vs_dense=a.tok_s / b.tok_s,
        speedup_vs_hf=None if c is None else a.tok_s / c.tok_s,
        bytes_saving_vs_dense=b.bytes_per_token / a.bytes_per_token,
        bytes_saving_vs_hf=None if c is None else c.bytes_per_token / a.bytes_per_token,
    )


def render(console: Console, r: Row) -> None:
    table = Table(title=f"decode at {r.context:,} tokens of context")
    table.add_column("system", no_wrap=True)
    # Short headers, explained in the caption printed after the tables.
    for name in ("tok/s", "B/token", "(a) ×tok/s", "÷B/token"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("ops/step", justify="right", no_wrap=True)
    table.add_column("in ops", justify="right", no_wrap=True)
    if r.peers:
        table.add_column("(a) ÷ step", justify="right", no_wrap=True)

    def ops(m: OpCount | None) -> tuple[str, str]:
        return ("", "") if m is None else (f"{m.top_level_ops:,}", f"{m.in_ops:.0%}")

    table.add_row("(a) kvstack stack", f"{r.stack_tok_s:.1f}",
                  f"{r.stack_bytes_per_token:,.1f}", "", "", *ops(r.stack_ops))
    table.add_row("(b) dense control", f"{r.dense_tok_s:.1f}",
                  f"{r.dense_bytes_per_token:,.1f}", f"{r.speedup_vs_dense:.2f}×",
                  f"{r.bytes_saving_vs_dense:.2f}×", *ops(r.dense_ops))
    if r.hf_tok_s is not None:
        table.add_row("(c) HF Llama", f"{r.hf_tok_s:.1f}", f"{r.hf_bytes_per_token:,.1f}",
                      f"{r.speedup_vs_hf:.2f}×", f"{r.bytes_saving_vs_hf:.2f}×")
    if r.compiled_tok_s is not None:
        vs_hf = "" if r.compiled_speedup_vs_hf is None else f"; {r.compiled_speedup_vs_hf:.2f}× (c)"
        table.add_row("(a') stack, compiled", f"{r.compiled_tok_s:.1f}",
                      f"{r.stack_bytes_per_token:,.1f}", f"{1 / r.compiled_speedup_vs_eager:.2f}×",
                      "")
        table.caption = f"(a') = {r.compiled_speedup_vs_eager:.2f}× (a){vs_hf}"
    if r.torch_ops_tok_s is not None:
        table.add_row("(t) stack, torch's ops", f"{r.torch_ops_tok_s:.1f}",
                      f"{r.stack_bytes_per_token:,.1f}", f"{r.c_kernels_speedup:.2f}×", "")
    for p in r.peers:
        table.add_row(f"(l) {p.name}", f"{p.tok_s:.1f}", f"{p.bytes_per_token:,.1f}",
                      f"{r.stack_tok_s / p.tok_s:.2f}×",
                      f"{p.bytes_per_token / r.stack_bytes_per_token:.2f}×", "", "",
                      f"{p.stack_step_over_peer_step:.2f}")
    console.print(table)


def render_batch(console: Console, r: BatchRow, base: int) -> None:
    title = f"decode at batch {r.batch}, {r.context:,} tokens of context each"
    table = Table(title=title + (f"; (c) with a {r.hf_cache}" if r.hf_cache else ""))
    table.add_column("system", no_wrap=True)
    for name in ("tok/s", "(a) ×tok/s", f"÷B={base}", "ops/step", "top-level"):
        table.add_column(name, justify="right", no_wrap=True)

    def ops(n: int | None) -> str:
        return "" if n is None else f"{n:,}"

    table.add_row("(a) kvstack stack", f"{r.stack_tok_s:.1f}", "", f"{r.stack_scaling:.2f}×",
                  ops(r.stack_aten_ops), ops(r.stack_top_level_ops))
    table.add_row("(b) dense control", f"{r.dense_tok_s:.1f}", f"{r.speedup_vs_dense:.2f}×",
                  f"{r.dense_scaling:.2f}×", ops(r.dense_aten_ops), ops(r.dense_top_level_ops))
    if r.hf_tok_s is not None:
        table.add_row("(c) HF Llama", f"{r.hf_tok_s:.1f}",
                      f"{r.speedup_vs_hf:.2f}×", f"{r.hf_scaling:.2f}×", ops(r.hf_aten_ops),
                      ops(r.hf_top_level_ops))
    if r.compiled_tok_s is not None:
        table.add_row("(a') stack, compiled", f"{r.compiled_tok_s:.1f}",
                      f"{r.stack_tok_s / r.compiled_tok_s:.2f}×", "",
                      ops(r.compiled_aten_ops), ops(r.compiled_top_level_ops))
        if r.compiled_speedup_vs_hf is not None:
            table.caption = f"(a') = {r.compiled_speedup_vs_hf:.2f}× (c)"
    if r.torch_ops_tok_s is not None:
        table.add_row("(t) stack, torch's ops", f"{r.torch_ops_tok_s:.1f}",
                      f"{r.stack_tok_s / r.torch_ops_tok_s:.2f}×", "",
                      ops(r.torch_ops_aten_ops), ops(r.torch_ops_top_level_ops))
    console.print(table)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a benchmark machine
    import matplotlib.pyplot as plt

    contexts = [r.context for r in rows]
    series = [("(a) kvstack stack", "stack"), ("(b) dense control", "dense"),
              ("(c) HF Llama", "hf")]
    fig, (speed, size) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, key in series:
        tok_s = [getattr(r, f"{key}_tok_s") for r in rows]
        if tok_s[0] is None:
            continue
        speed.plot(contexts, tok_s, marker="o", label=label)
        size.plot(contexts, [getattr(r, f"{key}_bytes_per_token") for r in rows], marker="o",
                  label=label)
    speed.set(title="decode tokens/s (batch 1)", xlabel="context (tokens)", ylabel="tokens/s",
              xscale="log", ylim=(0, None))
    size.set(title="cache bytes per token", xlabel="context (tokens)", ylabel="bytes/token",
             xscale="log", yscale="log")
    for ax in (speed, size):
        ax.set_xticks(contexts, [f"{c // 1024}K" if c >= 1024 else str(c) for c in contexts])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def start_peer(args: argparse.Namespace, llama: Any) -> tuple[LlamaCpp | None, str | None]:
    """llama.cpp's worker, or None and why it is skipped (never an error: the peer is
    optional and built by hand)."""
    if "llama.cpp" not in args.peer:
        return None, None
    if not any(LLAMACPP_PYTHON.parent.parent.glob(
            "lib/python*/site-packages/llama_cpp/__init__.py")):
        return None, (f"(l) llama.cpp skipped: {LLAMACPP_PYTHON.parent.parent} has no "
                      "llama_cpp; build it once with bench/peers/setup_llamacpp.sh")
    if llama is None:
        return None, "(l) llama.cpp skipped: it decodes (c)'s Llama, which needs transformers"
    log = Path(tempfile.gettempdir()) / f"kvstack-bench-llamacpp-{os.getpid()}.log"
    try:
        return LlamaCpp(llama, args.gguf_type, torch.get_num_threads(), log), None
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        return None, f"(l) llama.cpp skipped: it did not start ({e})"


def main() -> None:
    args = parse_args()
    # One thread each by default against llama.cpp, whose figures are quoted per thread.
    if args.threads is not None or args.peer:
        torch.set_num_threads(args.threads or 1)
    # Room past the longest context for the warm-up and timed steps.
    headroom = max(64, 2 + WARMUP_STEPS + args.steps * args.repeat)  # + the counted step
    max_tokens = max(args.contexts) + headroom
    config = bench_config(max_tokens)
    dense = dense_control(config)
    stack_llm = engine(config, max_tokens, args.dtype)
    dense_llm = engine(dense, max_tokens, args.dtype)
    compiled_llm = (engine(config, max_tokens, args.dtype, compile_decode=True) if args.compile
                    else None)
    torch_llm = (engine(config, max_tokens, args.dtype, cpu_kernels="torch") if args.torch_ops
                 else None)
    llama = hf_model(config, max_tokens) if HAVE_TRANSFORMERS else None
    peer, peer_skipped = start_peer(args, llama)
    specs, peer_notes = peer_specs(args) if peer is not None else ([], [])
    rows = []
    for context in args.contexts:
        # Each context's systems timed interleaved (`time_interleaved`).
        blocks, opened = {}, {}
        if peer is not None:
            blocks, opened = peer.open(context, context + headroom, specs)
        with ExitStack() as open_steps:
            systems = {"a": open_steps.enter_context(engine_step(stack_llm, context)),
                       "b": open_steps.enter_context(engine_step(dense_llm, context))}
            if llama is not None:
                systems["c"], hf_bytes_per_token = hf_step(llama, context)
            if compiled_llm is not None:
                systems["a'"] = open_steps.enter_context(engine_step(compiled_llm, context))
            if torch_llm is not None:
                systems["t"] = open_steps.enter_context(engine_step(torch_llm, context))
            tok_s = time_interleaved(systems, args.steps, args.repeat, blocks)
            counted = {name: count_ops(systems[name]) for name in ("a", "b")}
        if peer is not None:
            peer.close_contexts()
        a = Measured(tok_s["a"], stack_llm.memory_report()["bytes_per_token"])
        b = Measured(tok_s["b"], dense_llm.memory_report()["bytes_per_token"])
        c = None if llama is None else Measured(tok_s["c"], hf_bytes_per_token)
        rows.append(dataclasses.replace(
            row(context, a, b, c),
            stack_floor_bytes=weight_reads(stack_llm.model, stack_llm.model.embed)
            + decode_step_reads(config, context),
            hf_floor_bytes=None if llama is None else hf_reads(llama, context),
            peers=tuple(peer_row(s, tok_s[s["name"]], a.tok_s, opened[s["name"]], config)
                        for s in specs),
            stack_ops=counted["a"], dense_ops=counted["b"]))
        if compiled_llm is not None:
            t = tok_s["a'"]
            rows[-1] = dataclasses.replace(
                rows[-1], compiled_tok_s=t, compiled_speedup_vs_eager=t / a.tok_s,
                compiled_speedup_vs_hf=None if c is None else t / c.tok_s)
        if torch_llm is not None:
            rows[-1] = dataclasses.replace(rows[-1], torch_ops_tok_s=tok_s["t"],
                                           c_kernels_speedup=a.tok_s / tok_s["t"])
    peer_info = None
    if peer is not None:
        peer_info = {"llama_cpp": peer.version, "system_info": peer.system_info,
                     "gguf_type": args.gguf_type, "threads": torch.get_num_threads(),
                     "notes": peer_notes}
        peer.quit()
    bandwidth = copy_bandwidth()
    batch_table, batch_notes = ([], []) if args.batches is None else measure_batches(args)
    layer_table = None if args.layer_contexts is None else measure_layers(args)
    plot_path = Path(args.plot) if HAVE_MATPLOTLIB else None
    if plot_path is not None:
        plot(rows, plot_path)
    skipped = [] if HAVE_TRANSFORMERS else [SKIPPED_HF]
    if peer_skipped is not None:
        skipped.append(peer_skipped)
    if not HAVE_MATPLOTLIB:
        skipped.append("plot skipped: matplotlib is not installed (pip install -e '.[bench]')")

    if args.json:
        transformers_version = None
        if HAVE_TRANSFORMERS:
            import transformers

            transformers_version = transformers.__version__
        report = {
            "config": {"dim": config.dim, "n_layers": config.n_layers,
                       "n_heads": config.n_heads, "head_dim": config.head_dim,
                       "dense_n_kv_heads": dense.n_kv_heads, "window_size": config.window_size},
            "torch": torch.__version__,
            "transformers": transformers_version,
            "threads": torch.get_num_threads(),
            "dtype": args.dtype,
            "steps": args.steps,
            "repeat": args.repeat,
            "synthetic_context": True,
            "plot": str(plot_path) if plot_path else None,
            "skipped": skipped,
            "rows": [asdict(r) for r in rows],
            "copy_bandwidth_bytes_per_s": bandwidth,
            "compile_seconds": (None if compiled_llm is None
                                else compiled_llm.runner.compile_seconds),
            "stack_cpu_kernels": stack_llm.memory_report()["backend"]["cpu_kernels"],
            "peer": peer_info,
        }
        if args.batches is not None:
            report["batch_context"] = args.batch_context
            report["batch_notes"] = batch_notes
            report["batches"] = [asdict(r) for r in batch_table]
        if layer_table is not None:
            report["layers"] = layer_table
        print(json.dumps(report, indent=2))
        return
    console = Console(width=max(Console().width, 120))  # the floor table's 11 columns
    caption = (
        f"dim {config.dim}, {config.n_layers} layers, {config.n_heads} heads of "
        f"{config.head_dim}; (b) and (c) {dense.n_kv_heads} KV head(s); (a) and (b)'s "
        f"weight matrices {args.dtype}, (c)'s float32; batch 1, best of "
        f"{args.repeat} rounds of {args.steps} steps after {WARMUP_STEPS} warm-up, the "
        "systems taking turns in each round; synthetic "
        "context (random cache). (a) ×tok/s = (a)'s tokens/s over the row's; ÷B/token = "
        "the row's bytes/token over (a)'s; ops/step = the top-level aten ops one step "
        "issues (torch.profiler), in ops = their share of that profiled step's wall time "
        f"(the rest: Python and dispatch on the host). torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    for r in rows:
        render(console, r)
    console.print(caption)
    render_floor(console, rows, bandwidth)
    if compiled_llm is not None:
        console.print(f"(a') = (a) with compile_decode=True: torch.compile (Inductor), one "
                      "graph per batch-size bucket, compiled in "
                      f"{compiled_llm.runner.compile_seconds:.0f} s over the warm-up steps "
                      "(not timed)")
    kernels = stack_llm.memory_report()["backend"]["cpu_kernels"]
    console.print(f"(a) and (a') ran the decode step's packed reads, index scoring and "
                  f"expert matmuls by {'the C kernels' if kernels == 'c' else 'torch'} "
                  f"(cpu_kernels={kernels})" + (
                      "; (t) = (a) with cpu_kernels='torch', (a) ×tok/s on its row = (a)'s "
                      "tokens/s over (t)'s" if torch_llm is not None else ""))
    if peer_info is not None:
        console.print(
            f"(l) llama.cpp {peer_info['llama_cpp']} (llama-cpp-python), {args.gguf_type} "
            f"weights of (c)'s Llama, {peer_info['threads']} thread(s) (n_threads = "
            "n_threads_batch), context by a real prefill; B/token computed = 2 × "
            f"{config.n_layers} layers × {dense.n_kv_heads} KV head(s) × {config.head_dim} × "
            "bytes per element (f16 2, q8_0 34/32, q4_0 18/32); (a) ÷ step = (a)'s step "
            "time over the row's (below 1: kvstack faster). llama.cpp's own log, KV bytes "
            "per token: " + "; ".join(
                f"{p.name} {p.logged_bytes_per_token:,.1f}" for p in rows[0].peers
                if p.logged_bytes_per_token is not None), markup=False)
        console.print(f"llama.cpp's prefills that filled the contexts ({peer_info['threads']} "
                      "thread(s), not timed as decode), seconds: " + "; ".join(
                          (f"{r.context // 1024}K " if r.context >= 1024 else f"{r.context} ")
                          + " / ".join(
                              f"{p.prefill_s:.0f}" for p in r.peers) for r in rows)
                      + " (in the rows' order)", markup=False)
        for line in peer_notes:
            console.print(line, markup=False)
        console.print(f"llama.cpp system info: {peer_info['system_info'].strip()}",
                      markup=False)
    for line in skipped:
        console.print(line, markup=False)  # "[bench]" is not rich markup
    if args.batches is not None:
        base = args.batches[0]
        for r in batch_table:
            render_batch(console, r, base)
        counted = sorted({base, args.batches[-1]})
        console.print(
            f"batch of B sequences, {args.batch_context:,} tokens of context each; tok/s = "
            f"B × {args.steps} steps / time, best of {args.repeat} rounds after "
            f"{WARMUP_STEPS} warm-up, the systems taking turns in each round; (a) ×tok/s = "
            f"(a)'s tokens/s over the row's; ÷B={base} = the system's "
            f"tokens/s at this batch over its tokens/s at batch {base}. ops/step = torch."
            "profiler CPU events named aten::* in one decode step after the timed ones, nested "
            "ones (an op another op calls) included; top-level = those with no aten op above "
            f"them; counted at batch {' and '.join(map(str, counted))}. (c) keeps a batch's "
            "cache in the cache its title names, sized to the context and the steps (the "
            f"context tables' (c) uses a DynamicCache). torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")
        for line in batch_notes:
            console.print(line, markup=False)
    if layer_table is not None:
        render_layers(console, layer_table, args.steps)
    if plot_path is not None:
        console.print(f"plot: {plot_path}")


if __name__ == "__main__":
    main()
