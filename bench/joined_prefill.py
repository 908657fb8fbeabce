"""Short prompts' first tokens: one decode call holding their rows against a prefill call
each, on the bundled model through the engine.

A prompt whose rest fits a window runs as rows of the step's decode call
(`ModelRunner.joins_decode`); before, each ran its own `Model.prefill`. This times
`LLM.generate(prompts, max_tokens=1)` both ways in one process, alternating rounds (the
machine is shared: the ratio in one run is the figure, not the milliseconds), with the
prompts arriving together (one step) and, with --streams, beside that many running
streams. It checks that both ways give the same tokens first.

    python bench/joined_prefill.py [--prompts 8] [--streams 0] [--threads 1] [--rounds 5]
"""

import argparse
import json
import time

import torch

from kvstack import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts arriving together")
    parser.add_argument("--streams", type=int, default=0,
                        help="running streams decoding beside them")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds; best kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.prompts < 1 or args.streams < 0 or args.rounds < 1 or args.threads < 1:
        parser.error("--prompts, --rounds and --threads at least 1, --streams at least 0")
    return args


def main() -> None:
    args = parse_args()
    llm = LLM("default", kv_budget="512MiB", threads=args.threads,
              max_num_seqs=args.prompts + args.streams, enable_prefix_caching=False)
    window = llm.config.window_size
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(window // 8, window, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(10, llm.config.vocab_size, (n,), generator=g).tolist()
               for n in lengths]
    first = SamplingParams(max_tokens=1, temperature=0)
    joins = llm.runner.joins_decode

    def run(joined: bool) -> tuple[float, list[list[int]]]:
        llm.runner.joins_decode = joins if joined else (lambda seq, n: False)
        for i in range(args.streams):  # running streams, decoding when the prompts arrive
            llm.add_request(prompts[i % len(prompts)], SamplingParams(
                max_tokens=10_000, temperature=0, ignore_eos=True), request_id=f"s{i}")
        while args.streams and any(s.prefilling or not s.output_ids for s in
                                   llm.scheduler.running):
            llm.step()
        started = time.perf_counter()
        outs = llm.generate(prompts, first)
        seconds = time.perf_counter() - started
        for i in range(args.streams):
            llm.abort(f"s{i}")
        while llm.has_unfinished_requests():
            llm.step()
        return seconds, [o.token_ids for o in outs]

    best = {True: float("inf"), False: float("inf")}
    tokens = {}
    run(True), run(False)  # warm-up
    for _ in range(args.rounds):
        for joined in (False, True):
            seconds, tokens[joined] = run(joined)
            best[joined] = min(best[joined], seconds)
    result = {"prompts": args.prompts, "prompt_tokens": lengths, "streams": args.streams,
              "threads": args.threads, "prefill_each_ms": best[False] * 1e3,
              "joined_ms": best[True] * 1e3, "speedup": best[False] / best[True],
              "same_tokens": tokens[True] == tokens[False]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.prompts} prompts of {min(lengths)}..{max(lengths)} tokens "
          f"({sum(lengths):,} in all) arriving together, {args.streams} running streams, "
          f"{args.threads} thread(s), best of {args.rounds} alternated rounds")
    print(f"  a prefill call each: {best[False] * 1e3:.0f} ms; rows of one decode call: "
          f"{best[True] * 1e3:.0f} ms ({result['speedup']:.2f}x); same first tokens: "
          f"{result['same_tokens']}")


if __name__ == "__main__":
    main()
