"""Resume latency of saved sessions, prefix-cache hits and the disk bytes of a saved
session, each beside what it saves, in one run.

1. Resume. For each context length a session of that many (seeded random) tokens is built
   and saved to a temporary cache directory. Then, on a fresh `LLM` per system (built
   before the clock starts, warmed up on a small saved session), the time to the first new
   token after appending a few tokens: (a) `LLM.resume` + bounded replay, (b) `LLM.resume`
   + exact replay, and (c) a full re-prefill of the same tokens with prefix caching off
   (what a lost session costs). The model is the `default` preset (the bundled model's
   shape) with random weights and a max_seq_len that admits the longest context: timing
   does not depend on the weights, and random weights reach 64K.
2. Prefix cache. On the bundled trained model, the time to first token of a prompt of real
   text (the start of the standard library's inspect.py) cold, then the same prompt again
   (a hit on its full blocks), then the prompt followed by new tokens (a partial hit: the
   prompt's blocks are reused, the rest is computed), with bounded and exact replay.
3. Disk bytes. A saved session's block files per token beside what saving its window rings
   too would add (`DiskTier.show`: disk_bytes, window_ring_bytes). The rings are a fixed
   cost per session, so the ratio shrinks as the context grows.

The numbers that matter are the ratios measured in the same run, because the machines are
shared and noisy. The saved blocks are read back from the operating system's page cache
(they were just written), so (a) and (b) include checking and copying them but not a cold
disk read.
"""

import argparse
import json
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvstack import LLM, SamplingParams
from kvstack.config import ModelConfig, preset
from kvstack.engine.session import Session

# On this project's 2-core CPU (idle) the default run takes about 5 minutes, most of it the
# two prefills of 64K tokens (building the session, then (c)), about 2 minutes each; a
# prefill's cost grows faster than its length (the encoder's indexers score every earlier
# entry), and on a loaded machine it is several times longer. --quick is a 10-second run.
DEFAULT_CONTEXTS = (4096, 16384, 65536)
QUICK_CONTEXTS = (1024, 2048)
PROMPT_TOKENS = 3000  # of the prefix-cache prompt
QUICK_PROMPT_TOKENS = 1000
SUFFIX_TOKENS = 256  # added to the prompt for the partial hit
APPEND_TOKENS = 16  # appended to a resumed session before its first new token
WARMUP_TOKENS = 128
MODES = ("bounded", "exact")
TEXT_FILE = "inspect.py"  # as kvstack demo: a large, self-contained stdlib module
WARMUP_FILE = "textwrap.py"  # another one, for the warm-up request
GREEDY_1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class ResumeRow:
    context: int  # tokens the saved session's blocks hold
    session_tokens: int  # tokens of the saved session (the context and its one reply)
    appended: int
    build_s: float  # the prefill that built the session (in no ratio)
    reprefill_s: float  # (c)
    bounded_s: float  # (a): resume + replay + first token
    exact_s: float  # (b)
    bounded_load_s: float  # of which LLM.resume (read, check, copy the blocks)
    exact_load_s: float
    bounded_replayed: tuple[int, int]  # tokens re-run (through the encoder, the decoder)
    exact_replayed: tuple[int, int]
    bounded_same_token: bool  # first new token equal to the re-prefill's
    exact_same_token: bool
    reprefill_over_bounded: float
    reprefill_over_exact: float


@dataclass(frozen=True)
class PrefixRow:
    replay: str
    prompt_tokens: int
    cold_ttft_s: float
    hit_ttft_s: float
    hit_cached_tokens: int
    hit_same_token: bool  # the hit's first token equal to the cold run's
    partial_tokens: int
    partial_ttft_s: float
    partial_cached_tokens: int
    cold_over_hit: float
    cold_over_partial: float


@dataclass(frozen=True)
class DiskRow:
    context: int
    tokens: int  # of the saved session
    disk_bytes: int
    window_ring_bytes: int
    bytes_per_token: float
    with_rings_bytes_per_token: float
    with_rings_over_without: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help=f"session contexts in tokens (default {DEFAULT_CONTEXTS})")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: contexts {QUICK_CONTEXTS}, a "
                             f"{QUICK_PROMPT_TOKENS}-token prompt")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help=f"prefix-cache prompt length (default {PROMPT_TOKENS})")
    parser.add_argument("--append", type=int, default=APPEND_TOKENS,
                        help="tokens appended to a session before its first new token")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs; the best is kept")
    parser.add_argument("--kv-budget", default="512MiB", help="each LLM's cache budget")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    if args.contexts is None:
        args.contexts = list(QUICK_CONTEXTS if args.quick else DEFAULT_CONTEXTS)
    if args.prompt_tokens is None:
        args.prompt_tokens = QUICK_PROMPT_TOKENS if args.quick else PROMPT_TOKENS
    if min(args.contexts) <= 0:
        parser.error("--contexts must be positive")
    if args.append < 1 or args.repeat < 1:
        parser.error("--append and --repeat must be at least 1")
    if args.prompt_tokens < 1:
        parser.error("--prompt-tokens must be positive")
    return args


