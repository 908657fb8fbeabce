"""DSpark's draft trained for a trained target, the target frozen (`kvstack train-draft`).

The recipe of DeepSeek's DeepSpec, on a CPU's budget: each step takes rows of the corpus,
runs the target over them once (no gradient) for its logits and the target layers' states
(`ModelOutput.target_hidden`), and picks `positions` decode positions p in each row. At
each the draft makes its block as the engine makes it -- the states of the last `window`
positions, the token p+1, then noise tokens -- with the Markov head fed the corpus's own
next tokens (teacher forcing), and learns:
- the target's choice at every block position (cross-entropy against the target's argmax
  given the same prefix: what a verify accepts), and
- the confidence head, each position's chance that it is accepted given that every one
  before it was (binary cross-entropy on whether the draft's argmax is the target's, over
  the positions whose predecessors all were), which the engine's verify length reads.
The trunk, the embedding and the head are the target's and stay frozen; only `draft.*`
trains. The run directory holds its settings (`train_config.json`), a JSON-lines log, the
tokenised corpus, and a checkpoint written whole or not at all (a killed run resumes from
it); the finished model (the target with its draft) is `OUT/model`.
"""

import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from kvstack.corpus.data import TokenCache, split_corpus, stdlib_root
from kvstack.model import Model
from kvstack.model.checkpoint import float_state_dict
from kvstack.train.draft_config import DraftTrainConfig
from kvstack.train.trainer import lock_run, replace_text, swap_in, trim_log


