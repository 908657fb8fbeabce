"""Prefill throughput of the CED split (design.md section 2) next to the reference forward.

For each prompt length this times, on one seeded CPU-sized model with the `tiny` preset's
layer pattern, the reference forward (every layer over every token) and `Model.prefill`
(the encoder over every token, the decoder only over the last `decoder_span` tokens) with
bounded and with exact replay, and prints tokens/s for each. The number that matters is
the ratio prefill / reference measured in the same run, because the machines are shared
and noisy: absolute tokens/s drift between runs, the ratio drifts much less. With half the
layers in the encoder the design expects close to 2x for long prompts; here it keeps rising
with length, because the decoder's ratio-1 indexers score every earlier token per query.

Bounded replay buys its speed with fidelity, so the KL divergence KL(reference || prefill)
of the last position's next-token distribution is printed too: ~0 for exact replay, small
but non-zero for bounded replay once the prompt is longer than its decoder span.
"""

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from kvstack.cache.contiguous import ContiguousCache
from kvstack.config import ModelConfig, preset
from kvstack.model.model import Model

# 32768 is left out: on a 2-core CPU it alone takes about 3 minutes; pass it with --lengths.
DEFAULT_LENGTHS = (2048, 4096, 8192, 16384)
WARMUP_TOKENS = 256


@dataclass(frozen=True)
class Row:
    tokens: int
    reference_tok_s: float
    bounded_tok_s: float
    exact_tok_s: float
    bounded_speedup: float
    exact_speedup: float
    bounded_kl: float
    exact_kl: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                        help="prompt lengths in tokens")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs; the best is kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    if min(args.lengths) <= 0:
        parser.error("--lengths must be positive")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def bench_config(max_seq_len: int) -> ModelConfig:
    """The tiny preset's layer pattern (window-only, ratio-2 and CED layers, MoE,
    hyper-connections) at widths where the work, not Python overhead, sets the time."""
    return preset("tiny").replace(
        dim=256, n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=128, o_groups=2,
        o_lora_rank=128, window_size=128, index_n_heads=4, index_head_dim=64, index_topk=64,
        candidate_topk_blocks=64, candidate_block_size=8, n_routed_experts=8,
        n_activated_experts=2, moe_inter_dim=256, max_seq_len=max_seq_len,
        # The preset's YaRN is tuned to its 512-token context; plain RoPE at these lengths.
        rope_factor=1.0, original_seq_len=0,
    )


def best_seconds(fn: Callable[[], torch.Tensor], repeat: int) -> tuple[float, torch.Tensor]:
    """Minimum wall time of fn over repeat runs (the least disturbed run), and its result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def reference_last(model: Model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits[:, -1]


def prefill_last(model: Model, ids: torch.Tensor, replay: str) -> torch.Tensor:
    # A fresh cache per call: prefill appends to whatever the cache already holds.
    cache = ContiguousCache(model.config, batch_size=1, max_tokens=ids.shape[1])
    return model.prefill(ids, cache, replay=replay)


def kl(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """KL(reference || approx) of the next-token distributions, in float64 so exact
    replay reads as ~0 rather than float32 rounding noise."""
    target = reference.double().log_softmax(-1)
    return F.kl_div(approx.double().log_softmax(-1), target, log_target=True,
                    reduction="sum").item()


def bench_length(model: Model, tokens: int, repeat: int) -> Row:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    ref_s, ref = best_seconds(lambda: reference_last(model, ids), repeat)
    bounded_s, bounded = best_seconds(lambda: prefill_last(model, ids, "bounded"), repeat)
    exact_s, exact = best_seconds(lambda: prefill_last(model, ids, "exact"), repeat)
    return Row(
        tokens=tokens,
        reference_tok_s=tokens / ref_s,
        bounded_tok_s=tokens / bounded_s,
        exact_tok_s=tokens / exact_s,
        bounded_speedup=ref_s / bounded_s,
        exact_speedup=ref_s / exact_s,
        bounded_kl=kl(ref, bounded),
        exact_kl=kl(ref, exact),
    )


def render(console: Console, header: str, caption: str, rows: list[Row]) -> None:
    table = Table(title=header, caption=caption)
    # Short headers, explained in the caption, keep the table inside an 80-column terminal.
    for name in ("tokens", "ref/s", "bounded/s", "×ref", "exact/s", "×ref", "KL bnd", "KL exact"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            str(r.tokens),
            f"{r.reference_tok_s:.0f}",
            f"{r.bounded_tok_s:.0f}",
            f"{r.bounded_speedup:.2f}×",
            f"{r.exact_tok_s:.0f}",
            f"{r.exact_speedup:.2f}×",
            f"{r.bounded_kl:.2e}",
            f"{r.exact_kl:.2e}",
        )
    console.print(table)


def main() -> None:
    args = parse_args()
    config = bench_config(max(args.lengths))
    torch.manual_seed(0)
    model = Model(config).eval()
    spans = {mode: model.decoder_span(mode) for mode in ("bounded", "exact")}
    with torch.no_grad():
        # Warm-up: first calls pay for lazy initialisation and allocator growth.
        warm = torch.randint(0, config.vocab_size, (1, min(WARMUP_TOKENS, config.max_seq_len)))
        reference_last(model, warm)
        prefill_last(model, warm, "bounded")
        rows = [bench_length(model, n, args.repeat) for n in args.lengths]

    if args.json:
        report = {
            "config": {
                "dim": config.dim,
                "n_layers": config.n_layers,
                "n_encoder_layers": config.n_encoder_layers,
                "window_size": config.window_size,
            },
            "decoder_span": spans,
            "rows": [asdict(r) for r in rows],
        }
        print(json.dumps(report, indent=2))
        return
    header = (
        f"CED prefill vs reference forward · torch {torch.__version__} · "
        f"{torch.get_num_threads()} threads · best of {args.repeat}"
    )
    caption = (
        f"dim {config.dim}, {config.n_layers} layers ({config.n_encoder_layers} encoder), "
        f"window {config.window_size}; decoder span: bounded {spans['bounded']}, "
        f"exact {spans['exact']} tokens; /s = tokens/s; ×ref = prefill / reference "
        "speed; KL = KL(reference || prefill) at the last position"
    )
    render(Console(), header, caption, rows)


if __name__ == "__main__":
    main()
