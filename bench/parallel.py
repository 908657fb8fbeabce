"""Prefill and decode throughput of a model split over two processes (tensor parallel,
gloo on the CPU) beside the same model in one process, in one run.

For each model it times, side by side: one process on one thread, one process on two
threads (the same cores as two ranks), and two ranks of one thread each, over the same
prompts. It prints tokens/s and the ratios against one process, and the share of rank 0's
time spent inside collectives (the all-reduces, all-gathers and call broadcasts: moving
bytes, and waiting for the other rank to get there). On a CPU the ranks share the
machine's memory bandwidth and every layer adds collectives, so a slowdown is expected;
the point of tensor parallelism is room for weights on devices, and this measures its cost.

Models: the bundled model (read slice by slice from its checkpoint by each rank) and the
tiny-v41 preset (random weights: MoE, Engram, four residual copies), its experts split by
their inter dim and, with expert parallelism, whole by rank.
"""

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from kvstack import LLM, SamplingParams


@dataclass(frozen=True)
class Row:
    model: str
    setup: str
    prefill_tok_s: float
    decode_tok_s: float
    prefill_ratio: float
    decode_ratio: float
    collective_share: float | None  # of rank 0's time in the timed calls
    collectives_per_step: float | None  # rank 0's collectives in one decode step


class CollectiveClock:
    """Time rank 0 spends in torch.distributed's collectives, and how many it calls, by
    wrapping them."""

    NAMES = ("all_reduce", "all_gather", "broadcast_object_list")

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._real: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> "CollectiveClock":
        for name in self.NAMES:
            real = self._real[name] = getattr(dist, name)

            def timed(*args: Any, _real: Callable[..., Any] = real, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start
                    self.calls += 1
            setattr(dist, name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self._real.items():
            setattr(dist, name, real)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4, help="sequences decoded at once")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs; the best is kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    return parser.parse_args()


def measure(llm: LLM, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(prefill tok/s, decode tok/s, seconds in collectives / seconds timed, collectives
    per decode step), best of --repeat, with prompts of --prompt-tokens (or as many as the
    model takes)."""
    vocab = llm.config.vocab_size
    n = min(args.prompt_tokens, llm.core.max_model_len - 2)  # tiny-v41 takes 512 in all
    best_prefill = best_decode = 0.0
    share = per_step = 0.0
    for run in range(args.repeat + 1):  # run 0 warms up
        prompts = [[(7 * run + 13 * b + i) % (vocab - 3) + 3 for i in range(n)]
                   for b in range(args.batch)]
        with CollectiveClock() as clock:
            timed_from = start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
            prefill_s = time.perf_counter() - start
            short = [p[:16] for p in prompts]
            before = clock.calls
            llm.generate(short, SamplingParams(max_tokens=1, temperature=0))
            prefill_calls, before = clock.calls - before, clock.calls
            start = time.perf_counter()
            llm.generate(short, SamplingParams(max_tokens=args.decode_tokens + 1,
                                               temperature=0, ignore_eos=True))
            decode_s = time.perf_counter() - start
            # The same prefill again, then the decode steps.
            per_step = (clock.calls - before - prefill_calls) / args.decode_tokens
        timed_s = time.perf_counter() - timed_from
        if run == 0:
            continue
        prefill = args.batch * n / prefill_s
        decode = args.batch * args.decode_tokens / decode_s
        if decode > best_decode:
            share = clock.seconds / timed_s
        best_prefill, best_decode = max(best_prefill, prefill), max(best_decode, decode)
    return best_prefill, best_decode, share, per_step


SETUPS = (("1 process, 1 thread", 1, 1, False), ("1 process, 2 threads", 1, 2, False),
          ("2 ranks, 1 thread each", 2, 1, False))


def main() -> None:
    args = parse_args()
    models = [("bundled model", "default", False, ()),
              ("tiny-v41", "tiny-v41", True, (("2 ranks, experts whole", 2, 1, True),))]
    rows = []
    for label, name, random_init, extra in models:
        base = None
        for setup, ranks, threads, expert_parallel in SETUPS + extra:
            llm = LLM(name, random_init=random_init, kv_budget="256MiB", threads=threads,
                      max_num_seqs=max(8, args.batch), tensor_parallel_size=ranks,
                      expert_parallel=expert_parallel, enable_prefix_caching=False)
            try:
                prefill, decode, share, per_step = measure(llm, args)
            finally:
                llm.close()
            base = base or (prefill, decode)
            rows.append(Row(label, setup, prefill, decode, prefill / base[0], decode / base[1],
                            share if ranks > 1 else None, per_step if ranks > 1 else None))
    if args.json:
        print(json.dumps({"args": vars(args), "rows": [asdict(r) for r in rows]}))
        return
    table = Table(title=f"{args.batch} prompts of {args.prompt_tokens} tokens (tiny-v41: "
                        f"510), then {args.decode_tokens} decode steps of {args.batch}")
    for column in ("model", "setup", "prefill tok/s", "decode tok/s", "prefill ×",
                   "decode ×", "rank 0 in collectives", "collectives per step"):
        table.add_column(column)
    for r in rows:
        table.add_row(r.model, r.setup, f"{r.prefill_tok_s:,.0f}", f"{r.decode_tok_s:.1f}",
                      f"{r.prefill_ratio:.2f}", f"{r.decode_ratio:.2f}",
                      "–" if r.collective_share is None else f"{r.collective_share:.0%}",
                      "–" if r.collectives_per_step is None else f"{r.collectives_per_step:.0f}")
    Console(width=max(Console().width, 120)).print(table)


if __name__ == "__main__":
    main()
