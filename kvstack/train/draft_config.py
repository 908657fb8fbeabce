"""`kvstack train-draft`'s settings (`kvstack.train.dspark`), apart so that parsing the
command loads no torch."""

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DraftTrainConfig:
    target: str  # the target's model directory (config.json, weights, tokenizer.json)
    steps: int = 300
    batch_size: int = 8  # corpus rows a step
    seq_len: int = 384  # tokens a row: more than the window, for whole contexts
    positions: int = 16  # draft blocks a row
    block_size: int = 5  # dspark_block_size: the drafts a block proposes
    stages: int = 1  # n_mtp_layers
    markov_rank: int = 64
    lr: float = 2e-3
    warmup_steps: int = 20
    heldout_percent: float = 2.0
    eval_every: int = 50
    checkpoint_every: int = 50
    seed: int = 0
    corpus: str | None = None  # a directory of .py files (default: the standard library)

    def check(self) -> None:
        for key in ("steps", "batch_size", "seq_len", "positions", "block_size", "stages",
                    "markov_rank", "eval_every", "checkpoint_every"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"train-draft setting {key} must be a positive integer, got "
                                 f"{value!r}")
        if not self.lr > 0:
            raise ValueError(f"train-draft setting lr must be positive, got {self.lr!r}")
        if not (Path(self.target) / "tokenizer.json").exists():
            raise ValueError(f"target {self.target}: not a model directory with a "
                             "tokenizer.json (the corpus is tokenised with the target's)")
