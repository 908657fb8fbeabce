"""The V4.1 forward as DeepSeek's code computes it: single-pass hyper-connections, FP4
indexer queries, the router's details, the reference numerics, both config.json forms."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvstack.config import ModelConfig, preset
from kvstack.formats import fake_quantize
from kvstack.formats.weights import quantize_fp8_blocks
from kvstack.model import Model
from kvstack.model.model import Gate, rotate, swiglu
from kvstack.model.packed import PackedLinear
from tests.v41_checkpoint import hf_config, inference_config


def two_layer(hc_residual: str = "single_pass") -> Model:
    """Two window-only layers, three residual copies; attention and FFN replaced by fixed
    functions of their input, so only the residual's rule decides the output."""
    config = preset("tiny").replace(
        n_layers=2, compress_ratios=[0, 0], kv_source_layers=[], index_source_layers=[],
        candidate_source_layer=None, n_encoder_layers=0, n_routed_experts=0,
        n_activated_experts=0, inter_dim=16, hc_mult=3, hc_residual=hc_residual)
    torch.manual_seed(0)
    model = Model(config).eval()

    class Attn(nn.Module):
        def forward(self, x, start, store, ctx):
            return torch.tanh(2 * x) + 0.5

    class FFN(nn.Module):
        def forward(self, x):
            return x * x - 0.25

    with torch.no_grad():
        for block in model.layers:
            block.attn, block.ffn = Attn(), FFN()
            for hc in (block.hc_attn, block.hc_ffn):
                hc.fn.normal_(0, 0.5)
                hc.base.normal_(0, 0.5)
    return model


def by_hand(model: Model, ids: torch.Tensor, rule: str) -> torch.Tensor:
    """The residual rule written out copy by copy: "single_pass", "per_site", or "own"
    (each sublayer its own mix, the head the last FFN's: the rule single-pass replaced)."""
    h = model.config.hc_mult
    copies = [model.embed(ids).float() for _ in range(h)]  # each [B, n, dim]

    def collapse(weights):  # weights [B, n, h]
        return sum(weights[..., i, None] * copies[i] for i in range(h))

    def expand(out, post, comb):
        return [post[..., i, None] * out + sum(comb[..., k, i, None] * copies[k]
                                               for k in range(h)) for i in range(h)]

    carried = torch.zeros(*ids.shape, h)
    carried[..., 0] = 1.0  # the first sublayer collapses copy 0
    for block in model.layers:
        stacked = torch.stack(copies, dim=2)
        attn_pre, post, comb = block.hc_attn.mixes(stacked)
        y = collapse(carried if rule == "single_pass" else attn_pre)
        copies = expand(block.attn(block.attn_norm(y), 0, None, None), post, comb)
        stacked = torch.stack(copies, dim=2)
        ffn_pre, post, comb = block.hc_ffn.mixes(stacked)
        y = collapse(attn_pre if rule == "single_pass" else ffn_pre)
        copies = expand(block.ffn(block.ffn_norm(y)), post, comb)
        carried = ffn_pre
    if rule != "per_site":
        final = collapse(carried)
    else:
        stacked = torch.stack(copies, dim=2).flatten(2)
        mix = F.linear(stacked, model.hc_head_fn) * torch.rsqrt(
            stacked.square().mean(-1, keepdim=True) + model.config.norm_eps)
        final = collapse(torch.sigmoid(mix * model.hc_head_scale + model.hc_head_base)
                         + model.config.hc_eps)
    return model.head(model.norm(final))


def test_single_pass_hyper_connections_carry_each_pre_mix_to_the_next_sublayer():
    model = two_layer()
    assert not hasattr(model, "hc_head_fn")  # the head collapses with the last FFN's mix
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(1))
    logits = model(ids).logits
    expected = by_hand(model, ids, "single_pass")
    assert torch.allclose(logits, expected, atol=1e-5)
    # Each sublayer collapsing with its own mix gives something else: the rule matters.
    assert not torch.allclose(by_hand(model, ids, "own"), expected, atol=1e-2)


def test_per_site_hyper_connections_still_run_as_they_were_trained():
    model = two_layer("per_site")
    ids = torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(2))
    assert torch.allclose(model(ids).logits, by_hand(model, ids, "per_site"), atol=1e-5)


def test_a_per_site_checkpoint_loads_only_when_its_config_says_so(tmp_path):
    torch.manual_seed(0)
    model = Model(preset("tiny").replace(hc_residual="per_site")).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 30))
    assert torch.equal(Model.from_pretrained(tmp_path).eval()(ids).logits, model(ids).logits)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["hc_residual"]  # as a config written before the key existed
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r'hc_head_\* tensors are those of per-site .*add '
                                         r'"hc_residual": "per_site"'):
        Model.from_pretrained(tmp_path)


