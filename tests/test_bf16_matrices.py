"""Weight matrices held in bf16 (EngineConfig.dtype, Model.narrow_matrices): the C calls
of a step on bf16 matrices give what they give on the same values in float32, an engine
decodes as it does on those values, and a checkpoint keeps the dtype it was saved in."""

from copy import deepcopy

import pytest
import torch
from safetensors import safe_open

from kvstack import LLM, SamplingParams, native
from kvstack.config import dense_control, preset
from kvstack.engine.config import EngineConfig
from kvstack.engine.tokenizer import byte_level_tokenizer_json
from kvstack.model import Model
from kvstack.model.model import StepContext
from kvstack.model.packed import PackedLinear

needs_c = pytest.mark.skipif(not native.resolve("auto"), reason="no C compiler here")
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 9, 2, 7] * 20, [3, 1] * 33, list(range(40, 140))]


def rounded(model: Model) -> Model:
    """model with its matrices rounded to bf16 in place, still float32."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in model.matrix_names():
            params[name].copy_(params[name].to(torch.bfloat16).float())
    return model


def pair(config) -> tuple[Model, Model]:
    """A float32 model whose matrices hold bf16 values, and a copy narrowed to bf16."""
    torch.manual_seed(0)
    wide = rounded(Model(config).eval())
    narrow = deepcopy(wide)
    narrow.narrow_matrices()
    return wide, narrow


def test_narrowing_holds_the_matrices_in_bf16_and_nothing_else():
    """Linears of the layers and the head become bf16 PackedLinears, the experts and the
    embedding bf16; norms, routers, hyper-connections and sinks stay float32, and the
    matrices' bytes halve."""
    wide, narrow = pair(preset("tiny"))
    names = set(wide.matrix_names())
    assert "head.weight" in names and "embed.weight" in names
    assert any(n.endswith("ffn.experts.w1") for n in names)
    assert not any(n.endswith(("norm.weight", "ffn.gate.weight")) or ".hc_" in n for n in names)
    assert narrow.matrix_dtype is torch.bfloat16 and wide.matrix_dtype is torch.float32
    assert isinstance(narrow.head, PackedLinear) and narrow.head.fmt == "bf16"
    state = narrow.state_dict()
    for name, t in state.items():
        matrix = name.replace(".stored", ".weight") in names
        if t.is_floating_point():
            assert t.dtype is (torch.bfloat16 if matrix else torch.float32), name

    def matrix_bytes(m: Model) -> int:
        return sum(t.numel() * t.element_size() for n, t in m.state_dict().items()
                   if n.replace(".stored", ".weight") in names)

    assert matrix_bytes(narrow) * 2 == matrix_bytes(wide)
    assert narrow.fingerprint() != wide.fingerprint()  # no cache of one serves the other
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():  # torch's own forward, widening the bf16 weights per call
        assert torch.allclose(narrow(ids).logits, wide(ids).logits, atol=1e-5, rtol=1e-5)


@needs_c
@pytest.mark.parametrize("routed", [8, 0])
def test_a_layers_c_calls_on_bf16_matrices_equal_them_on_the_same_values_in_float32(routed):
    """The attention half's two calls, the feed-forward half (MoE or dense) and the
    indexer's queries, for one token and several: the same floats bit for bit (the
    kernels widen each bf16 weight in registers and add in the float32 path's order)."""
    config = preset("tiny-v41").replace(n_routed_experts=routed,
                                        n_activated_experts=min(2, routed), inter_dim=48)
    wide, narrow = pair(config)
    index = next(i for i, layer in enumerate(wide.layers) if layer.attn.indexer is not None)
    for b, n in ((1, 1), (3, 2)):
        x = torch.randn(b, n, config.hc_mult, config.dim)
        start = torch.tensor([5, 40, 77][:b])
        positions = start[:, None] + torch.arange(n)
        mix = torch.rand(b, n, config.hc_mult)
        heads = torch.randn(b, n, config.n_heads, config.head_dim)
        results = []
        for model in (wide, narrow):
            layer = model.layers[index]
            attn = layer.attn
            with torch.no_grad(), native.active(True):
                projections = attn.c_projections()
                assert projections is not None
                assert projections[0].dtype is model.matrix_dtype
                block_in = layer._attention_in_c(x, mix, start, StepContext())
                out = native.attention_out(heads, positions, attn.freqs, projections[3],
                                           attn.local_groups, projections[4],
                                           (x, block_in[1], block_in[2]))
                ffn = layer._ffn_in_c(x, mix)
                queries = attn.indexer._queries(x[:, :, 0], block_in[4][1], positions)
            assert block_in is not None and ffn is not None
            results.append((*block_in[:4], *block_in[4][1:4], out, *ffn, *queries))
        for w, g in zip(*results, strict=True):
            assert torch.equal(w, g)