class DraftTrainer:
    def __init__(self, tc: DraftTrainConfig, out: str | Path) -> None:
        tc.check()
        self.tc, self.out = tc, Path(out)
        target = Model.from_pretrained(tc.target)
        c = target.config
        if c.arch != "v41":
            raise ValueError(f"target {tc.target}: DSpark drafts for a V4.1 model, this one "
                             f"is {c.arch}")
        if tc.seq_len <= c.window_size + tc.block_size + 1:
            raise ValueError(f"seq_len {tc.seq_len} must exceed the window ({c.window_size}) "
                             f"and a block ({tc.block_size}) by more than one token")
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock = lock_run(self.out, "train-draft")
        saved = self.out / "train_config.json"
        if saved.exists():
            before = json.loads(saved.read_text())
            differs = [k for k, v in asdict(tc).items() if k != "steps" and before.get(k) != v]
            if differs:
                raise ValueError(f"{self.out} holds a run with other settings ("
                                 f"{', '.join(differs)}); use a new --out, or the same "
                                 "settings to resume (--steps may grow)")
        replace_text(saved, json.dumps(asdict(tc), indent=2))
        kv = set(c.kv_source_layers)
        self.config = c.replace(
            n_mtp_layers=tc.stages, compress_ratios=[*c.compress_ratios, *[0] * tc.stages],
            dspark_block_size=tc.block_size, dspark_markov_rank=tc.markov_rank,
            dspark_noise_token_id=_noise_token(tc.target),
            dspark_target_layer_ids=[i for i in range(c.n_layers) if i not in kv][-3:])
        torch.manual_seed(tc.seed)
        self.model = Model(self.config)
        missing, unexpected = self.model.load_state_dict(float_state_dict(target),
                                                         strict=False)
        if unexpected or any(not name.startswith("draft.") for name in missing):
            raise ValueError(f"target {tc.target}: its weights do not fit its own config "
                             f"({unexpected[:3] or missing[:3]})")
        for name, p in self.model.named_parameters():
            p.requires_grad_(name.startswith("draft."))
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trained, lr=tc.lr, betas=(0.9, 0.95),
                                           weight_decay=0.0)
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(tc.target) / "tokenizer.json"))
        root = Path(tc.corpus) if tc.corpus else stdlib_root()
        train_files, heldout_files = split_corpus(root, tc.heldout_percent)
        self.train_data = TokenCache.build(root, train_files, self.tokenizer,
                                           self.out / "data" / "train.npy")
        self.heldout_data = TokenCache.build(root, heldout_files, self.tokenizer,
                                             self.out / "data" / "heldout.npy")
        self.step = 0
        self._resume()

    # ---- the loss ------------------------------------------------------------------------
    def losses(self, rows: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        """The draft's losses on corpus rows [B, seq_len + 1], at `positions` blocks a row
        drawn with `seed`, and what they score: each block position's accuracy against
        the target and the acceptance length greedy drafts would reach (1 + the run of
        positions the target agrees with)."""
        tc, c, model = self.tc, self.config, self.model
        k, w = tc.block_size, c.window_size
        ids = rows[:, : tc.seq_len]
        with torch.no_grad():
            out = model(ids, target_hidden=True)
        chosen = out.logits.argmax(-1)  # [B, T]: the target's choice after each position
        g = torch.Generator().manual_seed(seed)
        b = ids.shape[0]
        # Position p: the draft reads the states at p-w+1..p and the token at p+1, and
        # proposes the tokens at p+2..p+k+1, whose target choices are made at p+1..p+k.
        p = torch.randint(w - 1, tc.seq_len - k - 1, (b, tc.positions), generator=g)
        row = torch.arange(b)[:, None].expand_as(p)
        window = p[..., None] - torch.arange(w - 1, -1, -1)  # [B, P, w]
        context = out.target_hidden[row[..., None], window].flatten(0, 1)  # [N, w, H]
        block = p[..., None] + 1 + torch.arange(k + 1)  # [B, P, k + 1]: p+1..p+k+1
        tokens = ids[row[..., None], block].flatten(0, 1)  # [N, k + 1]
        targets = chosen[row[..., None], block[..., :k]].flatten(0, 1)  # [N, k]
        forced = iter(tokens[:, 1:].unbind(1))
        drafted = model.draft(model, context, tokens[:, 0], p.flatten(),
                              sample=lambda _logits: next(forced))
        logits = drafted.logits  # [N, k, vocab]
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        right = (logits.argmax(-1) == targets).float()  # [N, k]
        alive = torch.cat((torch.ones_like(right[:, :1]), right.cumprod(1)[:, :-1]), 1)
        confidence = (F.binary_cross_entropy_with_logits(drafted.confidence, right,
                                                         reduction="none") * alive).sum() \
            / alive.sum()
        return {"loss": ce + confidence, "ce": ce, "confidence": confidence,
                "accuracy": right.mean(), "acceptance": 1 + right.cumprod(1).sum(1).mean()}

    # ---- training ------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        tc = self.tc
        if step < tc.warmup_steps:
            return tc.lr * (step + 1) / tc.warmup_steps
        done = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
        return tc.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done))))

    def train_step(self) -> dict[str, float]:
        tc = self.tc
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        rows = self.train_data.batch(tc.batch_size, tc.seq_len, tc.seed, self.step)
        parts = self.losses(rows, tc.seed * 1_000_003 + self.step)
        self.optimizer.zero_grad(set_to_none=True)
        parts["loss"].backward()
        torch.nn.utils.clip_grad_norm_(self.trained, 1.0)
        self.optimizer.step()
        self.step += 1
        return {k: float(v.detach()) for k, v in parts.items()}

    @torch.no_grad()
    def evaluate(self, batches: int = 4) -> dict[str, float]:
        """The losses and scores on held-out rows (the same rows every time)."""
        self.model.eval()
        tc, totals = self.tc, {}
        for i in range(batches):
            rows = self.heldout_data.batch(tc.batch_size, tc.seq_len, 1 << 20, i)
            for key, value in self.losses(rows, i).items():
                totals[key] = totals.get(key, 0.0) + float(value) / batches
        return totals

    def run(self, log=print) -> dict[str, float]:
        """Train to `steps`, logging each step, evaluating and checkpointing as set; the
        finished model goes to OUT/model. The last held-out scores."""
        tc = self.tc
        scores: dict[str, float] = {}
        try:
            while self.step < tc.steps:
                started = time.perf_counter()
                record = {"step": self.step + 1, **self.train_step(),
                          "seconds": time.perf_counter() - started}
                if self.step % tc.eval_every == 0 or self.step == tc.steps:
                    scores = self.evaluate()
                    record.update({f"heldout_{k}": v for k, v in scores.items()})
                with open(self.out / "log.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
                log(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                             for k, v in record.items()))
                if self.step % tc.checkpoint_every == 0 or self.step == tc.steps:
                    self.save_checkpoint()
            self.export(self.out / "model")
            return scores or self.evaluate()
        finally:
            self.close()

    def export(self, directory: Path) -> None:
        """The target with its trained draft, as a model directory."""
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)
        shutil.copy(Path(self.tc.target) / "tokenizer.json", tmp / "tokenizer.json")
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)

    # ---- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """The draft's weights, the optimizer and the step, swapped in whole."""
        tmp, final = self.out / "checkpoint.tmp", self.out / "checkpoint"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        draft = {k: v for k, v in self.model.state_dict().items() if k.startswith("draft.")}
        torch.save({"draft": draft, "optimizer": self.optimizer.state_dict(),
                    "step": self.step}, tmp / "trainer.pt")
        swap_in(tmp, final)

    def _resume(self) -> None:
        path = self.out / "checkpoint" / "trainer.pt"
        if not path.exists():
            return
        state = torch.load(path, weights_only=True)
        self.model.load_state_dict(state["draft"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        trim_log(self.out / "log.jsonl", self.step)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _noise_token(target: str) -> int:
    """The token a draft block's positions after the first hold: the tokenizer's padding
    token (never in text), else 0."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(target) / "tokenizer.json"))
    pad = tokenizer.token_to_id("<|pad|>")
    return pad if pad is not None else 0


