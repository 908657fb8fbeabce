"""Training: the corpus split, the token cache, retrieval samples, the trainer."""

import json
from types import SimpleNamespace

import pytest
import torch

from kvstack.cli import main
from kvstack.corpus.data import (
    TokenCache,
    corpus_files,
    is_heldout,
    retrieval_sample,
    split_corpus,
    stdlib_root,
    train_tokenizer,
)
from kvstack.train.trainer import IGNORE, TrainConfig, Trainer, losses

CORPUS = str(stdlib_root() / "json")  # five real modules: seconds to tokenize and train on


def small_run(**changes) -> TrainConfig:
    settings = dict(preset="tiny", steps=6, seq_len=64, batch_size=4, lr=3e-3,
                    warmup_steps=2, dense_warmup_steps=3, eval_every=3, eval_batches=1,
                    checkpoint_every=3, vocab_size=512, heldout_percent=40.0, corpus=CORPUS)
    return TrainConfig(**(settings | changes))


def test_the_split_never_puts_a_file_in_both_halves():
    train, heldout = split_corpus(heldout_percent=2.0)
    assert not set(train) & set(heldout)
    assert len(train) + len(heldout) == len(corpus_files())
    assert 0.005 < len(heldout) / len(corpus_files()) < 0.05
    # Decided by the path alone: the same in any order, with any other files around.
    assert all(is_heldout(f, 2.0) for f in heldout)
    assert split_corpus(heldout_percent=2.0) == (train, heldout)
    with pytest.raises(ValueError, match="heldout_percent 150 must lie strictly between"):
        split_corpus(heldout_percent=150)


