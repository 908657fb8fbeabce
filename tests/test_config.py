"""ModelConfig: presets, mode resolution, JSON, and the validation rules of docs/design.md."""

import json
from pathlib import Path

import pytest

from kvstack.config import PRESETS, Mode, ModelConfig, preset

# DeepSeek-V4.1-Flash's published inference/config.json, as operators have it.
PUBLISHED_V41_INFERENCE_CONFIG = {
    "vocab_size": 129280, "dim": 5120, "moe_inter_dim": 2304, "n_layers": 40,
    "n_mtp_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3,
    "n_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1,
    "n_activated_experts": 6, "score_func": "sqrtsoftplus", "route_scale": 1.5,
    "swiglu_limit": 10.0, "q_lora_rank": 1280, "head_dim": 512,
    "rope_head_dim": 64, "norm_eps": 1e-20, "o_groups": 8, "o_lora_rank": 1024,
    "window_size": 128, "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36], "original_seq_len": 65536,
    "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
    "candidate_source_layer": 20, "candidate_topk_blocks": 2048,
    "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06, "engram_layer_ids": [1, 14], "engram_vocab_size": 16000000,
    "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_pad_id": 2, "engram_compressed_vocab_size": 99092, "engram_n_heads": 8,
    "engram_head_dim": 256, "dtype": "fp8", "expert_dtype": "fp4", "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
    "vision_n_layers": 32, "vision_dim": 1024, "image_token_id": 129264,
}


def modes(config: ModelConfig) -> list[str]:
    return [spec.mode.value for spec in config.layers]


def test_every_preset_validates():
    for name in PRESETS:
        assert preset(name).layers


def test_v41_flash_layer_modes():
    c = preset("deepseek-v4.1-flash")
    assert len(c.layers) == 40  # the 3 draft layers are not trunk layers
    m = modes(c)
    assert m[:2] == ["window", "window"]
    assert [i for i, x in enumerate(m) if x == "full"] == [2, 8, 14, 20]
    assert [i for i, x in enumerate(m) if x == "reindex"] == [24, 28, 32, 36]
    assert m.count("reuse") == 40 - 2 - 4 - 4
    layer = c.layers
    assert (layer[7].kv_source, layer[7].index_source) == (2, 2)
    assert (layer[19].kv_source, layer[19].index_source) == (14, 14)
    assert (layer[26].kv_source, layer[26].index_source) == (20, 24)
    assert layer[20].is_candidate_source and not layer[20].uses_candidates
    assert [s.index for s in layer if s.uses_candidates] == [24, 28, 32, 36]
    assert [s.in_encoder for s in layer] == [True] * 20 + [False] * 20


def test_tiny_has_every_mechanism():
    c = preset("tiny")
    enc = [s for s in c.layers if s.in_encoder]
    dec = [s for s in c.layers if not s.in_encoder]
    assert enc and dec and c.n_encoder_layers == len(enc)
    assert {s.mode for s in c.layers} == set(Mode)
    assert {s.ratio for s in c.layers} == {0, 1, 2}
    for half in (enc, dec):
        assert {Mode.FULL, Mode.REINDEX, Mode.REUSE} <= {s.mode for s in half}
    assert any(s.is_candidate_source for s in c.layers)
    assert any(s.uses_candidates for s in c.layers)
    assert c.uses_moe and c.hc_mult > 1 and c.rope_factor > 1


def test_v41_layout_small_keeps_the_real_layout():
    big, small = preset("deepseek-v4.1-flash"), preset("v41-layout-small")
    assert [(s.mode, s.ratio, s.kv_source, s.index_source) for s in small.layers] == [
        (s.mode, s.ratio, s.kv_source, s.index_source) for s in big.layers
    ]
    for key in ("head_dim", "index_head_dim", "window_size", "kv_format", "index_format",
                "window_format", "n_encoder_layers"):
        assert getattr(small, key) == getattr(big, key)
    assert small.dim < 128 and small.vocab_size <= 1024


