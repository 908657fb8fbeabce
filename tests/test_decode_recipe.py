"""A decode step's kept calls (`DecodeRecipe`, and `DenseRecipe` for a layer with no
hyper-connections): bit for bit the logits of resolving every
call again, whatever the batch's shape and the selection's width do between steps, and a
weight replaced, re-pointed or updated in place between steps is the one the next step
reads."""

import sys

import pytest
import torch
from torch import nn

import kvstack.engine.runner as runner
from kvstack import LLM, SamplingParams, native
from kvstack.model.model import DecodeRecipe, DenseRecipe, SelectionCalls


def replace_parameter(model) -> None:
    g = torch.Generator().manual_seed(1)
    norm = model.layers[1].ffn_norm
    norm.weight = nn.Parameter(torch.rand(norm.weight.shape, generator=g) + 0.5)


def repoint_data(model) -> None:
    g = torch.Generator().manual_seed(2)
    norm = model.layers[2].attn_norm
    norm.weight.data = torch.rand(norm.weight.shape, generator=g) + 0.5


def repoint_indexer(model) -> None:
    g = torch.Generator().manual_seed(4)
    wq = model.layers[4].attn.indexer.wq
    wq.weight.data = torch.randn(wq.weight.shape, generator=g) * 0.05


def replace_compressor_norm(model) -> None:
    g = torch.Generator().manual_seed(5)
    norm = model.layers[1].attn.compressor.norm
    norm.weight = nn.Parameter(torch.rand(norm.weight.shape, generator=g) + 0.5)


def update_in_place(model) -> None:
    with torch.no_grad():
        model.layers[0].hc_ffn.base.add_(0.25)


def replace_module(model) -> None:
    g = torch.Generator().manual_seed(3)
    old = model.layers[1].attn.wo_b
    new = nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(torch.randn(new.weight.shape, generator=g) * 0.02)
    model.layers[1].attn.wo_b = new


def decode_logits(monkeypatch, recipes: bool, change, model: object = "tiny",
                  lengths: tuple[int, ...] = (37, 5, 59),
                  change_at: int = 6) -> tuple[list[torch.Tensor], int]:
    """Every decode step's logits of three greedy requests that end at different steps
    (the batch shrinks), `change` applied to the model after step `change_at`; and how
    many layer steps ran a recipe."""
    runs = [0]
    for kind in (DecodeRecipe, DenseRecipe):
        if recipes:
            def counted(self, *args, run=kind.run):
                runs[0] += 1
                return run(self, *args)

            monkeypatch.setattr(kind, "run", counted)
        else:
            monkeypatch.setattr(kind, "capture", staticmethod(lambda *args: None))
    seen, sample = [], runner.sample_batch

    def record(logits, requests):
        seen.append(logits.clone())
        return sample(logits, requests)

    monkeypatch.setattr(runner, "sample_batch", record)
    llm = LLM(model, random_init=True, kv_budget="2MiB", block_tokens=16)
    g = torch.Generator().manual_seed(7)
    for i, length in enumerate(lengths):
        llm.add_request(torch.randint(0, 256, (length,), generator=g).tolist(),
                        SamplingParams(max_tokens=10 + 6 * i, temperature=0, ignore_eos=True))
    steps = 0
    while llm.has_unfinished_requests():
        llm.step()
        steps += 1
        if change is not None and steps == change_at:
            change(llm.model)
    monkeypatch.undo()
    return seen, runs[0]


@pytest.mark.parametrize("change", [None, replace_parameter, repoint_data, update_in_place,
                                    replace_module, repoint_indexer, replace_compressor_norm])
