"""What each mechanism of the stack buys: small models of the bundled recipe, one mechanism
changed at a time, trained on the same data and token budget, then measured side by side.

    python bench/ablations.py train [--budget cpu|gpu] [--only NAME ...] [--jobs 2]
    python bench/ablations.py eval  [--budget cpu|gpu] [--only NAME ...]
    python bench/ablations.py speed
    python bench/ablations.py table [--budget cpu|gpu]

`train` runs `kvstack train` once per recipe (each a run directory under runs/ that
resumes if killed; each process one thread). `eval` measures every finished run into the
budget's results directory (one JSON file per run, with its training command): cache bytes
per token (HBM and disk, from kvstack.formats through the cache layout), held-out
perplexity (overall and beyond the largest window), retrieval on the held-out families at
1x / 4x / 16x the training length. `speed` times batch-1 decode at a 4K context of every
recipe's model side by side in one process (one thread, rounds interleaved, the best of
each); a step's cost depends on the configuration alone, so both budgets' tables read the
one timing. `table` reads only those files, prints the table with the gap between the two
seeds of the bundled recipe, and draws quality against bytes per token.

Two token budgets (BUDGETS), each the same for every recipe: `cpu`, 200 steps of 16 rows
of 512 tokens (1.6M tokens, 3.6 % of the bundled model's first stage, 46M: what a 2-core
CPU trains ten times over in a few hours), and `gpu`, 250 steps of 64 rows (8.2M tokens,
18 %: all ten side by side on one H200 in about six minutes). The figures compare the
recipes with each other at one budget; they are not the bundled model's.
"""

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvstack.config import ModelConfig, preset
from kvstack.plan import mechanism_variants

ROOT = Path(__file__).resolve().parent.parent

SEQ_LEN = 512


