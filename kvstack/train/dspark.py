"""DSpark's draft trained for a trained target, the target frozen (`kvstack train-draft`).

The recipe of DeepSeek's DeepSpec, on a CPU's budget. The data is the target's own
writing: once per run, the engine continues `rows` windows of the corpus greedily for
`continuation` tokens (`distill`), so a block's context and labels are what they are when
the engine drafts, where every token before a block is the target's choice (on the
corpus's own text the target's next choice often differs from the text that follows, and
a draft learns a context it never meets). Each step takes `batch_size` of those rows, runs
the target over them once (no gradient) for its logits and the target layers' states
(`ModelOutput.target_hidden`), and picks `positions` decode positions p in each row's
continuation. At each the draft makes its block as the engine makes it -- the states of
the last `window` positions, the token p+1, then noise tokens -- with the Markov head fed
the row's next tokens (teacher forcing: the target's choices, as a verify accepts them),
and learns:
- the target's choice at every block position (cross-entropy against the target's argmax
  given the same prefix: what a verify accepts), and
- the confidence head, each position's chance that it is accepted given that every one
  before it was (binary cross-entropy on whether the draft's argmax is the target's, over
  the positions whose predecessors all were), which the engine's verify length reads.
The trunk, the embedding and the head are the target's and stay frozen; only `draft.*`
trains. The run directory holds its settings (`train_config.json`), a JSON-lines log, the
tokenised corpus and the target's continuations, and a checkpoint written whole or not at
all (a killed run resumes from it); the finished model (the target with its draft) is
`OUT/model`.
"""

import hashlib
import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
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
        if tc.continuation <= tc.block_size + 1:
            raise ValueError(f"continuation {tc.continuation} must exceed a block "
                             f"({tc.block_size}) by more than one token")
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
        self.train_rows = distill(tc.target, self.train_data, tc.rows, c.window_size,
                                  tc.continuation, tc.seed, self.out / "data" / "train-rows")
        self.heldout_rows = distill(tc.target, self.heldout_data, HELDOUT_ROWS,
                                    c.window_size, tc.continuation, tc.seed + 1,
                                    self.out / "data" / "heldout-rows")
        self.step = 0
        self._resume()

    # ---- the loss ------------------------------------------------------------------------
    def losses(self, rows: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        """The draft's losses on rows [B, window + continuation] (`distill`'s), at
        `positions` blocks a row drawn with `seed` in the continuation, and what they
        score: each block position's accuracy against the target and the acceptance
        length greedy drafts would reach (1 + the run of positions the target agrees
        with)."""
        tc, c, model = self.tc, self.config, self.model
        k, w = tc.block_size, c.window_size
        ids = rows
        with torch.no_grad():
            out = model(ids, target_hidden=True)
        chosen = out.logits.argmax(-1)  # [B, T]: the target's choice after each position
        g = torch.Generator().manual_seed(seed)
        b = ids.shape[0]
        # Position p: the draft reads the states at p-w+1..p and the token at p+1, and
        # proposes the tokens at p+2..p+k+1, whose target choices are made at p+1..p+k.
        p = torch.randint(w - 1, ids.shape[1] - k - 1, (b, tc.positions), generator=g)
        row = torch.arange(b)[:, None].expand_as(p)
        # Early in a sequence the engine's draft reads fewer states than a window (all
        # there are): half the steps read a span drawn at random, the rest a whole window.
        span = w if torch.rand((), generator=g) < 0.5 else \
            int(torch.randint(1, w + 1, (), generator=g))
        window = p[..., None] - torch.arange(span - 1, -1, -1)  # [B, P, span]
        context = out.target_hidden[row[..., None], window].flatten(0, 1)  # [N, span, H]
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
        g = torch.Generator().manual_seed(tc.seed * 1_000_003 + self.step)
        rows = self.train_rows[torch.randint(len(self.train_rows), (tc.batch_size,),
                                             generator=g)]
        parts = self.losses(rows, tc.seed * 1_000_003 + self.step)
        self.optimizer.zero_grad(set_to_none=True)
        parts["loss"].backward()
        torch.nn.utils.clip_grad_norm_(self.trained, 1.0)
        self.optimizer.step()
        self.step += 1
        return {k: float(v.detach()) for k, v in parts.items()}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The losses and scores on the held-out rows (the same blocks every time)."""
        self.model.eval()
        tc, totals = self.tc, {}
        batches = self.heldout_rows.split(tc.batch_size)
        for i, rows in enumerate(batches):
            for key, value in self.losses(rows, i).items():
                totals[key] = totals.get(key, 0.0) + float(value) / len(batches)
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


HELDOUT_ROWS = 32


def distill(target: str, corpus: TokenCache, n_rows: int, prompt_tokens: int,
            continuation: int, seed: int, path: Path) -> torch.Tensor:
    """Rows [n_rows, prompt_tokens + continuation]: windows of the corpus drawn with `seed`,
    each followed by the `continuation` tokens the target's engine writes after it
    greedily (its end-of-text ignored, as a benchmark's fixed-length requests). Made once
    and kept at `path` (.npy, written whole) with a key of everything they depend on."""
    from kvstack.engine import LLM, SamplingParams

    if corpus.tokens.size <= prompt_tokens:
        raise ValueError(f"the corpus ({corpus.tokens.size} tokens) is shorter than one "
                         f"window of {prompt_tokens}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, corpus.tokens.size - prompt_tokens, (n_rows,), generator=g)
    prompts = np.stack([corpus.tokens[s : s + prompt_tokens] for s in starts.tolist()])
    key = hashlib.sha256(prompts.tobytes() + str(continuation).encode())
    for weights in sorted(Path(target).glob("*.safetensors")):
        key.update(weights.read_bytes())
    rows_path, key_path = path.with_suffix(".npy"), path.with_suffix(".key")
    if rows_path.exists() and key_path.exists() and key_path.read_text() == key.hexdigest():
        return torch.from_numpy(np.load(rows_path).astype(np.int64))
    llm = LLM(target, threads=torch.get_num_threads(), max_num_seqs=64,
              enable_prefix_caching=False)
    try:
        outs = llm.generate(prompts.tolist(), SamplingParams(
            max_tokens=continuation, temperature=0, ignore_eos=True))
    finally:
        llm.close()
    rows = np.concatenate((prompts, np.array([o.token_ids for o in outs], dtype=np.int32)),
                          axis=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = rows_path.with_name(rows_path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, rows)
    tmp.replace(rows_path)
    replace_text(key_path, key.hexdigest())
    return torch.from_numpy(rows.astype(np.int64))


def _noise_token(target: str) -> int:
    """The token a draft block's positions after the first hold: the tokenizer's padding
    token (never in text), else 0."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(target) / "tokenizer.json"))
    pad = tokenizer.token_to_id("<|pad|>")
    return pad if pad is not None else 0