def test_indexer_queries_are_rounded_to_fp4_with_a_straight_through_gradient():
    torch.manual_seed(0)
    for fmt in ("fp4_ue8m0_32", "none"):
        model = Model(preset("tiny").replace(index_query_format=fmt))
        attn = model.layers[1].attn
        indexer, c = attn.indexer, model.config
        x = torch.randn(1, 6, c.dim)
        qr = attn.q_norm(attn.wq_a(x))
        positions = torch.arange(6)[None]
        from kvstack.cache.reference import ReferenceStore

        store = ReferenceStore(c, 1)
        attn.compressor(x, 0, store)
        n = store.stream_len(1)
        scores = indexer.scores(x, qr, positions, store, n)
        q = rotate(indexer.wq(qr).unflatten(-1, (c.index_n_heads, c.index_head_dim)),
                   positions, indexer.freqs).float()
        if fmt != "none":
            q = fake_quantize(q, fmt)
        keys = store.read_stream(1, "index", 0, n)
        w = indexer.wweights(x) * (c.index_head_dim**-0.5 * c.index_n_heads**-0.5)
        expected = (torch.einsum("bnhd,bkd->bnhk", q, keys).relu() * w[..., None]).sum(2)
        visible = torch.arange(n) < ((positions + 1) // 2)[..., None]
        assert torch.allclose(scores[visible], expected[visible], atol=1e-6)
        scores[visible].sum().backward()
        assert indexer.wq.weight.grad.abs().sum() > 0  # the rounding lets gradient through


def gate(**changes) -> Gate:
    config = preset("tiny").replace(**changes)
    g = Gate(config)
    torch.manual_seed(0)
    nn.init.normal_(g.weight)
    return g


def test_the_router_divides_by_gate_temp_and_renormalises_only_several_experts():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    g = gate(gate_temp=2.0, score_func="softmax", route_scale=1.5)
    weights, chosen = g(x)
    scores = (x @ g.weight.T / 2.0).softmax(-1)
    picked = scores.gather(-1, chosen)
    assert torch.allclose(weights, picked / (picked.sum(-1, keepdim=True) + 1e-20) * 1.5)
    one = gate(n_activated_experts=1, score_func="sigmoid", route_scale=1.5)
    weights, chosen = one(x)
    assert torch.allclose(weights, (x @ one.weight.T).sigmoid().gather(-1, chosen) * 1.5)


def test_the_routing_weight_scales_the_activation_entering_w2():
    seen = []

    def w2(t):
        seen.append(t)
        return t

    x, weights = torch.randn(3, 4), torch.tensor([[0.5], [2.0], [0.25]])
    swiglu(x, lambda t: t, w2, lambda t: t + 1, 0.0, weights)
    assert torch.allclose(seen[0], F.silu(x) * (x + 1) * weights)


def test_reference_numerics_round_activations_into_quantised_weights_only():
    w = torch.randn(64, 96)
    codes, scales = quantize_fp8_blocks(w)
    linear = PackedLinear("fp8", codes, scales, round_inputs=True)
    x = torch.randn(3, 96)
    plain, rounded = F.linear(x, linear.weight), F.linear(fake_quantize(x, "fp8_ue8m0_32"),
                                                          linear.weight)
    assert torch.allclose(linear(x), plain, rtol=1e-5, atol=1e-5)
    linear.round_inputs = True
    assert torch.allclose(linear(x), rounded, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rounded, plain, rtol=1e-3, atol=1e-3)

    model = Model(preset("tiny-v41"))
    codes, scales = quantize_fp8_blocks(model.layers[0].attn.wo_a.weight)
    model.layers[0].attn.wo_a = PackedLinear("fp8", codes, scales, round_inputs=False)
    codes, scales = quantize_fp8_blocks(model.layers[0].attn.wq_a.weight)
    model.layers[0].attn.wq_a = PackedLinear("fp8", codes, scales, round_inputs=True)
    model.set_numerics("reference")
    attn = model.layers[0].attn
    # wo_a: DeepSeek's code makes it bf16 and multiplies unrounded activations.
    assert attn.wq_a.round_inputs and not attn.wo_a.round_inputs
    assert attn.freqs.dtype == torch.float32 and model.layers[1].attn.indexer.freqs is (
        model.layers[1].attn.freqs)
    pos = torch.tensor([[1_000_003]])
    x = torch.randn(1, 1, 2, 32)
    far32 = rotate(x, pos, attn.freqs)
    model.set_numerics("default")
    assert attn.freqs.dtype == torch.float64 and not attn.wq_a.round_inputs
    far64 = rotate(x, pos, attn.freqs)
    assert not torch.equal(far32, far64) and torch.allclose(far32, far64, atol=0.1)
    with pytest.raises(ValueError, match="numerics must be one of default, reference"):
        model.set_numerics("fast")


def test_both_published_config_forms_read_as_the_preset():
    flash = preset("deepseek-v4.1-flash")
    assert ModelConfig.from_dict(hf_config(flash)) == flash
    assert ModelConfig.from_dict(inference_config(flash)) == flash.replace(
        max_seq_len=flash.max_seq_len)
    hf = hf_config(flash)
    del hf["text_config"]["candidate_source_layer_id"]  # HF: the last kv source
    assert ModelConfig.from_dict(hf).candidate_source_layer == 20
    inference = inference_config(flash) | {"candidate_source_layer": -1}
    assert ModelConfig.from_dict(inference).candidate_source_layer is None
    for key, value, match in (
            ("num_key_value_heads", 2, r"text_config\.num_key_value_heads = 2: kvstack "
                                       r"builds only 1"),
            ("hidden_act", "gelu", r"text_config\.hidden_act = 'gelu'"),
            ("rope_scaling", {"rope_type": "linear"}, r"rope_scaling\.rope_type = 'linear'"),
            ("mystery_key", 1, r"unknown keys mystery_key")):
        bad = hf_config(flash)
        bad["text_config"][key] = value
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_dict(bad)
