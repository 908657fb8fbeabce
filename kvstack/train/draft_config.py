"""`kvstack train-draft`'s settings (`kvstack.train.dspark`), apart so that parsing the
command loads no torch."""

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DraftTrainConfig:
    target: str  # the target's model directory (config.json, weights, tokenizer.json)
    steps: int = 300
    batch_size: int = 8  # rows a step
    # A row is a window of corpus tokens, then `continuation` tokens the target writes
    # after it greedily: what the draft meets in the engine, where every token before a
    # block is the target's own choice.
    continuation: int = 128
    rows: int = 1024  # such rows made once for training (and 32 held-out ones)
    positions: int = 32  # draft blocks a row
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
        for key in ("steps", "batch_size", "continuation", "rows", "positions", "block_size",
                    "stages", "markov_rank", "eval_every", "checkpoint_every"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"train-draft setting {key} must be a positive integer, got "
                                 f"{value!r}")
        if not self.lr > 0:
            raise ValueError(f"train-draft setting lr must be positive, got {self.lr!r}")
        if not (Path(self.target) / "tokenizer.json").exists():
            raise ValueError(f"target {self.target}: not a model directory with a "
                             "tokenizer.json (the corpus is tokenised with the target's)")
