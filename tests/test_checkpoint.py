"""Loading DeepSeek's published V4.1 checkpoint layout (and writing it), kept packed."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstack import LLM, SamplingParams, native
from kvstack.cli import main
from kvstack.config import preset
from kvstack.model import Model
from kvstack.model.checkpoint import export_v41, float_state_dict
from kvstack.model.packed import PackedExperts, PackedLinear
from tests.v41_checkpoint import published_tensors, write_v41_checkpoint

ROOT = Path(__file__).resolve().parents[1]
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("v41")
    write_v41_checkpoint(directory, preset("tiny-v41"), seed=1)
    return directory


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (2, n), generator=torch.Generator().manual_seed(seed))


def fp8_values(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Independent of kvstack's codecs: torch's own float8 conversions."""
    s = scale.float().repeat_interleave(32, 0)[: weight.shape[0]]
    return weight.float() * s.repeat_interleave(32, 1)[:, : weight.shape[1]]


def fp4_values(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).long()
    values = torch.stack((E2M1[b & 15], E2M1[b >> 4]), dim=-1).flatten(-2)
    return values * scale.float().repeat_interleave(32, -1)


def test_a_v41_checkpoint_loads_packed_and_gives_the_logits_of_its_float_weights(v41_dir):
    packed = Model.from_pretrained(v41_dir).eval()
    block = packed.layers[1]
    assert isinstance(block.attn.wq_a, PackedLinear) and block.attn.wq_a.fmt == "fp8"
    assert block.attn.wq_a.stored.dtype == torch.uint8
    assert isinstance(block.ffn.experts, PackedExperts)
    assert block.engram.table_codes.dtype == torch.uint8
    # The checkpoint's bf16 matrices stay bf16: the compressor's, the indexer's head
    # weights, the router's (layer 1 is a Full layer of ratio 2).
    compressor = block.attn.compressor
    for m in (compressor.wkv, compressor.wgate, compressor.wk_index, block.attn.indexer.wweights):
        assert isinstance(m, PackedLinear) and m.stored.dtype == torch.bfloat16
    assert block.ffn.gate.weight.dtype == torch.bfloat16
    floats = float_state_dict(packed)
    unpacked = Model(packed.config)
    unpacked.load_state_dict(floats)
    ids = tokens(40)
    want = unpacked.eval()(ids).logits
    with native.active(False):  # dequantise-then-matmul: the float model's very ops
        assert torch.equal(packed(ids).logits, want)
    got = packed(ids).logits  # the C kernels where they build: within float32 rounding
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    # The values are the published bytes read as the spec says, named as kvstack names them.
    written = published_tensors(preset("tiny-v41"), torch.Generator().manual_seed(1))
    cases = {
        "layers.1.attn.wq_a.weight": fp8_values(written["layers.1.attn.wq_a.weight"],
                                                written["layers.1.attn.wq_a.scale"]),
        "layers.3.attn.indexer.wq.weight": fp8_values(
            written["layers.3.attn.indexer.wq_b.weight"],
            written["layers.3.attn.indexer.wq_b.scale"]),
        "layers.2.ffn.experts.w2": torch.stack([fp4_values(
            written[f"layers.2.ffn.experts.{e}.w2.weight"],
            written[f"layers.2.ffn.experts.{e}.w2.scale"]) for e in range(4)]),
        "layers.4.ffn.shared.w3.weight": fp8_values(
            written["layers.4.ffn.shared_experts.w3.weight"],
            written["layers.4.ffn.shared_experts.w3.scale"]),
        "layers.1.attn.compressor.wk_index.weight": written["layers.1.attn.indexer.wk.weight"],
        "layers.4.attn.compressor.index_norm.weight":
            written["layers.4.attn.indexer.k_norm.weight"],
        "layers.0.attn.sink": written["layers.0.attn.attn_sink"],
        "layers.5.hc_ffn.fn": written["layers.5.hc_ffn_fn"],
        "layers.7.attn.wo_a.weight": fp8_values(written["layers.7.attn.wo_a.weight"],
                                                written["layers.7.attn.wo_a.scale"]),
    }
    for name, expected in cases.items():
        assert torch.equal(floats[name].float(), expected.float()), name
    assert torch.equal(floats["layers.4.engram.table_codes"],
                       written["layers.4.engram.embed.weight"].view(torch.uint8))


