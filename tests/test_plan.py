"""The planner: layout, bytes per token, parameter counts, capacity and mechanism table."""

import json
import math

import pytest

from kvstack.cache.layout import CacheLayout
from kvstack.cli import main
from kvstack.config import PRESETS, preset
from kvstack.formats import bytes_per_entry
from kvstack.model.params import (
    count_parameters,
    draft_parameter_shapes,
    engram_table_bytes,
    parameter_shapes,
    vision_parameter_shapes,
)
from kvstack.parallel.plan import ShardingPlan
from kvstack.plan import RESERVE_FRACTION, make_plan, rank_weights, stored_bytes


def test_v41_flash_is_890_bytes_per_token():
    layout = CacheLayout.from_config(preset("deepseek-v4.1-flash"))
    assert layout.bytes_per_token == 890
    rows = [(s.layer, s.kind, s.fmt, s.width, s.ratio, s.entry_bytes) for s in layout.streams]
    assert rows == [
        (2, "kv", "fp4_e4m3_16", 512, 2, 288), (2, "index", "fp4_ue8m0_32", 128, 2, 68),
        (8, "kv", "fp4_e4m3_16", 512, 2, 288), (8, "index", "fp4_ue8m0_32", 128, 2, 68),
        (14, "kv", "fp4_e4m3_16", 512, 2, 288), (14, "index", "fp4_ue8m0_32", 128, 2, 68),
        (20, "kv", "fp4_e4m3_16", 512, 1, 288), (20, "index", "fp4_ue8m0_32", 128, 1, 68),
    ]
    # One window ring per layer: 40 x 128 slots x 528 B; draft layers are not served.
    assert layout.window_bytes_per_sequence == 40 * 128 * 528
    assert CacheLayout.from_config(preset("v41-layout-small")).bytes_per_token == 890


def test_bytes_follow_the_formats():
    c = preset("deepseek-v4.1-flash").replace(kv_format="fp8_ue8m0_32")
    per_token = CacheLayout.from_config(c).bytes_per_token
    assert per_token == (3 / 2 + 1) * (bytes_per_entry("fp8_ue8m0_32", 512) + 68)


def test_sequence_bytes_count_complete_groups_only():
    layout = CacheLayout.from_config(preset("tiny"))
    fixed = layout.window_bytes_per_sequence + layout.partial_bytes_per_sequence
    # 5 tokens: 2 entries of the ratio-2 stream (layer 1), 5 of the ratio-1 stream (layer 4)
    expected = 2 * (18 + 17) + 5 * (18 + 17) + fixed
    assert layout.sequence_bytes(5) == expected


def test_v41_flash_parameter_counts_match_the_published_figures():
    p = count_parameters(preset("deepseek-v4.1-flash"))
    assert 548e9 < p.total < 556e9  # "552B trunk, without Engram tables and draft layers"
    assert 15.5e9 < p.active_decode < 17e9  # "16B active per decoded token"
    assert 7.6e9 < p.active_prefill < 8.6e9  # "8B per prefilled token under CED"


def test_parameter_shapes_follow_the_layer_modes():
    c = preset("tiny")
    shapes = parameter_shapes(c)
    compressors = {int(n.split(".")[1]) for n in shapes if ".compressor.wkv." in n}
    gates = {int(n.split(".")[1]) for n in shapes if ".compressor.wgate." in n}
    indexers = {int(n.split(".")[1]) for n in shapes if ".indexer.wq." in n}
    assert compressors == set(c.kv_source_layers)
    assert gates == {i for i in c.kv_source_layers if c.compress_ratios[i] > 1}
    assert indexers == set(c.index_source_layers)
    p = count_parameters(c)
    assert p.total == sum(math.prod(s) for s in shapes.values())
    assert p.active_prefill < p.active_decode < p.total


def test_without_ced_prefill_touches_every_layer():
    c = preset("tiny")
    with_ced = count_parameters(c)
    without = count_parameters(c.replace(n_encoder_layers=0))
    shapes = parameter_shapes(c)
    head = math.prod(shapes["head.weight"]) + math.prod(shapes["norm.weight"])
    head += sum(math.prod(s) for n, s in shapes.items() if n.startswith("hc_head"))
    assert without.active_prefill == without.active_decode - head
    assert with_ced.active_prefill < without.active_prefill