def test_kept_calls_give_the_logits_of_resolving_them(monkeypatch, change):
    # After step 8 the batch's block table keeps its width for two more steps of its
    # shape, so the kept compressor and indexer calls see the change too.
    want, _ = decode_logits(monkeypatch, False, change, change_at=8)
    got, runs = decode_logits(monkeypatch, True, change, change_at=8)
    assert runs > 0  # the recipes ran
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["per_site", "tiny-v41"])
def test_other_residuals_and_engram_layers_keep_their_logits(monkeypatch, name):
    """Hyper-connections mixed at each site (no carried pre), and V4.1's layout, whose
    Engram layers never keep a recipe while the others do."""
    from kvstack.config import preset

    model = preset("tiny").replace(hc_residual="per_site") if name == "per_site" else name
    want, _ = decode_logits(monkeypatch, False, None, model)
    got, runs = decode_logits(monkeypatch, True, None, model)
    assert runs > 0
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_selection_that_widens_after_a_recipe_was_kept_runs_the_calls_afresh(monkeypatch):
    """A sequence whose block table grows past one block while it decodes: its stream
    then holds more entries than one block's, and the indexer's top-k widens (index_topk
    above one block's entries). A recipe kept for the narrower selection hands that step
    to the calls as `Attention.forward` makes them, with the same logits."""
    from kvstack.config import preset

    tails = [0]
    attention_out, recipe_code = native.attention_out, DecodeRecipe.run.__code__

    def counted(*args, **kwargs):
        tails[0] += sys._getframe(1).f_code is recipe_code  # a recipe's hand-over
        return attention_out(*args, **kwargs)

    monkeypatch.setattr(native, "attention_out", counted)
    model = preset("tiny").replace(index_topk=16)
    want, _ = decode_logits(monkeypatch, False, None, model, (12,))
    monkeypatch.setattr(native, "attention_out", counted)
    tails[0] = 0
    got, runs = decode_logits(monkeypatch, True, None, model, (12,))
    assert runs > 0 and tails[0] > 0  # recipes ran, and some handed their step over
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_kept_compressor_and_indexer_calls_run_every_selection_path(monkeypatch):
    """The kept compressor and indexer calls (`SelectionCalls`) of tiny's layers: a Full
    layer scoring its stream, a candidate source, a Reindex layer inside its candidate
    pool once the stream outgrows it, Reuse and window-only layers reading what others
    chose; bit for bit the logits of the general path, which the masked pool of a short
    stream still takes."""
    modes = []
    run = SelectionCalls.run

    def counted(self, *args):
        modes.append(self.mode)
        return run(self, *args)

    want, _ = decode_logits(monkeypatch, False, None)
    monkeypatch.setattr(SelectionCalls, "run", counted)
    got, _ = decode_logits(monkeypatch, True, None)
    assert {"scores", "candidate_source", "in_pool", ""} <= set(modes)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def dense_attention_weight(model) -> None:
    g = torch.Generator().manual_seed(6)
    wk = model.layers[3].attn.wk
    wk.weight.data = torch.randn(wk.weight.shape, generator=g) * 0.05


@pytest.mark.parametrize("change", [None, replace_parameter, dense_attention_weight])
def test_the_dense_controls_kept_calls_give_the_logits_of_resolving_them(monkeypatch, change):
    """The dense control's layers (no hyper-connections, one attention call and one
    feed-forward call each) keep theirs too, and see a weight replaced or re-pointed."""
    from kvstack.config import dense_control, preset

    model = dense_control(preset("tiny"))
    want, _ = decode_logits(monkeypatch, False, change, model, change_at=8)
    got, runs = decode_logits(monkeypatch, True, change, model, change_at=8)
    assert runs > 0
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dense", [False, True])
def test_a_one_token_prefill_between_decode_steps_leaves_the_recipes_calls_alone(
        monkeypatch, dense):
    """A prefix hit on all but one token of its prompt owes a replay, so its last token is
    a prefill of one token: the layers' calls for that shape are the plans the recipes
    were made from, and such a call sets the slots it takes (its own output buffer among
    them). The recipes keep slots of their own: the next decode steps give the tokens of
    an engine that keeps no recipe; the dense control's too."""

    def outputs(recipes: bool) -> list[list[int]]:
        if not recipes:
            for kind in (DecodeRecipe, DenseRecipe):
                monkeypatch.setattr(kind, "capture", staticmethod(lambda *args: None))
        from kvstack.config import dense_control, preset

        model = dense_control(preset("tiny")) if dense else "tiny"
        llm = LLM(model, random_init=True, kv_budget="1MiB", block_tokens=16)
        prompt = torch.randint(3, 250, (177,), generator=torch.Generator().manual_seed(0))
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        outs = [llm.generate([prompt.tolist()], params)[0] for _ in range(3)]
        assert [o.num_cached_tokens for o in outs] == [0, 176, 176]
        monkeypatch.undo()
        return [o.token_ids for o in outs]

    assert outputs(True) == outputs(False)