def test_what_is_skipped_is_named(v41_dir):
    report = Model.from_pretrained(v41_dir).checkpoint_report
    assert report.layout == "v41" and len(report.files) == 3
    assert "DSpark" in report.skipped["mtp.0.attn.wq_a.weight"]
    assert "without a vision tower" in report.skipped["vision.patch_embed.proj.weight"]
    assert "without a vision tower" in report.skipped["image_newline"]
    assert "image tokens" in report.skipped["layers.0.ffn.gate.bias_vl"]


def test_the_hf_form_of_the_config_loads_the_same_model(tmp_path, v41_dir):
    write_v41_checkpoint(tmp_path, preset("tiny-v41"), seed=1, hf_form=True)
    assert "text_config" in json.loads((tmp_path / "config.json").read_text())
    a, b = Model.from_pretrained(v41_dir), Model.from_pretrained(tmp_path)
    assert a.config == b.config == preset("tiny-v41").replace(norm_eps=a.config.norm_eps)
    ids = tokens(20)
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_a_single_file_v41_checkpoint_loads_like_the_sharded_one(tmp_path, v41_dir):
    write_v41_checkpoint(tmp_path, preset("tiny-v41"), seed=1, shards=0)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    one = Model.from_pretrained(tmp_path)
    assert one.checkpoint_report.files == ["model.safetensors"]
    ids = tokens(20)
    assert torch.equal(one(ids).logits, Model.from_pretrained(v41_dir)(ids).logits)


