"""DSpark's draft model: against DeepSeek's own code, what the target hands it, its config
keys, and its tensors in the published layout."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvstack import native
from kvstack.cache.reference import ReferenceStore
from kvstack.config import ModelConfig, preset
from kvstack.model import Model
from kvstack.model.checkpoint import export_v41
from kvstack.model.packed import PackedExperts, PackedLinear
from kvstack.plan import make_plan
from tests.v41_checkpoint import hf_config, inference_config, write_v41_checkpoint

# DeepSeek's V4.1 draft (its model.py forward_spec, with the CPU ports of its kernels) run on
# the tiny-v41-dspark checkpoint tests/v41_checkpoint.py writes with seed 0: data/README.md.
REFERENCE = Path(__file__).parent / "data" / "dspark_reference.safetensors"
SEED, PREFILL = 0, 5


@pytest.fixture(scope="module")
def drafted(tmp_path_factory) -> Model:
    directory = tmp_path_factory.mktemp("dspark")
    write_v41_checkpoint(directory, preset("tiny-v41-dspark"), seed=SEED, shards=0)
    return Model.from_pretrained(directory).eval()


def test_the_draft_equals_deepseeks_within_its_own_noise_floor(drafted):
    """Each decode step's draft block, its tokens forced to the reference's, against the
    reference's logits and confidence: within twice what the reference itself moves when
    every input value moves by one bf16 ulp (the floor of its bf16 activations)."""
    ref = load_file(REFERENCE)
    model = drafted
    model.set_numerics("reference")
    c = model.config
    hidden, tokens = ref["hidden"].float(), ref["tokens"]  # [B, T, 3 dim], [B, T + 1]
    for step, want in enumerate(ref["draft_tokens"]):  # [B, K + 1] each
        p = PREFILL + step
        w = min(c.window_size, p + 1)
        forced = iter(want[:, 1:].unbind(1))
        with torch.no_grad():
            block = model.draft(model, hidden[:, p - w + 1 : p + 1], tokens[:, p + 1], p,
                                sample=lambda _, forced=forced: next(forced))
        logits, confidence = ref["logits"][step], ref["confidence"][step]
        assert (block.logits - logits).abs().max() <= 2 * ref["floor_logits"][step]
        assert (block.confidence - confidence).abs().max() <= 2 * ref["floor_confidence"][step]
        top2 = logits.topk(2, dim=-1).values
        clear = top2[..., 0] - top2[..., 1] > 2 * ref["floor_logits"][step]
        assert torch.equal(block.logits.argmax(-1)[clear], logits.argmax(-1)[clear])


def test_per_sequence_positions_equal_each_sequence_alone(drafted):
    model, c = drafted, drafted.config
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, c.window_size, 3 * c.dim, generator=g)
    token = torch.randint(0, c.vocab_size, (2,), generator=g)
    with torch.no_grad():
        both = model.draft(model, hidden, token, torch.tensor([20, 9]))
        alone = [model.draft(model, hidden[i : i + 1], token[i : i + 1], p)
                 for i, p in enumerate((20, 9))]
    assert torch.equal(both.tokens, torch.cat([a.tokens for a in alone]))
    torch.testing.assert_close(both.logits, torch.cat([a.logits for a in alone]))
    torch.testing.assert_close(both.confidence, torch.cat([a.confidence for a in alone]))


def one_copy_draft() -> Model:
    """The bundled model's shape (one residual copy, a dense feed-forward) with a draft."""
    torch.manual_seed(0)
    return Model(preset("default").replace(
        compress_ratios=[*preset("default").compress_ratios, 0], n_mtp_layers=1,
        dspark_block_size=4, dspark_noise_token_id=2, dspark_target_layer_ids=[5, 6, 7],
        dspark_markov_rank=16, max_seq_len=1024)).eval()