def random_ids(config: ModelConfig, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (n,), generator=g).tolist()


def stdlib_text(name: str) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / name).read_text()


def check_capacity(llm: LLM, tokens: int) -> None:
    capacity = llm.memory_report()["capacity_tokens"]
    if capacity < tokens:
        raise SystemExit(f"--kv-budget holds {capacity:,} tokens; {tokens:,} are needed")


# ---- 1. resume ---------------------------------------------------------------------------
def session_name(context: int) -> str:
    return f"context-{context}"


def build_sessions(llm: LLM, contexts: list[int]) -> dict[str, float]:
    """Save a warm-up session and one session per context (its tokens and one greedy
    reply); the seconds each build took (a prefill of its context), by session name."""
    built = {}
    for name, context in [("warmup", WARMUP_TOKENS)] + [(session_name(c), c) for c in contexts]:
        s = llm.session(name)
        s.append(random_ids(llm.config, context, seed=context))
        start = time.perf_counter()
        s.generate(GREEDY_1)
        built[name] = time.perf_counter() - start
        s.save()
        s.close()
    return built


def resume_first_token(llm: LLM, name: str, appended: list[int]) -> tuple[float, float, int]:
    """Seconds from nothing held to the first new token of a saved session (resume, append,
    generate one), of which resume; and that token."""
    start = time.perf_counter()
    s: Session = llm.resume(name)
    loaded = time.perf_counter()
    s.append(appended)
    out = s.generate(GREEDY_1)
    end = time.perf_counter()
    s.close()
    return end - start, loaded - start, out.token_ids[0]


def best_resume(llm: LLM, name: str, appended: list[int],
                repeat: int) -> tuple[float, float, int]:
    runs = [resume_first_token(llm, name, appended) for _ in range(repeat)]
    return min(runs, key=lambda r: r[0])


def best_generate(llm: LLM, ids: list[int], repeat: int) -> tuple[float, int]:
    best, token = float("inf"), -1
    for _ in range(repeat):
        start = time.perf_counter()
        out = llm.generate(ids, GREEDY_1)[0]
        best, token = min(best, time.perf_counter() - start), out.token_ids[0]
    return best, token


def bench_resume(config: ModelConfig, contexts: list[int], append: int, repeat: int,
                 kv_budget: str, cache_dir: str) -> tuple[list[ResumeRow], list[DiskRow]]:
    need = max(contexts) + 1 + append + 1
    # (c) and the builder: no prefix cache (nothing to hit), exact replay (its decoder
    # re-runs the exact span: its first token is the reference the resumed ones are
    # compared with).
    base = LLM(config, random_init=True, kv_budget=kv_budget, replay="exact",
               enable_prefix_caching=False, cache_dir=cache_dir)
    check_capacity(base, need)
    built = build_sessions(base, contexts)  # the first build warms it up
    saved = {c: base.disk.show(session_name(c)) for c in contexts}
    appended = {c: random_ids(config, append, seed=c + 1) for c in contexts}
    reprefill = {c: best_generate(base, saved[c].token_ids + appended[c], repeat)
                 for c in contexts}
    del base
    resumed: dict[str, dict[int, tuple[float, float, int]]] = {}
    spans: dict[str, dict[int, tuple[int, int]]] = {}
    for mode in MODES:
        llm = LLM(config, random_init=True, kv_budget=kv_budget, replay=mode,
                  cache_dir=cache_dir)
        check_capacity(llm, need)
        resume_first_token(llm, "warmup", random_ids(config, append, seed=1))
        resumed[mode] = {c: best_resume(llm, session_name(c), appended[c], repeat)
                         for c in contexts}
        spans[mode] = {c: llm.model.rebuild_spans(saved[c].held_tokens, mode)
                       for c in contexts}
        del llm
    rows, disk = [], []
    for c in contexts:
        (c_s, c_token), (a_s, a_load, a_token), (b_s, b_load, b_token) = (
            reprefill[c], resumed["bounded"][c], resumed["exact"][c])
        rows.append(ResumeRow(
            context=saved[c].held_tokens, session_tokens=len(saved[c].token_ids),
            appended=append, build_s=built[session_name(c)], reprefill_s=c_s,
            bounded_s=a_s, exact_s=b_s,
            bounded_load_s=a_load, exact_load_s=b_load,
            bounded_replayed=spans["bounded"][c], exact_replayed=spans["exact"][c],
            bounded_same_token=a_token == c_token, exact_same_token=b_token == c_token,
            reprefill_over_bounded=c_s / a_s, reprefill_over_exact=c_s / b_s))
        tokens = len(saved[c].token_ids)
        disk_bytes, rings = saved[c].disk_bytes, saved[c].window_ring_bytes
        disk.append(DiskRow(
            context=c, tokens=tokens, disk_bytes=disk_bytes, window_ring_bytes=rings,
            bytes_per_token=disk_bytes / tokens,
            with_rings_bytes_per_token=(disk_bytes + rings) / tokens,
            with_rings_over_without=(disk_bytes + rings) / disk_bytes))
    return rows, disk


