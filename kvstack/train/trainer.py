"""Training models of the family from scratch (design.md section 6).

Loss: next-token cross-entropy plus, for each index source, the KL divergence from the
main attention's distribution over compressed entries (summed over heads, renormalised,
no gradient) to the softmax of the indexer scores. The indexer reads its inputs detached
(model.py), so the KL trains only the indexer and the cross-entropy only the rest. A dense
warm-up (attention over every visible compressed entry) comes first, then top-k. The
caches pass through their formats with a straight-through gradient (`ReferenceStore`), so
the model learns the FP4 noise.
The MoE routing bias is balanced outside backprop: after each step it moves toward the
experts that got fewer tokens than the mean.

Under torchrun the same command trains data-parallel: every process runs the same model
on its share of each batch and the gradients are averaged (all-reduce over gloo on CPU,
NCCL on GPU) before the step.

A run lives in one directory: `train_config.json`, `checkpoint/` (model, optimizer, step;
replaced atomically), `log.jsonl`, and the tokenizer and token caches it built. Batches are
a pure function of (seed, step), so a run killed and resumed continues exactly where it was.
"""

import dataclasses
import fcntl
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvstack.config import ModelConfig, preset
from kvstack.corpus.data import (
    MIN_VOCAB,
    TokenCache,
    retrieval_sample,
    split_corpus,
    stdlib_root,
    train_tokenizer,
)
from kvstack.corpus.families import HELD_OUT, families
from kvstack.model import Model
from kvstack.model.checkpoint import float_state_dict
from kvstack.model.model import Compressor, Gate, Indexer, ModelOutput
from kvstack.model.params import parameter_shapes

BIAS_STEP = 1e-3  # how far the routing bias moves per step toward balance