@dataclass(frozen=True)
class Budget:
    """How long every recipe trains, and where: the bundled recipe scaled to the budget
    (its learning rate, and its warm-up and dense warm-up in the same proportion of the
    run), half of the rows retrieval samples (the six forms of the bundled model's first
    long-context stages, no loss on their definitions)."""
    name: str
    device: str
    steps: int
    batch_size: int  # rows per micro-batch
    grad_accum: int
    warmup_steps: int
    dense_warmup_steps: int
    checkpoint_every: int

    @property
    def rows(self) -> int:  # per optimizer step
        return self.batch_size * self.grad_accum

    @property
    def tokens(self) -> int:
        return self.steps * self.rows * SEQ_LEN

    def args(self) -> list[str]:
        return [
            "--device", self.device, "--steps", str(self.steps), "--seq-len", str(SEQ_LEN),
            "--batch-size", str(self.batch_size), "--grad-accum", str(self.grad_accum),
            "--lr", "3e-3", "--warmup-steps", str(self.warmup_steps),
            "--dense-warmup-steps", str(self.dense_warmup_steps),
            "--eval-every", str(self.steps // 2),
            "--checkpoint-every", str(self.checkpoint_every),
            "--retrieval-rate", "0.5", "--retrieval-keys", "4", "--retrieval-families", "six",
            "--no-define-loss",
        ]

    @property
    def runs(self) -> Path:  # one run directory per recipe
        return ROOT / "runs" / f"ablations{self.suffix}"

    @property
    def results(self) -> Path:  # one JSON file per run
        return ROOT / "bench" / "results" / f"ablations{self.suffix}"

    @property
    def suffix(self) -> str:  # the CPU budget's paths came first and keep their names
        return "" if self.name == "cpu" else f"-{self.name}"


BUDGETS = {b.name: b for b in (
    Budget("cpu", "cpu", steps=200, batch_size=8, grad_accum=2, warmup_steps=15,
           dense_warmup_steps=20, checkpoint_every=20),
    # The bundled model's first stage ran 64-row steps on an H200 (docs/training-on-a-gpu.md).
    Budget("gpu", "cuda", steps=250, batch_size=64, grad_accum=1, warmup_steps=18,
           dense_warmup_steps=25, checkpoint_every=25),
)}


@dataclass(frozen=True)
class Recipe:
    name: str
    what: str  # the one change from the bundled recipe
    change: Callable[[ModelConfig], ModelConfig] | None = None
    preset: str = "default"
    seed: int = 0

    def config(self) -> ModelConfig:
        base = preset(self.preset)
        return self.change(base) if self.change else base

    def sets(self) -> list[str]:
        """The change as `kvstack train --set` arguments: every key it alters."""
        base, changed = preset(self.preset).to_dict(), self.config().to_dict()
        return [f"{k}={json.dumps(v)}" for k, v in changed.items() if v != base[k]]

    def command(self, budget: Budget, runs: Path) -> list[str]:
        cmd = [sys.executable, "-m", "kvstack.cli", "train", "--preset", self.preset,
               "--out", str(runs / self.name), "--seed", str(self.seed), *budget.args()]
        for s in self.sets():
            cmd += ["--set", s]
        return cmd


def _mechanism(label: str) -> Callable[[ModelConfig], ModelConfig]:
    """One of `kvstack plan`'s mechanism rows, so that the trained model is the one whose
    bytes that table counts."""
    return lambda c: next(v.config for v in mechanism_variants(c) if v.label == label)


# The bundled layout (kvstack/config.py, preset "default"): layer 0 window-only; 1-3 the
# encoder's ratio-2 Full / Reuse / Reindex; 4-7 the CED decoder stream (ratio 1) that 4
# writes, with 6 a Reindex layer and 4 the candidate pool's source.
RECIPES = (
    Recipe("bundled", "as bundled"),
    Recipe("bundled-seed1", "as bundled, second seed", seed=1),
    Recipe("bf16-caches", "bf16 caches (no QAT)", _mechanism("bf16 cache")),
    # The encoder's compressed layers each write their own stream; the decoder keeps the
    # one CED stream (that is the next row).
    Recipe("no-sharing", "no sharing: every encoder compressed layer Full",
           _mechanism("no sharing")),
    # Every decoder compressed layer writes its own ratio-1 stream; the candidate pool is
    # over one stream that later layers read, so it goes too.
    Recipe("no-ced", "no CED: every decoder layer its own stream", _mechanism("no CED")),
    # A top-k as large as the longest context: every visible compressed entry is attended.
    Recipe("dense-compressed", "dense compressed attention (no top-k)",
           lambda c: c.replace(index_topk=c.max_seq_len, candidate_source_layer=None)),
    Recipe("no-candidates", "no candidate pool",
           lambda c: c.replace(candidate_source_layer=None)),
    Recipe("window-64", "window 64", lambda c: c.replace(window_size=64)),
    Recipe("window-256", "window 256", lambda c: c.replace(window_size=256)),
    Recipe("dense-control", "dense control (MQA, bf16, every token)", preset="dense-default"),
)
BY_NAME = {r.name: r for r in RECIPES}


def selected(names: list[str] | None) -> list[Recipe]:
    unknown = sorted(set(names or ()) - set(BY_NAME))
    if unknown:
        raise SystemExit(f"unknown recipe {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in names] if names else list(RECIPES)  # in the order asked


def finished(run: Path, budget: Budget) -> bool:
    log = run / "log.jsonl"
    if not log.exists():
        return False
    lines = log.read_text().splitlines()
    return bool(lines) and json.loads(lines[-1])["step"] >= budget.steps


def train(args: argparse.Namespace) -> None:
    budget = BUDGETS[args.budget]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def one(recipe: Recipe) -> int:
        run = budget.runs / recipe.name
        if finished(run, budget):
            return 0
        run.parent.mkdir(parents=True, exist_ok=True)
        corpus = ["--corpus", str(args.corpus)] if args.corpus else []
        with open(budget.runs / f"{recipe.name}.out", "a") as out:
            return subprocess.run(recipe.command(budget, budget.runs) + corpus, env=env,
                                  cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode

    recipes = selected(args.only)
    with ThreadPoolExecutor(args.jobs or len(recipes)) as pool:
        codes = list(pool.map(one, recipes))
    failed = [r.name for r, c in zip(recipes, codes, strict=True) if c]
    if failed:
        raise SystemExit(f"training failed for {', '.join(failed)} "
                         f"(see {budget.runs}/NAME.out)")


# ---- eval: every finished run's figures, one file each ----------------------------------
PPL_WINDOWS = 64
RETRIEVAL_LENGTHS = (SEQ_LEN, 4 * SEQ_LEN, 16 * SEQ_LEN)  # 1x, 4x, 16x the training length
RETRIEVAL_DEPTHS = (0.1, 0.5, 0.9)
RETRIEVAL_SAMPLES = 8  # per length and depth: 24 questions per length
DECODE_CONTEXT = 4096
# Beyond every recipe's window (the largest is 256) and inside the training length.
FAR = f"{SEQ_LEN // 2}-{SEQ_LEN}"


def measure(recipe: Recipe, budget: Budget) -> dict:
    import torch

    from kvstack.cache.layout import CacheLayout
    from kvstack.eval.quality import heldout_tokens, load_eval_model, perplexity, retrieval
    from kvstack.plan import make_plan

    torch.set_num_threads(1)
    run = budget.runs / recipe.name
    model, tokenizer = load_eval_model(run / "checkpoint" / "model")
    data = heldout_tokens(tokenizer, run / "heldout.npy")
    stored = make_plan(model.config, recipe.name)["mechanisms"][0]  # as configured
    ppl = perplexity(model, data, SEQ_LEN, PPL_WINDOWS)
    found = retrieval(model, tokenizer, data, list(RETRIEVAL_LENGTHS), list(RETRIEVAL_DEPTHS),
                      RETRIEVAL_SAMPLES, forms="held-out")
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return {
        "what": recipe.what, "preset": recipe.preset, "seed": recipe.seed,
        "budget": budget.name,
        "command": " ".join(["OMP_NUM_THREADS=1", "kvstack", *recipe.command(
            budget, budget.runs.relative_to(ROOT))[3:]]),
        "tokens": log[-1]["step"] * budget.rows * SEQ_LEN,
        "final_heldout_loss": next(
            (r["heldout_loss"] for r in reversed(log) if "heldout_loss" in r), None),
        "params": sum(p.numel() for p in model.parameters()),
        "hbm_bytes_per_token": stored["hbm_bytes_per_token"],
        "disk_bytes_per_token": stored["persistent_bytes_per_token"],
        "window_ring_bytes_per_sequence":
            CacheLayout.from_config(model.config).window_bytes_per_sequence,
        "ppl": ppl["ppl"], "ppl_far": ppl["ppl_by_position"][FAR], "ppl_windows": PPL_WINDOWS,
        "retrieval": {str(n): sum(row) / len(row)
                      for n, row in zip(RETRIEVAL_LENGTHS, found["accuracy"], strict=True)},
        "answer_nll": {str(n): nll
                       for n, nll in zip(RETRIEVAL_LENGTHS, found["answer_nll"], strict=True)},
        "retrieval_families": found["families"],
        "retrieval_questions_per_length": RETRIEVAL_SAMPLES * len(RETRIEVAL_DEPTHS),
    }


def evaluate(args: argparse.Namespace) -> None:
    budget = BUDGETS[args.budget]
    budget.results.mkdir(parents=True, exist_ok=True)
    for recipe in selected(args.only):
        if not finished(budget.runs / recipe.name, budget):
            print(f"{recipe.name}: not trained to step {budget.steps} yet, skipped")
            continue
        row = measure(recipe, budget)
        path = budget.results / f"{recipe.name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(row, indent=1) + "\n")
        tmp.replace(path)  # whole or not at all: evaluations may run side by side
        print(f"{recipe.name}: {json.dumps(row)}")


DECODE_ROUNDS = 5
TIMING = ROOT / "bench" / "results" / "ablations-decode.json"  # read by both budgets' tables


def speed(args: argparse.Namespace) -> None:
    """Decode tokens/s of every recipe's model at DECODE_CONTEXT, measured side by side:
    random weights (a step's cost does not depend on them) and a cache filled through its
    real write path (bench/decode.py), each round timing every model once, so that the
    machine's drift falls on all of them alike."""
    from contextlib import ExitStack

    import torch
    from decode import engine, engine_step, time_interleaved  # bench/ is on the path

    torch.set_num_threads(1)
    with ExitStack() as open_steps:
        systems = {recipe.name: open_steps.enter_context(
            engine_step(engine(recipe.config(), DECODE_CONTEXT + 64), DECODE_CONTEXT))
            for recipe in RECIPES}
        best = time_interleaved(systems, steps=16, repeat=DECODE_ROUNDS)
    out = {"context": DECODE_CONTEXT, "batch": 1, "threads": 1, "rounds": DECODE_ROUNDS,
           "tok_s": best}
    TIMING.write_text(json.dumps(out, indent=1) + "\n")
    for name, tok_s in best.items():
        print(f"{name}: {tok_s:.1f} tok/s ({tok_s / best['bundled']:.2f}x as bundled)")


def load(results: Path, timing: Path) -> dict:
    """Every measured run in the results directory, by recipe name, with its decode speed
    from the side-by-side timing where that has run."""
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))
            if p.stem in BY_NAME}
    tok_s = json.loads(timing.read_text())["tok_s"] if timing.exists() else {}
    for name, row in runs.items():
        if name in tok_s:
            row["decode_tok_s_4k"] = tok_s[name]
    return runs