def test_bf16_matrices_stored_as_float32_load_as_float_weights(tmp_path):
    """A checkpoint that holds the compressor's, the indexer's and the router's matrices in
    float32 (a conversion may): they load as float32, never narrowed, and the model gives
    the logits of the bf16-stored one (the same values)."""
    write_v41_checkpoint(tmp_path, preset("tiny-v41"), seed=1, shards=0)
    bf16 = Model.from_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    widened = [n for n in tensors if n.endswith(("compressor.wkv.weight", "wgate.weight",
                                                 "indexer.wk.weight", "weights_proj.weight",
                                                 "gate.weight"))]
    tensors.update({n: tensors[n].float() for n in widened})
    save_file(tensors, str(path))
    wide = Model.from_pretrained(tmp_path)
    block = wide.layers[1]
    for m in (block.attn.compressor.wkv, block.attn.compressor.wgate,
              block.attn.compressor.wk_index, block.attn.indexer.wweights):
        assert type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
    assert block.ffn.gate.weight.dtype == torch.float32
    ids = tokens(20)
    want, got = bf16(ids).logits, wide(ids).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def edit_shard(directory: Path, change) -> None:
    """Rewrite the first shard after change(tensors), keeping the index in step."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    file = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(str(directory / file))
    change(tensors)
    save_file(tensors, str(directory / file))
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != file}
    index["weight_map"].update(dict.fromkeys(tensors, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_bad_checkpoints_are_refused_naming_the_tensor_and_file(tmp_path, v41_dir):
    shard1 = "model-00001-of-00003.safetensors"

    def refused(name: str, change, match: str) -> None:
        d = copy_checkpoint(v41_dir, tmp_path / name)
        change(d)
        with pytest.raises(ValueError, match=match):
            Model.from_pretrained(d)

    refused("missing-shard", lambda d: (d / "model-00002-of-00003.safetensors").unlink(),
            r"shard model-00002-of-00003\.safetensors is missing \(the index places \d+ "
            r"tensors in it, e\.g\. ")
    refused("truncated", lambda d: (d / shard1).write_bytes((d / shard1).read_bytes()[:5000]),
            rf"checkpoint shard .*{shard1}: cannot read")
    refused("no-scale", lambda d: edit_shard(d, lambda t: t.pop("layers.0.attn.wq_a.scale")),
            r"tensors of the V4.1 layout are missing: layers\.0\.attn\.wq_a\.scale")
    refused("wrong-shape", lambda d: edit_shard(d, lambda t: t.update(
        {"layers.0.attn.wq_a.weight": t["layers.0.attn.wq_a.weight"][:, :32].contiguous()})),
        rf"{shard1}: tensor layers\.0\.attn\.wq_a\.weight has shape \[32, 32\], the config "
        r"needs \[32, 64\]")
    refused("wrong-dtype", lambda d: edit_shard(d, lambda t: t.update(
        {"layers.0.attn.wq_a.weight": t["layers.0.attn.wq_a.weight"].to(torch.bfloat16)})),
        r"tensor layers\.0\.attn\.wq_a\.weight is BF16, the V4\.1 layout stores it as F8_E4M3")
    refused("unknown", lambda d: edit_shard(d, lambda t: t.update(
        {"layers.0.attn.rotary.inv_freq": torch.zeros(4)})),
        rf"{shard1}: tensor layers\.0\.attn\.rotary\.inv_freq is not part of DeepSeek-V4\.1")

    def contradicting(d: Path) -> None:  # a config with more experts than the tensors
        config = json.loads((d / "config.json").read_text())
        config["n_routed_experts"] = 8
        (d / "config.json").write_text(json.dumps(config))

    refused("contradicts", contradicting, r"tensor layers\.0\.ffn\.gate\.\w+ has shape "
            r"\[4\S*\], the config needs \[8")

    def v3(d: Path) -> None:
        (d / "config.json").write_text(json.dumps({
            "vocab_size": 129280, "dim": 7168, "n_layers": 61, "n_heads": 128,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "dtype": "fp8"}))

    refused("v3", v3, r"not a DeepSeek-V4\.1 config .*V3 and V4 checkpoints are other")

    def v4_hf(d: Path) -> None:
        (d / "config.json").write_text(json.dumps({
            "model_type": "deepseek_v4", "text_config": {"hidden_size": 4096},
            "quantization_config": {"quant_method": "fp8"}}))

    refused("v4", v4_hf, r"model_type 'deepseek_v4' is not DeepSeek-V4\.1")
    # Nothing was changed in the good checkpoint by any of this.
    assert Model.from_pretrained(v41_dir).config == preset("tiny-v41")


def test_export_round_trips_the_published_bytes(tmp_path, v41_dir):
    model = Model.from_pretrained(v41_dir)
    files = export_v41(model, tmp_path / "again", shard_bytes=100_000)
    assert len(files) > 3
    original, again = {}, {}
    for f in v41_dir.glob("model-*.safetensors"):
        original.update(load_file(str(f)))
    for f in files:
        again.update(load_file(str(tmp_path / "again" / f)))
    kept = {n for n in original if not n.startswith(("mtp.", "vision.", "image_"))
            and not n.endswith("bias_vl")}
    assert set(again) == kept
    for name in kept:
        assert again[name].dtype == original[name].dtype, name
        assert torch.equal(again[name].view(torch.uint8), original[name].view(torch.uint8)), name


def test_export_of_a_float_model_loads_as_its_quantised_self(tmp_path):
    torch.manual_seed(0)
    model = Model(preset("tiny-v41")).eval()
    export_v41(model, tmp_path / "out")
    loaded = Model.from_pretrained(tmp_path / "out").eval()
    ids = tokens(30)
    diff = (loaded(ids).logits - model(ids).logits).abs().max()
    assert 0 < diff < 0.5  # FP8/FP4 rounding of the weights, nothing else
    # Models the published layout cannot hold are refused with the reason.
    with pytest.raises(ValueError, match=r"MoE feed-forward layers .* a dense FFN"):
        export_v41(Model(preset("default")), tmp_path / "dense")
    with pytest.raises(ValueError, match=r"no keys for n_encoder_layers = 0 \(V4\.1 implies 4\)"):
        export_v41(Model(preset("tiny-v41").replace(n_encoder_layers=0)), tmp_path / "odd")


def test_the_export_command_makes_a_tiny_v41_checkpoint_that_serves(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["export", str(out), "--format", "v41", "--preset", "tiny-v41",
                 "--random-init", "--shard-size", "200KiB"]) == 0
    assert "shards + model.safetensors.index.json" in capsys.readouterr().out
    llm = LLM(out, kv_budget="2MiB", replay="exact", block_tokens=16)
    report = llm.memory_report()
    # Engram tables are weights: their own line, never in the bytes per token.
    assert [(e["layer"], e["bytes"], e["device"]) for e in report["engram"]] == [
        (1, 240 * 33, "cpu"), (4, 306 * 33, "cpu")]
    assert report["bytes_per_token"] == 52.5
    assert main(["export", str(out), "--format", "v41", "--preset", "tiny"]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_engine_equals_the_reference_on_a_packed_v41_model(v41_dir):
    llm = LLM(v41_dir, kv_budget="2MiB", replay="exact", block_tokens=16)
    prompts = [tokens(37, seed=3)[0].tolist(), tokens(70, seed=4)[0].tolist()]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, greedy)
    model = llm.model
    for prompt, out in zip(prompts, outs, strict=True):
        ids = list(prompt)
        for token in out.token_ids:
            assert token == int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
    # What runs by default is named; the same greedy tokens as dequantise-then-matmul.
    assert llm.memory_report()["backend"]["packed_weights"].startswith("C kernels")
    dequantising = LLM(v41_dir, kv_budget="2MiB", replay="exact", block_tokens=16,
                       cpu_kernels="torch")
    assert dequantising.memory_report()["backend"]["packed_weights"].startswith("torch")
    assert [o.token_ids for o in dequantising.generate(prompts, greedy)] == \
        [o.token_ids for o in outs]


def test_a_session_of_a_packed_v41_model_resumes_token_for_token(tmp_path, v41_dir):
    kwargs = dict(kv_budget="2MiB", replay="exact", block_tokens=8, cache_dir=tmp_path)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm = LLM(v41_dir, **kwargs)
    session = llm.session("work")
    session.append(tokens(60, seed=5)[0].tolist())
    session.generate(greedy)
    session.save()
    uninterrupted = session.generate(greedy).token_ids
    resumed = LLM(v41_dir, **kwargs).resume("work").generate(greedy).token_ids
    assert resumed == uninterrupted


def test_the_fingerprint_comes_from_the_files(tmp_path, v41_dir):
    a = Model.from_pretrained(v41_dir)
    assert a.fingerprint() == Model.from_pretrained(v41_dir).fingerprint()
    d = copy_checkpoint(v41_dir, tmp_path / "changed")
    shard = d / "model-00003-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    shard.write_bytes(bytes(data))
    assert Model.from_pretrained(d).fingerprint() != a.fingerprint()
    a.set_numerics("reference")  # other numerics compute other cache contents
    assert a.fingerprint() != Model.from_pretrained(v41_dir).fingerprint()


def test_resident_memory_stays_close_to_the_checkpoint_size(tmp_path):
    # ~100 MB of FP4 experts and FP8 projections: what loading must not expand.
    config = preset("tiny-v41").replace(dim=256, n_routed_experts=32, moe_inter_dim=1024,
                                        q_lora_rank=128, o_lora_rank=128)
    write_v41_checkpoint(tmp_path, config, shards=4)
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert size > 80e6
    script = textwrap.dedent(f"""
        import gc, json
        import torch
        import kvstack.model.checkpoint  # what loading imports, before the baseline
        from kvstack.config import preset
        from kvstack.model import Model
        def rss():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
        # The first model built on the meta device loads torch's meta kernels, once,
        # whatever the checkpoint: outside what is measured.
        with torch.device("meta"):
            Model(preset("tiny"))
        gc.collect()
        before = rss()
        model = Model.from_pretrained({str(tmp_path)!r})
        gc.collect()
        print(json.dumps(rss() - before))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, cwd=ROOT, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    grown = json.loads(done.stdout.strip().splitlines()[-1])
    assert grown <= 1.3 * size, (grown, size)
