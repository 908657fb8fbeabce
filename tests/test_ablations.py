"""bench/ablations.py: each recipe changes one mechanism, its training command builds the
model it names, and the table marks only differences beyond the two seeds' gap."""

import argparse
import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import ablations

from kvstack.cache.layout import CacheLayout
from kvstack.cli import build_parser
from kvstack.config import Mode, preset
from kvstack.train.trainer import TrainConfig


def trained_config(recipe: ablations.Recipe, budget: ablations.Budget):
    """The model config `kvstack train` builds from the recipe's command line."""
    args = build_parser().parse_args(recipe.command(budget, Path("runs"))[3:])
    tc = TrainConfig(preset=args.preset, seq_len=args.seq_len, seed=args.seed,
                     model_overrides=dict(args.set or []),
                     retrieval_families=args.retrieval_families)
    tc.check()
    return tc.model_config(), args


@pytest.mark.parametrize("budget", ablations.BUDGETS.values(), ids=lambda b: b.name)
@pytest.mark.parametrize("recipe", ablations.RECIPES, ids=lambda r: r.name)
def test_command_trains_the_recipes_model(recipe, budget):
    config, args = trained_config(recipe, budget)
    assert config == recipe.config()
    assert args.seed == recipe.seed and args.no_define_loss
    assert (args.steps, args.seq_len, args.device) == (budget.steps, ablations.SEQ_LEN,
                                                       budget.device)
    assert args.steps * args.batch_size * args.grad_accum * args.seq_len == budget.tokens


def test_budgets_scale_the_recipe_in_proportion():
    cpu, gpu = ablations.BUDGETS["cpu"], ablations.BUDGETS["gpu"]
    assert gpu.tokens > cpu.tokens and gpu.runs != cpu.runs and gpu.results != cpu.results
    for b in (cpu, gpu):  # warm-ups a like share of the run
        assert 0.05 <= b.warmup_steps / b.steps <= 0.1
        assert 0.08 <= b.dense_warmup_steps / b.steps <= 0.12
        assert b.steps % b.checkpoint_every == 0  # the last step is a checkpoint


def test_each_recipe_changes_its_one_mechanism():
    base = preset("default")
    cfg = {r.name: r.config() for r in ablations.RECIPES}
    modes = {n: [s.mode for s in c.layers] for n, c in cfg.items()}
    bytes_ = {n: CacheLayout.from_config(c).bytes_per_token for n, c in cfg.items()}
    assert cfg["bundled"] == cfg["bundled-seed1"] == base
    assert ablations.BY_NAME["bundled-seed1"].seed != ablations.BY_NAME["bundled"].seed
    assert {cfg["bf16-caches"].kv_format, cfg["bf16-caches"].index_format,
            cfg["bf16-caches"].window_format} == {"bf16"}
    # No sharing: the encoder's compressed layers all Full, the CED decoder left alone.
    assert modes["no-sharing"][1:4] == [Mode.FULL] * 3
    assert modes["no-sharing"][4:] == modes["bundled"][4:]
    # No CED: no encoder, every decoder compressed layer writes its own stream.
    assert cfg["no-ced"].n_encoder_layers == 0 and modes["no-ced"][4:] == [Mode.FULL] * 4
    assert cfg["dense-compressed"].index_topk >= cfg["dense-compressed"].max_seq_len
    assert cfg["no-candidates"].candidate_source_layer is None
    assert base.candidate_source_layer is not None
    assert (cfg["window-64"].window_size, cfg["window-256"].window_size) == (64, 256)
    assert cfg["dense-control"].arch == "dense"
    # The byte side moves where the mechanism stores something, and only there.
    for same in ("dense-compressed", "no-candidates", "window-64", "window-256"):
        assert bytes_[same] == bytes_["bundled"]
    for more in ("bf16-caches", "no-sharing", "no-ced", "dense-control"):
        assert bytes_[more] > bytes_["bundled"]
    # Nothing else changes: the same widths and depth in every recipe but the control.
    for name, c in cfg.items():
        if name != "dense-control":
            assert (c.dim, c.n_layers, c.n_heads, c.head_dim, c.inter_dim) == (
                base.dim, base.n_layers, base.n_heads, base.head_dim, base.inter_dim)


def results(gap: float = 0.2) -> dict:
    row = {"what": "x", "hbm_bytes_per_token": 133.5, "disk_bytes_per_token": 133.5,
           "ppl": 10.0, "ppl_far": 12.0, "decode_tok_s_4k": 30.0,
           "retrieval": {"512": 0.5, "2048": 0.25, "8192": 0.0},
           "answer_nll": {"512": 2.0, "2048": 3.0, "8192": 4.0}}
    out = {}
    for r in ablations.RECIPES:
        out[r.name] = copy.deepcopy(row) | {"what": r.what}
    out["bundled-seed1"]["ppl"] = 10.0 + gap
    return out


def test_table_stars_only_differences_beyond_twice_the_seed_gap():
    res = results(gap=0.2)  # the seeds' mean ppl is 10.1, the gap 0.2
    res["window-64"]["ppl"] = 10.6  # 0.5 from the mean: beyond 2 x 0.2
    res["window-256"]["ppl"] = 10.4  # 0.3: inside it
    rows = {line.split(" | ")[0][2:]: line for line in ablations.render(res).splitlines()}
    assert "(+5.0%*)" in rows["window 64"]
    assert "(+3.0%)" in rows["window 256"] and "*" not in rows["window 256"]
    assert "Seed gap" in ablations.render(res)


def table(results: Path) -> None:
    ablations.table(argparse.Namespace(budget="cpu", results=results,
                                       timing=results / "decode.json", plot=None))


def test_a_metric_some_runs_lack_is_left_out_of_the_table():
    res = results()
    table = ablations.render(res)
    assert "nll 16x" in table.splitlines()[0] and "| 4.00 (+0.0%) |" in table
    del res["window-64"]["answer_nll"]  # measured before the metric existed
    assert "nll" not in ablations.render(res) and "found 16x" in ablations.render(res)


def test_table_needs_both_seeds(tmp_path):
    res = results()
    del res["bundled-seed1"]
    for name, row in res.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(row))
    (tmp_path / "decode.json").write_text(json.dumps({"tok_s": {n: 1.0 for n in res}}))
    with pytest.raises(SystemExit, match="bundled-seed1"):
        table(tmp_path)


def test_decode_timing_is_merged_and_required(tmp_path):
    res = results()
    for name, row in res.items():
        del row["decode_tok_s_4k"]
        (tmp_path / f"{name}.json").write_text(json.dumps(row))
    with pytest.raises(SystemExit, match=r"ablations\.py speed"):
        table(tmp_path)
    (tmp_path / "decode.json").write_text(json.dumps({"tok_s": {n: 2.0 for n in res}}))
    assert {r["decode_tok_s_4k"] for r in ablations.load(
        tmp_path, tmp_path / "decode.json").values()} == {2.0}


def test_plot_draws_every_recipe(tmp_path):
    path = tmp_path / "ablations.png"
    ablations.plot(results(), ablations.BUDGETS["gpu"], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