@dataclass
class TrainConfig:
    preset: str = "tiny"
    steps: int = 200
    seq_len: int = 256
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    dense_warmup_steps: int = 50
    # The dense warm-up trains the indexers alone (their query, weight and index-key
    # projections) on the KL to dense attention, every other weight frozen, as
    # DeepSeek-V3.2's does: for a trained model whose indexer must learn to rank entries
    # its top-k misses, which the sparse KL, over its own picks, never shows it. Off,
    # every weight trains, attention dense (the bundled model's first stage).
    dense_warmup_indexer_only: bool = False
    # With the indexer-only warm-up: score every visible entry at this many query
    # positions per row (up to half where an answer token is predicted, the rest at
    # random past the first window) and attend sparsely, as served, everywhere; 0:
    # attention dense at every position. The
    # [T, N] matrices of the dense warm-up outgrow memory on rows as long as the questions
    # (16K-32K), where the indexer must learn to rank among that many entries.
    index_target_rows: int = 0
    index_loss_weight: float = 1.0
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 50
    seed: int = 0
    retrieval_rate: float = 0.0  # share of rows replaced by a synthetic retrieval sample
    retrieval_keys: int = 1  # keys defined and asked in each retrieval sample
    # The written forms of retrieval samples (kvstack.corpus.families: "key", the single
    # form of the bundled model's first stage; "six", the forms of its first long-context
    # stages; "trained", every family but the held-out ones; or names); held-out families
    # are refused, so that they measure generalisation.
    retrieval_families: str = "key"
    # Train on the tokens of the planted definitions too: off, only the answers (and the
    # code) teach, so free generation does not learn to open with a definition.
    retrieval_define_loss: bool = True
    # Weigh the cross-entropy where a retrieval answer token is predicted by this factor
    # (every other position 1, the mean taken over the weights): an 8K row with 48 keys
    # holds a few hundred answer tokens among 8,192, so at 1 reading a far definition is
    # a sliver of the loss. The held-out loss stays unweighted.
    answer_loss_weight: float = 1.0
    vocab_size: int = 0  # 0: the preset's
    heldout_percent: float = 2.0
    corpus: str = ""  # a directory of .py files; "" = the standard library
    model_overrides: dict = field(default_factory=dict)
    init_from: str = ""  # a model directory whose weights and tokenizer start the run

    def model_config(self) -> ModelConfig:
        c = preset(self.preset)
        changes = dict(self.model_overrides)
        known = {f.name for f in dataclasses.fields(ModelConfig) if f.init}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"model config has no key {', '.join(unknown)}")
        if self.vocab_size:
            changes["vocab_size"] = self.vocab_size
        changes.setdefault("max_seq_len", max(c.max_seq_len, self.seq_len))
        return c.replace(**changes)

    def check(self) -> None:
        """Refuse an impossible setting by name (before a run directory is written)."""
        at_least = {"steps": 1, "seq_len": 2, "batch_size": 1, "grad_accum": 1,
                    "warmup_steps": 0, "dense_warmup_steps": 0, "eval_every": 1,
                    "eval_batches": 1, "checkpoint_every": 1, "retrieval_keys": 1,
                    "vocab_size": 0, "index_loss_weight": 0, "weight_decay": 0,
                    "index_target_rows": 0}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be at least {low}, got {getattr(self, name)}")
        for name in ("lr", "grad_clip", "answer_loss_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr {self.min_lr} must lie between 0 and lr {self.lr}")
        if self.index_target_rows and not self.dense_warmup_indexer_only:
            raise ValueError("index_target_rows needs dense_warmup_indexer_only: it trains "
                             "the indexers alone, on a sparse forward")
        if not 0 <= self.retrieval_rate <= 1:
            raise ValueError(f"retrieval_rate {self.retrieval_rate} must lie in [0, 1] (a "
                             "share of the rows)")
        held_out = [f.name for f in families(self.retrieval_families) if f in HELD_OUT]
        if held_out:
            raise ValueError(f"retrieval_families: {', '.join(held_out)} are held out from "
                             "training (kvstack.corpus.families.HELD_OUT), so that retrieval "
                             "on them measures generalisation")
        model = self.model_config()
        past_window = self.seq_len - min(model.window_size, self.seq_len - 1)
        if self.index_target_rows > past_window:
            raise ValueError(f"index_target_rows {self.index_target_rows} exceeds the "
                             f"{past_window} positions of a row past its first window")
        vocab = model.vocab_size
        if vocab < MIN_VOCAB:
            raise ValueError(f"vocab_size {vocab} cannot hold the byte-level BPE alphabet "
                             f"and its special tokens ({MIN_VOCAB})")


def replace_text(path: Path, text: str) -> None:
    """Swap in `text` as the whole of `path` by a rename, so no reader sees it half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def lock_run(out: Path, command: str):
    """One run per directory: a second process on it would interleave the log and swap
    checkpoints under the first. The kernel drops the lock when a process dies, so a
    killed run's directory resumes. The open lock file (held until closed)."""
    handle = open(out / "train.lock", "a+")  # noqa: SIM115 (held until close())
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ValueError(f"{out} is in use by another kvstack {command} process; wait for "
                         "it, or use another --out") from None
    return handle


def trim_log(log: Path, step: int) -> None:
    """Drop the log's lines of steps after `step` (a resumed run runs them again)."""
    if log.exists():
        kept = [line for line in log.read_text().splitlines()
                if json.loads(line)["step"] <= step]
        replace_text(log, "".join(line + "\n" for line in kept))


def swap_in(tmp: Path, final: Path) -> None:
    """Make the directory `tmp` (its files synced) the directory `final`, by renames: a
    kill at any moment leaves the old one or the new one whole."""
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _saved_config(path: Path) -> TrainConfig:
    """A run directory's training config; keys added to TrainConfig since it was written
    take their defaults, so older runs still resume."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a training config ({e}); restore it or start a "
                         "new --out") from e
    unknown = sorted(set(saved) - fields)
    if unknown:
        raise ValueError(f"{path}: unknown training settings {', '.join(unknown)}")
    return TrainConfig(**saved)


def _check_init_from(tc: TrainConfig) -> None:
    """tc.init_from is a model directory with its tokenizer whose parameter shapes are the
    run's (settings that change no shape, such as the window or top-k, may differ)."""
    directory = Path(tc.init_from)
    if not (directory / "config.json").is_file():
        raise ValueError(f"init_from {directory}: not a model directory (no config.json)")
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(f"init_from {directory}: tokenizer.json is missing (the run must "
                         "use the tokenizer the model was trained with)")
    have = parameter_shapes(ModelConfig.from_json(directory / "config.json"))
    want = parameter_shapes(tc.model_config())
    differ = sorted(n for n in want.keys() | have.keys() if want.get(n) != have.get(n))
    if differ:
        name = differ[0]
        raise ValueError(f"init_from {directory}: its weights do not fit the run's model "
                         f"({len(differ)} parameters differ; {name}: "
                         f"{list(have.get(name, ()))} there, {list(want.get(name, ()))} here)")


