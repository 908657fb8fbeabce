"""DSpark speculative decoding against plain decoding, side by side in one run.

For each batch size (`--batches`, default 1 4 16) the same requests -- `--prompts` prompts
of `--prompt-tokens` token ids, `--max-tokens` greedy tokens each (`--temperature` to
sample), at most B running at once -- run through engines on the same model:
`speculative="none"` (one token a step) and `speculative="dspark"` (a draft block per
sequence, its confident prefix verified in one target call) under each of `--schedules`:
"measured" (the default: a sequence drafts while its verifies pay, as timed in the
engine's own steps) and "always" (every sequence drafts every step). Each engine first
warms up on B of the prompts, 16 tokens each (alike for all: the measured schedule times
its steps there, as a server does in its first seconds). The engines take turns for
`--repeat` rounds and each keeps its best round. Reported per batch and
schedule: output tokens/s (end to end, the prompts' prefill included, which is the same
work in all), DSpark's ratio to plain, and from the DSpark engine's runner the share of
sequence steps that drafted, the mean acceptance length (tokens a verify yields:
accepted drafts + the target's own), how many drafts each verify accepted (a histogram),
the verify lengths the confidence head chose, and the milliseconds of a step's draft call
and verify call (steps that drafted) beside a plain step's; then what a batch-1 verify
step costs by the rows it feeds.

The model is `--model`: a directory with DSpark's draft layers (`mtp.*`: DeepSeek's V4.1
checkpoint, or a model trained with a drafter), or a preset with random weights (default
`tiny-v41-dspark`, seed 0). A random draft's acceptance is that of chance, so on the
default the figures measure what drafting and verifying cost, not what a trained drafter
gains. For a model directory with a tokenizer the prompts are held-out text: the first
`--prompt-tokens` tokens of files of the standard library's held-out split (the 2 % the
bundled model and `kvstack train-draft` never train on); for a preset they are random
token ids (seeded): what a model of random weights does with text is no different.
Prefix caching is off in both engines, so every round prefills alike. Torch runs one
thread; the load average is printed beside the figures.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstack.engine import LLM, SamplingParams


def engine(args: argparse.Namespace, speculative: str, batch: int,
           schedule: str = "measured") -> LLM:
    model = Path(args.model)
    source = dict(model=str(model)) if model.is_dir() else dict(
        model=args.model, random_init=True, seed=0)
    drafts = dict(speculative_schedule=schedule) if speculative == "dspark" else {}
    return LLM(**source, speculative=speculative, threads=1, kv_budget=args.kv_budget,
               max_num_seqs=batch, enable_prefix_caching=False, **drafts)


def run(args: argparse.Namespace, engine_kind: str, batch: int,
        prompts: list[list[int]]) -> tuple[float, LLM]:
    speculative, _, schedule = engine_kind.partition(" ")
    llm = engine(args, speculative, batch, schedule or "measured")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=1 if args.temperature else None, ignore_eos=True)
    # Warm-up, alike for every engine: a server's first steps, where the measured
    # schedule times a plain and a drafting step of the batch's size.
    llm.generate(prompts[:batch], SamplingParams(max_tokens=16, ignore_eos=True))
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    return sum(len(o.token_ids) for o in outs) / seconds, llm


def heldout_prompts(llm: LLM, args: argparse.Namespace) -> list[list[int]]:
    """The first --prompt-tokens tokens of --prompts held-out standard-library files."""
    from kvstack.corpus.data import read_source, split_corpus, stdlib_root

    root = stdlib_root()
    prompts = []
    for path in split_corpus(root, 2.0)[1]:
        text = read_source(root / path)
        ids = llm.encode(text) if text else []
        if len(ids) >= args.prompt_tokens:
            prompts.append(ids[: args.prompt_tokens])
        if len(prompts) == args.prompts:
            return prompts
    raise ValueError(f"too few held-out files of {args.prompt_tokens} tokens")


def verify_cost(llm: LLM, prompt: list[int]) -> str:
    """Milliseconds of one sequence's verify step by the rows it feeds (1, 2, 3, 5, 8),
    each the best of 20: what one more verified draft costs (the runner's MIN_SURVIVAL
    rests on it). The verify is taken back after each (settle(0)), so every call starts
    from the same cache."""
    from kvstack import native
    from kvstack.cache.batch import DecodeBatch

    first = llm.add_request(prompt, SamplingParams(max_tokens=2, temperature=0,
                                                   ignore_eos=True), keep_cache=True,
                            watch=True)
    while not llm.wait(first).finished:
        pass
    store, model = llm.scheduler.kept[first].store, llm.runner.model
    store.reserve(store.num_tokens + 8)
    times = {}
    for rows in (1, 2, 3, 5, 8):
        best = float("inf")
        for _ in range(20):
            store.speculate(rows)
            started = time.perf_counter()
            with native.active(llm.runner.cpu_kernels):
                model.verify([prompt[0]] * rows, DecodeBatch([store], counts=[rows]))
            best = min(best, time.perf_counter() - started)
            store.settle(0)
        times[rows] = 1e3 * best
    return ", ".join(f"{rows} rows {ms:.2f} ms" for rows, ms in times.items())


def histogram(counts: dict[int, int]) -> str:
    total = sum(counts.values()) or 1
    return " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-v41-dspark")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompts", type=int, default=16,
                        help="requests run at every batch size (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--schedules", nargs="+", choices=("measured", "always"),
                        default=["measured", "always"],
                        help="DSpark's schedules to run beside plain decoding")
    parser.add_argument("--kv-budget", default="64MiB")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"model {args.model}, {args.prompts} prompts of {args.prompt_tokens} tokens, "
          f"{args.max_tokens} tokens each, temperature {args.temperature}, 1 torch thread, load "
          f"{os.getloadavg()[0]:.2f}")
    plain = engine(args, "none", 1)
    vocab = plain.model.config.vocab_size
    held_out = heldout_prompts(plain, args) if Path(args.model, "tokenizer.json").exists() \
        else None
    header = ("| batch | schedule | plain tok/s | DSpark tok/s | DSpark ÷ plain | drafted "
              "| acceptance length | accepted per verify | verify lengths | draft ms "
              "| verify ms | plain ms/token |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    kinds = ["none", *(f"dspark {schedule}" for schedule in args.schedules)]
    for batch in args.batches:
        prompts = held_out if held_out is not None else torch.randint(
            0, vocab, (args.prompts, args.prompt_tokens),
            generator=torch.Generator().manual_seed(0)).tolist()
        best: dict[str, tuple[float, LLM | None]] = {kind: (0.0, None) for kind in kinds}
        for _ in range(args.repeat):
            for kind in kinds:
                rate, llm = run(args, kind, batch, prompts)
                if rate > best[kind][0]:
                    best[kind] = (rate, llm)
        plain = best["none"][0]
        for kind in kinds[1:]:
            drafting, r = best[kind][0], best[kind][1].runner
            verifies, steps = max(r.verifies, 1), max(r.drafting_steps, 1)
            print(f"| {batch} | {kind.split()[1]} | {plain:.1f} | {drafting:.1f} | "
                  f"{drafting / plain:.2f}× | "
                  f"{100 * r.verifies / max(r.verifies + r.undrafted, 1):.0f}% | "
                  f"{(r.accepted_tokens + r.verifies) / verifies:.2f} | "
                  f"{histogram(r.accepted_lengths)} | {histogram(r.verify_lengths)} | "
                  f"{1e3 * r.draft_seconds / steps:.1f} | "
                  f"{1e3 * r.verify_seconds / steps:.1f} | {1e3 / plain:.1f} |")
    if engine(args, "dspark", 1).runner.verify_in_c:
        prompt = held_out[0] if held_out is not None else list(range(1, args.prompt_tokens))
        print(f"a batch-1 verify step by its rows: "
              f"{verify_cost(engine(args, 'dspark', 1), prompt)}")


if __name__ == "__main__":
    main()
