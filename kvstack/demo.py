"""`kvstack demo`: read a long real file as an agent ingests a repository, continue it,
and show what the cache costs beside a dense control of the same width and depth.

Both models run through the engine; every byte figure is measured from the pools the
engine allocated, every speed from the same run.
"""

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvstack.engine import LLM, SamplingParams
from kvstack.engine.loading import bundled_model

# Shipped beside the bundled model as package data, so an installed wheel shows both columns.
BUNDLED_CONTROL = bundled_model().parent / "dense-default"
DEMO_FILE = "inspect.py"  # a large, self-contained standard-library module


@dataclass
class Session:
    name: str
    text: str
    prompt_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    report: dict[str, Any]

    @property
    def session_bytes(self) -> float:
        r = self.report
        return r["tokens_in_use"] * r["in_use_bytes_per_token"] + r["window_bytes_per_sequence"]


def run_session(name: str, model: str | Path, source: str, context: int,
                max_tokens: int) -> Session:
    llm = LLM(model, kv_budget="512MiB", replay="bounded", max_num_seqs=1)
    # Stop two thirds into the file, so there is code to continue (at its end the right
    # continuation is end-of-file).
    ids = llm.tokenizer.encode(source)
    ids = ids[: len(ids) * 2 // 3][-context:]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    # keep_cache: the report below sees the session's cache as it stood at the end.
    final = list(llm.stream(ids, params, keep_cache=True))[-1]
    metrics = final.metrics
    return Session(name, final.text, len(ids), len(ids) / metrics["time_to_first_token_s"],
                   metrics.get("decode_tokens_per_s", 0.0), llm.memory_report(len(ids)))


def figures(s: Session, hbm_bytes: float = 80e9) -> dict[str, float]:
    per_session = s.session_bytes
    return {
        "bytes_per_token": s.report["bytes_per_token"],
        "planned_bytes_per_token": s.report["planned_bytes_per_token"],
        "session_bytes": per_session,
        "prefill_tokens_per_s": s.prefill_tok_s,
        "decode_tokens_per_s": s.decode_tok_s,
        "sessions_in_80_gb": int(hbm_bytes // per_session),
    }


def _max_seq_len(model: Path) -> int:
    from kvstack.config import ModelConfig

    return ModelConfig.from_json(model / "config.json").max_seq_len


def demo(model: str | Path | None = None, control: str | Path | None = None,
         context: int = 3072, max_tokens: int = 48, console: Console | None = None
         ) -> dict[str, Any]:
    console = console or Console()
    why = "it holds no model.safetensors" if model else "the bundled model is not trained yet"
    model = Path(model) if model else bundled_model()
    control = Path(control) if control else BUNDLED_CONTROL
    if not (model / "model.safetensors").is_file():
        raise ValueError(f"no model at {model}: {why}")
    if not (control / "model.safetensors").is_file():
        raise ValueError(f"no dense control at {control}: it holds no model.safetensors")
    limit = _max_seq_len(model) - max_tokens
    if context > limit:
        raise ValueError(f"--context {context:,} is more than the model takes: at most "
                         f"{limit:,} tokens of prompt leave room for {max_tokens} new ones "
                         f"(max_seq_len {limit + max_tokens:,})")
    path = Path(sysconfig.get_paths()["stdlib"]) / DEMO_FILE
    source = path.read_text()
    console.print(f"[bold]kvstack demo[/bold]: reading {path} ({len(source):,} characters) "
                  f"as an agent ingests a repository; {context:,} tokens up to two thirds of it "
                  "are the prompt")
    sessions = []
    with console.status("prefill and decode with the compressed stack…"):
        sessions.append(run_session("kvstack (V4.1 stack)", model, source, context,
                                    max_tokens))
    console.print("[bold]continuation[/bold] (greedy, bundled model):")
    console.print(sessions[0].text, markup=False, highlight=False)
    with console.status("the same with the dense control…"):
        sessions.append(run_session("dense control (GQA bf16)", control, source, context,
                                    max_tokens))
    rows = {s.name: figures(s) for s in sessions}
    table = Table(title=f"the same {sessions[0].prompt_tokens:,}-token session",
                  title_justify="left")
    table.add_column("measured")
    for s in sessions:
        table.add_column(s.name, justify="right")
    labels = (
        ("cache bytes / token", "bytes_per_token", "{:,.1f}"),
        ("cache for this session", "session_bytes", "{:,.0f} B"),
        ("prefill tokens / s", "prefill_tokens_per_s", "{:,.0f}"),
        ("decode tokens / s", "decode_tokens_per_s", "{:,.1f}"),
        ("sessions in 80 GB", "sessions_in_80_gb", "{:,}"),
    )
    for label, key, fmt in labels:
        table.add_row(label, *(fmt.format(rows[s.name][key]) for s in sessions))
    console.print(table)
    return {"context": sessions[0].prompt_tokens, "continuation": sessions[0].text,
            "models": rows}