def test_published_v41_config_json_loads_as_the_preset(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PUBLISHED_V41_INFERENCE_CONFIG))
    loaded = ModelConfig.from_json(path)
    # It has no key for the CED split; the layout implies 20 encoder layers.
    assert loaded.n_encoder_layers == 20
    assert loaded == preset("deepseek-v4.1-flash").replace(max_seq_len=loaded.max_seq_len)


def test_ced_split_is_implied_by_the_last_ratio_1_kv_source_unless_given():
    d = tiny_with()
    del d["n_encoder_layers"]
    assert ModelConfig.from_dict(d).n_encoder_layers == 4
    assert ModelConfig.from_dict(tiny_with(n_encoder_layers=0)).n_encoder_layers == 0
    d = tiny_with(compress_ratios=[0, 2, 2, 2, 2, 2, 2, 2], kv_source_layers=[1],
                  index_source_layers=[1, 3], candidate_source_layer=None)
    del d["n_encoder_layers"]
    assert ModelConfig.from_dict(d).n_encoder_layers == 0  # ratio 2: not a CED stream

def test_json_round_trip(tmp_path):
    for name in PRESETS:
        c = preset(name)
        path = tmp_path / f"{name}.json"
        c.to_json(path)
        assert ModelConfig.from_json(path) == c
        assert json.loads(path.read_text())["compress_ratios"] == list(c.compress_ratios)


def test_replace_revalidates():
    with pytest.raises(ValueError, match="head_dim"):
        preset("tiny").replace(head_dim=48)


# ---- bad configs: each error names the key and, where there is one, the layer ------------