def test_sequences_fit():
    c = preset("deepseek-v4.1-flash")
    plan = make_plan(c, "v41", context=131072, hbm_gib=80)
    per_seq = CacheLayout.from_config(c).sequence_bytes(131072)
    assert plan["bytes_per_sequence"] == per_seq
    assert plan["sequences_fit"] == 80 * 2**30 // per_seq
    assert "sequences_fit" not in make_plan(c, "v41", context=131072)


def test_mechanism_table_for_v41_flash():
    plan = make_plan(preset("deepseek-v4.1-flash"), "v41", context=65536, hbm_gib=80)
    rows = {r["variant"]: r for r in plan["mechanisms"]}
    assert rows["as configured"]["hbm_bytes_per_token"] == 890
    # bf16: 3 sources x (1024 + 256) / 2 + (1024 + 256)
    assert rows["bf16 cache"]["hbm_bytes_per_token"] == 3200
    # every encoder compressed layer (2..19) its own ratio-2 source, plus the CED stream
    assert rows["no sharing"]["hbm_bytes_per_token"] == 18 * 356 / 2 + 356
    # every compressed decoder layer (20..39) its own ratio-1 source
    assert rows["no CED"]["hbm_bytes_per_token"] == 3 * 356 / 2 + 20 * 356
    window = rows["window persisted"]
    assert window["hbm_bytes_per_token"] == 890
    assert window["persistent_bytes_per_token"] == 890 + 40 * 528
    assert rows["all four off"]["persistent_bytes_per_token"] == (
        18 * 1280 / 2 + 20 * 1280 + 40 * 1024
    )
    # the dense control: 40 layers x (k + v) x 8 KV heads x 512 x 2 bytes
    assert rows["dense control"]["hbm_bytes_per_token"] == 40 * 2 * 8 * 512 * 2
    for r in plan["mechanisms"][1:]:
        assert r["sequences_fit"] <= rows["as configured"]["sequences_fit"]
        assert r["hbm_ratio"] >= 1 and r["persistent_ratio"] > 1