def lr_at(tc: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine down to min_lr."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


IGNORE = -100  # a target the loss leaves out (cross_entropy's ignore_index)


def losses(out: ModelOutput, targets: torch.Tensor, weights: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy over the targets not IGNORE, indexer KL) of one forward with
    collect=True; `weights` [B, T], if given, weigh each position's cross-entropy (a
    weighted mean)."""
    if weights is None:
        ce = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    else:
        each = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(),
                               ignore_index=IGNORE, reduction="none")
        weights = torch.where(targets.flatten() == IGNORE, 0.0, weights.flatten().to(each))
        ce = (each * weights).sum() / weights.sum()
    kls = []
    for layer, scores in out.index_scores.items():
        # Over the entries attention weighed: every visible one in the dense warm-up, the
        # selected ones after it (DeepSeek-V3.2's indexer loss).
        # [B, T, N] or, sparse, [B, T, k] (the selected entries); rows sum to 1 where attended
        target = out.attention_targets[layer]
        attended = target > 0
        rows = attended.any(-1)
        if not rows.any():
            continue
        log_p = scores.masked_fill(~attended, float("-inf")).log_softmax(-1)
        terms = torch.where(attended, target * (target.clamp(min=1e-30).log() - log_p), 0.0)
        kls.append(terms.sum(-1)[rows].mean())
    kl = torch.stack(kls).mean() if kls else ce.new_zeros(())
    return ce, kl


def _indexer_parameters(model: Model) -> list[torch.nn.Parameter]:
    """What the indexer's KL trains: each indexer's query and head-weight projections and
    each stream's index-key projection and norm."""
    params = []
    for module in model.modules():
        if isinstance(module, Indexer):
            params += module.parameters()
        elif isinstance(module, Compressor):
            params += [*module.wk_index.parameters(), *module.index_norm.parameters()]
    return params