def tiny_with(**changes) -> dict:
    d = preset("tiny").to_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(compress_ratios=[0, 2, 2, 2, 1, 1, 1]), "compress_ratios: has 7 entries"),
        (dict(kv_source_layers=[0, 4]), "kv_source_layers: layer 0 has compress ratio 0"),
        (dict(kv_source_layers=[4, 1]), "kv_source_layers: must be strictly increasing"),
        (dict(kv_source_layers=[1, 4, 9]), "kv_source_layers: layer 9 is out of range"),
        (dict(kv_source_layers=[4], index_source_layers=[3, 4, 6]),
         "kv_source_layers: layer 1 \\(ratio 2\\) has no kv source"),
        (dict(compress_ratios=[0, 2, 2, 1, 1, 1, 1, 1]),
         "compress_ratios: layer 3 has ratio 1 but reads kv source layer 1 of ratio 2"),
        (dict(index_source_layers=[3, 4, 6], kv_source_layers=[1, 4]),
         "index_source_layers: layer 1 is a kv source, so it must also be an index source"),
        (dict(index_source_layers=[1, 3, 6], candidate_source_layer=6),
         "index_source_layers: layer 4 is a kv source"),
        (dict(candidate_source_layer=5), "candidate_source_layer: layer 5 is not in"),
        (dict(kv_source_layers=[1, 4, 6], index_source_layers=[1, 3, 4, 6]),
         "kv_source_layers: decoder layer 6 is a kv source; with CED only the first decoder"),
        (dict(n_encoder_layers=3),
         "kv_source_layers: with CED \\(n_encoder_layers=3\\) the first decoder layer 3"),
        (dict(candidate_source_layer=1, n_encoder_layers=0),
         "candidate_source_layer: index source layer 4 comes after candidate source layer 1 "
         "but reads kv source layer 4"),
        (dict(head_dim=48), "head_dim = 48: must be a multiple of 32"),
        (dict(index_head_dim=40), "index_head_dim = 40: must be a multiple of 32"),
        (dict(rope_head_dim=7), "rope_head_dim = 7: must be even"),
        (dict(o_groups=3), "o_groups = 3: must divide n_heads"),
        (dict(n_activated_experts=5), "n_activated_experts = 5"),
        (dict(score_func="relu"), "score_func = 'relu'"),
        (dict(kv_format="fp2"), "kv_format: unknown storage format 'fp2'"),
        (dict(window_size=0), "window_size = 0: must be a positive integer"),
        (dict(dim=True), "dim = True: must be a positive integer"),
        (dict(n_encoder_layers=8), "n_encoder_layers = 8: must leave a decoder layer"),
        (dict(compress_ratios=[0, 2, 2, 2, 1, 1, 1, -1]), "layer 7 has negative ratio"),
        (dict(kv_source_layers="1,4"), "kv_source_layers: expected a list of integers"),
        (dict(rope_factor=4.0, original_seq_len=0), "original_seq_len = 0"),
        (dict(n_kv_heads=2), "n_kv_heads: only the dense control"),
        (dict(arch="gpt"), "arch = 'gpt': must be v41 or dense"),
        (dict(arch="dense", n_kv_heads=3), "n_kv_heads = 3: the dense control needs a positive "
                                           "divisor of n_heads"),
        (dict(arch="dense", n_kv_heads=2), "the dense control has no compressed layers"),
    ],
)
def test_invalid_configs_are_refused_naming_key_and_layer(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(tiny_with(**changes))


def test_draft_layers_must_be_window_only():
    d = tiny_with(n_mtp_layers=1, compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="draft layer 8 has ratio 1"):
        ModelConfig.from_dict(d)
    d["compress_ratios"][-1] = 0
    assert len(ModelConfig.from_dict(d).layers) == 8


def test_unknown_and_missing_keys_are_refused():
    with pytest.raises(ValueError, match="unknown keys kv_fromat"):
        ModelConfig.from_dict(tiny_with(kv_fromat="bf16"))
    d = tiny_with()
    del d["dim"]
    with pytest.raises(ValueError, match="missing required keys dim"):
        ModelConfig.from_dict(d)


def test_unreadable_and_corrupt_files_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.json: cannot read"):
        ModelConfig.from_json(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"dim": 64,')
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON"):
        ModelConfig.from_json(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad\.json: config: expected a JSON object"):
        ModelConfig.from_json(bad)
    bad.write_text(json.dumps(tiny_with(head_dim=33)))
    with pytest.raises(ValueError, match=r"bad\.json: config key head_dim"):
        ModelConfig.from_json(bad)


def test_dense_control_keeps_width_depth_and_ffn():
    for name in ("tiny", "deepseek-v4.1-flash"):
        c, d = preset(name), preset(f"dense-{name}" if name == "tiny" else "dense-v4.1-flash")
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "n_routed_experts",
                    "n_activated_experts", "moe_inter_dim", "inter_dim"):
            assert getattr(d, key) == getattr(c, key), key
        assert d.arch == "dense" and d.kv_format == "bf16" and d.n_encoder_layers == 0
        assert all(s.mode is Mode.WINDOW for s in d.layers)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown preset 'huge'; known: deepseek-v4\.1-flash"):
        preset("huge")


def test_the_default_presets_are_the_shipped_models_configs():
    """`--preset default` / `dense-default` must reproduce what kvstack/data/default and
    kvstack/data/dense-default were trained with: the model cards' commands rely on it (the
    bundled model's long-context stage adds its YaRN settings with --set, and
    `kvstack train-draft --stages 2` its two draft stages)."""
    from kvstack.config import LONG_CONTEXT

    root = Path(__file__).resolve().parent.parent
    bundled = ModelConfig.from_json(root / "kvstack" / "data" / "default" / "config.json")
    trunk = preset("default").replace(**LONG_CONTEXT)
    drafter = dict(compress_ratios=[*trunk.compress_ratios, 0, 0], n_mtp_layers=2,
                   dspark_block_size=5, dspark_noise_token_id=2,
                   dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=64)
    assert trunk.replace(**drafter) == bundled
    control = ModelConfig.from_json(root / "kvstack" / "data" / "dense-default" / "config.json")
    assert preset("dense-default") == control