def test_dense_control_plan(capsys):
    assert main(["plan", "--preset", "dense-tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["arch"] == "dense" and out["bytes_per_token"] == 8 * 2 * 32 * 2
    assert [r["variant"] for r in out["mechanisms"]] == ["as configured"]
    assert {s["kind"] for s in out["streams"]} == {"k", "v"}
    assert out["window_bytes_per_sequence"] == 0
    assert main(["plan", "--preset", "dense-tiny"]) == 0
    assert "dense attention layers" in capsys.readouterr().out


def test_mechanisms_a_config_does_not_use_get_no_row():
    c = preset("tiny").replace(
        n_encoder_layers=0, kv_format="bf16", index_format="bf16", window_format="bf16"
    )
    variants = [r["variant"] for r in make_plan(c, "t")["mechanisms"]]
    assert "no CED" not in variants and "bf16 cache" not in variants


@pytest.mark.parametrize("name", PRESETS)
def test_plan_json_has_the_documented_keys(name, capsys):
    assert main(["plan", "--preset", name, "--context", "4096", "--hbm-gib", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("bytes_per_token", "streams", "window_bytes_per_sequence", "params_total",
                "params_active_decode", "params_active_prefill", "sequences_fit",
                "mechanisms", "basis"):
        assert key in out
    assert "computed from the config" in out["basis"]


def test_plan_table_for_v41_flash(capsys):
    assert main(["plan", "--preset", "deepseek-v4.1-flash", "--hbm-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "890 bytes/token" in out
    assert "computed from the config" in out
    assert "551.9B total" in out and "16.8B active per decoded token" in out
    assert "Engram tables (weights, apart from the cache): 188.83 GiB (202.8 GB)" in out
    for variant in ("bf16 cache", "no sharing", "no CED", "window persisted", "all four off"):
        assert variant in out


def test_plan_from_a_config_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    preset("tiny").to_json(path)
    assert main(["plan", "--config", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 52.5  # (18 + 17) / 2 + (18 + 17)
    assert out["context"] == preset("tiny").max_seq_len


def test_plan_errors_are_clear(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text('{"dim": ')
    assert main(["plan", "--config", str(bad)]) == 2
    assert "config.json: not valid JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--preset", "tiny", "--context", "-5"])
    assert "must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--preset", "tiny", "--hbm-gib", "0"])
    assert "must be a positive number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan"])
    assert "one of the arguments --preset --config is required" in capsys.readouterr().err


def test_the_kvstack_command_is_installed():
    import subprocess
    import sys
    from pathlib import Path

    command = Path(sys.executable).parent / "kvstack"
    result = subprocess.run(
        [str(command), "plan", "--preset", "deepseek-v4.1-flash", "--json"],
        capture_output=True, text=True, check=True,
    )
    assert json.loads(result.stdout)["bytes_per_token"] == 890


# ---- tensor / expert parallel ---------------------------------------------------------


def _published_bytes_by_name(config):
    """Bytes of each of kvstack's tensors in DeepSeek's published layout, from the name
    table (a packed weight and its scales, every expert's projection, under one name)."""
    from kvstack.model.checkpoint import _nbytes, v41_names

    out: dict[str, int] = {}
    for entry in v41_names(config).values():
        if entry.kind in ("linear", "linear_scale", "head", "bf16_linear"):
            name = entry.target + ".weight"
        elif entry.kind in ("expert", "expert_scale"):
            name = f"{entry.target}.{entry.proj}"
        else:
            name = entry.target
        out[name] = out.get(name, 0) + _nbytes(entry)
    return out


@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v41-dspark", "deepseek-v4.1-flash"])
def test_weight_bytes_are_those_of_the_published_checkpoint(name):
    c = preset(name)
    published = _published_bytes_by_name(c)
    shapes = parameter_shapes(c) | draft_parameter_shapes(c) | vision_parameter_shapes(c)
    assert {n: stored_bytes(n, s) for n, s in shapes.items()} == published
    single = make_plan(c, name, tensor_parallel_size=1)["parallel"]
    assert single["weight_bytes_one_process"] == single["weight_bytes_per_device"]
    assert single["weight_bytes_one_process"] == sum(published.values())
    assert single["engram_table_bytes_on_host"] == sum(engram_table_bytes(c))
    if name == "deepseek-v4.1-flash":
        # DeepSeek's shards hold ~510 GB, draft layers and vision tower included.
        assert 495e9 < single["weight_bytes_one_process"] < 512e9


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_ranks_add_up_to_one_process_plus_what_each_replicates(expert_parallel):
    # 511 vocabulary rows pad to 2 x 256; 241 table rows split 121 + 120.
    c = preset("tiny-v41").replace(vocab_size=511, engram_compressed_vocab_size=511,
                                   engram_num_embeddings=[241, 306], moe_inter_dim=64)
    single = rank_weights(c, ShardingPlan(c, 1))[0]
    ranks = rank_weights(c, ShardingPlan(c, 2, expert_parallel))
    padding = 2 * 1 * c.dim * 2  # embed and head: one bf16 row
    assert ranks[0].replicated == ranks[1].replicated > 0
    assert sum(r.total for r in ranks) == single.total + ranks[0].replicated + padding
    assert [r.tables for r in ranks] == [(121 + 153) * 33, (120 + 153) * 33]
    p = make_plan(c, "t", tensor_parallel_size=2, expert_parallel=expert_parallel)["parallel"]
    assert p["weight_bytes_per_device"] == ranks[0].total
    assert p["weight_bytes_per_device_tables_on_host"] == ranks[0].total - ranks[0].tables
    assert p["weight_bytes_all_devices"] == sum(r.total for r in ranks)


def test_a_piece_off_the_block_grid_keeps_its_scales():
    assert stored_bytes("layers.0.attn.wq_b.weight", (64, 64)) == 64 * 64 + 4
    assert stored_bytes("layers.0.attn.wq_b.weight", (16, 64)) == 16 * 64 + 2
    assert stored_bytes("layers.0.ffn.experts.w2", (4, 64, 16)) == 4 * 64 * (8 + 1)


def test_each_device_keeps_the_whole_cache_and_the_fit_leaves_room_for_weights():
    c = preset("deepseek-v4.1-flash")
    plan = make_plan(c, "v41", context=131072, hbm_gib=141, tensor_parallel_size=8)
    p = plan["parallel"]
    assert p["cache_bytes_per_token_per_device"] == plan["bytes_per_token"] == 890
    assert p["cache_bytes_per_sequence_per_device"] == plan["bytes_per_sequence"]
    usable = int(141 * 2**30 * (1 - RESERVE_FRACTION))
    for key, weights in (("tables_on_device", p["weight_bytes_per_device"]),
                         ("tables_on_host", p["weight_bytes_per_device_tables_on_host"])):
        fit = p["fit"][key]
        assert fit["sequences_fit"] == (usable - weights) // plan["bytes_per_sequence"] > 0
    assert p["fit"]["tables_on_host"]["sequences_fit"] > p["fit"]["tables_on_device"][
        "sequences_fit"]
    # Expert parallelism moves whole experts, not bytes: the same weights per device.
    ep = make_plan(c, "v41", context=131072, tensor_parallel_size=8, expert_parallel=True)
    assert ep["parallel"]["experts_per_rank"] == 48
    assert ep["parallel"]["weight_bytes_per_device"] == p["weight_bytes_per_device"]


def test_weights_that_do_not_fit_leave_no_sequences():
    p = make_plan(preset("deepseek-v4.1-flash"), "v41", context=131072, hbm_gib=80,
                  tensor_parallel_size=1)["parallel"]
    for fit in p["fit"].values():
        assert fit == {**fit, "cache_bytes": 0, "sequences_fit": 0, "weights_exceed_hbm": True}


def test_a_tensor_parallel_size_that_does_not_divide_is_refused_by_name(tmp_path, capsys):
    assert main(["plan", "--preset", "tiny-v41", "--tensor-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "kvstack plan: error:" in err and "n_heads" in err and "Traceback" not in err
    path = tmp_path / "config.json"
    preset("tiny-v41").replace(n_routed_experts=5).to_json(path)
    assert main(["plan", "--config", str(path), "--tensor-parallel-size", "2",
                 "--expert-parallel"]) == 2
    assert "n_routed_experts (5)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="moe_inter_dim"):
        make_plan(preset("tiny-v41").replace(moe_inter_dim=33), "t", tensor_parallel_size=2)
    assert main(["plan", "--preset", "tiny-v41", "--expert-parallel"]) == 2
    assert "tensor_parallel_size" in capsys.readouterr().err


def test_plan_prints_the_parallel_section(capsys):
    args = ["plan", "--preset", "deepseek-v4.1-flash", "--tensor-parallel-size", "8",
            "--hbm-gib", "141", "--context", "131072"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Tensor parallel over 8 devices" in out
    assert "each device keeps every token's whole record" in out
    assert "890 bytes/token per device" in out
    assert "Engram tables on the host" in out and "600" in out and "813" in out
    assert main([*args[:-4], "--hbm-gib", "40"]) == 0
    assert "exceed the device's 40 GiB" in capsys.readouterr().out
    assert main([*args, "--expert-parallel", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parallel"]["expert_parallel"] and out["parallel"]["fit"]
    assert out["bytes_per_token"] == 890
    assert main(["plan", "--preset", "tiny-v41", "--json"]) == 0
    assert "parallel" not in json.loads(capsys.readouterr().out)


def test_a_cpu_run_counts_the_published_bytes_and_what_a_token_reads():
    """RAM with the Engram tables in it or mapped from disk, and the weight bytes a decoded
    token reads, counted here from the published tensor table (names, dtypes, shapes):
    one embedding row, the experts a token picks, the table rows its n-grams hash to."""
    from kvstack.model.checkpoint import STORED_DTYPES, v41_names

    c = preset("tiny-v41")
    plan = make_plan(c, "tiny-v41", context=256)
    run = plan["cpu_run"]
    read = tables = stored = 0
    for entry in v41_names(c).values():
        size = math.prod(entry.shape) * STORED_DTYPES[entry.dtype].itemsize
        stored += size
        if entry.kind.startswith("table"):
            tables += size
        elif entry.kind == "embed":
            read += size // entry.shape[0]
        elif entry.kind.startswith("expert"):
            read += size * c.n_activated_experts // c.n_routed_experts
        else:
            read += size
    rows = len(c.engram_layer_ids) * (c.engram_max_ngram_size - 1) * c.engram_n_heads
    read += rows * (c.engram_head_dim + c.engram_head_dim // 32)
    assert run["decode_read_bytes_per_token"] == read
    assert run["disk_bytes"] == run["checkpoint_bytes"] == stored
    assert run["engram_table_bytes"] == tables > 0
    sequence = CacheLayout.from_config(c).sequence_bytes(256)
    assert run["ram_bytes_tables_in_ram"] == stored + sequence
    assert run["ram_bytes_tables_on_disk"] == stored - tables + sequence
    flash = make_plan(preset("deepseek-v4.1-flash"), "flash", context=4096)["cpu_run"]
    assert 12e9 < flash["decode_read_bytes_per_token"] < 14e9  # ~13 GB a token
    # Only a model DeepSeek's layout holds has a published checkpoint to run.
    assert "cpu_run" not in make_plan(preset("dense-v4.1-flash"), "dense", context=64)