# ---- table: the results as a table and a plot -------------------------------------------
SEEDS = ("bundled", "bundled-seed1")  # the recipe trained twice, for run-to-run noise
METRICS = (  # key, heading
    ("ppl", "ppl"), ("ppl_far", f"ppl {FAR}"),
    *((f"retrieval.{n}", f"found {n // SEQ_LEN}x") for n in RETRIEVAL_LENGTHS),
    # Nats per answer token, the answer fed back: it moves before a greedy answer is exact.
    *((f"answer_nll.{n}", f"nll {n // SEQ_LEN}x") for n in RETRIEVAL_LENGTHS),
    ("decode_tok_s_4k", "tok/s 4K"),
)


def value(row: dict, key: str) -> float:
    head, _, rest = key.partition(".")
    return row[head][rest] if rest else row[head]


def measured(results: dict) -> list[tuple[str, str]]:
    """The metrics every run has (results measured before a metric existed lack it)."""
    def has(row: dict, key: str) -> bool:
        head, _, rest = key.partition(".")
        return head in row and (not rest or rest in row[head])
    return [(k, h) for k, h in METRICS if all(has(row, k) for row in results.values())]


def noise(results: dict) -> dict[str, float]:
    """Per metric, the gap between the two seeds of the bundled recipe."""
    a, b = (results[name] for name in SEEDS)
    return {key: abs(value(a, key) - value(b, key)) for key, _ in measured(results)}


