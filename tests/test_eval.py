"""`kvstack eval ppl`, `retrieval`, `attention`, `knockout` and `selection`."""

import json
import math

import pytest
import torch

from kvstack.cli import main
from kvstack.corpus.data import stdlib_root
from kvstack.eval.quality import (
    _answers,
    attention_mass,
    knockout,
    perplexity,
    position_buckets,
    retrieval,
    selection,
)
from kvstack.train.trainer import TrainConfig, Trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model after a few steps on five stdlib modules, saved as a model directory."""
    out = tmp_path_factory.mktemp("run")
    tc = TrainConfig(preset="tiny", steps=3, seq_len=64, batch_size=4, warmup_steps=1,
                     dense_warmup_steps=1, eval_every=3, eval_batches=1, checkpoint_every=3,
                     vocab_size=512, heldout_percent=40.0, corpus=str(stdlib_root() / "json"))
    Trainer(tc, out).run(progress=False)
    return out / "checkpoint" / "model"



def test_perplexity_compares_fp4_with_bf16_caches(trained, data):
    from kvstack.eval.quality import load_eval_model

    model, _ = load_eval_model(trained)
    result = perplexity(model, data[1], seq_len=64, windows=2)
    assert result["formats"]["kv_format"] == "fp4_e4m3_16"
    assert 1 < result["ppl"] < 512 and 1 < result["ppl_bf16"] < 512
    assert result["ppl"] != result["ppl_bf16"]  # the FP4 path is really taken
    assert 0 < result["kl_vs_bf16"] < 0.1 and 0.5 < result["top1_agreement"] <= 1
    # By position: the buckets cover every position once, and their size-weighted
    # log-perplexities average back to the whole window's.
    buckets = position_buckets(64)
    assert buckets == [(0, 64)]
    assert list(result["ppl_by_position"]) == ["0-64"]
    assert result["ppl_by_position"]["0-64"] == pytest.approx(result["ppl"], rel=1e-5)


def test_position_buckets_double_up_to_the_window_length(trained, data):
    from kvstack.eval.quality import load_eval_model

    assert position_buckets(300) == [(0, 64), (64, 128), (128, 256), (256, 300)]
    assert position_buckets(40) == [(0, 40)]
    model, _ = load_eval_model(trained)
    result = perplexity(model, data[1], seq_len=160, windows=2)
    sizes = [hi - lo for lo, hi in position_buckets(160)]
    logs = [math.log(v) for v in result["ppl_by_position"].values()]
    assert list(result["ppl_by_position"]) == ["0-64", "64-128", "128-160"]
    assert math.exp(sum(s * v for s, v in zip(sizes, logs, strict=True)) / 160) == pytest.approx(
        result["ppl"], rel=1e-5)
    assert len(set(result["ppl_by_position"].values())) == 3


def test_short_context_scores_the_same_tokens_seeing_only_their_recent_past(trained, data):
    from kvstack.eval.quality import _sliding_nll, load_eval_model

    model, _ = load_eval_model(trained)
    result = perplexity(model, data[1], seq_len=160, windows=2, short_context=64)
    whole, short = result["ppl_by_position"], result["ppl_by_position_short_context"]
    assert list(short) == list(whole) == ["0-64", "64-128", "128-160"]
    # The first window is the whole window's start: the same tokens, the same context.
    assert short["0-64"] == pytest.approx(whole["0-64"], rel=1e-5)
    assert short["128-160"] != pytest.approx(whole["128-160"], rel=1e-5)
    # A token past the first half-window is scored after 32..63 tokens: what lies
    # further back cannot reach it, while the whole window's scores do change.
    ids = data[1].batch(1, 161, 0, 0)[0]
    changed = ids.clone()
    changed[:8] = (changed[:8] + 1) % model.config.vocab_size
    targets = ids[1:]
    before = _sliding_nll(model, ids[:-1], targets, 64)
    after = _sliding_nll(model, changed[:-1], targets, 64)
    assert torch.equal(before[8 + 64:], after[8 + 64:])
    assert not torch.equal(before[8:64], after[8:64])
    with pytest.raises(ValueError, match=r"short_context must lie in 2\.\.159"):
        perplexity(model, data[1], seq_len=160, windows=1, short_context=160)


def test_retrieval_scores_the_greedy_answer(monkeypatch, data):
    from kvstack.config import preset
    from kvstack.model import Model

    tokenizer, cache = data
    torch.manual_seed(0)
    model = Model(preset("tiny")).eval()
    result = retrieval(model, tokenizer, cache, lengths=[64, 96], depths=[0.2, 0.8], samples=2)
    assert len(result["accuracy"]) == 2 and all(len(r) == 2 for r in result["accuracy"])
    assert all(0 <= a <= 1 for r in result["accuracy"] for a in r)
    assert len(result["answer_nll"]) == 2 and all(n > 0 for n in result["answer_nll"])
    with pytest.raises(ValueError, match=r"depth 1\.5 must lie in \[0, 1\]"):
        retrieval(model, tokenizer, cache, lengths=[64], depths=[0.5, 1.5], samples=1)
    # A model made to emit exactly the answer scores, at a likelihood of one; one that
    # misses a token does not, and that token's likelihood is next to nothing.
    ids = list(range(10, 40))
    answer_start = 25
    for wrong_at, expected in ((None, True), (2, False)):
        queue = [t if i != wrong_at else t + 1 for i, t in enumerate(ids[answer_start:])]
        hook = model.head.register_forward_hook(
            lambda module, args, out, q=queue: out.index_fill(-1, torch.tensor([q.pop(0)]), 1e4)
            if q else out)
        answered = _answers(model, ids, answer_start, "exact")
        hook.remove()
        assert answered.exact is expected and answered.tokens == len(ids) - answer_start
        assert not queue
        assert answered.nll < 1e-3 if expected else answered.nll > 100
        # the first wrong token and what was chosen there name the miss
        assert answered.first_wrong == wrong_at
        assert answered.chose == (None if expected else ids[answer_start + 2] + 1)


def test_retrieval_names_each_wrong_answer_and_draws_questions_by_seed(data):
    from kvstack.config import preset
    from kvstack.model import Model

    tokenizer, cache = data
    torch.manual_seed(0)
    model = Model(preset("tiny")).eval()  # untrained: nearly every answer is wrong
    result = retrieval(model, tokenizer, cache, lengths=[64], depths=[0.5], samples=3)
    missed = result["misses"][0]
    assert len(missed) == round(3 * (1 - result["accuracy"][0][0])) > 0
    for miss in missed:
        answer = tokenizer.encode(miss["answer"]).ids
        assert 0 <= miss["at"] < len(answer) and miss["chose"] != miss["expected"]
        assert miss["answer"].startswith(tokenizer.decode(answer[: miss["at"]]))
    again = retrieval(model, tokenizer, cache, lengths=[64], depths=[0.5], samples=3)
    other = retrieval(model, tokenizer, cache, lengths=[64], depths=[0.5], samples=3, seed=1)
    assert again["misses"] == result["misses"] and other["seed"] == 1
    assert {m["answer"] for m in other["misses"][0]} != {m["answer"] for m in missed}


def test_eval_commands(trained, tmp_path, capsys):
    assert main(["eval", "ppl", "--model", str(trained), "--seq-len", "64", "--windows", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["windows"] == 2 and "ppl_increase" in out
    plot = tmp_path / "heat.png"
    assert main(["eval", "retrieval", "--model", str(trained), "--lengths", "64",
                 "--depths", "0.5", "--samples", "1", "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "retrieval accuracy" in capsys.readouterr().out
    assert main(["eval", "retrieval", "--model", str(trained), "--lengths", "64",
                 "--depths", "0.5", "--samples", "2", "--seed", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seed"] == 3 and len(out["misses"][0]) == round(2 * (1 - out["accuracy"][0][0]))
    assert main(["eval", "attention", "--model", str(trained), "--seq-len", "64",
                 "--windows", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["from_position"] == 32
    assert main(["eval", "knockout", "--model", str(trained), "--length", "64",
                 "--depths", "0.2", "--samples", "1"]) == 0
    assert "layer 1" in capsys.readouterr().out
    assert main(["eval", "selection", "--model", str(trained), "--lengths", "96",
                 "--depths", "0.2", "--samples", "1"]) == 0
    assert "reindex" in capsys.readouterr().out
    assert main(["eval", "selection", "--model", str(trained), "--lengths", "96",
                 "--depths", "0.2", "--samples", "1", "--trunk-picks",
                 "--logit-scale", "4=2"]) == 0
    assert "own attention logits; layer 4's logits x2.0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["eval", "selection", "--model", str(trained), "--logit-scale", "4"])
    assert "expected LAYER=FACTOR" in capsys.readouterr().err
    assert main(["eval", "ppl", "--model", str(tmp_path / "missing")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_demo_compares_the_session_with_the_dense_control(trained, tmp_path, capsys):
    control = tmp_path / "control"
    tc = TrainConfig(preset="dense-tiny", steps=1, seq_len=64, batch_size=4, warmup_steps=1,
                     eval_every=1, eval_batches=1, checkpoint_every=1, vocab_size=512,
                     heldout_percent=40.0, corpus=str(stdlib_root() / "json"))
    Trainer(tc, tmp_path / "run").run(progress=False)
    (tmp_path / "run" / "checkpoint" / "model").rename(control)
    assert main(["demo", "--model", str(trained), "--control", str(control), "--context", "300",
                 "--max-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    stack, dense = out["models"].values()
    assert out["context"] == 300
    assert stack["bytes_per_token"] == stack["planned_bytes_per_token"] == 52.5
    assert dense["bytes_per_token"] == 8 * 2 * 32 * 2
    assert stack["sessions_in_80_gb"] > dense["sessions_in_80_gb"]
    assert stack["prefill_tokens_per_s"] > 0 and stack["decode_tokens_per_s"] > 0
    assert main(["demo", "--model", str(tmp_path / "nothing")]) == 2
    assert "holds no model.safetensors" in capsys.readouterr().err
    assert main(["demo", "--model", str(trained), "--control", str(tmp_path / "nothing")]) == 2
    assert "no dense control at" in capsys.readouterr().err


def test_the_attention_probe_accounts_for_every_query_and_changes_nothing():
    from kvstack.config import Mode, preset
    from kvstack.model import Instruments, Model

    torch.manual_seed(0)
    model = Model(preset("tiny")).eval()
    ids = torch.randint(0, 512, (2, 40))
    probed = Instruments(probe=True)
    with torch.no_grad():
        plain, out = model(ids), model(ids, instruments=probed)
    assert torch.equal(plain.logits, out.logits)
    assert sorted(probed.attention_mass) == list(range(model.config.n_layers))
    w = model.config.window_size
    for layer, mass in probed.attention_mass.items():
        spec = model.config.layers[layer]
        assert mass.shape == (2, 40, 5)
        # window + near + far + sink: one softmax, so every query's attention is all there
        torch.testing.assert_close(mass[..., :4].sum(-1), torch.ones(2, 40, dtype=mass.dtype))
        if spec.mode is Mode.WINDOW:
            assert (mass[..., 1:3] == 0).all() and mass[..., 4].isnan().all()
        else:
            assert (mass[:, : w - 1, 2] == 0).all()  # nothing lies beyond the window yet
            assert mass[:, 2 * w :, 2].sum() > 0
            share = mass[:, 2 * w :, 4]
            assert ((share >= 0) & (share <= 1)).all()
        if spec.mode is Mode.REUSE:  # its picks are its index source's
            source = probed.attention_mass[spec.index_source]
            torch.testing.assert_close(mass[..., 4], source[..., 4], equal_nan=True)


def test_attention_probe_over_held_out_windows(trained, data):
    from kvstack.config import preset
    from kvstack.eval.quality import load_eval_model
    from kvstack.model import Model

    model, _ = load_eval_model(trained)
    result = attention_mass(model, data[1], seq_len=64, windows=2, from_position=32)
    assert [row["layer"] for row in result["layers"]] == list(range(model.config.n_layers))
    for row in result["layers"]:
        assert abs(row["window"] + row["near"] + row["far"] + row["sink"] - 1) < 1e-6
        assert (row["selected_near"] is None) == (row["mode"] == "window")
    with pytest.raises(ValueError, match=r"from_position must lie in 0\.\.63"):
        attention_mass(model, data[1], seq_len=64, windows=1, from_position=64)
    with pytest.raises(ValueError, match="dense control attends to every token"):
        attention_mass(Model(preset("dense-tiny")), data[1], seq_len=64, windows=1,
                       from_position=0)


def test_a_knocked_out_layer_attends_to_its_window_and_sink_only():
    from kvstack.config import preset
    from kvstack.model import Instruments, Model

    torch.manual_seed(0)
    model = Model(preset("tiny")).eval()
    ids = torch.randint(0, 512, (1, 80))
    compressed = [spec.index for spec in model.config.layers if spec.ratio]
    plain = Instruments(probe=True)
    with torch.no_grad():
        plain_logits = model(ids, instruments=plain).logits
        for layer in compressed:
            out = Instruments(probe=True, window_only=frozenset({layer}))
            logits = model(ids, instruments=out).logits
            assert (out.attention_mass[layer][..., 1:3] == 0).all()
            for earlier in range(layer):
                torch.testing.assert_close(out.attention_mass[earlier],
                                           plain.attention_mass[earlier], rtol=0, atol=0,
                                           equal_nan=True)
            assert not torch.equal(logits, plain_logits)


def test_knockout_leaves_out_each_compressed_layer_in_turn(trained, data):
    from kvstack.config import preset
    from kvstack.eval.quality import load_eval_model
    from kvstack.model import Model

    model, tokenizer = load_eval_model(trained)
    result = knockout(model, tokenizer, data[1], length=64, depths=[0.1, 0.5], samples=2)
    rows = result["layers"]
    assert rows[0]["layer"] is None
    assert [r["layer"] for r in rows[1:]] == [s.index for s in model.config.layers if s.ratio]
    for row in rows:
        assert row["answer_nll"] > 0 and row["accuracy"] in (0, 0.25, 0.5, 0.75, 1)
    assert len({round(r["answer_nll"], 9) for r in rows}) > 1  # leaving a layer out matters
    with pytest.raises(ValueError, match=r"depth 1\.5 must lie in"):
        knockout(model, tokenizer, data[1], length=64, depths=[1.5], samples=1)
    with pytest.raises(ValueError, match="no compressed entries"):
        knockout(Model(preset("dense-tiny")), tokenizer, data[1], length=64, depths=[0.5],
                 samples=1)


def test_selection_finds_the_definition_in_each_top_k(data):
    """Every visible entry selected when the top-k and the candidate pool hold the whole
    stream, so each picking layer holds all of the definition's entries and puts some of
    its attention there; a top-1 holds at most one of them."""
    from kvstack.config import preset
    from kvstack.model import Model

    tokenizer, cache = data
    torch.manual_seed(0)
    config = preset("tiny").replace(vocab_size=512, index_topk=4096, candidate_topk_blocks=4096)
    everything = selection(Model(config).eval(), tokenizer, cache, [160], [0.1, 0.3], 2)
    pickers = [s.index for s in config.layers if s.ratio and s.index_source == s.index]
    (row,) = everything["lengths"]
    assert [layer["layer"] for layer in row["layers"]] == pickers == [1, 3, 4, 6]
    assert len(row["questions"]) == 4 and everything["families"] == ["keyword_argument",
                                                                      "environment", "annotated"]
    for layer in row["layers"]:
        assert layer["selected"] == layer["value_selected"] == 1.0
        assert 0 < layer["value_mass"] < layer["mass"] < 1
        assert layer["found"][1] == 4 and layer["missed"] == [0, 0]
        assert layer["found"][0] == round(row["exact"] * 4)
    torch.manual_seed(0)
    one = selection(Model(config.replace(index_topk=1, candidate_topk_blocks=1)).eval(),
                    tokenizer, cache, [160], [0.1, 0.3], 2)
    for question in one["lengths"][0]["questions"]:
        for share in question["selected"].values():
            assert share <= 0.5  # every definition spans more than two entries
        assert all(question["value_mass"][k] <= question["mass"][k] for k in question["mass"])
    with pytest.raises(ValueError, match="no top-k selection"):
        selection(Model(preset("dense-tiny")), tokenizer, cache, [160], [0.5], 1)


def test_eval_takes_the_bundled_model_by_name_as_every_command_does():
    from kvstack.eval.quality import load_eval_model

    model, tokenizer = load_eval_model("default")
    assert model.config.vocab_size == tokenizer.get_vocab_size()
