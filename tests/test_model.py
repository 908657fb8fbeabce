"""The model: reference forward, CED prefill, decode, replay, layer modes, checkpoints."""

import copy
import gc
import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack.cache.contiguous import ContiguousCache
from kvstack.cache.layout import CacheLayout
from kvstack.config import Mode, ModelConfig, preset
from kvstack.model.instruments import Instruments
from kvstack.model.model import (
    Attention,
    Gate,
    Model,
    first_k_descending,
    pool_mask,
    rope_frequencies,
    select_topk,
)
from kvstack.model.params import count_parameters, parameter_shapes

BF16 = dict(kv_format="bf16", index_format="bf16", window_format="bf16")
TOL = 2e-5  # float32 rounding across different chunkings; logits here are ~0.2 in scale


def make_model(config: ModelConfig | None = None, seed: int = 0) -> Model:
    torch.manual_seed(seed)
    return Model(config or preset("tiny")).eval()


def tokens(batch: int, n: int, seed: int = 1, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    # float64: in float32 the rounding of each log-probability (~1e-7) does not cancel in
    # the sum, and logits equal to 1e-7 would show a KL of 1e-7 instead of ~1e-14.
    p = p_logits.detach().double().log_softmax(-1)
    return float((p.exp() * (p - q_logits.detach().double().log_softmax(-1))).sum(-1).max())


# ---- the parameter contract -----------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "v41-layout-small", "dense-tiny"])
def test_parameters_are_exactly_the_contract(name):
    c = preset(name)
    model = Model(c)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == parameter_shapes(c)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(c).total


def test_v41_flash_builds_with_the_planned_parameter_count():
    c = preset("deepseek-v4.1-flash")
    # Engram needs a token map of engram_compressed_vocab_size ids (its tokenizer's).
    token_map = torch.arange(c.vocab_size) % c.engram_compressed_vocab_size
    with torch.device("meta"):
        model = Model(c, token_map)
    counts = count_parameters(c)
    assert sum(p.numel() for p in model.parameters()) == \
        counts.total + counts.draft + counts.vision
    assert sum(p.numel() for p in model.draft.parameters()) == counts.draft
    tower = [model.vision, model.aligner]
    assert sum(p.numel() for m in tower for p in m.parameters()) + 3 * c.dim == counts.vision


def test_layer_modes_own_what_they_should():
    c = preset("tiny")
    model = Model(c)
    for spec, block in zip(c.layers, model.layers, strict=True):
        attn = block.attn
        names = {n for n, _ in attn.named_parameters()}
        if spec.mode is Mode.FULL:
            assert attn.compressor is not None and attn.indexer is not None
        elif spec.mode is Mode.REINDEX:
            assert attn.compressor is None and attn.indexer is not None
            assert not any(n.startswith("compressor.") for n in names)
        else:  # Reuse and window-only layers own no stream and no indexer
            assert attn.compressor is None and attn.indexer is None
            assert not any(n.startswith(("compressor.", "indexer.")) for n in names)


# ---- the reference forward ------------------------------------------------------------


@pytest.mark.parametrize("dense", [False, True])
def test_causality(dense):
    model = make_model()
    ids = tokens(2, 64)
    base = model(ids, dense=dense).logits
    for t in (0, 5, 17, 40):
        changed = ids.clone()
        changed[:, t + 1 :] = tokens(2, 63 - t, seed=t + 7)
        logits = model(changed, dense=dense).logits
        assert torch.allclose(logits[:, : t + 1], base[:, : t + 1], atol=1e-6, rtol=0), t
        assert not torch.allclose(logits[:, t + 1 :], base[:, t + 1 :], atol=1e-4)


def test_compressed_entries_are_visible_only_once_their_group_is_complete():
    model = make_model()
    out = model(tokens(1, 48), dense=True, collect=True)
    for layer in (1, 3, 4, 6):
        ratio = preset("tiny").compress_ratios[layer]
        scores, target = out.index_scores[layer][0], out.attention_targets[layer][0]
        t = torch.arange(48)[:, None]
        j = torch.arange(scores.shape[-1])[None, :]
        visible = j < (t + 1) // ratio
        assert torch.all(torch.isinf(scores[~visible]))
        assert torch.all(target[~visible] == 0)
        assert torch.all(target[visible] > 0)  # dense: every visible entry is attended
    # Sparse attention respects the same rule.
    target = model(tokens(1, 48), collect=True).dense_targets(1, 48 // 2)[0]
    j = torch.arange(target.shape[-1])[None, :]
    assert torch.all(target[j >= (torch.arange(48)[:, None] + 1) // 2] == 0)


def test_sparse_attention_uses_at_most_index_topk_entries():
    c = preset("tiny")
    out = make_model(c)(tokens(1, 80), collect=True)
    for layer, target in out.attention_targets.items():
        assert target.shape[-1] == out.index_entries[layer].shape[-1] <= c.index_topk
        dense = out.dense_targets(layer, 80 // c.compress_ratios[layer])
        assert int((dense[0] > 0).sum(-1).max()) <= c.index_topk, layer
        assert torch.allclose(dense.sum(-1), target.sum(-1))


def test_sparse_attention_trains_the_indexer_on_its_selected_entries_scores(monkeypatch):
    """Sparse attention keeps the indexer's scores and targets over each query's selected
    entries only ([B, T, k], not the whole stream's [B, T, N]), scored again with a
    gradient: those scores are the whole stream's scoring at the same entries, so the
    indexer loss (a softmax over the attended entries) is unchanged."""
    model, checked = make_model().train(), []
    for layer in (1, 4):
        indexer = model.layers[layer].attn.indexer
        original = indexer.scores_at

        def scores_at(x, qr, positions, store, entries, indexer=indexer, original=original):
            got = original(x, qr, positions, store, entries)
            n = store.stream_len(indexer.spec.kv_source)
            with torch.no_grad():
                full = indexer.scores(x, qr, positions, store, n)
            want = full.gather(-1, entries.clamp(min=0)).masked_fill(entries < 0, -torch.inf)
            assert got.requires_grad and torch.allclose(got, want, atol=1e-6)
            checked.append((entries >= 0).sum())
            return got

        monkeypatch.setattr(indexer, "scores_at", scores_at)
    out = model(tokens(2, 70), collect=True)
    assert len(checked) == 2 and all(n > 0 for n in checked)
    for layer in out.index_scores:
        k = out.index_entries[layer].shape[-1]
        assert out.index_scores[layer].shape[-1] == out.attention_targets[layer].shape[-1] == k


def test_candidate_pool_restricts_later_index_sources(monkeypatch):
    """Plant entry 30 as the best entry for layer 6 (which indexes inside the candidate
    pool of layer 4) while layer 4 scores it lowest and favours entry 10: layer 6 must not
    select entry 30 once its block is out of the pool, and must select a planted entry
    that is in the pool."""
    c = preset("tiny")  # pool: 2 blocks of 2 entries; layer 4 is the candidate source
    model = make_model(c)
    source, consumer = model.layers[4].attn.indexer, model.layers[6].attn.indexer

    def planted(indexer, boosts):
        original = indexer.scores

        def scores(*args):
            s = original(*args)
            for entry, value in boosts.items():
                s[..., entry] = torch.where(torch.isinf(s[..., entry]), s[..., entry], value)
            return s

        monkeypatch.setattr(indexer, "scores", scores)

    planted(source, {10: 1e6, 30: -1e6})
    planted(consumer, {30: 1e9})
    target = model(tokens(1, 64), collect=True).dense_targets(6, 64)  # ratio 1
    # Queries from 32 on: entry 30's block is neither the best block nor the newest one.
    assert torch.all(target[0, 32:, 30] == 0)
    assert torch.all(target[0, 32:, 10] > 0)  # the pool's planted block is selected

    monkeypatch.undo()
    planted(source, {10: 1e6})
    planted(consumer, {11: 1e9})  # entry 11 shares entry 10's block: in the pool
    target = model(tokens(1, 64), collect=True).dense_targets(6, 64)
    assert torch.all(target[0, 32:, 11] > 0)


def test_a_reindex_layer_scoring_only_its_pool_selects_as_scoring_every_entry():
    """Layer 6 indexes inside layer 4's candidate pool. Scoring only the pool's keys must
    pick what scoring the whole stream and masking to the pool picks, ties (equal keys)
    and pool blocks past the visible entries included."""
    c = preset("tiny").replace(candidate_topk_blocks=6, candidate_block_size=4, index_topk=5)
    indexer = make_model(c).layers[6].attn.indexer
    g = torch.Generator().manual_seed(0)
    n, b, q = 96, 2, 3
    cache = ContiguousCache(c, batch_size=b, max_tokens=128)
    keys = torch.randn(b, n, c.index_head_dim, generator=g)
    keys[:, 40:60] = keys[:, 20:21]  # twenty-one equal keys: ties to break
    cache.append_stream(4, {"kv": torch.randn(b, n, c.head_dim, generator=g), "index": keys})
    positions = torch.tensor([[70, 71, 95], [60, 88, 90]])  # entries past 70 unseen by some
    x, qr = torch.randn(b, q, c.dim, generator=g), torch.randn(b, q, c.q_lora_rank, generator=g)
    for trial in range(5):
        blocks = torch.stack([torch.randperm(n // 4, generator=g)[:6] for _ in range(b * q)])
        blocks = blocks.view(b, q, 6)
        if trial == 0:
            blocks[..., :2] = torch.tensor([5, 10])  # entries 20..23 and 40..43: tied keys
        in_pool = pool_mask(blocks, n, c)
        scored = indexer.scores(x, qr, positions, cache, n).masked_fill(~in_pool, float("-inf"))
        expected = select_topk(scored, c.index_topk)
        assert torch.equal(indexer.select_in_pool(x, qr, positions, cache, blocks, n), expected)


# Few distinct values, signed zeros and infinities: most scores tie with another.
_SCORES = st.lists(st.sampled_from([0.0, -0.0, 1.5, -1.5, 2.0, 1e-30, float("inf"),
                                    float("-inf")]), min_size=1, max_size=80)


@settings(max_examples=200, deadline=None)
@given(_SCORES, st.integers(1, 80))
def test_the_top_k_is_the_stable_sort_s_first_k(values, k):
    """first_k_descending picks by one top-k what a stable descending sort puts first,
    in its order: among equal scores (0.0 and -0.0 included) the earlier entry wins."""
    scores = torch.tensor(values).view(1, -1)
    k = min(k, scores.shape[-1])
    stable = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    assert torch.equal(first_k_descending(scores, k), stable)
    chosen = stable.masked_fill(scores.gather(-1, stable) == float("-inf"), -1)
    ascending = torch.where(chosen < 0, scores.shape[-1], chosen).sort(-1).values
    assert torch.equal(select_topk(scores, k),
                       ascending.masked_fill(ascending == scores.shape[-1], -1))


def test_a_decode_step_scores_no_more_than_the_pool_in_reindex_layers(monkeypatch):
    """Once the stream outgrows the pool, a decode step's Reindex layer scores the pool's
    keys alone: it never scores the whole stream, whose cost grows with the context."""
    c = preset("tiny")
    model = make_model(c)
    cache = ContiguousCache(c, batch_size=1, max_tokens=64)
    model.prefill(tokens(1, 40), cache)

    def whole_stream(*args):
        raise AssertionError("layer 6 scored its whole stream")

    monkeypatch.setattr(model.layers[6].attn.indexer, "scores", whole_stream)
    model.decode(tokens(1, 1)[:, 0], cache)


# ---- incremental = reference ----------------------------------------------------------


@pytest.mark.parametrize("formats", ["bf16", "fp4"])
def test_prefill_then_decode_reproduces_the_reference(formats):
    c = preset("tiny").replace(**BF16) if formats == "bf16" else preset("tiny")
    model = make_model(c)
    ids = tokens(2, 60)
    reference = model(ids).logits
    cache = ContiguousCache(c, batch_size=2, max_tokens=64)
    logits = model.prefill(ids[:, :45], cache, replay="exact", chunk_size=16)
    assert (logits - reference[:, 44]).abs().max() < TOL
    for t in range(45, 60):
        logits = model.decode(ids[:, t], cache)
        assert (logits - reference[:, t]).abs().max() < TOL, t


def test_dense_control_prefill_then_decode_reproduces_its_reference():
    c = preset("dense-tiny")
    model = make_model(c)
    ids = tokens(2, 50)
    reference = model(ids).logits
    cache = ContiguousCache(c, batch_size=2, max_tokens=50)
    assert (model.prefill(ids[:, :40], cache, chunk_size=16) - reference[:, 39]).abs().max() < TOL
    for t in range(40, 50):
        assert (model.decode(ids[:, t], cache) - reference[:, t]).abs().max() < TOL
    # Its cache is every layer's keys and values for every token, in bf16.
    assert cache.stream_bytes_allocated() == 2 * 50 * c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2
    with pytest.raises(ValueError, match="no window state to rebuild"):
        model.rebuild_window(cache)


def test_quantised_formats_change_the_logits():
    # The FP4 path is not the bf16 path in disguise.
    ids = tokens(1, 40)
    fp4 = make_model(preset("tiny"))(ids).logits
    bf16 = make_model(preset("tiny").replace(**BF16))(ids).logits
    assert (fp4 - bf16).abs().max() > 1e-3


def test_chunked_prefill_continues_an_existing_cache():
    model = make_model()
    ids = tokens(1, 90)
    reference = model(ids).logits
    cache = ContiguousCache(model.config, max_tokens=90)
    model.prefill(ids[:, :50], cache, replay="exact", chunk_size=13)
    logits = model.prefill(ids[:, 50:], cache, replay="exact", chunk_size=13)
    assert (logits - reference[:, -1]).abs().max() < TOL


def test_exact_replay_prefill_equals_the_reference_far_beyond_its_span():
    model = make_model()
    n = 8 * model.decoder_span("exact")
    ids = tokens(1, n)
    reference = model(ids).logits[:, -1]
    logits = model.prefill(ids, ContiguousCache(model.config, max_tokens=n), replay="exact")
    assert (logits - reference).abs().max() < TOL


def test_bounded_replay_differs_only_past_the_window():
    model = make_model()
    w = model.config.window_size
    for n, differs in ((w, False), (w // 2, False), (12 * w, True)):
        ids = tokens(1, n, seed=n)
        reference = model(ids).logits[:, -1]
        cache = ContiguousCache(model.config, max_tokens=n)
        divergence = kl(reference, model.prefill(ids, cache, replay="bounded"))
        if differs:
            assert divergence > 1e-7, divergence
        else:
            assert divergence < 1e-9, divergence


def test_replay_spans():
    v41 = Model.__new__(Model)
    v41.config = preset("deepseek-v4.1-flash")
    assert v41.decoder_span("bounded") == 128
    assert v41.decoder_span("exact") == 20 * 127 + 1
    assert v41.encoder_span("bounded") == 128
    assert v41.encoder_span("exact") == 20 * 127 + 1 + 20 * 127
    with pytest.raises(ValueError, match="replay must be one of bounded, exact"):
        v41.decoder_span("full")


# ---- rebuilding the window state ------------------------------------------------------


def stream_bytes(cache: ContiguousCache) -> dict[str, torch.Tensor]:
    rows = {f"{layer}{kind}": r.data.clone()
            for layer, streams in cache._streams.items() for kind, r in streams.items()}
    return rows | {f"len{k}": torch.tensor(n) for k, n in cache._len.items()}


def test_rebuild_window_exact_restores_the_next_token_logits():
    model = make_model()
    ids = tokens(2, 130)
    cache = ContiguousCache(model.config, batch_size=2, max_tokens=140)
    model.prefill(ids[:, :120], cache, replay="exact")
    streams_before = stream_bytes(cache)

    dropped = copy.deepcopy(cache)
    dropped.drop_window_state()
    stale = copy.deepcopy(dropped)
    model.rebuild_window(dropped, replay="exact")
    after = stream_bytes(dropped)  # replay wrote nothing to the streams
    assert after.keys() == streams_before.keys()
    assert all(torch.equal(after[k], streams_before[k]) for k in after)

    for t in range(120, 125):
        kept, rebuilt = model.decode(ids[:, t], cache), model.decode(ids[:, t], dropped)
        assert (kept - rebuilt).abs().max() < TOL, t
    # Without the rebuild, the dropped state does change the logits.
    assert (model.decode(ids[:, 120], stale) - model(ids[:, :121]).logits[:, -1]).abs().max() > 1e-4


@pytest.mark.parametrize("replay", ["bounded", "exact"])
def test_a_rebuild_without_logits_leaves_the_same_window_state(replay):
    """Without logits the last layer only writes its rings and partial groups: the same
    bytes and positions as a whole rebuild's, so the next tokens' logits are the same."""
    model = make_model()
    ids = tokens(2, 131)
    cache = ContiguousCache(model.config, batch_size=2, max_tokens=140)
    model.prefill(ids[:, :121], cache, replay="exact")
    cache.drop_window_state()
    whole, lean = copy.deepcopy(cache), copy.deepcopy(cache)
    assert model.rebuild_window(lean, replay=replay, logits=False) is None
    model.rebuild_window(whole, replay=replay)
    a, b = whole._rings, lean._rings
    assert all(torch.equal(a.rows[k].data, b.rows[k].data) for k in a.rows)
    assert all(torch.equal(a.pos[k], b.pos[k]) for k in a.pos)
    assert whole._partial.keys() == lean._partial.keys() and whole._partial
    assert all(torch.equal(u, v) for k in whole._partial
               for u, v in zip(whole._partial[k], lean._partial[k], strict=True))
    for t in range(121, 125):
        assert torch.equal(model.decode(ids[:, t], whole), model.decode(ids[:, t], lean)), t


def test_rebuild_window_bounded_is_close_but_approximate():
    model = make_model()
    ids = tokens(1, 200)
    cache = ContiguousCache(model.config, max_tokens=200)
    model.prefill(ids, cache, replay="exact")
    reference = model(ids).logits[:, -1]
    cache.drop_window_state()
    divergence = kl(reference, model.rebuild_window(cache, replay="bounded"))
    assert 1e-9 < divergence < 0.1


# ---- the byte store -------------------------------------------------------------------


def test_contiguous_cache_holds_bytes_not_floats():
    c = preset("tiny")
    model = make_model(c)
    cache = ContiguousCache(c, max_tokens=100)
    model.prefill(tokens(1, 99), cache)
    layout = CacheLayout.from_config(c)
    assert cache.stream_bytes_allocated() == layout.stream_bytes(100)
    streams = [r for kinds in cache._streams.values() for r in kinds.values()]
    for rows in (*streams, *cache._rings.rows.values()):
        assert rows.data.dtype == torch.uint8
    for values, gates in cache._partial.values():  # ratio 2: at most one pending token
        assert values.shape[1] <= 1 and gates.shape[1] <= 1
    assert cache.stream_len(1) == 49 and cache.stream_len(4) == 99


# ---- pieces ---------------------------------------------------------------------------


@pytest.mark.parametrize("func", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_gate_bias_selects_but_does_not_weigh(func):
    c = preset("tiny").replace(score_func=func, route_scale=2.0)
    gate = Gate(c)
    torch.nn.init.normal_(gate.weight)
    x = torch.randn(16, c.dim)
    weights, _ = gate(x)
    assert torch.allclose(weights.sum(-1), torch.full((16,), 2.0))
    with torch.no_grad():
        gate.bias[3] = 1e4
    weights, chosen = gate(x)
    assert torch.all((chosen == 3).any(-1))
    logits = x @ gate.weight.T
    scores = {"softmax": logits.softmax(-1), "sigmoid": logits.sigmoid(),
              "sqrtsoftplus": torch.nn.functional.softplus(logits).sqrt()}[func]
    picked = scores.gather(-1, chosen)
    assert torch.allclose(weights, 2.0 * picked / picked.sum(-1, keepdim=True), atol=1e-6)


def test_yarn_scales_only_the_low_frequencies():
    c = preset("tiny")
    plain = rope_frequencies(c.replace(rope_factor=1.0, original_seq_len=0), compressed=True)
    yarn = rope_frequencies(c, compressed=True)
    assert torch.allclose(yarn[0], plain[0])  # fastest rotation untouched
    assert torch.allclose(yarn[-1], plain[-1] / c.rope_factor)
    window_only = rope_frequencies(c, compressed=False)
    assert torch.allclose(window_only, 1 / c.rope_theta ** (torch.arange(0, 8, 2) / 8).double())


def test_hyper_connection_mixing_is_doubly_stochastic():
    model = make_model()
    x = torch.randn(1, 5, 2, model.config.dim)
    _, post, comb = model.layers[0].hc_attn.mixes(x)
    assert torch.allclose(comb.sum(-1), torch.ones(1, 5, 2), atol=1e-3)
    assert torch.allclose(comb.sum(-2), torch.ones(1, 5, 2), atol=1e-3)
    assert torch.all((post > 0) & (post < 2))


# ---- checkpoints and bad input --------------------------------------------------------


def test_save_and_load_round_trip(tmp_path):
    model = make_model()
    model.save_pretrained(tmp_path)
    loaded = Model.from_pretrained(tmp_path).eval()
    ids = tokens(1, 20)
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_bad_checkpoints_are_refused_naming_the_file(tmp_path):
    make_model().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = b"\xff" * 8
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors: cannot load"):
        Model.from_pretrained(tmp_path)

    make_model().save_pretrained(tmp_path)
    preset("tiny").replace(dim=96).to_json(tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"embed\.weight has shape \[512, 64\], the config needs"):
        Model.from_pretrained(tmp_path)

    preset("tiny").replace(n_routed_experts=0, n_activated_experts=0, inter_dim=32).to_json(
        tmp_path / "config.json")
    with pytest.raises(ValueError, match="does not match"):
        Model.from_pretrained(tmp_path)


def test_bad_input_is_refused_clearly():
    model = make_model()
    cache = ContiguousCache(model.config, max_tokens=16)
    with pytest.raises(ValueError, match="prompt is empty"):
        model.prefill(torch.zeros(1, 0, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"token ids must lie in 0\.\.511"):
        model.prefill(torch.tensor([[1, 512]]), cache)
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="cache holds 1 sequences, got a batch of 2"):
        model.prefill(tokens(2, 4), cache)
    with pytest.raises(ValueError, match="replay must be one of"):
        model.prefill(tokens(1, 4), cache, replay="full")
    with pytest.raises(ValueError, match="cache full"):
        model.prefill(tokens(1, 17), cache)
    assert cache.num_tokens == 0  # nothing was half-written by the refusals
    too_long = model.config.max_seq_len + 1
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        model(tokens(1, too_long))
    with pytest.raises(ValueError, match="no tokens to replay"):
        model.rebuild_window(cache)


@pytest.mark.parametrize("dense", [False, True])
def test_training_signals_reach_every_parameter(dense):
    """Cross-entropy trains everything but the indexer (its top-k is a selection); the
    indexer loss (KL to the attention targets) trains the indexer and its keys. The
    cached values pass through FP4 rounding with a straight-through gradient."""
    model = make_model().train()
    ids = tokens(2, 40)
    out = model(ids, dense=dense, collect=True)
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    ce.backward(retain_graph=True)
    indexer_only = ("indexer.", "wk_index", "index_norm")
    for name, p in model.named_parameters():
        if name.endswith("gate.bias"):
            assert p.grad is None
        elif any(k in name for k in indexer_only):
            assert p.grad is None or not p.grad.any(), name
        elif "experts.w" not in name:  # an expert no token chose gets no gradient
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.zero_grad()
    loss = sum(
        torch.nn.functional.kl_div(
            out.index_scores[i].clamp(min=-1e4).log_softmax(-1), out.attention_targets[i],
            reduction="sum")
        for i in out.index_scores
    )
    loss.backward()
    for name, p in model.named_parameters():
        if any(k in name for k in indexer_only):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("dense", [False, True])
def test_a_training_step_leaves_no_tensors_behind(dense):
    """A graph kept alive by a reference cycle (an in-place op on a tensor its own graph
    saved, in a part backward never reaches) is never freed: memory grows every step."""
    model = make_model().train()
    ids = tokens(2, 40)

    def step() -> int:
        out = model(ids, dense=dense, collect=True)
        loss = out.logits.sum() + sum(s.clamp(min=-1e4).sum() for s in out.index_scores.values())
        loss.backward()
        model.zero_grad(set_to_none=True)
        del out, loss
        gc.collect()
        return sum(type(o) is torch.Tensor for o in gc.get_objects())

    # What the process held before is set aside: neither collected nor counted. In a whole
    # suite's process that is millions of objects, which each collection would walk.
    gc.collect()
    gc.freeze()
    try:
        step()
        assert step() == step()
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("shared", [True, False])
def test_selected_entries_read_in_pieces_equal_a_plain_gather(monkeypatch, shared):
    import kvstack.model.model as model_module
    from kvstack.model.model import SelectedEntries

    monkeypatch.setattr(model_module, "KEY_CHUNK", 5)  # several pieces
    monkeypatch.setattr(model_module, "GATHER_FLOATS", 3 * 4 * 32)  # several gathers
    c = preset("tiny")
    cache = ContiguousCache(c, max_tokens=64)
    g = torch.Generator().manual_seed(0)
    cache.append_stream(4, {"kv": torch.randn(1, 40, 32, generator=g),
                            "index": torch.randn(1, 40, 32, generator=g)})
    selected = torch.randint(0, 40, (1, 7, 4), generator=g)
    selected[0, 2, 3] = -1  # a missing entry
    q = torch.randn(1, 7, 4, 32, generator=g)
    p = torch.rand(1, 4, 7, 4, generator=g)
    entries = SelectedEntries(cache, 4, selected, heads=4, head_dim=32)
    entries.shared = shared
    rows = cache.gather_stream(4, "kv", selected.clamp(min=0))  # [1, 7, 4, 32]
    assert torch.allclose(entries.logits(q), torch.einsum("bqhd,bqkd->bhqk", q, rows),
                          atol=1e-5)
    assert torch.allclose(entries.weighted_sum(p), torch.einsum("bhqk,bqkd->bqhd", p, rows),
                          atol=1e-5)


def test_each_sequence_reads_its_own_selected_entries_once():
    """The C attention's rows: per sequence, the distinct entries it selected, each once
    (a batch's sequences share none: rows distinct over the batch made each read about B
    times its own), and every choice's column names its own entry's row."""
    from kvstack.model.model import _selected_rows

    c = preset("tiny")
    cache = ContiguousCache(c, batch_size=3, max_tokens=64)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 40, 32, generator=g)
    cache.append_stream(4, {"kv": kv, "index": torch.randn(3, 40, 32, generator=g)})
    selected = torch.stack([torch.randperm(40, generator=g)[:8].view(2, 4) for _ in range(3)])
    selected[1, 1] = selected[1, 0]  # a sequence whose two queries choose alike
    selected[2, 0, 3] = -1  # a missing entry
    rows, columns = _selected_rows(cache, 4, selected, 32)
    assert rows.shape[:2] == (3, 8)  # the most one sequence chose, not the batch's 20
    assert torch.equal(columns < 0, selected < 0)
    stored = cache.gather_stream(4, "kv", selected.clamp(min=0))  # [3, 2, 4, 32]
    at = columns.clamp(min=0)
    for b in range(3):
        assert torch.equal(rows[b][at[b]][selected[b] >= 0], stored[b][selected[b] >= 0])


def test_trunk_picks_rank_entries_by_the_layers_own_attention_logits(monkeypatch):
    """What a perfect indexer would buy: each picking layer's top-k is the entries with
    the highest attention logits (logsumexp over heads), not its indexer's; a factor on a
    layer's logits changes its attention, a factor of 1 nothing."""
    config = preset("tiny").replace(index_topk=3, candidate_topk_blocks=4096)
    model = make_model(config)
    ids = tokens(1, 40)
    seen = {}
    trunk_logits = Attention._trunk_logits

    def recorded(self, q, positions, store, n_entries):
        logits = trunk_logits(self, q, positions, store, n_entries)
        seen[self.spec.index] = logits
        return logits

    monkeypatch.setattr(Attention, "_trunk_logits", recorded)
    picked = model(ids, collect=True, instruments=Instruments(trunk_picks=True)).index_entries
    indexed = model(ids, collect=True).index_entries
    assert set(seen) == set(picked) == {1, 3, 4, 6}
    for layer, logits in seen.items():
        assert torch.equal(picked[layer], select_topk(logits.logsumexp(1), 3))
    assert any(not torch.equal(picked[k], indexed[k]) for k in picked)
    plain = model(ids).logits

    def scaled(factors: dict[int, float]) -> torch.Tensor:
        return model(ids, instruments=Instruments(logit_scale=factors)).logits

    assert torch.equal(scaled({4: 1.0}), plain)
    assert not torch.allclose(scaled({4: 3.0}), plain)
    with pytest.raises(ValueError, match="logit_scale: no layer 8"):
        scaled({8: 2.0})


def test_the_forward_takes_research_probes_only_through_instruments():
    """Model.forward's keywords are what inference and training need; the probes of
    `kvstack eval` are settings of an Instruments object, which refuses a sharded model
    where it reads every head."""
    params = set(inspect.signature(Model.forward).parameters)
    assert not params & {"probe", "window_only", "trunk_picks", "logit_scale"}
    assert "instruments" in params
    with pytest.raises(ValueError, match="probe and trunk_picks read every head"):
        Instruments(trunk_picks=True).attach(8, sharded=True)
    Instruments(window_only=frozenset({4}), logit_scale={4: 2.0}).attach(8, sharded=True)


def test_a_forward_with_idle_instruments_is_the_plain_forward():
    """Instruments that ask for nothing change no logit, and record nothing."""
    model = make_model()
    ids = tokens(2, 80)
    idle = Instruments()
    with torch.no_grad():
        plain, instrumented = model(ids), model(ids, instruments=idle)
    assert torch.equal(plain.logits, instrumented.logits)
    assert idle.attention_mass == {}


def test_instruments_reused_record_only_the_last_forward():
    model = make_model()
    probe = Instruments(probe=True)
    with torch.no_grad():
        model(tokens(1, 40), instruments=probe)
        model(tokens(1, 24), instruments=probe)
    assert {mass.shape for mass in probe.attention_mass.values()} == {(1, 24, 5)}


@pytest.mark.parametrize("replay", ["bounded", "exact"])
def test_a_prompt_prefilled_in_parts_equals_one_prefill(replay):
    """prefill_part over the leading parts (the encoder and the decoder's stream) and then
    prefill over a last part that holds the decoder span compute what one prefill of the
    whole prompt computes: the same logits, and the same next decode."""

    torch.manual_seed(0)
    model = Model(preset("tiny")).eval()
    ids = torch.randint(0, 512, (1, 200))
    assert model.final_prefill_tokens(replay) <= 80
    whole = ContiguousCache(model.config, max_tokens=256)
    parts = ContiguousCache(model.config, max_tokens=256)
    expected = model.prefill(ids, whole, replay=replay, chunk_size=64)
    model.prefill_part(ids[:, :70], parts, chunk_size=64)
    model.prefill_part(ids[:, 70:120], parts, chunk_size=64)
    got = model.prefill(ids[:, 120:], parts, replay=replay, chunk_size=64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    token = expected.argmax(-1)
    torch.testing.assert_close(model.decode(token, parts), model.decode(token, whole),
                               rtol=1e-5, atol=1e-5)