@pytest.mark.parametrize("shape", ["hyper-connections", "one copy"])
def test_a_draft_in_an_engine_step_equals_torchs_within_float_rounding(shape, drafted):
    """In an engine step the C kernels run a draft stage (one C call where it has one
    residual copy and float weights) or its packed matmuls (the V4.1 layout's), and,
    where its Markov embedding is float32, a greedy block's head, Markov choices and
    confidence (one C call, the Markov head's columns kept): the same block as torch's
    ops, within float rounding."""
    model = drafted if shape == "hyper-connections" else one_copy_draft()
    c = model.config
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(2, c.window_size, len(c.dspark_target_layer_ids) * c.dim, generator=g)
    token = torch.randint(0, c.vocab_size, (2,), generator=g)
    blocks = []
    for kernels in (False, True):
        with torch.no_grad(), native.active(kernels):
            window = model.draft.window(hidden, torch.tensor([40, 70]))
            blocks.append(model.draft.block(model, window, token, torch.tensor([40, 70])))
    torch_ops, c_kernels = blocks
    # Float weights take the trunk's calls (the checkpoint's FP8 ones its packed kernels).
    assert bool(model.draft.stages[0].c_calls) == (shape == "one copy")
    # The head's C call ran where the Markov embedding is float32 (the checkpoint's bf16
    # one takes torch's ops).
    assert (model.draft._markov_columns is not None) == (shape == "one copy")
    assert torch.equal(c_kernels.tokens, torch_ops.tokens)
    torch.testing.assert_close(c_kernels.logits, torch_ops.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c_kernels.confidence, torch_ops.confidence, rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("kernels", [False, True])
def test_windows_of_several_lengths_padded_into_one_call_equal_each_alone(kernels, drafted):
    """The engine drafts for every sequence in one call, a window shorter than the
    longest left-padded (`padding`): the same block as each sequence's own window made
    by torch's ops. With the C kernels (an engine step's: the bundled model's shape,
    whose draft stage is one C call), within float rounding."""
    model = one_copy_draft() if kernels else drafted
    c = model.config
    g = torch.Generator().manual_seed(5)
    lengths, positions = (c.window_size, 3, 11), (200, 2, 10)
    hidden = [torch.randn(1, n, 3 * c.dim, generator=g) for n in lengths]
    token = torch.randint(0, c.vocab_size, (3,), generator=g)
    with torch.no_grad():
        windows = [model.draft.window(h, p) for h, p in zip(hidden, positions, strict=True)]
        alone = [model.draft.block(model, w, token[i : i + 1], p)
                 for i, (w, p) in enumerate(zip(windows, positions, strict=True))]
        width = max(lengths)
        padded = torch.zeros(len(c.draft_layers), 3, width, c.head_dim)
        padding = torch.ones(3, width, dtype=torch.bool)
        for i, w in enumerate(windows):
            padded[:, i, width - w.shape[2] :] = w[:, 0]
            padding[i, width - w.shape[2] :] = False
        padded[:, 1, 0] = 1e4  # what a padded slot holds is never read
        with native.active(kernels):
            both = model.draft.block(model, padded, token, torch.tensor(positions),
                                     padding=padding)
    # The C path ran, or not.
    assert ("draft_stage" in model.draft.stages[0].c_calls) == kernels
    tolerance = dict(rtol=1e-4, atol=1e-4) if kernels else {}
    assert torch.equal(both.tokens, torch.cat([a.tokens for a in alone]))
    torch.testing.assert_close(both.logits, torch.cat([a.logits for a in alone]),
                               **tolerance)
    torch.testing.assert_close(both.confidence, torch.cat([a.confidence for a in alone]),
                               **tolerance)


def test_the_markov_rows_kept_follow_the_weights():
    """A block's Markov bias comes from rows kept by token outside training (and, for the
    C path, the head's columns kept): the same as the head computes, and computed anew
    once the head's weights change."""
    model = one_copy_draft()
    draft = model.draft
    tokens = torch.tensor([5, 9, 5])
    with torch.no_grad():
        fresh = draft.markov_head(draft.markov_embed(tokens)).float()
        torch.testing.assert_close(draft.markov_bias(tokens), fresh)
        assert set(draft._markov_rows) == {5, 9}
        torch.testing.assert_close(draft._kept_markov_columns(), draft.markov_head.weight.T)
        draft.markov_head.weight.mul_(2.0)
        torch.testing.assert_close(draft.markov_bias(tokens), 2.0 * fresh)
        torch.testing.assert_close(draft._kept_markov_columns(), draft.markov_head.weight.T)
    draft.train()
    biased = draft.markov_bias(tokens)  # training: no kept rows, the gradient flows
    assert biased.requires_grad


def test_the_target_hands_over_its_target_layers_attention_inputs(drafted):
    model, c = drafted, drafted.config
    ids = torch.randint(0, c.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model(ids, target_hidden=True)
        plain = model(ids)
        # Layer 5's input, the first target: the residual copies after layers 0..4.
        store = ReferenceStore(c, 2, ids.device)
        s = model._run(model._states(ids, 0, store), 0, store, range(5))
    assert plain.target_hidden is None
    assert torch.equal(out.logits, plain.logits)
    assert out.target_hidden.shape == (2, 11, 3 * c.dim)
    torch.testing.assert_close(out.target_hidden[..., : c.dim], s.x.mean(2))
    with pytest.raises(ValueError, match="no draft"):
        Model(preset("tiny-v41")).eval()(ids, target_hidden=True)


def test_the_draft_stages_load_packed_and_export_byte_for_byte(tmp_path, drafted):
    draft = drafted.draft
    assert isinstance(draft.main_proj, PackedLinear) and draft.main_proj.fmt == "fp8"
    assert isinstance(draft.markov_head, PackedLinear) and draft.markov_head.fmt == "bf16"
    experts = draft.stages[0].ffn.experts
    assert isinstance(experts, PackedExperts) and len(experts) == 3  # the draft's own count
    assert draft.stages[0].ffn.gate.weight.shape[0] == 3
    assert all(n.endswith("bias_vl") for n in drafted.checkpoint_report.skipped
               if n.startswith("mtp."))
    files = export_v41(drafted, tmp_path / "out")
    written: dict[str, torch.Tensor] = {}
    for file in files:
        written.update(load_file(str(tmp_path / "out" / file)))
    original = write_v41_checkpoint(tmp_path / "again", drafted.config, seed=SEED, shards=0)
    drafts = {n for n in original if n.startswith("mtp.") and not n.endswith("bias_vl")}
    assert drafts == {n for n in written if n.startswith("mtp.")}
    for name in drafts:
        assert torch.equal(written[name].view(torch.uint8), original[name].view(torch.uint8))


def test_a_config_without_a_draft_skips_the_draft_tensors(tmp_path):
    c = preset("tiny-v41-dspark").replace(dspark_block_size=0)
    assert not c.has_draft and not c.draft_layers
    write_v41_checkpoint(tmp_path, preset("tiny-v41-dspark"), seed=SEED, shards=0)
    (tmp_path / "config.json").write_text(json.dumps(inference_config(c)))
    model = Model.from_pretrained(tmp_path)
    assert model.draft is None
    assert "dspark_block_size 0" in model.checkpoint_report.skipped["mtp.0.main_proj.weight"]


def test_dspark_keys_validate_and_map_from_hf_names():
    c = preset("tiny-v41-dspark")
    assert ModelConfig.from_dict(hf_config(c)["text_config"]) == c
    # HF leaves out what equals its defaults: those are V4.1-Flash's draft (its targets the
    # last three layers that are not kv sources).
    flash = preset("deepseek-v4.1-flash")
    hf = hf_config(flash)
    for key in [k for k in hf["text_config"] if k.startswith("dspark_")]:
        del hf["text_config"][key]
    assert ModelConfig.from_dict(hf) == flash
    assert c.draft_experts == (3, 2)
    assert c.replace(dspark_n_routed_experts=0, dspark_n_activated_experts=0).draft_experts \
        == (c.n_routed_experts, c.n_activated_experts)
    for changes, message in [
        (dict(dspark_target_layer_ids=[5, 8]), "dspark_target_layer_ids: must be strictly"),
        (dict(dspark_target_layer_ids=[]), "dspark_target_layer_ids"),
        (dict(dspark_noise_token_id=512), "dspark_noise_token_id = 512"),
        (dict(dspark_markov_rank=0), "dspark_markov_rank = 0"),
        (dict(dspark_n_activated_experts=4), "more than the draft stages' 3"),
        (dict(dspark_block_size=-1), "dspark_block_size = -1"),
        (dict(hc_residual="per_site"), "DSpark's draft stages are V4.1 layers"),
    ]:
        with pytest.raises(ValueError, match=message):
            c.replace(**changes)


def test_the_plan_counts_the_draft_apart():
    c = preset("tiny-v41-dspark")
    with_draft, trunk = make_plan(c, "d"), make_plan(preset("tiny-v41"), "t")
    assert with_draft["params_total"] == trunk["params_total"]
    assert with_draft["draft_layers"] == 3 and trunk["draft_layers"] == 0
    assert with_draft["params_draft"] == sum(p.numel() for p in
                                             Model(c).draft.parameters()) > 0
    assert with_draft["draft_weight_bytes"] > 0 == trunk["params_draft"]


def test_window_entries_made_piece_by_piece_give_the_same_block(drafted):
    """The engine makes a sequence's window entries as its tokens are kept, a few at a
    time (`Draft.window`), and drafts from them (`Draft.block`): the same block as the
    draft made from the whole span of states at once."""
    model, c = drafted, drafted.config
    g = torch.Generator().manual_seed(4)
    p = c.window_size + 6
    hidden = torch.randn(1, c.window_size, 3 * c.dim, generator=g)  # positions p-W+1..p
    token = torch.randint(0, c.vocab_size, (1,), generator=g)
    with torch.no_grad():
        whole = model.draft(model, hidden, token, p)
        pieces, end = [], p - c.window_size  # the position before the window
        for n in (1, 5, 2, c.window_size - 8):
            end += n
            pieces.append(model.draft.window(hidden[:, end - (p - c.window_size) - n :
                                                    end - (p - c.window_size)], end))
        block = model.draft.block(model, torch.cat(pieces, dim=2), token, p)
    assert torch.equal(block.tokens, whole.tokens)
    torch.testing.assert_close(block.logits, whole.logits)
    torch.testing.assert_close(block.confidence, whole.confidence)
