"""Checkpoints: kvstack's own layout and DeepSeek's published V4.1 layout.

kvstack's layout: `config.json` (ModelConfig keys), `model.safetensors` (the tensors of
`parameter_shapes`: float weights, Engram tables packed), `tokenizer.json`.

DeepSeek's V4.1 layout, as published and as `export_v41` writes it: `config.json` in the
inference form (DeepSeek's ModelArgs keys plus `dtype` "fp8" / `expert_dtype` "fp4") or
the HF form (`text_config` + `quantization_config`); `model.safetensors.index.json`
naming the shard of every tensor (or one `model.safetensors`); `tokenizer.json`. Dense
projections are FP8 E4M3 with a UE8M0 `.scale` per 32x32 block, routed experts E2M1
packed two per byte (I8) with a UE8M0 `.scale` per row per 32, Engram tables FP8 with a
UE8M0 scale per row per 32, everything else bf16 or float32. `V41_NAMES` is the one table
from those names to kvstack's modules.

Loading builds the model on the meta device and assigns each tensor as safetensors maps
it from the shard: FP8/FP4 weights stay packed (`kvstack.model.packed`) and stay backed by
the mapped file (pages the OS can drop and read again, not copies), so resident memory is
about the checkpoint's size. The bf16 matrices the model multiplies (the compressors',
the indexers' head weights, the routers') stay bf16, widened in registers by the kernels;
the norms, Engram's small query and key weights and the vision tower's weights are
widened to float32.
"""

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from kvstack.config import LayerSpec, Mode, ModelConfig
from kvstack.formats import quantize
from kvstack.formats.weights import EXPERT_FORMAT, fp8_block_scale_shape, quantize_fp8_blocks
from kvstack.model.engram import build_token_map
from kvstack.model.model import Model
from kvstack.model.packed import Experts, PackedExpert, PackedExperts, PackedLinear
from kvstack.model.params import (
    draft_parameter_shapes,
    engram_columns,
    parameter_shapes,
    vision_parameter_shapes,
)

log = logging.getLogger("kvstack")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHARD_BYTES = 4 << 30  # export: bytes per shard, as DeepSeek's and HF's shards run
_DIGEST_CHUNK = 1 << 24

# safetensors dtype names of what the published checkpoint stores, and their torch dtypes.
_F8, _E8M0, _I8, _BF16, _F32 = "F8_E4M3", "F8_E8M0", "I8", "BF16", "F32"
STORED_DTYPES = {_F8: torch.float8_e4m3fn, _E8M0: torch.float8_e8m0fnu, _I8: torch.int8,
                 _BF16: torch.bfloat16, _F32: torch.float32}
_FLOAT_DTYPES = frozenset({_BF16, _F32, "F16"})
# Kinds kept bf16 where stored so (any float dtype loads, as "float" kinds do).
BF16_KINDS = ("bf16_linear", "bf16_matrix")

# Tensors of the published checkpoint a model built without its vision tower
# (vision_n_layers 0) leaves out, by prefix, with why.
_NO_VISION = " (this model is built without a vision tower: vision_n_layers 0)"
SKIPPED_PREFIXES = {
    "vision.": "vision tower" + _NO_VISION,
    "aligner.": "vision aligner" + _NO_VISION,
    "image_": "image segment embeddings" + _NO_VISION,
}
SKIPPED_SUFFIXES = {".ffn.gate.bias_vl": "routing bias of image tokens" + _NO_VISION}