# ---- 2. prefix cache -----------------------------------------------------------------------
def ttft(llm: LLM, ids: list[int]) -> tuple[float, int, int]:
    """Time to first token of a max_tokens=1 request, its cached prompt tokens, its token."""
    out = llm.generate(ids, GREEDY_1)[0]
    return out.metrics["time_to_first_token_s"], out.num_cached_tokens, out.token_ids[0]


def bench_prefix(prompt_tokens: int, repeat: int, kv_budget: str,
                 cache_dir: str) -> tuple[list[PrefixRow], int]:
    rows = []
    limit = None
    for mode in MODES:
        llm = LLM("default", kv_budget=kv_budget, replay=mode, cache_dir=cache_dir)
        limit = llm.config.max_seq_len
        ids = llm.encode(stdlib_text(TEXT_FILE))
        if (prompt_tokens + SUFFIX_TOKENS >= limit
                or prompt_tokens + max(repeat - 1, SUFFIX_TOKENS * repeat) > len(ids)):
            raise SystemExit(f"--prompt-tokens {prompt_tokens} and a {SUFFIX_TOKENS}-token "
                             f"suffix ({repeat} of each) do not fit max_seq_len {limit} of "
                             f"the bundled model or the {len(ids):,} tokens of {TEXT_FILE}")
        llm.generate(llm.encode(stdlib_text(WARMUP_FILE))[:WARMUP_TOKENS], GREEDY_1)
        prompt = ids[:prompt_tokens]
        # Cold: every repeat a prompt no earlier request shares a block with (shifted by
        # one token, every block's hash differs); the last one is the first prompt.
        colds = [ttft(llm, ids[r : r + prompt_tokens]) for r in range(repeat - 1, -1, -1)]
        cold_s, cold_token = min(t for t, _, _ in colds), colds[-1][2]
        hits = [ttft(llm, prompt) for _ in range(repeat)]
        hit_s = min(t for t, _, _ in hits)
        # Partial: the prompt and tokens that follow it, new each repeat.
        tail = ids[prompt_tokens:]
        partials = [ttft(llm, prompt + tail[r * SUFFIX_TOKENS : (r + 1) * SUFFIX_TOKENS])
                    for r in range(repeat)]
        partial_s = min(t for t, _, _ in partials)
        rows.append(PrefixRow(
            replay=mode, prompt_tokens=prompt_tokens, cold_ttft_s=cold_s, hit_ttft_s=hit_s,
            hit_cached_tokens=hits[0][1], hit_same_token=hits[0][2] == cold_token,
            partial_tokens=prompt_tokens + SUFFIX_TOKENS, partial_ttft_s=partial_s,
            partial_cached_tokens=partials[0][1], cold_over_hit=cold_s / hit_s,
            cold_over_partial=cold_s / partial_s))
        del llm
    return rows, limit


# ---- report --------------------------------------------------------------------------------
def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render_resume(console: Console, rows: list[ResumeRow]) -> None:
    table = Table(title="1. time to the first new token of a saved session")
    for name in ("context", "(c) re-prefill", "(a) bounded", "×(c)", "(b) exact", "×(c)"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            f"{r.context:,}", f"{r.reprefill_s:.3f} s", f"{r.bounded_s:.3f} s",
            f"{r.reprefill_over_bounded:.1f}×", f"{r.exact_s:.3f} s",
            f"{r.reprefill_over_exact:.1f}×")
    console.print(table)
    detail = Table(title="1. of which: loading, replay, fidelity")
    for name in ("context", "build", "(a) load", "replayed", "same", "(b) load", "replayed",
                 "same"):
        detail.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        detail.add_row(
            f"{r.context:,}", f"{r.build_s:.2f} s", f"{r.bounded_load_s:.3f} s",
            "+".join(map(str, r.bounded_replayed)), yes(r.bounded_same_token),
            f"{r.exact_load_s:.3f} s", "+".join(map(str, r.exact_replayed)),
            yes(r.exact_same_token))
    console.print(detail)


