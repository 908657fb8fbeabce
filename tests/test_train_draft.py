"""`kvstack train-draft`: DSpark's draft trained for a frozen target, resumable, exported as
a model the engine drafts with."""

import json

import pytest
import torch

from kvstack.cli import main
from kvstack.config import preset
from kvstack.corpus.data import corpus_files, stdlib_root, train_tokenizer
from kvstack.engine import LLM, SamplingParams
from kvstack.model import Model
from kvstack.train.draft_config import DraftTrainConfig
from kvstack.train.dspark import DraftTrainer

CORPUS = stdlib_root() / "json"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny V4.1-layout model (random weights: what matters is that the draft learns the
    target, whatever it is) with a tokenizer of the json modules."""
    directory = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    Model(preset("tiny")).save_pretrained(directory)
    train_tokenizer(CORPUS, corpus_files(CORPUS), 512, directory / "tokenizer.json")
    return directory


def settings(target, **changes) -> DraftTrainConfig:
    return DraftTrainConfig(**{**dict(
        target=str(target), steps=4, batch_size=2, continuation=12, rows=6, positions=4,
        block_size=3,
        markov_rank=8, lr=1e-2, warmup_steps=1, eval_every=2, checkpoint_every=2,
        heldout_percent=40.0, corpus=str(CORPUS)), **changes})


def test_the_draft_learns_the_target_and_only_the_draft_trains(target, tmp_path):
    """On the same rows again and again (a random target's choices are a function of the
    context a few steps cannot learn in general) the draft's losses fall, and only
    `draft.*` moves."""
    trainer = DraftTrainer(settings(target), tmp_path)
    # The rows: a window of corpus tokens, then what the target's engine writes greedily.
    window = trainer.config.window_size
    assert trainer.train_rows.shape == (6, window + 12)
    written = LLM(target, kv_budget="8MiB", threads=1).generate(
        trainer.train_rows[:, :window].tolist(),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in written] == trainer.train_rows[:, window:].tolist()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rows = trainer.train_rows[:2]
    seen = []
    for _ in range(25):
        parts = trainer.losses(rows, 0)
        trainer.optimizer.zero_grad()
        parts["loss"].backward()
        trainer.optimizer.step()
        seen.append((float(parts["ce"].detach()), float(parts["confidence"].detach())))
    assert seen[-1][0] < seen[0][0] - 1.0 and seen[-1][1] < seen[0][1]
    after = trainer.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("draft.") for k in changed)
    trainer.close()


def test_a_killed_run_resumes_and_its_model_drafts_in_the_engine(target, tmp_path):
    """Four steps with a checkpoint every two; the run is taken up again for six (as after
    a kill after step 4): the log holds each step once, and OUT/model is the target with
    its draft, whose greedy outputs with DSpark equal the target's."""
    DraftTrainer(settings(target), tmp_path).run(log=lambda line: None)
    rows = tmp_path / "data" / "train-rows.npy"
    made = rows.stat().st_mtime_ns
    scores = DraftTrainer(settings(target, steps=6), tmp_path).run(log=lambda line: None)
    assert rows.stat().st_mtime_ns == made  # the target's rows are made once per run
    steps = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text()
             .splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6] and 1 <= scores["acceptance"] <= 4
    drafted = Model.from_pretrained(tmp_path / "model")
    assert drafted.config.has_draft and drafted.config.dspark_block_size == 3
    plain = Model.from_pretrained(target).state_dict()
    assert all(torch.equal(plain[k], v) for k, v in drafted.state_dict().items()
               if not k.startswith("draft."))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = [LLM(tmp_path / "model", speculative=s, kv_budget="8MiB", threads=1)
            .generate(["def f(x):"], params)[0].token_ids for s in ("none", "dspark")]
    assert outs[0] == outs[1]


def test_bad_settings_are_refused(target, tmp_path, capsys):
    with pytest.raises(ValueError, match="continuation 4 must exceed a block"):
        DraftTrainer(settings(target, continuation=4), tmp_path / "short")
    with pytest.raises(ValueError, match=r"not a model directory with a tokenizer\.json"):
        DraftTrainer(settings(tmp_path), tmp_path / "none")
    DraftTrainer(settings(target), tmp_path / "run").close()
    with pytest.raises(ValueError, match=r"other settings \(lr\)"):
        DraftTrainer(settings(target, lr=1e-3), tmp_path / "run")
    assert main(["train-draft", "--target", str(tmp_path), "--out",
                 str(tmp_path / "cli")]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