def render(results: dict) -> str:
    """The table as Markdown: each metric, and its change from the bundled recipe's mean
    over the two seeds, starred where it is more than twice the seeds' gap."""
    gap, metrics = noise(results), measured(results)
    base = {key: sum(value(results[n], key) for n in SEEDS) / 2 for key, _ in metrics}
    heads = ["recipe", "HBM B/tok", "disk B/tok", *(h for _, h in metrics)]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for name in [r.name for r in RECIPES if r.name in results]:
        row = results[name]
        cells = [row["what"], f"{row['hbm_bytes_per_token']:,.1f}",
                 f"{row['disk_bytes_per_token']:,.1f}"]
        for key, _ in metrics:
            v = value(row, key)
            text = f"{v:.0%}" if key.startswith("retrieval") else f"{v:.2f}" if key.startswith(
                ("ppl", "answer_nll")) else f"{v:.1f}"
            if name not in SEEDS:
                delta = v - base[key]
                star = "*" if abs(delta) > 2 * gap[key] else ""
                if key.startswith("retrieval"):
                    text += f" ({delta * 100:+.0f}{star})"
                else:
                    text += f" ({delta / base[key]:+.1%}{star})"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Seed gap (bundled recipe, seeds 0 and 1): " + ", ".join(
        f"{h} {gap[k] * 100:.0f} points" if k.startswith("retrieval") else
        f"{h} {gap[k] / base[k]:.1%}" for k, h in metrics))
    return "\n".join(lines)