def render_prefix(console: Console, rows: list[PrefixRow]) -> None:
    table = Table(title=f"2. time to first token, bundled model, a {rows[0].prompt_tokens:,}-"
                        f"token prompt of {TEXT_FILE}")
    for name in ("replay", "cold s", "hit s", "cached", "same", "×hit", "part s", "cached",
                 "×part"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            r.replay, f"{r.cold_ttft_s:.3f}", f"{r.hit_ttft_s:.3f}", f"{r.hit_cached_tokens:,}",
            yes(r.hit_same_token), f"{r.cold_over_hit:.1f}×", f"{r.partial_ttft_s:.3f}",
            f"{r.partial_cached_tokens:,}", f"{r.cold_over_partial:.1f}×")
    console.print(table)


def render_disk(console: Console, rows: list[DiskRow]) -> None:
    table = Table(title="3. disk bytes of a saved session")
    for name in ("context", "tokens", "disk B", "B/token", "rings B", "+rings B/token", "×"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            f"{r.context:,}", f"{r.tokens:,}", f"{r.disk_bytes:,}", f"{r.bytes_per_token:.2f}",
            f"{r.window_ring_bytes:,}", f"{r.with_rings_bytes_per_token:.2f}",
            f"{r.with_rings_over_without:.3f}×")
    console.print(table)


def summary(resume: list[ResumeRow], prefix: list[PrefixRow], disk: list[DiskRow]) -> str:
    def by_context(attr: str) -> str:
        return ", ".join(f"{r.context:,}: {getattr(r, attr):.1f}×" for r in resume)

    hit = ", ".join(f"{r.replay} {r.cold_over_hit:.1f}×" for r in prefix)
    rings = ", ".join(f"{r.context:,}: {r.with_rings_over_without:.3f}×" for r in disk)
    return (f"re-prefill / resume, bounded: {by_context('reprefill_over_bounded')}; exact: "
            f"{by_context('reprefill_over_exact')} | cold / prefix hit: {hit} | disk with "
            f"window rings / without: {rings}")


def main() -> None:
    args = parse_args()
    contexts = sorted(set(args.contexts))
    config = preset("default").replace(max_seq_len=max(contexts) + args.append + 64)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstack-resume-") as cache_dir:
        resume, disk = bench_resume(config, contexts, args.append, args.repeat,
                                    args.kv_budget, cache_dir)
        prefix, prefix_limit = bench_prefix(args.prompt_tokens, args.repeat, args.kv_budget,
                                            cache_dir)
    wall = time.perf_counter() - started
    line = summary(resume, prefix, disk)
    if args.json:
        report: dict[str, Any] = {
            "config": {"preset": "default", "random_init": True, "dim": config.dim,
                       "n_layers": config.n_layers,
                       "n_encoder_layers": config.n_encoder_layers,
                       "window_size": config.window_size, "max_seq_len": config.max_seq_len},
            "prefix_model": {"model": "default (bundled)", "max_seq_len": prefix_limit,
                             "text": TEXT_FILE, "suffix_tokens": SUFFIX_TOKENS},
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "repeat": args.repeat,
            "kv_budget": args.kv_budget,
            "wall_s": wall,
            "resume": [asdict(r) for r in resume],
            "prefix_cache": [asdict(r) for r in prefix],
            "disk": [asdict(r) for r in disk],
            "summary": line,
        }
        print(json.dumps(report, indent=2))
        return
    console = Console()
    render_resume(console, resume)
    console.print(
        f"default preset, random weights, max_seq_len {config.max_seq_len:,}; "
        f"{args.append} tokens appended after the saved session's reply; best of "
        f"{args.repeat}. (c) = a fresh request of the same tokens, prefix cache off, exact "
        "replay; (a), (b) = LLM.resume + append + generate(max_tokens=1) on a fresh LLM; "
        "×(c) = (c)'s seconds over the column's; build = the prefill that built the session "
        "(in no ratio); load = of (a), (b), the LLM.resume call; replayed = tokens re-run "
        "through the encoder + the decoder (Model.rebuild_spans); same = first token equal "
        "to (c)'s.")
    render_prefix(console, prefix)
    console.print(
        f"one LLM per replay mode, prefix cache on; cold = first sight of the prompt; hit = "
        f"the same prompt again; part = a partial hit, the prompt and the next {SUFFIX_TOKENS} "
        "tokens of the file; s = RequestOutput.metrics time_to_first_token_s; cached = "
        "RequestOutput.num_cached_tokens; same = the hit's first token equal to the cold "
        "run's; ×hit, ×part = the cold time over theirs.")
    render_disk(console, disk)
    console.print(
        "disk B = the saved session's block files (DiskTier.show disk_bytes; the token ids "
        "in the manifest, 4 B each, are not counted); rings B = what saving its window rings "
        "too would add, a fixed cost per session; +rings = the block files and the rings; × "
        "= with rings over without. "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {wall:.0f} s in all.")
    console.print(f"summary: {line}", markup=False)


if __name__ == "__main__":
    main()
