"""Decode throughput and cache bytes per token of the compressed stack, its dense control
and a Hugging Face Llama, side by side, at long contexts.

For each context length this times batch-1 decode steps of three systems on one CPU-sized
model (the one bench/prefill.py uses): (a) kvstack with the compressed stack, (b) kvstack's
dense control of the same model through the same engine (per-layer GQA keys and values in
bf16), and (c) transformers' `LlamaForCausalLM` of the same width, depth, KV heads and
active FFN width with its default `DynamicCache` in float32. Beside tokens/s it reports the
cache bytes per token: measured from the allocated pools for (a) and (b), from the
DynamicCache's tensors for (c).

The contexts are synthetic: each system's cache is filled with random values of the right
shapes through its own storage (for kvstack, the store's real quantise-and-pack write path;
for transformers, `DynamicCache.update`), as vLLM's dummy-weight benchmarks do, instead of
prefilling. Prefilling 32K tokens three times would take many minutes on a 2-core CPU, and
a decode step's cost depends on how much cache it reads, not on what the values are.

The numbers that matter are the ratios measured in the same run, (a)/(b) and (a)/(c) for
tokens/s and (b)/(a), (c)/(a) for bytes per token, because the machines are shared and
noisy: absolute tokens/s drift between runs, the ratios much less. transformers and
matplotlib come with the `bench` extra; without transformers, (c) is skipped.
"""

import argparse
import importlib.util
import inspect
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from prefill import bench_config  # bench/ is on the path: the same model in both
from rich.console import Console
from rich.table import Table

from kvstack import LLM, SamplingParams
from kvstack.cache.layout import CacheLayout
from kvstack.cache.paged import PagedSequenceStore, block_bytes
from kvstack.config import ModelConfig, dense_control
from kvstack.engine.sequence import Sequence

DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768)
WARMUP_STEPS = 3
BLOCK_TOKENS = 64
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
SKIPPED_HF = "(c) skipped: transformers is not installed (pip install -e '.[bench]')"


@dataclass(frozen=True)
class Measured:
    tok_s: float
    bytes_per_token: float


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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS),
                        help="context lengths in tokens")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs; the best is kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--plot", default="bench/decode.png", help="where to write the PNG")
    args = parser.parse_args()
    # Even contexts: the ratio-2 streams then hold whole groups and no partial one.
    if min(args.contexts) <= 0 or any(c % 2 for c in args.contexts):
        parser.error("--contexts must be positive and even")
    if args.steps < 1 or args.repeat < 1:
        parser.error("--steps and --repeat must be at least 1")
    return args


def time_decode(step: Callable[[], None], steps: int, repeat: int) -> float:
    """Decode tokens/s: warm-up steps first (lazy initialisation, allocator growth), then
    the best of `repeat` runs of `steps` steps (the least disturbed run)."""
    for _ in range(WARMUP_STEPS):
        step()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, time.perf_counter() - start)
    return steps / best


# ---- (a) and (b): kvstack's engine ---------------------------------------------------------
def engine(config: ModelConfig, max_tokens: int) -> LLM:
    """An LLM whose budget holds one sequence of max_tokens and nothing more, so the
    benchmark allocates what it uses."""
    layout = CacheLayout.from_config(config)
    budget = (layout.window_bytes_per_sequence
              + block_bytes(layout, BLOCK_TOKENS) * -(-max_tokens // BLOCK_TOKENS))
    return LLM(config, random_init=True, kv_budget=budget, max_num_seqs=1,
               block_tokens=BLOCK_TOKENS)


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


def measure_engine(llm: LLM, context: int, steps: int, repeat: int) -> Measured:
    store = llm.cache.open_sequence()
    try:
        ids = fill(store, llm.config, context, torch.Generator().manual_seed(context))
        greedy = SamplingParams(temperature=0, ignore_eos=True)
        # ModelRunner.decode feeds output_ids[-1]: seed it with the context's last token.
        seq = Sequence("bench", ids, greedy, output_ids=[ids[-1]], store=store)

        def step() -> None:
            if not store.reserve(seq.num_tokens):
                raise RuntimeError("the cache pools are full")
            seq.output_ids.append(llm.runner.decode([seq])[0])

        tok_s = time_decode(step, steps, repeat)
    finally:
        llm.cache.close_sequence(store)
    return Measured(tok_s, llm.memory_report()["bytes_per_token"])


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


def measure_hf(model: Any, context: int, steps: int, repeat: int) -> Measured:
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
        out = model(input_ids=token, position_ids=torch.tensor([[position]]), use_cache=True,
                    **{cache_arg: cache}, **extra)
        token = out.logits[:, -1].argmax(-1, keepdim=True)

    with torch.no_grad():
        tok_s = time_decode(step, steps, repeat)
    return Measured(tok_s, nbytes / context)


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
    table.add_row("(a) kvstack stack", f"{r.stack_tok_s:.1f}",
                  f"{r.stack_bytes_per_token:,.1f}", "", "")
    table.add_row("(b) dense control", f"{r.dense_tok_s:.1f}",
                  f"{r.dense_bytes_per_token:,.1f}", f"{r.speedup_vs_dense:.2f}×",
                  f"{r.bytes_saving_vs_dense:.2f}×")
    if r.hf_tok_s is not None:
        table.add_row("(c) HF Llama", f"{r.hf_tok_s:.1f}", f"{r.hf_bytes_per_token:,.1f}",
                      f"{r.speedup_vs_hf:.2f}×", f"{r.bytes_saving_vs_hf:.2f}×")
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


def main() -> None:
    args = parse_args()
    # Room past the longest context for the warm-up and timed steps.
    headroom = max(64, 1 + WARMUP_STEPS + args.steps * args.repeat)
    max_tokens = max(args.contexts) + headroom
    config = bench_config(max_tokens)
    dense = dense_control(config)
    stack_llm, dense_llm = engine(config, max_tokens), engine(dense, max_tokens)
    llama = hf_model(config, max_tokens) if HAVE_TRANSFORMERS else None
    rows = []
    for context in args.contexts:
        a = measure_engine(stack_llm, context, args.steps, args.repeat)
        b = measure_engine(dense_llm, context, args.steps, args.repeat)
        c = measure_hf(llama, context, args.steps, args.repeat) if llama is not None else None
        rows.append(row(context, a, b, c))
    plot_path = Path(args.plot) if HAVE_MATPLOTLIB else None
    if plot_path is not None:
        plot(rows, plot_path)
    skipped = [] if HAVE_TRANSFORMERS else [SKIPPED_HF]
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
            "steps": args.steps,
            "repeat": args.repeat,
            "synthetic_context": True,
            "plot": str(plot_path) if plot_path else None,
            "skipped": skipped,
            "rows": [asdict(r) for r in rows],
        }
        print(json.dumps(report, indent=2))
        return
    console = Console()
    caption = (
        f"dim {config.dim}, {config.n_layers} layers, {config.n_heads} heads of "
        f"{config.head_dim}; (b) and (c) {dense.n_kv_heads} KV head(s); batch 1, best of "
        f"{args.repeat} × {args.steps} steps after {WARMUP_STEPS} warm-up; synthetic "
        "context (random cache). (a) ×tok/s = (a)'s tokens/s over the row's; ÷B/token = "
        f"the row's bytes/token over (a)'s. torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    for r in rows:
        render(console, r)
    console.print(caption)
    for line in skipped:
        console.print(line, markup=False)  # "[bench]" is not rich markup
    if plot_path is not None:
        console.print(f"plot: {plot_path}")


if __name__ == "__main__":
    main()