def plot(results: dict, budget: Budget, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in RECIPES if r.name in results]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, label in ((axes[0], "ppl", "held-out perplexity (512 tokens)"),
                           (axes[1], "ppl_far", f"held-out perplexity, positions {FAR}")):
        at: dict[float, list[tuple[float, str]]] = {}  # recipes at one byte count
        for name in names:
            row = results[name]
            x, y = row["hbm_bytes_per_token"], value(row, key)
            ax.scatter(x, y, color="tab:red" if name in SEEDS else "tab:blue", zorder=2)
            at.setdefault(x, []).append((y, name))
        for x, points in at.items():  # a crowded column's labels stacked to its left
            crowded = len(points) > 1
            for i, (y, name) in enumerate(sorted(points)):
                offset = 12 * (i - (len(points) - 1) / 2) if crowded else 0
                ax.annotate(name, (x, y), textcoords="offset points", fontsize=8,
                            xytext=(-40 if crowded else 8, offset), va="center",
                            ha="right" if crowded else "left",
                            arrowprops=dict(arrowstyle="-", lw=0.4, color="grey"))
        ax.set_xscale("log")
        ticks: list[float] = []
        for t in sorted(at):  # a tick per byte count, but none crowding the last one
            if not ticks or t / ticks[-1] > 1.4:
                ticks.append(t)
        ax.set_xticks(ticks, [f"{t:,.0f}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlim(ticks[0] / 6, ticks[-1] * 2.5)
        ax.set_xlabel("cache bytes per token (log)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Quality against cache bytes: {budget.steps} steps x {budget.rows} x "
                 f"{SEQ_LEN} tokens per recipe")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(args: argparse.Namespace) -> None:
    budget = BUDGETS[args.budget]
    where = args.results or budget.results
    results = load(where, args.timing)
    missing = [r.name for r in RECIPES if r.name not in results]
    if any(name in missing for name in SEEDS):
        raise SystemExit(f"{where}: the bundled recipe's two seeds are needed for the "
                         f"noise; missing {', '.join(n for n in SEEDS if n in missing)}")
    untimed = [n for n, row in results.items() if "decode_tok_s_4k" not in row]
    if untimed:
        raise SystemExit(f"{args.timing}: no decode timing for {', '.join(untimed)}; run "
                         "`python bench/ablations.py speed` first")
    print(render(results))
    if missing:
        print(f"\nnot measured yet: {', '.join(missing)}")
    if args.plot:
        plot(results, budget, args.plot)
        print(f"\nplot: {args.plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train every recipe (resumes)")
    t.add_argument("--only", nargs="+")
    t.add_argument("--jobs", type=int, default=2,
                   help="runs side by side (one thread each); 0: every recipe at once")
    t.add_argument("--corpus", type=Path,
                   help="the standard library's .py files copied from the machine that "
                        "built the token caches (default: this Python's)")
    t.set_defaults(run=train)
    e = sub.add_parser("eval", help="measure every finished run into the results directory")
    e.add_argument("--only", nargs="+")
    e.set_defaults(run=evaluate)
    d = sub.add_parser("speed", help="decode tokens/s of every recipe, side by side")
    d.set_defaults(run=speed)
    b = sub.add_parser("table", help="the results as a Markdown table and a plot")
    b.add_argument("--results", type=Path, help="default: the budget's results directory")
    b.add_argument("--timing", type=Path, default=TIMING)
    b.add_argument("--plot", type=Path, help="where to draw quality against bytes per token "
                   "(PNG; default bench/ablations.png, bench/ablations-gpu.png)")
    b.set_defaults(run=table)
    for p in (t, e, b):
        p.add_argument("--budget", choices=BUDGETS, default="cpu")
    args = parser.parse_args()
    if args.command == "table" and args.plot is None:
        args.plot = ROOT / "bench" / f"ablations{BUDGETS[args.budget].suffix}.png"
    args.run(args)


if __name__ == "__main__":
    main()
