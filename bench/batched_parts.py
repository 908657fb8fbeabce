"""What one model call for several prompts' long parts would buy over a call each.

A prompt part longer than a window runs its own `Model.prefill_part` call (the encoder over
its tokens and the decoder's stream); parts that fit a window already run as rows of the
decode call (`bench/joined_prefill.py`). This bounds what batching the long parts of
several prompts into one call could gain: it times two sequences' parts of n tokens as
one [2, n] `prefill_part` over a two-sequence cache (the best case: equal lengths, equal
positions, no padding) against two [1, n] calls, on the bundled model, alternating rounds
in one process (the machine is shared: the ratio in one run is the figure).

    python bench/batched_parts.py [--lengths 128 256 512 1024] [--threads 1] [--rounds 5]
"""

import argparse
import json
import time

import torch

from kvstack import native
from kvstack.cache.contiguous import ContiguousCache
from kvstack.engine.loading import bundled_model
from kvstack.model import Model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024],
                        help="tokens in each sequence's part")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds; best kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if min(args.lengths) < 1 or args.rounds < 1 or args.threads < 1:
        parser.error("--lengths, --rounds and --threads at least 1")
    return args


def part_seconds(model: Model, ids: torch.Tensor, batched: bool) -> float:
    """Seconds for the second halves of ids [2, 2n] after their first halves are cached:
    one [2, n] call over a two-sequence cache, or a [1, n] call for each sequence."""
    n = ids.shape[1] // 2
    if batched:
        caches, parts = [ContiguousCache(model.config, 2, 2 * n)], [ids]
    else:
        caches = [ContiguousCache(model.config, 1, 2 * n) for _ in range(2)]
        parts = [ids[:1], ids[1:]]
    for cache, part in zip(caches, parts, strict=True):
        model.prefill_part(part[:, :n], cache)
    started = time.perf_counter()
    for cache, part in zip(caches, parts, strict=True):
        model.prefill_part(part[:, n:], cache)
    return time.perf_counter() - started


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = Model.from_pretrained(bundled_model()).eval()
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in args.lengths:
        # Each sequence already holds n tokens, so the timed part is a middle one.
        ids = torch.randint(10, model.config.vocab_size, (2, 2 * n), generator=g)
        best = {False: float("inf"), True: float("inf")}
        with torch.no_grad(), native.active(native.resolve("auto")):
            part_seconds(model, ids, False), part_seconds(model, ids, True)  # warm-up
            for _ in range(args.rounds):
                for batched in (False, True):
                    best[batched] = min(best[batched], part_seconds(model, ids, batched))
        rows.append({"part_tokens": n, "two_calls_ms": best[False] * 1e3,
                     "one_call_ms": best[True] * 1e3, "speedup": best[False] / best[True]})
    if args.json:
        print(json.dumps({"threads": args.threads, "rows": rows}))
        return
    print(f"two sequences' parts, bundled model, {args.threads} thread(s), best of "
          f"{args.rounds} alternated rounds")
    for r in rows:
        print(f"  {r['part_tokens']:>5} tokens each: two calls {r['two_calls_ms']:.1f} ms, "
              f"one [2, n] call {r['one_call_ms']:.1f} ms ({r['speedup']:.2f}x)")


if __name__ == "__main__":
    main()