@needs_c
def test_the_dense_controls_one_call_attention_on_bf16_matrices_equals_float32s():
    config = dense_control(preset("tiny"))
    results = []
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        llm = LLM(config, random_init=True, kv_budget="8MiB", max_num_seqs=3,
                  dtype="float32")
        rounded(llm.model)
        if dtype == "bfloat16":
            llm.model.narrow_matrices()
        attn = llm.model.layers[0].attn
        calls = 0
        decode_block = type(attn).decode_block

        def counted(self, *args, _f=decode_block):
            nonlocal calls
            out = _f(self, *args)
            calls += out is not None
            return out

        type(attn).decode_block = counted
        try:
            results.append([o.token_ids for o in llm.generate(PROMPTS, GREEDY)])
        finally:
            type(attn).decode_block = decode_block
        assert calls > 0  # the one-call attention ran on these matrices
    assert results[0] == results[1]


@pytest.mark.parametrize("kernels", ["c", "torch"])
def test_an_engine_with_dtype_bfloat16_decodes_as_float32_does_on_the_rounded_weights(
        kernels):
    """Greedy tokens equal, log-probabilities within float rounding (the prefill's
    matmuls add in another order), through the C kernels and through torch's ops."""
    if kernels == "c" and not native.resolve("auto"):
        pytest.skip("no C compiler here")
    outputs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM("tiny", random_init=True, kv_budget="8MiB", max_num_seqs=3,
                  cpu_kernels=kernels, dtype=dtype)
        if dtype == "float32":
            rounded(llm.model)
        assert llm.memory_report()["backend"]["matrices"] == dtype
        outputs[dtype] = llm.generate(PROMPTS, GREEDY)
    for w, g in zip(outputs["float32"], outputs["bfloat16"], strict=True):
        assert w.token_ids == g.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(w.logprobs, g.logprobs,
                                                               strict=True)) < 2e-2


def test_a_saved_bf16_model_loads_bf16_with_dtype_auto_and_float32_when_asked(tmp_path):
    """A narrowed model saves its matrices as bf16; the default `auto` holds them so
    again, `float32` widens them exactly; a float32 checkpoint stays float32 under auto."""
    wide, narrow = pair(preset("tiny"))
    narrow.save_pretrained(tmp_path / "bf16")
    wide.save_pretrained(tmp_path / "f32")
    for path in (tmp_path / "bf16", tmp_path / "f32"):
        (path / "tokenizer.json").write_text(byte_level_tokenizer_json())
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        stored = {name: f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
    assert all(stored[name] == "BF16" for name in wide.matrix_names())
    assert stored["layers.0.attn_norm.weight"] == "F32"
    ids = [[3, 1, 4, 1, 5, 9, 2, 6] * 4]
    tokens = {}
    for source, dtype, want in (("bf16", "auto", "bfloat16"), ("bf16", "float32", "float32"),
                                ("f32", "auto", "float32"), ("f32", "bfloat16", "bfloat16")):
        llm = LLM(str(tmp_path / source), kv_budget="8MiB", max_num_seqs=1, dtype=dtype)
        assert llm.memory_report()["backend"]["matrices"] == want
        assert str(llm.model.matrix_dtype) == f"torch.{want}"
        tokens[source, dtype] = llm.generate(ids, GREEDY)[0].token_ids
    assert len(set(map(tuple, tokens.values()))) == 1


def test_a_bad_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16"):
        EngineConfig(dtype="float16")
    with pytest.raises(ValueError, match="dtype='bfloat16' runs in one process"):
        EngineConfig(dtype="bfloat16", tensor_parallel_size=2)