# DeepSeek's ModelArgs keys that kvstack's config holds under the same name: what an
# exported config.json carries (with dtype / expert_dtype).
_INFERENCE_KEYS = (
    "vocab_size", "dim", "moe_inter_dim", "n_layers", "n_mtp_layers", "n_heads",
    "n_routed_experts", "n_shared_experts", "n_activated_experts", "score_func", "gate_temp",
    "norm_topk_prob", "route_scale", "swiglu_limit", "q_lora_rank", "head_dim",
    "rope_head_dim", "norm_eps", "o_groups", "o_lora_rank", "window_size", "compress_ratios",
    "kv_source_layers", "index_source_layers", "compress_rope_theta", "original_seq_len",
    "rope_theta", "rope_factor", "beta_fast", "beta_slow", "index_n_heads", "index_head_dim",
    "index_topk", "candidate_source_layer", "candidate_topk_blocks", "candidate_block_size",
    "hc_mult", "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids", "engram_vocab_size",
    "engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim",
    "engram_pad_id", "engram_compressed_vocab_size", "max_seq_len", "dspark_block_size",
    "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_n_activated_experts", "vision_n_layers", "vision_dim",
    "vision_n_heads", "vision_inter_dim", "vision_patch_size", "vision_rope_theta",
    "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels",
    "vision_max_wh_ratio", "image_token_id",
)
DRAFT_PREFIX = "mtp."  # DSpark's stages in the published layout
_NO_DRAFT = "DSpark draft stages (this model is built without its draft: {})"


# ---- the name table -------------------------------------------------------------------


@dataclass(frozen=True)
class V41Tensor:
    """One tensor of the published layout and where it goes in kvstack's model."""

    target: str  # a tensor name, or for linear / expert kinds a module path
    kind: str  # "float" | "embed" | "head" | "bf16_linear" | "bf16_matrix" | "linear" |
    #            "linear_scale" | "expert" | "expert_scale" | "table" | "table_scale"
    shape: tuple[int, ...]  # as stored (FP4: in/2 bytes)
    dtype: str  # safetensors dtype name
    expert: int = -1  # expert kinds: which expert
    proj: str = ""  # expert kinds: w1 | w2 | w3
    # linear: whether DeepSeek's code runs it as an FP8 GEMM (it makes wo_a bf16 first)
    quantized_matmul: bool = True