class Trainer:
    def __init__(self, tc: TrainConfig, out: str | Path,
                 device: torch.device | str = "cpu") -> None:
        self.tc, self.out, self.device = tc, Path(out), torch.device(device)
        # Data parallel under torchrun: each process takes every world-th row of the
        # global batch, and gradients are averaged over processes before each step.
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        # A group this trainer starts, it ends (close): a process that exits with a live
        # gloo group can abort in its teardown.
        self._owns_group = self.world > 1 and not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        if tc.batch_size % self.world:
            raise ValueError(f"batch_size {tc.batch_size} does not split over {self.world} "
                             "processes")
        # A bad setting, model, corpus or starting model fails before the run directory is
        # written.
        tc.check()
        self.corpus = Path(tc.corpus) if tc.corpus else stdlib_root()
        self.split = split_corpus(self.corpus, tc.heldout_percent)  # (train, held-out)
        if not all(self.split):
            raise ValueError(f"corpus {self.corpus}: {len(self.split[0])} training and "
                             f"{len(self.split[1])} held-out files at heldout_percent "
                             f"{tc.heldout_percent}; both halves need files (a small "
                             "corpus needs a larger --heldout-percent, e.g. 20)")
        if tc.init_from:
            _check_init_from(tc)
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock = lock_run(self.out, "train") if self.rank == 0 else None
        saved = self.out / "train_config.json"
        extended = False
        if saved.exists():
            before = _saved_config(saved)
            # Only --steps may change: a run extended further resumes as it was.
            differs = [f.name for f in dataclasses.fields(TrainConfig)
                       if f.name != "steps" and getattr(before, f.name) != getattr(tc, f.name)]
            if differs:
                said = ", ".join(f"{k} {getattr(before, k)!r} (now {getattr(tc, k)!r})"
                                 for k in differs)
                raise ValueError(f"{self.out} holds a run with another training config: "
                                 f"{said}; use a new --out, or the same settings to resume "
                                 "(--steps may grow)")
            extended = tc.steps != before.steps
        if self.rank == 0:
            if not saved.exists() or extended:
                # Written once, whole or not at all: the other processes of a resumed run
                # read it at this moment, and a kill must not leave it empty.
                replace_text(saved, json.dumps(asdict(tc), indent=2))
            tokenizer = self.out / "tokenizer.json"
            if tc.init_from and not tokenizer.exists():  # its token ids are the model's
                shutil.copy(Path(tc.init_from) / "tokenizer.json", tokenizer)
            self._prepare_data()
        if self.world > 1:
            dist.barrier()  # the tokenizer and token caches exist before the others read them
            if self.rank != 0:
                self._prepare_data()
        torch.manual_seed(tc.seed)
        self.model = Model(self.config).to(self.device)
        decay = [p for n, p in self.model.named_parameters()
                 if p.requires_grad and p.dim() >= 2]
        other = [p for n, p in self.model.named_parameters()
                 if p.requires_grad and p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": tc.weight_decay},
             {"params": other, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95))
        self.step = 0
        self._resume()
        if self.step == 0 and tc.init_from:  # a resumed run has its own checkpoint
            start = Model.from_pretrained(tc.init_from, device=self.device)
            # float_state_dict: a checkpoint loaded packed (V4.1's FP8/FP4) trains in float.
            self.model.load_state_dict(float_state_dict(start))

    def _prepare_data(self) -> None:
        tc = self.tc
        self.config = tc.model_config()
        root, (train_files, heldout_files) = self.corpus, self.split
        tok_path = self.out / "tokenizer.json"
        if tok_path.exists():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(tok_path))
        else:
            self.tokenizer = train_tokenizer(root, train_files, self.config.vocab_size, tok_path)
        if self.tokenizer.get_vocab_size() > self.config.vocab_size:
            raise ValueError(f"tokenizer has {self.tokenizer.get_vocab_size()} tokens, the "
                             f"model {self.config.vocab_size}")
        self.train_data = TokenCache.build(root, train_files, self.tokenizer,
                                           self.out / "data" / "train.npy")
        self.heldout_data = TokenCache.build(root, heldout_files, self.tokenizer,
                                             self.out / "data" / "heldout.npy")

    def close(self) -> None:
        """Let another process take the run directory, and end the process group this
        trainer started (run() does this when it ends)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    # ---- checkpoints -------------------------------------------------------------------
    def _resume(self) -> None:
        state_path = self.out / "checkpoint" / "trainer.pt"
        if not state_path.exists():
            return
        state = torch.load(state_path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        if self.rank == 0:
            trim_log(self.out / "log.jsonl", self.step)

    def save_checkpoint(self) -> None:
        """Write to a temporary directory, then swap it in: a kill leaves the old one."""
        tmp, final = self.out / "checkpoint.tmp", self.out / "checkpoint"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "step": self.step}, tmp / "trainer.pt")
        self.model.save_pretrained(tmp / "model")
        shutil.copy(self.out / "tokenizer.json", tmp / "model" / "tokenizer.json")
        swap_in(tmp, final)

    # ---- one step ----------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        tc = self.tc
        self.model.train()
        lr = lr_at(tc, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        dense = self.step < tc.dense_warmup_steps
        indexer_only = dense and tc.dense_warmup_indexer_only
        # Frozen weights keep no graph: the dense forward of a long row then costs little
        # more memory than the indexers' scores.
        trained = {id(p) for p in _indexer_parameters(self.model)} if indexer_only else None
        for p in self.model.parameters():
            p.requires_grad_(trained is None or id(p) in trained)
        ce_sum = kl_sum = 0.0
        for micro in range(tc.grad_accum):
            index = self.step * tc.grad_accum + micro
            rows, targets, answers = self.batch(index)
            mine = slice(self.rank, None, self.world)
            rows, targets = rows[mine].to(self.device), targets[mine].to(self.device)
            with self._autocast():
                if indexer_only and tc.index_target_rows:
                    out = self.model(rows[:, :-1],
                                     target_rows=self.target_rows(index, answers)[mine])
                else:
                    out = self.model(rows[:, :-1], dense=dense, collect=True)
                weights = None
                if tc.answer_loss_weight != 1:
                    weights = 1 + (tc.answer_loss_weight - 1) * answers[mine].to(self.device)
                ce, kl = losses(out, targets, weights)
            loss = kl if indexer_only else ce + tc.index_loss_weight * kl
            (loss / tc.grad_accum).backward()
            ce_sum += ce.item() / tc.grad_accum
            kl_sum += kl.item() / tc.grad_accum
        if self.world > 1:
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= self.world
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._balance_experts(move=not indexer_only)
        self.step += 1
        return {"step": self.step, "lr": lr, "loss": ce_sum, "index_kl": kl_sum,
                "grad_norm": float(norm), "dense": dense}

    def _autocast(self) -> torch.autocast:
        """bf16 matrix products on a GPU that has them; CPUs train in float32, where bf16
        autocast is slower than float32 on most cores."""
        enabled = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Training rows [batch_size, seq_len + 1] for micro-batch `index` -- windows of the
        corpus, some replaced by retrieval samples (depth uniform) -- their targets
        [batch_size, seq_len], each position's next token, IGNORE where the loss leaves it
        out (the planted definitions, with retrieval_define_loss off), and which positions
        predict an answer token [batch_size, seq_len] (none in a row of code); all a pure
        function of (seed, index)."""
        tc = self.tc
        rows = self.train_data.batch(tc.batch_size, tc.seq_len, tc.seed, index)
        targets = rows[:, 1:].clone()
        answers = torch.zeros(targets.shape, dtype=torch.bool)
        if tc.retrieval_rate > 0:
            g = torch.Generator().manual_seed(tc.seed * 7_919 + index)
            forms = families(tc.retrieval_families)
            for r in range(rows.shape[0]):
                if torch.rand((), generator=g) < tc.retrieval_rate:
                    depth = float(torch.rand((), generator=g)) * 0.9
                    sample = retrieval_sample(self.train_data, self.tokenizer, tc.seq_len + 1,
                                              depth, g, extra_keys=tc.retrieval_keys - 1,
                                              families=forms)
                    ids = sample.ids[: tc.seq_len + 1]
                    rows[r, -len(ids):] = torch.tensor(ids)
                    targets[r] = rows[r, 1:]
                    offset = rows.shape[1] - len(ids)
                    for start, end in sample.answers:  # target t predicts token t + 1
                        answers[r, max(offset + start - 1, 0) : offset + end - 1] = True
                    if not tc.retrieval_define_loss:
                        for start, end in sample.defines:  # target t predicts token t + 1
                            targets[r, max(offset + start - 1, 0) : offset + end - 1] = IGNORE
        return rows, targets, answers

    def target_rows(self, index: int, answers: torch.Tensor) -> torch.Tensor:
        """The query positions [batch_size, index_target_rows] where micro-batch `index`
        takes dense indexer targets: up to half of them among the positions that predict
        an answer token (`answers`, [batch_size, seq_len]), the rest past the first window,
        all drawn at random and sorted; a pure function of (seed, index)."""
        tc = self.tc
        first = min(self.config.window_size, tc.seq_len - 1)
        g = torch.Generator().manual_seed(tc.seed * 104_729 + index)
        out = []
        for row in answers:
            asked = row.nonzero().flatten()
            asked = asked[torch.randperm(len(asked), generator=g)][: tc.index_target_rows // 2]
            # Past the window, where the compressed entries hold what the window does not.
            rest = torch.ones(tc.seq_len, dtype=torch.bool)
            rest[:first] = False
            rest[asked] = False
            rest = rest.nonzero().flatten()
            rest = rest[torch.randperm(len(rest), generator=g)]
            out.append(torch.cat((asked, rest[: tc.index_target_rows - len(asked)])).sort().values)
        return torch.stack(out)

    def _balance_experts(self, move: bool) -> None:
        """Move each routing bias toward balance by the load since the last step (`move`;
        not while the trunk is frozen) and start counting again."""
        with torch.no_grad():
            for gate in (m for m in self.model.modules() if isinstance(m, Gate)):
                if gate.load is not None and move:
                    if self.world > 1:
                        dist.all_reduce(gate.load)
                    gate.bias += BIAS_STEP * torch.sign(gate.load.float().mean() - gate.load)
                gate.load = None

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out cross-entropy and perplexity, top-k attention as served. The rows are
        `eval_batches` draws of a whole step's rows (batch_size x grad_accum), fed in
        micro-batches: a recipe gets the same held-out set however its step is split."""
        self.model.eval()
        tc = self.tc
        total, n_rows = 0.0, 0
        for i in range(tc.eval_batches):
            rows = self.heldout_data.batch(tc.batch_size * tc.grad_accum, tc.seq_len,
                                           tc.seed + 1, i)  # [batch_size * grad_accum, T + 1]
            for micro in rows.split(tc.batch_size):
                micro = micro.to(self.device)
                with self._autocast():
                    logits = self.model(micro[:, :-1]).logits
                total += F.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten(),
                                         reduction="sum").item()
                n_rows += micro.shape[0]
        loss = total / (n_rows * tc.seq_len)
        return {"heldout_loss": loss, "heldout_ppl": math.exp(loss)}

    def run(self, progress: bool = True, lines: bool = False) -> None:
        """Train to tc.steps. progress: a live bar (a terminal); lines: a line on stderr at
        the first step, every evaluation and the last step (logs, pipes, CI)."""
        try:
            self._train(progress, lines)
            if self._owns_group:  # the other ranks wait for the first one's checkpoint
                dist.barrier()
        finally:
            self.close()

    def _train(self, progress: bool, lines: bool) -> None:
        from rich.progress import Progress

        lead = self.rank == 0  # only the first process logs, evaluates and checkpoints
        progress = progress and lead
        log = (self.out / "log.jsonl").open("a") if lead else None
        tokens_per_step = self.tc.batch_size * self.tc.seq_len * self.tc.grad_accum
        with Progress(disable=not progress) as bar:
            task = bar.add_task("training", total=self.tc.steps, completed=self.step)
            while self.step < self.tc.steps:
                start = time.perf_counter()
                record = self.train_step()
                record["tokens_per_s"] = tokens_per_step / (time.perf_counter() - start)
                if not lead:
                    continue
                if self.step % self.tc.eval_every == 0 or self.step == self.tc.steps:
                    record |= self.evaluate()
                log.write(json.dumps(record) + "\n")
                log.flush()
                if lines and (self.step == 1 or "heldout_loss" in record
                              or self.step == self.tc.steps):
                    heldout = (f" · held-out loss {record['heldout_loss']:.3f}"
                               if "heldout_loss" in record else "")
                    print(f"step {self.step}/{self.tc.steps} · loss {record['loss']:.3f} · "
                          f"kl {record['index_kl']:.3f} · {record['tokens_per_s']:.0f} "
                          f"tok/s{heldout}", file=sys.stderr, flush=True)
                bar.update(task, completed=self.step, description=(
                    f"loss {record['loss']:.3f} · kl {record['index_kl']:.3f} · "
                    f"{record['tokens_per_s']:.0f} tok/s"))
                if self.step % self.tc.checkpoint_every == 0 or self.step == self.tc.steps:
                    self.save_checkpoint()
        if log is not None:
            log.close()