def test_token_cache_is_written_once_and_batches_are_a_function_of_the_step(tmp_path):
    root = stdlib_root() / "json"
    files = corpus_files(root)
    tokenizer = train_tokenizer(root, files, 512, tmp_path / "tokenizer.json")
    assert tokenizer.get_vocab_size() <= 512
    assert [tokenizer.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>")] == [0, 1, 2]
    cache = TokenCache.build(root, files, tokenizer, tmp_path / "train.npy")
    mtime = (tmp_path / "train.npy").stat().st_mtime_ns
    again = TokenCache.build(root, files, tokenizer, tmp_path / "train.npy")
    assert (tmp_path / "train.npy").stat().st_mtime_ns == mtime  # read back, not rebuilt
    assert (again.tokens == cache.tokens).all()
    assert tokenizer.decode(cache.tokens[:40].tolist()) in (root / files[0]).read_text()
    assert torch.equal(cache.batch(3, 16, seed=0, step=5), cache.batch(3, 16, seed=0, step=5))
    assert not torch.equal(cache.batch(3, 16, seed=0, step=5), cache.batch(3, 16, seed=0, step=6))


def json_package_corpus(tmp_path):
    """(tokenizer, token cache) of the stdlib's json package: small and quick."""
    root = stdlib_root() / "json"
    files = corpus_files(root)
    tokenizer = train_tokenizer(root, files, 512, tmp_path / "tokenizer.json")
    return tokenizer, TokenCache.build(root, files, tokenizer, tmp_path / "train.npy")


def test_retrieval_samples_ask_for_a_key_defined_at_the_given_depth(tmp_path):
    tokenizer, cache = json_package_corpus(tmp_path)
    g = torch.Generator().manual_seed(0)
    sample = retrieval_sample(cache, tokenizer, length=400, depth=0.25, generator=g)
    text = tokenizer.decode(sample.ids)
    key = text.split("assert ")[-1].split(" ==")[0]
    value = tokenizer.decode(sample.ids[sample.answer_start :]).rstrip('"')
    assert key.startswith("KEY_") and len(value) == 6
    assert f'{key} = "{value}"' in text
    defined_at = text.index(f"{key} =") / len(text)
    assert 0.1 < defined_at < 0.4 and sample.depth == 0.25
    assert abs(len(sample.ids) - 400) <= 2
    with pytest.raises(ValueError, match=r"depth 1\.5 must lie in"):
        retrieval_sample(cache, tokenizer, length=400, depth=1.5, generator=g)


def test_training_retrieval_samples_ask_every_key_and_score_the_last(tmp_path):
    tokenizer, cache = json_package_corpus(tmp_path)
    g = torch.Generator().manual_seed(1)
    sample = retrieval_sample(cache, tokenizer, length=500, depth=0.5, generator=g,
                              extra_keys=3)
    text = tokenizer.decode(sample.ids)
    asked = [line for line in text.splitlines() if line.startswith("assert KEY_")]
    assert len(asked) == 4
    for line in asked:
        key, value = line[len("assert "):].split(" == ")
        assert f"{key} = {value}" in text.split("assert KEY_")[0]
    scored = tokenizer.decode(sample.ids[sample.answer_start :])
    assert asked[-1].endswith(scored)
    assert abs(len(sample.ids) - 500) <= 8


def test_a_few_steps_lower_the_loss(tmp_path):
    trainer = Trainer(small_run(steps=12, dense_warmup_steps=12, eval_every=12), tmp_path)
    first = [trainer.train_step()["loss"] for _ in range(2)]
    for _ in range(8):
        trainer.train_step()
    last = [trainer.train_step()["loss"] for _ in range(2)]
    assert sum(last) < sum(first) - 0.3


def test_the_heldout_set_does_not_depend_on_how_a_step_is_split(tmp_path):
    """batch 4 x accumulation 2 is evaluated on the rows of batch 8 x 1, so a CPU recipe's
    held-out loss compares with a GPU run's."""
    split = Trainer(small_run(batch_size=4, grad_accum=2), tmp_path / "split").evaluate()
    whole = Trainer(small_run(batch_size=8), tmp_path / "whole").evaluate()
    assert split["heldout_loss"] == pytest.approx(whole["heldout_loss"], rel=1e-5)
    half = Trainer(small_run(batch_size=4), tmp_path / "half").evaluate()
    assert half["heldout_loss"] != pytest.approx(whole["heldout_loss"], rel=1e-5)


def test_the_indexer_loss_trains_the_indexer():
    """Dense warm-up: with everything else frozen, the indexer's KL to the attention it
    should predict goes down."""
    torch.manual_seed(0)
    from kvstack.config import preset
    from kvstack.model import Model

    model = Model(preset("tiny"))
    with torch.no_grad():  # sharper attention than at init, so there is something to learn
        for name, p in model.named_parameters():
            if name.endswith(("wq_b.weight", "compressor.wkv.weight")):
                p.mul_(20)
    indexer = [p for n, p in model.named_parameters() if ".indexer." in n or "wk_index" in n
               or "index_norm" in n]
    opt = torch.optim.Adam(indexer, lr=2e-2)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    kls = []
    for _ in range(15):
        _, kl = losses(model(ids[:, :-1], dense=True, collect=True), ids[:, 1:])
        opt.zero_grad()
        kl.backward()
        opt.step()
        kls.append(kl.item())
    assert kls[-1] < 0.8 * kls[0], kls


def test_the_indexer_loss_trains_the_indexer_alone():
    """The KL term's gradient stays in the indexer and index-key projections (it must not
    pull the trunk's queries, residual stream or compressed entries towards what is easy
    to index), and the cross-entropy's never reaches them."""
    torch.manual_seed(0)
    from kvstack.config import preset
    from kvstack.model import Model

    model = Model(preset("tiny"))
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    ce, kl = losses(model(ids[:, :-1], dense=True, collect=True), ids[:, 1:])
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    indexer = {n for n in named if ".indexer." in n or "wk_index" in n or "index_norm" in n}
    kl_grads = torch.autograd.grad(kl, list(named.values()), allow_unused=True,
                                   retain_graph=True)
    ce_grads = torch.autograd.grad(ce, list(named.values()), allow_unused=True)
    def reached(grads: tuple) -> set[str]:
        return {n for n, g in zip(named, grads, strict=True) if g is not None and g.any()}

    reached_by_kl, reached_by_ce = reached(kl_grads), reached(ce_grads)
    assert kl.item() > 0 and reached_by_kl, "the KL term trains nothing"
    assert reached_by_kl <= indexer, sorted(reached_by_kl - indexer)
    assert not reached_by_ce & indexer, sorted(reached_by_ce & indexer)


def test_target_rows_give_dense_indexer_targets_where_asked_and_attend_sparsely():
    """At the asked query positions each index source scores every visible entry, as the
    dense warm-up does, against the trunk's attention over them (each head's softmax over
    the entries, averaged); the logits are the sparse forward's, and the KL trains the
    indexers and their keys alone."""
    from kvstack.config import preset
    from kvstack.model import Model

    torch.manual_seed(0)
    model = Model(preset("tiny"))
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    rows = torch.tensor([[47, 30, 5], [20, 47, 0]])
    out = model(ids, target_rows=rows)
    sparse = model(ids, collect=True)  # the indexers' scores of the entries they picked
    assert torch.equal(out.logits, sparse.logits)
    at = torch.arange(2)[:, None]
    assert set(out.index_scores) == set(sparse.index_scores)
    for layer, scores in out.index_scores.items():
        picked = sparse.index_entries[layer][at, rows]  # [B, R, k], -1 for none
        on = picked >= 0
        assert on.any()
        torch.testing.assert_close(scores.gather(-1, picked.clamp(min=0))[on],
                                   sparse.index_scores[layer][at, rows][on])
        target = out.attention_targets[layer]  # [B, R, N]
        visible = scores > float("-inf")
        assert torch.all(target[~visible] == 0)
        sums = target.sum(-1)
        assert torch.allclose(sums[visible.any(-1)], torch.ones(())), layer
        assert torch.all(sums[~visible.any(-1)] == 0)  # position 0 sees no entry yet
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    _, kl = losses(out, ids.roll(-1, 1))
    grads = torch.autograd.grad(kl, list(named.values()), allow_unused=True)
    reached = {n for n, g in zip(named, grads, strict=True) if g is not None and g.any()}
    assert kl.item() > 0 and any("wk_index" in n for n in reached)
    assert all(".indexer." in n or "wk_index" in n or "index_norm" in n for n in reached)
    with pytest.raises(ValueError, match="target_rows must be"):
        model(ids, target_rows=torch.tensor([[48], [0]]))
    with pytest.raises(ValueError, match="target_rows must be"):
        model(ids, target_rows=torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="collect and dense"):
        model(ids, collect=True, target_rows=rows)


def test_an_indexer_only_warm_up_moves_the_indexers_and_nothing_else(tmp_path):
    """Its dense steps change the indexers' and index keys' weights alone; the steps after
    it, and a warm-up without the setting, train every weight again."""
    def changes(**settings) -> tuple[set[str], set[str]]:
        trainer = Trainer(small_run(steps=settings.pop("steps"), **settings),
                          tmp_path / str(len(list(tmp_path.iterdir()))))
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train_step()
        after_one = {n for n, p in trainer.model.named_parameters()
                     if not torch.equal(p, before[n])}
        trainer.train_step()
        after_two = {n for n, p in trainer.model.named_parameters()
                     if not torch.equal(p, before[n])}
        return after_one, after_two

    def is_indexer(name: str) -> bool:
        return ".indexer." in name or "wk_index" in name or "index_norm" in name

    one, two = changes(steps=2, dense_warmup_steps=1, dense_warmup_indexer_only=True)
    assert one and all(is_indexer(n) for n in one)
    assert any(not is_indexer(n) for n in two)  # after the warm-up, the trunk trains
    every, _ = changes(steps=2, dense_warmup_steps=1)
    assert any(not is_indexer(n) for n in every) and one < every


def test_resume_after_a_kill_continues_exactly(tmp_path):
    whole = Trainer(small_run(), tmp_path / "whole")
    whole.run(progress=False)
    interrupted = Trainer(small_run(), tmp_path / "killed")
    for _ in range(5):  # checkpointed at step 3; step 4 and 5 are lost with the process
        interrupted.train_step()
        if interrupted.step % 3 == 0:
            interrupted.save_checkpoint()
    with (tmp_path / "killed" / "log.jsonl").open("a") as log:  # what the lost steps logged
        log.write(json.dumps({"step": 4}) + "\n" + json.dumps({"step": 5}) + "\n")
    del interrupted
    resumed = Trainer(small_run(), tmp_path / "killed")
    assert resumed.step == 3
    resumed.run(progress=False)
    for (name, a), (_, b) in zip(whole.model.state_dict().items(),
                                 resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    log = [json.loads(line) for line in (tmp_path / "whole" / "log.jsonl").open()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    resumed_log = [json.loads(line) for line in (tmp_path / "killed" / "log.jsonl").open()]
    assert [r["step"] for r in resumed_log] == [4, 5, 6]  # the lost steps' lines are gone
    assert "heldout_ppl" in log[2] and "heldout_ppl" in log[5]


def test_one_process_trains_in_a_run_directory_and_a_killed_ones_lock_goes_with_it(tmp_path):
    import subprocess
    import sys

    first = Trainer(small_run(), tmp_path)
    with pytest.raises(ValueError, match="is in use by another kvstack train process"):
        Trainer(small_run(), tmp_path)
    first.run(progress=False)  # its end lets the directory go
    second = Trainer(small_run(steps=9), tmp_path)
    second.close()
    # Another process holding the run, then killed (SIGKILL: no cleanup of its own).
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
         str(tmp_path / "train.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="in use"):
            Trainer(small_run(steps=9), tmp_path)
    finally:
        holder.kill()
        holder.wait()
    resumed = Trainer(small_run(steps=9), tmp_path)
    assert resumed.step == 6
    resumed.run(progress=False)
    assert resumed.step == 9


def test_a_run_directory_refuses_other_settings(tmp_path):
    Trainer(small_run(), tmp_path)
    with pytest.raises(ValueError, match=r"holds a run with another training config: lr "
                                         r"0\.003 \(now 0\.001\)"):
        Trainer(small_run(lr=1e-3), tmp_path)
    with pytest.raises(ValueError, match=r"0 held-out files at heldout_percent 0\.1; both "
                                         r"halves need files \(a small corpus needs a larger "
                                         r"--heldout-percent"):
        Trainer(small_run(heldout_percent=0.1), tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_a_run_extended_with_more_steps_resumes_and_logs_lines(tmp_path, capsys):
    Trainer(small_run(steps=2), tmp_path).run(progress=False, lines=True)
    first = capsys.readouterr().err
    assert "step 1/2 · loss" in first and "step 2/2" in first
    longer = Trainer(small_run(steps=4), tmp_path)  # --steps raised: the same run goes on
    assert longer.step == 2
    longer.run(progress=False, lines=True)
    assert "step 4/4" in capsys.readouterr().err
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").open()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert json.loads((tmp_path / "train_config.json").read_text())["steps"] == 4


@pytest.mark.parametrize(("change", "message"), [
    (dict(min_lr=1e-2), r"min_lr 0\.01 must lie between 0 and lr 0\.003"),
    (dict(retrieval_rate=1.5), r"retrieval_rate 1\.5 must lie in \[0, 1\]"),
    (dict(warmup_steps=-1), "warmup_steps must be at least 0, got -1"),
    (dict(dense_warmup_steps=-1), "dense_warmup_steps must be at least 0, got -1"),
    (dict(grad_clip=0.0), "grad_clip must be positive"),
    (dict(vocab_size=100), r"vocab_size 100 cannot hold the byte-level BPE alphabet"),
    (dict(heldout_percent=100.0), "heldout_percent 100.0 must lie strictly between"),
    (dict(corpus="/nonexistent"), "corpus /nonexistent: 0 training and 0 held-out files"),
])
def test_an_impossible_setting_is_refused_before_the_run_directory_is_written(
        tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        Trainer(small_run(**change), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_kvstack_train_command(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--out", str(out), "--steps", "2",
                 "--seq-len", "32", "--batch-size", "2", "--vocab-size", "512",
                 "--corpus", CORPUS, "--heldout-percent", "40", "--eval-every", "2",
                 "--checkpoint-every", "2", "--set", "window_size=4",
                 "--set", "kv_format=bf16", "--answer-loss-weight", "4"]) == 0
    assert (out / "checkpoint" / "model" / "model.safetensors").exists()
    assert (out / "checkpoint" / "model" / "tokenizer.json").exists()
    assert len((out / "log.jsonl").read_text().splitlines()) == 2
    saved = json.loads((out / "checkpoint" / "model" / "config.json").read_text())
    assert (saved["window_size"], saved["kv_format"]) == (4, "bf16")
    assert json.loads((out / "train_config.json").read_text())["answer_loss_weight"] == 4.0


@pytest.mark.parametrize("setting, error", [
    ("windowsize=4", "model config has no key windowsize"),
    ("window_size=0", "window_size = 0: must be a positive integer"),
])
def test_kvstack_train_refuses_a_bad_model_setting(tmp_path, capsys, setting, error):
    args = ["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--steps", "1",
            "--corpus", CORPUS, "--heldout-percent", "40", "--set", setting]
    assert main(args) != 0
    assert error in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written: the corrected command starts


def test_retrieval_samples_are_mixed_in_at_the_configured_rate(tmp_path):
    trainer = Trainer(small_run(retrieval_rate=1.0, seq_len=256), tmp_path)
    rows, targets, _ = trainer.batch(0)
    assert rows.shape == (4, 257) and torch.equal(targets, rows[:, 1:])
    for row in rows:
        assert "assert KEY_" in trainer.tokenizer.decode(row.tolist())
    assert torch.equal(rows, trainer.batch(0)[0])  # a function of the index


def test_two_torchrun_processes_step_like_one_process_on_the_whole_batch(tmp_path):
    """Data parallel: after one step, the weights of a 2-process run equal those of a
    1-process run over the same global batch (gradients averaged across processes)."""
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    args = ["train", "--preset", "tiny", "--steps", "1", "--seq-len", "32", "--batch-size",
            "4", "--vocab-size", "512", "--corpus", CORPUS, "--heldout-percent", "40",
            "--eval-every", "1", "--checkpoint-every", "1", "--dense-warmup-steps", "1"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main([*args, "--out", str(one)]) == 0
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "kvstack.cli",
         *args, "--out", str(two)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    a = load_file(str(one / "checkpoint" / "model" / "model.safetensors"))
    b = load_file(str(two / "checkpoint" / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=1e-5), name
    # Adam's first step hardly depends on the gradients' scale; their norm does.
    logs = [json.loads((d / "log.jsonl").read_text()) for d in (one, two)]
    assert logs[0]["grad_norm"] == pytest.approx(logs[1]["grad_norm"], rel=1e-5)
    # Each process saw only its half: the first process's own loss is not the whole batch's.
    assert logs[0]["loss"] != pytest.approx(logs[1]["loss"], rel=1e-6)


def test_init_from_starts_from_a_model_and_its_tokenizer(tmp_path):
    first = Trainer(small_run(), tmp_path / "first")
    first.run(progress=False)
    source = tmp_path / "first" / "checkpoint" / "model"
    # Settings that change no parameter shape (the window here) may differ.
    tuned = Trainer(small_run(steps=2, init_from=str(source),
                              model_overrides={"window_size": 8}), tmp_path / "tuned")
    assert tuned.step == 0
    for (name, a), (_, b) in zip(first.model.state_dict().items(),
                                 tuned.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert (tmp_path / "tuned" / "tokenizer.json").read_text() == (
        source / "tokenizer.json").read_text()
    tuned.run(progress=False)
    # Resuming the fine-tune takes its own checkpoint, not the starting weights again.
    again = Trainer(small_run(steps=2, init_from=str(source),
                              model_overrides={"window_size": 8}), tmp_path / "tuned")
    assert again.step == 2
    for (name, a), (_, b) in zip(tuned.model.state_dict().items(),
                                 again.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_init_from_refuses_a_model_of_another_shape(tmp_path):
    Trainer(small_run(steps=1), tmp_path / "first").run(progress=False)
    source = str(tmp_path / "first" / "checkpoint" / "model")
    with pytest.raises(ValueError, match=r"weights do not fit the run's model .*embed.weight"):
        Trainer(small_run(init_from=source, vocab_size=640), tmp_path / "wide")
    assert not (tmp_path / "wide").exists()
    with pytest.raises(ValueError, match="not a model directory"):
        Trainer(small_run(init_from=str(tmp_path)), tmp_path / "none")


def test_a_run_written_before_a_setting_existed_still_resumes(tmp_path):
    Trainer(small_run(steps=1), tmp_path).run(progress=False)
    saved = json.loads((tmp_path / "train_config.json").read_text())
    del saved["init_from"]  # as written before --init-from existed
    (tmp_path / "train_config.json").write_text(json.dumps(saved))
    assert Trainer(small_run(steps=1), tmp_path).step == 1
    saved["future_setting"] = 1
    (tmp_path / "train_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="unknown training settings future_setting"):
        Trainer(small_run(steps=1), tmp_path)


def test_resuming_never_rewrites_the_saved_config(tmp_path):
    # Under torchrun the other processes read it while process 0 starts: rewriting it
    # then let one of them read an empty file.
    Trainer(small_run(steps=1), tmp_path).run(progress=False)
    saved = tmp_path / "train_config.json"
    before = saved.stat()
    assert Trainer(small_run(steps=1), tmp_path).step == 1
    assert (saved.stat().st_ino, saved.stat().st_mtime_ns) == (before.st_ino,
                                                                before.st_mtime_ns)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".tmp") == []


def test_a_corrupt_saved_config_is_named(tmp_path):
    Trainer(small_run(steps=1), tmp_path)
    (tmp_path / "train_config.json").write_text("")  # as a kill mid-write once left it
    with pytest.raises(ValueError, match=r"train_config\.json is not a training config"):
        Trainer(small_run(steps=1), tmp_path)


def test_an_indexer_warm_up_on_target_rows_trains_the_indexers_where_the_answers_are(tmp_path):
    """With index_target_rows the indexer-only warm-up takes its dense targets half at
    a retrieval row's answer queries and half at random positions past the window, a pure
    function of the step; it moves the indexers alone and refuses settings it cannot
    run."""
    tc = small_run(steps=1, dense_warmup_steps=1, dense_warmup_indexer_only=True,
                   index_target_rows=6, retrieval_rate=1.0, seq_len=192)
    trainer = Trainer(tc, tmp_path / "run")
    _, targets, answers = trainer.batch(0)
    assert answers.any(-1).all()
    chosen = trainer.target_rows(0, answers)
    assert chosen.shape == (tc.batch_size, 6)
    assert torch.equal(chosen, trainer.target_rows(0, answers))
    window = trainer.config.window_size
    for row, picked, asked in zip(targets, chosen, answers, strict=True):
        assert len(set(picked.tolist())) == 6
        assert int(asked[picked].sum()) >= 3  # half at answer queries, and the rest
        assert all(p >= window for p in picked[~asked[picked]].tolist())  # past the window
        assert asked[-1] and not asked[: len(row) // 2].any()  # the scored answer ends the row
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    record = trainer.train_step()
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert record["index_kl"] > 0 and any("wk_index" in n for n in moved)
    assert all(".indexer." in n or "wk_index" in n or "index_norm" in n for n in moved)
    with pytest.raises(ValueError, match="needs dense_warmup_indexer_only"):
        small_run(index_target_rows=4).check()
    with pytest.raises(ValueError, match="past its first window"):
        small_run(dense_warmup_indexer_only=True, index_target_rows=200, seq_len=192).check()


def test_the_answer_loss_weight_weighs_the_positions_that_predict_an_answer(tmp_path):
    """answer_loss_weight W: the cross-entropy is the mean over weights W at the positions
    predicting an answer token and 1 elsewhere; ignored targets weigh nothing; 1 is the
    plain mean; W trains toward the answers harder."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    targets = torch.tensor([[1, 2, 3, IGNORE, 4], [5, 6, IGNORE, 0, 1]])
    out = SimpleNamespace(logits=logits, index_scores={}, attention_targets={})
    each = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                             ignore_index=IGNORE, reduction="none")
    asked = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    plain, _ = losses(out, targets)
    assert losses(out, targets, torch.ones(2, 5))[0] == pytest.approx(float(plain))
    weighted, _ = losses(out, targets, 1 + 3 * asked)
    kept = targets.flatten() != IGNORE
    w = (1 + 3 * asked).flatten()[kept].float()
    assert float(weighted) == pytest.approx(float((each[kept] * w).sum() / w.sum()))

    runs = {}
    for weight in (1.0, 8.0):
        trainer = Trainer(small_run(steps=1, dense_warmup_steps=0, retrieval_rate=1.0,
                                    seq_len=192, answer_loss_weight=weight),
                          tmp_path / str(weight))
        runs[weight] = trainer.train_step()["loss"]
    assert runs[8.0] != pytest.approx(runs[1.0])
    with pytest.raises(ValueError, match="answer_loss_weight must be positive"):
        small_run(answer_loss_weight=0.0).check()