def v41_names(c: ModelConfig) -> dict[str, V41Tensor]:
    """Every tensor of the published V4.1 layout of config c, by its published name."""
    if c.arch != "v41" or not c.uses_moe or not c.single_pass_hc:
        raise ValueError("DeepSeek's V4.1 layout holds V4.1's trunk only: MoE feed-forward "
                         "layers and single-pass hyper-connections (hc_mult > 1); this "
                         "model has " + ("a dense FFN" if not c.uses_moe else
                                         "no single-pass hyper-connections"
                                         if c.arch == "v41" else "the dense control"))
    names: dict[str, V41Tensor] = {}

    def add(name: str, target: str, kind: str, shape: tuple[int, ...], dtype: str,
            **extra: Any) -> None:
        names[name] = V41Tensor(target, kind, shape, dtype, **extra)

    def fp8(name: str, target: str, out_f: int, in_f: int, matmul: bool = True) -> None:
        add(name + ".weight", target, "linear", (out_f, in_f), _F8, quantized_matmul=matmul)
        add(name + ".scale", target, "linear_scale", fp8_block_scale_shape(out_f, in_f), _E8M0)

    def bf16(name: str, target: str, *shape: int) -> None:
        add(name, target, "float", shape, _BF16)

    def f32(name: str, target: str, *shape: int) -> None:
        add(name, target, "float", shape, _F32)

    # bf16 matrices a projection multiplies (the compressor's, the indexer's head weights):
    # kept bf16 and widened to float32 in registers by the kernels, so the products are
    # those of the widened weights, with no float32 copy held.
    def bf16_linear(name: str, target: str, out_f: int, in_f: int) -> None:
        add(name, target, "bf16_linear", (out_f, in_f), _BF16)

    d, h = c.dim, c.hc_mult
    add("embed.weight", "embed.weight", "embed", (c.vocab_size, d), _BF16)

    def layer(c: ModelConfig, spec: LayerSpec, p: str, t: str) -> None:
        """Layer `spec` of config c, published under p, kvstack's module path t."""
        a, ta = p + "attn.", t + "attn."
        bf16(p + "attn_norm.weight", t + "attn_norm.weight", d)
        bf16(p + "ffn_norm.weight", t + "ffn_norm.weight", d)
        for site in ("attn", "ffn"):
            f32(p + f"hc_{site}_fn", t + f"hc_{site}.fn", (2 + h) * h, h * d)
            f32(p + f"hc_{site}_base", t + f"hc_{site}.base", (2 + h) * h)
            f32(p + f"hc_{site}_scale", t + f"hc_{site}.scale", 3)
        f32(a + "attn_sink", ta + "sink", c.n_heads)
        fp8(a + "wq_a", ta + "wq_a", c.q_lora_rank, d)
        bf16(a + "q_norm.weight", ta + "q_norm.weight", c.q_lora_rank)
        fp8(a + "wq_b", ta + "wq_b", c.n_heads * c.head_dim, c.q_lora_rank)
        fp8(a + "wkv", ta + "wkv", c.head_dim, d)
        bf16(a + "kv_norm.weight", ta + "kv_norm.weight", c.head_dim)
        fp8(a + "wo_a", ta + "wo_a", c.o_groups * c.o_lora_rank,
            c.n_heads * c.head_dim // c.o_groups, matmul=False)
        fp8(a + "wo_b", ta + "wo_b", d, c.o_groups * c.o_lora_rank)
        if spec.mode is Mode.FULL:
            k, tk = a + "compressor.", ta + "compressor."
            bf16_linear(k + "wkv.weight", tk + "wkv", c.head_dim, d)
            if spec.ratio > 1:
                bf16_linear(k + "wgate.weight", tk + "wgate", c.head_dim, d)
            bf16(k + "norm.weight", tk + "norm.weight", c.head_dim)
            # V4.1 keeps the index-key projection on the indexer of the layer that owns it.
            bf16_linear(a + "indexer.wk.weight", tk + "wk_index", c.index_head_dim,
                        c.head_dim)
            bf16(a + "indexer.k_norm.weight", tk + "index_norm.weight", c.index_head_dim)
        if spec.mode in (Mode.FULL, Mode.REINDEX):
            fp8(a + "indexer.wq_b", ta + "indexer.wq", c.index_n_heads * c.index_head_dim,
                c.q_lora_rank)
            bf16_linear(a + "indexer.weights_proj.weight", ta + "indexer.wweights",
                        c.index_n_heads, d)
        if spec.index in c.engram_layer_ids:
            e, te = p + "engram.", t + "engram."
            rows = c.engram_num_embeddings[c.engram_layer_ids.index(spec.index)]
            add(e + "embed.weight", te + "table_codes", "table", (rows, c.engram_head_dim), _F8)
            add(e + "embed.scale", te + "table_scales", "table_scale",
                (rows, c.engram_head_dim // 32), _E8M0)
            fp8(e + "wkv", te + "wkv", (h + 1) * d, engram_columns(c) * c.engram_head_dim)
            bf16(e + "q_weight", te + "q_weight", h, d)
            bf16(e + "k_weight", te + "k_weight", h, d)
        f, tf = p + "ffn.", t + "ffn."
        # The router's weight stays bf16 too (`Gate` multiplies it as stored).
        add(f + "gate.weight", tf + "gate.weight", "bf16_matrix", (c.n_routed_experts, d), _BF16)
        f32(f + "gate.bias", tf + "gate.bias", c.n_routed_experts)
        if c.has_vision:
            f32(f + "gate.bias_vl", tf + "gate.bias_vl", c.n_routed_experts)
        for e in range(c.n_routed_experts):
            for proj, out_f, in_f in _expert_projections(c):
                name = f"{f}experts.{e}.{proj}"
                add(name + ".weight", tf + "experts", "expert", (out_f, in_f // 2), _I8,
                    expert=e, proj=proj)
                add(name + ".scale", tf + "experts", "expert_scale", (out_f, in_f // 32),
                    _E8M0, expert=e, proj=proj)
        for proj, out_f, in_f in _expert_projections(c):
            fp8(f"{f}shared_experts.{proj}", f"{tf}shared.{proj}", out_f, in_f)

    for spec in c.layers:
        layer(c, spec, f"layers.{spec.index}.", f"layers.{spec.index}.")
    bf16("norm.weight", "norm.weight", d)
    add("head.weight", "head", "head", (c.vocab_size, d), _BF16)
    if c.has_draft:
        routed, active = c.draft_experts
        stage = c.replace(n_routed_experts=routed, n_activated_experts=active)
        for s, spec in enumerate(c.draft_layers):
            layer(stage, spec, f"{DRAFT_PREFIX}{s}.", f"draft.stages.{s}.")
        fp8("mtp.0.main_proj", "draft.main_proj", d, len(c.dspark_target_layer_ids) * d)
        bf16("mtp.0.main_norm.weight", "draft.main_norm.weight", d)
        last, r = f"{DRAFT_PREFIX}{c.n_mtp_layers - 1}.", c.dspark_markov_rank
        bf16(last + "norm.weight", "draft.norm.weight", d)
        add(last + "markov_head.embed.weight", "draft.markov_embed.weight", "embed",
            (c.vocab_size, r), _BF16)
        add(last + "markov_head.head.weight", "draft.markov_head", "head", (c.vocab_size, r),
            _BF16)
        bf16(last + "confidence_head.proj.weight", "draft.confidence.weight", 1, d + r)
    # The vision tower keeps DeepSeek's module names: bf16 weights, float32 norms (its
    # code builds them float32; any float dtype loads).
    for name, shape in vision_parameter_shapes(c).items():
        (f32 if name.endswith(("norm1.weight", "norm2.weight", "vision.norm.weight"))
         else bf16)(name, name, *shape)
    return names


def _expert_projections(c: ModelConfig) -> tuple[tuple[str, int, int], ...]:
    i, d = c.moe_inter_dim, c.dim
    return ("w1", i, d), ("w2", d, i), ("w3", i, d)


def skip_reason(name: str, config: ModelConfig) -> str | None:
    """Why a published tensor is not loaded, or None if kvstack builds it."""
    if config.has_vision:
        return None
    for prefix, why in SKIPPED_PREFIXES.items():
        if name.startswith(prefix):
            return why
    for suffix, why in SKIPPED_SUFFIXES.items():
        if name.endswith(suffix):
            return why
    return None


# ---- reading ----------------------------------------------------------------------------


@dataclass
class CheckpointReport:
    """What a load read and what it left out."""

    directory: Path
    layout: str  # "kvstack" | "v41"
    files: list[str]
    bytes: int  # size of the weight files
    skipped: dict[str, str] = field(default_factory=dict)  # tensor -> why


def is_v41_checkpoint(directory: Path) -> bool:
    """DeepSeek's published layout (by its config or its shard index), not kvstack's."""
    if (directory / INDEX_FILE).exists():
        return True
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False  # the kvstack loader names the problem
    return isinstance(raw, dict) and any(k in raw for k in ("quantization_config", "dtype",
                                                            "expert_dtype"))


def load_pretrained(directory: Path, device: torch.device, numerics: str) -> Model:
    model = _load_v41(directory) if is_v41_checkpoint(directory) else _load_kvstack(directory)
    model.set_numerics(numerics)
    return model.to(device)


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"config {path}: cannot read ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"config {path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"config {path}: expected a JSON object")
    return raw


def _token_map(directory: Path, config: ModelConfig) -> torch.Tensor | None:
    """Engram's normalised token map, from the model's tokenizer.json."""
    # A compressed vocabulary as large as the vocabulary merges no tokens: the map is the
    # identity whatever the tokenizer (numbered first-seen, ids keep their order).
    if not config.engram_layer_ids or config.engram_compressed_vocab_size == config.vocab_size:
        return None
    path = directory / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"model {directory}: Engram hashes the normalised token map of "
                         f"tokenizer.json, which is missing")
    from tokenizers import Tokenizer

    token_map, size = build_token_map(Tokenizer.from_file(str(path)))
    if size != config.engram_compressed_vocab_size:
        raise ValueError(f"model {directory}: tokenizer.json normalises to {size} ids, the "
                         f"config's engram_compressed_vocab_size is "
                         f"{config.engram_compressed_vocab_size} (every Engram hash depends on "
                         "it: this is not the model's tokenizer)")
    return token_map


def _file_digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while chunk := f.read(_DIGEST_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _load_kvstack(directory: Path) -> Model:
    config = ModelConfig.from_json(directory / "config.json")
    weights = directory / SINGLE_FILE
    try:
        state = load_file(str(weights))
    except (OSError, SafetensorError) as e:
        raise ValueError(f"checkpoint {weights}: cannot load ({e})") from e
    expected = (parameter_shapes(config) | draft_parameter_shapes(config)
                | vision_parameter_shapes(config))
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        hint = ""
        if any(n.startswith("hc_head_") for n in unexpected) and config.single_pass_hc:
            hint = ('; its hc_head_* tensors are those of per-site hyper-connections: add '
                    '"hc_residual": "per_site" to its config.json')
        raise ValueError(f"checkpoint {weights} does not match {directory / 'config.json'}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}{hint}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"checkpoint {weights}: {name} has shape "
                             f"{list(state[name].shape)}, the config needs {list(shape)}")
    token_map = _token_map(directory, config)
    with torch.device("meta"):
        model = Model(config, token_map)
    if all(state[name].dtype is torch.bfloat16 for name in model.matrix_names()):
        model.stored_matrix_dtype = torch.bfloat16
    model.load_state_dict(widened(state), assign=True)
    _check_materialised(model, weights)
    model.checkpoint_digest = _file_digest([directory / "config.json", weights])
    model.checkpoint_report = CheckpointReport(directory, "kvstack", [SINGLE_FILE],
                                               weights.stat().st_size)
    return model


def widened(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A kvstack checkpoint's tensors as a model is built to hold them: bf16 and f16 ones
    widened to float32 (exactly); an engine's `dtype` narrows the matrices again."""
    return {name: t.float() if t.dtype in (torch.bfloat16, torch.float16) else t
            for name, t in state.items()}


def _check_materialised(model: Model, source: Path) -> None:
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise ValueError(f"checkpoint {source}: nothing was loaded into {name}")


def _check_v41_config(raw: dict[str, Any], path: Path) -> None:
    """Refuse what is not DeepSeek-V4.1 or not stored as kvstack reads it."""
    text = raw.get("text_config", raw)
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in ("deepseek_v41", "deepseek_v41_text"):
        raise ValueError(f"config {path}: model_type {model_type!r} is not DeepSeek-V4.1 "
                         "(deepseek_v41); kvstack runs V4.1 checkpoints only")
    if not isinstance(text, dict) or not any(
            k in text for k in ("kv_source_layers", "kv_source_layer_ids")):
        raise ValueError(f"config {path}: not a DeepSeek-V4.1 config (it names no kv source "
                         "layers, which every V4.1 config does; DeepSeek-V3 and V4 "
                         "checkpoints are other architectures)")
    if "quantization_config" in raw:
        q = raw["quantization_config"] or {}
        wanted = {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                  "expert_dtype": "fp4"}
        wrong = {k: q.get(k) for k, v in wanted.items() if q.get(k) != v}
        if wrong:
            raise ValueError(f"config {path}: quantization_config has {wrong}; kvstack reads "
                             f"the published V4.1 storage {wanted}")
    else:
        for key, value in (("dtype", "fp8"), ("expert_dtype", "fp4")):
            if raw.get(key, value) != value:
                raise ValueError(f"config {path}: {key} is {raw[key]!r}; kvstack reads the "
                                 f"published V4.1 storage ({key} {value!r})")


def _shards(directory: Path) -> dict[str, list[str]]:
    """Shard file -> the tensors the index places in it (one file: its own names)."""
    index = directory / INDEX_FILE
    if not index.exists():
        if not (directory / SINGLE_FILE).exists():
            raise ValueError(f"checkpoint {directory}: neither {INDEX_FILE} nor {SINGLE_FILE}")
        return {SINGLE_FILE: []}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint index {index}: unreadable ({e})") from e
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(file, []).append(name)
    for file, held in files.items():
        if Path(file).name != file:
            raise ValueError(f"checkpoint index {index}: shard {file!r} is not a file name")
        if not (directory / file).exists():
            raise ValueError(f"checkpoint {directory}: shard {file} is missing (the index "
                             f"places {len(held)} tensors in it, e.g. {held[0]})")
    return files


class _Assembler:
    """Puts tensors read from the shards into a model built on the meta device."""

    def __init__(self, model: Model, names: dict[str, V41Tensor],
                 experts: range | None = None) -> None:
        """experts: the routed experts this model holds (a rank's, by expert
        parallelism); None: all of them."""
        self.model, self.names = model, names
        self.held_experts = experts or range(model.config.n_routed_experts)
        self.linears: dict[str, dict[str, Any]] = {}
        self.experts: dict[str, dict[tuple[str, int, str], torch.Tensor]] = {}
        self.seen: set[str] = set()

    def put(self, name: str, entry: V41Tensor, t: torch.Tensor) -> None:
        self.seen.add(name)
        kind = entry.kind
        # bf16 kinds stored in another float dtype are widened to float32, as "float" is.
        if kind == "float" or (kind in BF16_KINDS and t.dtype is not torch.bfloat16):
            target = entry.target + ".weight" if kind == "bf16_linear" else entry.target
            _set_tensor(self.model, target, t.float())
        elif kind in ("embed", "bf16_matrix"):
            _set_tensor(self.model, entry.target, t)
        elif kind in ("head", "bf16_linear"):
            _set_module(self.model, entry.target, PackedLinear("bf16", t))
        elif kind in ("table", "table_scale"):
            _set_tensor(self.model, entry.target, t.view(torch.uint8))
        elif kind in ("linear", "linear_scale"):
            parts = self.linears.setdefault(entry.target, {})
            parts[kind] = t.view(torch.uint8)
            if kind == "linear":
                parts["matmul"] = entry.quantized_matmul
            if len(parts) == 3:
                _set_module(self.model, entry.target,
                            PackedLinear("fp8", parts["linear"], parts["linear_scale"],
                                         parts["matmul"]))
                del self.linears[entry.target]
        else:  # expert, expert_scale: one of a layer's experts' six tensors
            held = (range(self.model.config.draft_experts[0])
                    if entry.target.startswith("draft.") else self.held_experts)
            parts = self.experts.setdefault(entry.target, {})
            parts[kind, entry.expert, entry.proj] = t.view(torch.uint8)
            if len(parts) == 2 * 3 * len(held):
                _set_module(self.model, entry.target, PackedExperts([PackedExpert(
                    {p: parts["expert", e, p] for p in PackedExpert.NAMES},
                    {p: parts["expert_scale", e, p] for p in PackedExpert.NAMES})
                    for e in held]))
                del self.experts[entry.target]


def _set_tensor(model: nn.Module, name: str, t: torch.Tensor) -> None:
    path, _, leaf = name.rpartition(".")
    module = model.get_submodule(path)
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(t, requires_grad=old.requires_grad
                                                and t.is_floating_point())
    else:
        module._buffers[leaf] = t


def _set_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


class V41Cut(Protocol):
    """Which part of each published tensor one rank reads (`kvstack.parallel`)."""

    experts: range  # the routed experts the rank holds

    def index(self, entry: V41Tensor) -> tuple[slice, ...] | None:
        """The rank's slice of the tensor as stored; None: all of it."""

    def finish(self, entry: V41Tensor, piece: torch.Tensor) -> torch.Tensor:
        """The slice as the rank keeps it (vocabulary rows padded to one length)."""


def _load_v41(directory: Path, cut: V41Cut | None = None) -> Model:
    """DeepSeek's layout, onto the meta device from the mapped shards; with `cut`, only
    one rank's slices of the tensors are read (and its experts' tensors only)."""
    raw = _read_config(directory)
    _check_v41_config(raw, directory / "config.json")
    config = ModelConfig.from_json(directory / "config.json")
    names = v41_names(config)
    shards = _shards(directory)
    token_map = _token_map(directory, config)
    with torch.device("meta"):
        model = Model(config, token_map)
    no_draft = _NO_DRAFT.format("dspark_block_size 0" if not config.has_draft else
                                "it is sharded")
    if cut is not None and model.draft is not None:  # the draft runs unsharded
        model.draft = None
        names = {n: e for n, e in names.items() if not n.startswith(DRAFT_PREFIX)}
    assembler = _Assembler(model, names, cut.experts if cut is not None else None)
    indexed = {name: file for file, held in shards.items() for name in held}
    skipped: dict[str, str] = {}
    where: dict[str, str] = {}
    for file in shards:
        path = directory / file
        for name, read in _tensors(path):
            if indexed and indexed.get(name) != file:
                raise ValueError(f"checkpoint {directory}: tensor {name} is in {file}, but "
                                 f"{INDEX_FILE} places it in {indexed.get(name, 'no shard')}")
            if name in where:
                raise ValueError(f"checkpoint {directory}: tensor {name} is in both "
                                 f"{where[name]} and {file}")
            where[name] = file
            why = skip_reason(name, config)
            if why is None and model.draft is None and name.startswith(DRAFT_PREFIX):
                why = no_draft
            if why is not None:
                skipped[name] = why
                continue
            entry = names.get(name)
            if entry is None:
                raise ValueError(f"checkpoint {path}: tensor {name} is not part of DeepSeek-"
                                 "V4.1's layout for this config (unknown to kvstack's name "
                                 "table: a foreign checkpoint, or a config that contradicts "
                                 "its tensors)")
            if cut is None:
                assembler.put(name, entry, read(entry))
            elif entry.expert < 0 or entry.expert in cut.experts:
                assembler.put(name, entry, cut.finish(entry, read(entry, cut.index(entry))))
            else:  # another rank's expert: not read
                assembler.seen.add(name)
    missing = sorted(set(names) - assembler.seen)
    if missing:
        shown = ", ".join(f"{n} ({indexed.get(n, 'in no shard')})" for n in missing[:5])
        raise ValueError(f"checkpoint {directory}: {len(missing)} tensors of the V4.1 layout "
                         f"are missing: {shown}")
    _check_materialised(model, directory)
    files = sorted(shards)
    model.checkpoint_digest = _file_digest([directory / "config.json"]
                                           + [directory / f for f in files])
    size = sum((directory / f).stat().st_size for f in files)
    model.checkpoint_report = CheckpointReport(directory, "v41", files, size, skipped)
    _log_skipped(skipped)
    return model


def _tensors(path: Path) -> Iterator[tuple[str, Any]]:
    """(name, read) for each tensor of a shard; read(entry, index) checks the stored dtype
    and shape against the name table before the bytes (of the slice `index`, or all of
    them) are read."""
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
    except (OSError, SafetensorError) as e:
        raise ValueError(f"checkpoint shard {path}: cannot read ({e})") from e

    def reader(name: str) -> Any:
        def read(entry: V41Tensor, index: tuple[slice, ...] | None = None) -> torch.Tensor:
            piece = f.get_slice(name)
            dtype, shape = piece.get_dtype(), tuple(piece.get_shape())
            ok = ((dtype in _FLOAT_DTYPES) if entry.kind in ("float", *BF16_KINDS)
                  else dtype == entry.dtype)
            if not ok:
                raise ValueError(f"checkpoint shard {path}: tensor {name} is {dtype}, the V4.1 "
                                 f"layout stores it as {entry.dtype}")
            if shape != entry.shape:
                raise ValueError(f"checkpoint shard {path}: tensor {name} has shape "
                                 f"{list(shape)}, the config needs {list(entry.shape)}")
            try:
                # A slice reads only its own bytes of the mapped file.
                return f.get_tensor(name) if index is None else piece[index]
            except SafetensorError as e:
                raise ValueError(f"checkpoint shard {path}: tensor {name}: cannot read "
                                 f"({e})") from e
        return read

    with f:
        held = f.keys()  # a safe_open handle is not a dict
        for name in held:
            yield name, reader(name)


def _log_skipped(skipped: dict[str, str]) -> None:
    by_reason: dict[str, list[str]] = {}
    for name, why in skipped.items():
        by_reason.setdefault(why, []).append(name)
    for why, held in by_reason.items():
        log.info("skipped %d tensors, %s: %s%s", len(held), why, ", ".join(held[:3]),
                 ", ..." if len(held) > 3 else "")


# ---- writing ----------------------------------------------------------------------------


def float_state_dict(model: Model) -> dict[str, torch.Tensor]:
    """The model's tensors in kvstack's own layout: FP8/FP4 weights dequantised to float32,
    bf16 ones kept bf16 (a checkpoint's, or a model's `narrow_matrices`; the loader widens
    them exactly), Engram tables, which kvstack stores packed, kept packed."""
    state = {}
    for name, t in model.state_dict().items():
        path, _, leaf = name.rpartition(".")
        module = model.get_submodule(path) if path else model
        if isinstance(module, PackedLinear):
            if leaf == "stored":
                state[path + ".weight"] = t if module.fmt == "bf16" else module.weight
        elif isinstance(module, PackedExpert):
            experts, _, e = path.rpartition(".")
            if e == "0" and leaf.endswith("_codes"):
                proj = leaf.removesuffix("_codes")
                state[f"{experts}.{proj}"] = torch.stack(
                    [expert.weight(proj) for expert in model.get_submodule(experts)])
        else:
            state[name] = t
    return state


def save_kvstack(model: Model, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    model.config.to_json(directory / "config.json")
    tensors = {k: v.detach().contiguous().cpu() for k, v in float_state_dict(model).items()}
    save_file(tensors, str(directory / SINGLE_FILE), metadata={"format": "pt"})


def inference_config(config: ModelConfig) -> dict[str, Any]:
    """config.json in DeepSeek's inference form; refused when it cannot say everything
    the kvstack config says (kvstack-only keys away from what V4.1 implies)."""
    out = {k: list(v) if isinstance(v := getattr(config, k), tuple) else v
           for k in _INFERENCE_KEYS}
    if out["candidate_source_layer"] is None:
        out["candidate_source_layer"] = -1
    out.update(dtype="fp8", expert_dtype="fp4")
    back = ModelConfig.from_dict(out)
    differs = [f for f in config.to_dict() if getattr(back, f) != getattr(config, f)]
    if differs:
        said = ", ".join(f"{k} = {getattr(config, k)!r} (V4.1 implies {getattr(back, k)!r})"
                         for k in differs)
        raise ValueError(f"DeepSeek's V4.1 config.json has no keys for {said}")
    return out


def _stored(model: Model, name: str, entry: V41Tensor) -> torch.Tensor:
    """The published tensor `name` from the model, quantised where the model holds
    floats."""
    kind = entry.kind
    dtype = STORED_DTYPES[entry.dtype]
    if kind in ("float", "embed", "bf16_matrix"):
        return model.get_parameter(entry.target).detach().to(dtype)
    if kind in ("head", "bf16_linear"):
        return model.get_submodule(entry.target).weight.detach().to(dtype)
    if kind in ("table", "table_scale"):
        return model.get_buffer(entry.target).view(dtype)
    module = model.get_submodule(entry.target)
    if kind in ("linear", "linear_scale"):
        if isinstance(module, PackedLinear) and module.fmt == "fp8":
            codes, scales = module.stored, module.scales
        else:
            codes, scales = quantize_fp8_blocks(module.weight)
        return (codes if kind == "linear" else scales).view(dtype)
    if isinstance(module, PackedExperts):
        part = "codes" if kind == "expert" else "scales"
        return getattr(module[entry.expert], f"{entry.proj}_{part}").view(dtype)
    assert isinstance(module, Experts)
    q = quantize(getattr(module, entry.proj)[entry.expert].detach(), EXPERT_FORMAT)
    return (q.codes if kind == "expert" else q.scales).view(dtype)


def _nbytes(entry: V41Tensor) -> int:
    return math.prod(entry.shape) * STORED_DTYPES[entry.dtype].itemsize


def export_v41(model: Model, directory: Path, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write the model in DeepSeek's published V4.1 layout: FP8 dense projections with
    32x32 UE8M0 scales, FP4 experts, names and shards with their index, and config.json
    in the inference form (the tokenizer is the caller's to copy). Weights the model holds
    packed are written as they are; float weights are quantised. Returns the shard
    names."""
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    names = v41_names(model.config)
    config = inference_config(model.config)
    groups: list[list[str]] = [[]]
    size = 0
    for name, entry in names.items():
        if groups[-1] and size + _nbytes(entry) > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += _nbytes(entry)
    directory.mkdir(parents=True, exist_ok=True)
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for file, group in zip(files, groups, strict=True):
        tensors = {name: _stored(model, name, names[name]).contiguous().cpu() for name in group}
        tmp = directory / (file + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, directory / file)
        weight_map.update(dict.fromkeys(group, file))
    total = sum(_nbytes(e) for e in names.values())
    _write_json(directory / INDEX_FILE, {"metadata": {"total_size": total},
                                         "weight_map": weight_map})
    _write_json(directory / "config.json", config)
    return files


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
