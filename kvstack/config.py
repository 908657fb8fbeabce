"""Model configuration of the DeepSeek-V4.1 family, its validation, and the presets.

Keys follow the public V4.1 `inference/config.json` names, plus kvstack's own
`n_encoder_layers` (the CED split) and the storage format of each cache. Layer modes
(window-only / Full / Reindex / Reuse), the stream each layer reads and the top-k it uses
are resolved here, once, into `ModelConfig.layers`; nothing else re-derives them.
"""

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from kvstack.formats import bytes_per_entry, get_format


class Mode(StrEnum):
    WINDOW = "window"  # sliding window only, no compressed stream
    FULL = "full"  # writes a compressed stream and its indexer keys, runs its own indexer
    REINDEX = "reindex"  # reads an earlier stream, runs its own indexer
    REUSE = "reuse"  # reads an earlier stream and reuses an earlier top-k


@dataclass(frozen=True)
class LayerSpec:
    """What one layer is, resolved from the config's layer lists."""

    index: int
    ratio: int  # tokens per compressed entry; 0 = window only
    mode: Mode
    in_encoder: bool
    kv_source: int | None  # layer whose compressed stream (and indexer keys) it reads
    index_source: int | None  # layer whose top-k it attends to (itself for Full/Reindex)
    is_candidate_source: bool  # picks the candidate pool of blocks
    uses_candidates: bool  # restricts its top-k to that pool


# Keys of the published V4.1 config.json that are the checkpoint's weight dtypes, which
# the loader reads. A real config.json loads; these are set aside.
_UNBUILT_V41_KEYS = frozenset({"dtype", "expert_dtype"})
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
# How the hyper-connection residual collapses its copies (hc_mult > 1):
# "single_pass" (DeepSeek's V4.1 code: the `pre` mix a sub-layer computes collapses the
# next sub-layer's input, the head collapses with the last one, no head parameters) or
# "per_site" (each sub-layer collapses with its own `pre`, the head with its own
# hc_head_* parameters: kvstack models trained before single-pass existed).
HC_RESIDUALS = ("single_pass", "per_site")
# How a model computes (a runtime choice, not part of the config). "default": float32
# activations into every projection, RoPE angles in float64 (a position rotates alike in
# any chunk). "reference": as DeepSeek's V4.1 code, activations rounded to FP8 (UE8M0 per
# 32) before each FP8/FP4 weight and RoPE angles in float32: for parity checks.
NUMERICS = ("default", "reference")
# How window state is rebuilt by replay (design.md section 2): "bounded" re-runs the last
# window tokens (approximate), "exact" enough for the reference forward's result.
REPLAY_MODES = ("bounded", "exact")
# Who computes a decode step's attention (EngineConfig.attention): the Triton kernel over
# the packed rows, torch over the rows it reads, or the first that can run (auto).
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# Who runs a CPU step's packed-row reads, index scoring, expert matmuls and packed-weight
# matmuls (EngineConfig.cpu_kernels, kvstack.native): C kernels built on first use ("c":
# or fail), torch's ops, or C where a compiler builds them (auto).
CPU_KERNELS = ("auto", "c", "torch")
# What an engine holds the weight matrices in (EngineConfig.dtype, Model.narrow_matrices):
# as the checkpoint stores them (auto: bf16 where it stores them all so, else float32;
# random weights float32), float32, or bf16 (narrowed at load, as vLLM's --dtype
# bfloat16). A V4.1 checkpoint's FP8/FP4 weights stay packed under any of them.
DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # One ratio per layer, then one per draft (MTP) layer; 0 = window-only layer.
    compress_ratios: tuple[int, ...] = ()
    kv_source_layers: tuple[int, ...] = ()
    index_source_layers: tuple[int, ...] = ()
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int | None = None  # None (or < 0, as V4.1 writes it) = no pool
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # FFN: MoE when n_routed_experts > 0, else a dense SwiGLU of width inter_dim.
    n_routed_experts: int = 0
    n_shared_experts: int = 1
    n_activated_experts: int = 0
    moe_inter_dim: int = 0
    inter_dim: int = 0
    score_func: str = "softmax"
    gate_temp: float = 1.0  # router logits are divided by it before score_func
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights (when k > 1)
    route_scale: float = 1.0
    swiglu_limit: float = 0.0  # 0 = no clamp
    norm_eps: float = 1e-6
    hc_mult: int = 1  # > 1 turns on hyper-connections
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    hc_residual: str = "single_pass"  # one of HC_RESIDUALS
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 1.0  # YaRN on the compressed layers' rotations when > 1
    original_seq_len: int = 0
    beta_fast: int = 32
    beta_slow: int = 1
    n_mtp_layers: int = 0  # draft layers (DSpark stages), after the trunk's layers
    # DSpark, the draft model (`kvstack.model.dspark`), built when n_mtp_layers > 0 and
    # dspark_block_size > 0 (as DeepSeek's code builds it). A draft block is the last
    # token then dspark_block_size - 1 noise tokens; stage 0 projects the attention inputs
    # of the target layers (mean of the residual copies), the last stage's head and a
    # low-rank Markov head (the previous token's bias on the logits) propose the tokens.
    # The stages' MoE has its own expert counts (0 = the trunk's).
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0
    # Engram (n-gram hash memory added to the residual before these layers); () = none.
    # Each position hashes its 2..engram_max_ngram_size-grams of a normalised token map
    # (engram_compressed_vocab_size ids) with engram_n_heads heads each, into the layer's
    # table of engram_num_embeddings rows of engram_head_dim (FP8, UE8M0 per 32).
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 0  # each (n-gram size, head) bucket is the next prime above it
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2  # token filling n-gram slots before the sequence starts
    engram_compressed_vocab_size: int = 0
    # The vision tower (`kvstack.model.vision`), built when vision_n_layers > 0: a ViT over
    # patch_size pixel patches with 2-D RoPE, an aligner that merges downsample_ratio^2
    # patches into one token, and the processor's limits (at most vision_max_n_token
    # positions an image; smaller images are scaled up to vision_min_pixels; a width over
    # vision_max_wh_ratio times the height is squeezed). Every position of an image segment
    # carries image_token_id.
    vision_n_layers: int = 0
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 544 * 544
    vision_max_wh_ratio: int | None = None
    image_token_id: int = 129264
    # kvstack's own keys.
    # CED split: layers [0, n_encoder_layers) are the encoder; 0 = plain decoder-only.
    # None (the published config.json has no key for it) takes the split the layout
    # implies: the last kv source, when it has ratio 1, starts the decoder.
    n_encoder_layers: int | None = None
    kv_format: str = "fp4_e4m3_16"
    index_format: str = "fp4_ue8m0_32"
    window_format: str = "fp8_ue8m0_32"
    # Indexer queries are rounded to this format after RoPE before scoring, as V4.1 does;
    # "none" scores them unrounded (kvstack models trained before the rounding existed).
    index_query_format: str = "fp4_ue8m0_32"
    # "v41", or "dense": the control, a plain decoder-only transformer whose every layer
    # keeps its own GQA keys and values (n_kv_heads heads, kv_format) for every token.
    arch: str = "v41"
    n_kv_heads: int = 0
    layers: tuple[LayerSpec, ...] = field(init=False, repr=False, compare=False)
    # DSpark's stages (has_draft), layers n_layers.. of compress_ratios: window-only.
    draft_layers: tuple[LayerSpec, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("compress_ratios", "kv_source_layers", "index_source_layers",
                     "engram_layer_ids", "engram_num_embeddings", "dspark_target_layer_ids"):
            value = getattr(self, name)
            if not isinstance(value, list | tuple) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            ):
                raise ValueError(f"config key {name}: expected a list of integers, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        cand = self.candidate_source_layer
        if isinstance(cand, int) and not isinstance(cand, bool) and cand < 0:
            object.__setattr__(self, "candidate_source_layer", None)
        if self.n_encoder_layers is None:
            object.__setattr__(self, "n_encoder_layers", _implied_encoder_layers(self))
        _validate_scalars(self)
        _validate_engram(self)
        _validate_arch(self)
        _validate_draft(self)
        _validate_vision(self)
        object.__setattr__(self, "layers", _resolve_layers(self))
        object.__setattr__(self, "draft_layers", tuple(
            LayerSpec(self.n_layers + s, 0, Mode.WINDOW, False, None, None, False, False)
            for s in range(self.n_mtp_layers if self.has_draft else 0)))

    # ---- derived facts -------------------------------------------------------------
    @property
    def n_decoder_layers(self) -> int:
        return self.n_layers - self.n_encoder_layers

    @property
    def uses_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def single_pass_hc(self) -> bool:
        """Hyper-connections whose `pre` mix is carried to the next sub-layer."""
        return self.hc_mult > 1 and self.hc_residual == "single_pass"

    @property
    def has_draft(self) -> bool:
        """Whether the model holds DSpark's draft stages."""
        return self.n_mtp_layers > 0 and self.dspark_block_size > 0

    @property
    def has_vision(self) -> bool:
        """Whether the model holds the vision tower (image segments in prompts)."""
        return self.vision_n_layers > 0

    @property
    def draft_experts(self) -> tuple[int, int]:
        """Routed and activated experts of a draft stage's MoE."""
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A validated copy with some keys changed."""
        return dataclasses.replace(self, **changes)

    # ---- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in dataclasses.fields(self)
            if f.init
        }

    def to_json(self, path: str | Path | None = None) -> str:
        """The config as JSON text; written to `path` as well when one is given."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ValueError(f"config: expected a JSON object, got {type(data).__name__}")
        if "text_config" in data or "hidden_size" in data:
            data = _from_hf(data)
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(
            k
            for k in data
            if k not in known
            and k not in _UNBUILT_V41_KEYS
        )
        if unknown:
            raise ValueError(f"config: unknown keys {', '.join(unknown)}")
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.init and f.default is dataclasses.MISSING and f.name not in data
        )
        if missing:
            raise ValueError(f"config: missing required keys {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        """Load a config.json (kvstack's own, or the published V4.1 inference one)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"config {path}: cannot read ({e.strerror})") from e
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"config {path}: not valid JSON ({e})") from e
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"config {path}: {e}") from e


# HF transformers' form of DeepSeek's config.json (DeepseekV41Config: `text_config` beside
# `vision_config` and `quantization_config`) -> kvstack's keys, the one translation table.
# Keys spelled alike (vocab_size, head_dim, q_lora_rank, engram_*, ...) pass through.
_HF_KEYS = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim", "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers", "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "moe_intermediate_size": "moe_inter_dim", "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func", "routed_scaling_factor": "route_scale",
    "rms_norm_eps": "norm_eps", "max_position_embeddings": "max_seq_len",
    "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}
_HF_YARN_KEYS = {"factor": "rope_factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
                 "original_max_position_embeddings": "original_seq_len"}
# What kvstack builds is only this: other values are refused, never ignored.
_HF_FIXED = {"num_key_value_heads": 1, "attention_bias": False, "tie_word_embeddings": False,
             "hidden_act": "silu", "topk_method": "noaux_tc"}
# HF's defaults where they differ from kvstack's: a key the file leaves out means these.
_HF_DEFAULTS = {
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20, "max_position_embeddings": 1048576, "num_nextn_predict_layers": 3,
    "engram_vocab_size": 16000000, "engram_max_ngram_size": 4, "engram_n_heads": 8,
    "engram_head_dim": 256, "engram_compressed_vocab_size": 99092, "dspark_block_size": 5,
    "dspark_noise_token_id": 128799, "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
}
# Training, cache-dispatch and bookkeeping keys that change nothing kvstack computes.
_HF_INERT = frozenset({
    "model_type", "initializer_range", "use_cache", "pad_token_id", "bos_token_id",
    "eos_token_id", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
    "attention_dropout", "layer_types", "rope_parameters", "torch_dtype", "dtype",
    "transformers_version", "architectures",
})


# HF's `vision_config` (DeepseekV41VisionConfig) -> kvstack's keys, and its defaults.
_HF_VISION_KEYS = {
    "num_hidden_layers": "vision_n_layers", "hidden_size": "vision_dim",
    "num_attention_heads": "vision_n_heads", "intermediate_size": "vision_inter_dim",
    "patch_size": "vision_patch_size", "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio", "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels", "max_wh_ratio": "vision_max_wh_ratio",
}
_HF_VISION_DEFAULTS = {"num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16,
                       "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000.0,
                       "downsample_ratio": 3, "max_image_tokens": 1024, "min_pixels": 295936,
                       "max_wh_ratio": None}


def _from_hf(data: dict[str, Any]) -> dict[str, Any]:
    """An HF-form config (outer with `text_config` and `vision_config`, or the text config
    alone) in kvstack's keys. The quantisation settings are the loader's business."""
    outer = data
    text = data.get("text_config", data)
    if not isinstance(text, dict):
        raise ValueError("config key text_config: expected an object")
    if outer is not text and outer.get("tie_word_embeddings", False):
        raise ValueError("config key tie_word_embeddings = true: V4.1's head is its own tensor")
    out: dict[str, Any] = {}
    for key, value in {**_HF_DEFAULTS, **text}.items():
        if key in _HF_INERT:
            continue
        if key in _HF_FIXED:
            if value != _HF_FIXED[key]:
                raise ValueError(f"config key text_config.{key} = {value!r}: kvstack builds "
                                 f"only {_HF_FIXED[key]!r}")
            continue
        if key == "rope_scaling":
            for yarn_key, yarn_value in (value or {}).items():
                if yarn_key in ("rope_type", "type"):
                    if yarn_value not in ("yarn", "default"):
                        raise ValueError(f"config key text_config.rope_scaling.{yarn_key} = "
                                         f"{yarn_value!r}: only yarn is built")
                elif yarn_key in _HF_YARN_KEYS:
                    out[_HF_YARN_KEYS[yarn_key]] = yarn_value
                elif yarn_key != "attention_factor" or yarn_value != 1.0:
                    raise ValueError(f"config key text_config.rope_scaling.{yarn_key}: "
                                     "not built")
            continue
        out[_HF_KEYS.get(key, key)] = value
    ratios, n, mtp = out.get("compress_ratios"), out.get("n_layers"), out.get("n_mtp_layers", 0)
    if isinstance(ratios, list) and isinstance(n, int) and isinstance(mtp, int) and \
            len(ratios) == n and mtp:
        out["compress_ratios"] = ratios + [0] * mtp  # HF lists the draft layers' 0s optionally
    if out.get("candidate_source_layer") is None and out.get("kv_source_layers"):
        out["candidate_source_layer"] = out["kv_source_layers"][-1]  # HF: the last kv source
    kv = out.get("kv_source_layers")
    if out.get("dspark_target_layer_ids") is None and isinstance(n, int) and \
            isinstance(kv, list):  # HF: the last three layers that are not kv sources
        out["dspark_target_layer_ids"] = [i for i in range(n) if i not in kv][-3:]
    vision = outer.get("vision_config") if outer is not text else None
    if vision is None:
        out["vision_n_layers"] = 0
    else:
        if not isinstance(vision, dict):
            raise ValueError("config key vision_config: expected an object")
        for key, value in {**_HF_VISION_DEFAULTS, **vision}.items():
            if key in _HF_VISION_KEYS:
                out[_HF_VISION_KEYS[key]] = value
            elif key not in _HF_INERT:
                raise ValueError(f"config key vision_config.{key}: not built")
        if "image_token_id" in outer:
            out["image_token_id"] = outer["image_token_id"]
    return out


def _implied_encoder_layers(c: ModelConfig) -> int:
    kv = c.kv_source_layers
    ratios = c.compress_ratios
    if kv and 0 <= kv[-1] < len(ratios) and ratios[kv[-1]] == 1:
        return kv[-1]
    return 0


def _validate_scalars(c: ModelConfig) -> None:
    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ValueError(f"config key {key} = {getattr(c, key)!r}: {why}")

    for key in (
        "vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank", "o_groups",
        "o_lora_rank", "window_size", "index_n_heads", "index_head_dim", "index_topk",
        "candidate_topk_blocks", "candidate_block_size", "hc_mult", "max_seq_len",
    ):
        value = getattr(c, key)
        need(isinstance(value, int) and not isinstance(value, bool) and value > 0, key,
             "must be a positive integer")
    for key in ("n_mtp_layers", "n_encoder_layers", "n_routed_experts", "n_shared_experts",
                "n_activated_experts", "moe_inter_dim", "inter_dim", "original_seq_len"):
        value = getattr(c, key)
        need(isinstance(value, int) and not isinstance(value, bool) and value >= 0, key,
             "must be a non-negative integer")
    need(c.head_dim % 32 == 0, "head_dim", "must be a multiple of 32")
    need(c.index_head_dim % 32 == 0, "index_head_dim", "must be a multiple of 32")
    need(c.rope_head_dim % 2 == 0 and 0 < c.rope_head_dim <= min(c.head_dim, c.index_head_dim),
         "rope_head_dim", "must be even, positive and at most head_dim and index_head_dim")
    need(c.n_heads % c.o_groups == 0, "o_groups", f"must divide n_heads ({c.n_heads})")
    need(c.n_encoder_layers < c.n_layers, "n_encoder_layers", "must leave a decoder layer")
    if c.uses_moe:
        need(0 < c.n_activated_experts <= c.n_routed_experts, "n_activated_experts",
             f"must be between 1 and n_routed_experts ({c.n_routed_experts})")
        need(c.moe_inter_dim > 0, "moe_inter_dim", "must be positive with routed experts")
    else:
        need(c.inter_dim > 0, "inter_dim", "must be positive for a dense FFN (no experts)")
    need(c.score_func in SCORE_FUNCS, "score_func", f"must be one of {', '.join(SCORE_FUNCS)}")
    need(isinstance(c.gate_temp, int | float) and c.gate_temp > 0, "gate_temp",
         "must be a positive number")
    need(isinstance(c.norm_topk_prob, bool), "norm_topk_prob", "must be true or false")
    need(c.hc_residual in HC_RESIDUALS, "hc_residual", f"must be one of {', '.join(HC_RESIDUALS)}")
    need(c.rope_factor >= 1, "rope_factor", "must be at least 1")
    need(c.rope_factor == 1 or c.original_seq_len > 0, "original_seq_len",
         "must be positive when rope_factor > 1 (YaRN)")
    formats = [("kv_format", c.head_dim), ("index_format", c.index_head_dim),
               ("window_format", c.head_dim)]
    if c.index_query_format != "none":
        formats.append(("index_query_format", c.index_head_dim))
    for key, width in formats:
        try:
            get_format(getattr(c, key))
            bytes_per_entry(getattr(c, key), width)
        except ValueError as e:
            raise ValueError(f"config key {key}: {e}") from e


def _validate_engram(c: ModelConfig) -> None:
    if not c.engram_layer_ids:
        if c.engram_num_embeddings:
            raise ValueError("config key engram_num_embeddings: given without engram_layer_ids")
        return
    ids = list(c.engram_layer_ids)
    if ids != sorted(set(ids)) or not all(0 <= i < c.n_layers for i in ids):
        raise ValueError(f"config key engram_layer_ids: must be strictly increasing layers in "
                         f"0..{c.n_layers - 1}, got {ids}")
    if len(c.engram_num_embeddings) != len(ids):
        raise ValueError(f"config key engram_num_embeddings: has {len(c.engram_num_embeddings)} "
                         f"entries, engram_layer_ids has {len(ids)}")
    if not all(n > 0 for n in c.engram_num_embeddings):
        raise ValueError("config key engram_num_embeddings: every table needs rows")
    for key in ("engram_vocab_size", "engram_n_heads", "engram_head_dim",
                "engram_compressed_vocab_size"):
        value = getattr(c, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"config key {key} = {value!r}: must be a positive integer "
                             "with Engram layers")
    if c.engram_max_ngram_size < 2:
        raise ValueError(f"config key engram_max_ngram_size = {c.engram_max_ngram_size!r}: "
                         "must be at least 2 (a 2-gram) with Engram layers")
    if c.engram_head_dim % 32:
        raise ValueError(f"config key engram_head_dim = {c.engram_head_dim}: must be a multiple "
                         "of 32 (one UE8M0 scale per 32 values of a table row)")
    if not 0 <= c.engram_pad_id < c.vocab_size:
        raise ValueError(f"config key engram_pad_id = {c.engram_pad_id!r}: must be a token id "
                         f"in 0..{c.vocab_size - 1}")


def _validate_arch(c: ModelConfig) -> None:
    if c.arch == "v41":
        if c.n_kv_heads:
            raise ValueError("config key n_kv_heads: only the dense control (arch dense) has it")
        return
    if c.arch != "dense":
        raise ValueError(f"config key arch = {c.arch!r}: must be v41 or dense")
    if not 0 < c.n_kv_heads <= c.n_heads or c.n_heads % c.n_kv_heads:
        raise ValueError(f"config key n_kv_heads = {c.n_kv_heads}: the dense control needs a "
                         f"positive divisor of n_heads ({c.n_heads})")
    compressed = [i for i, r in enumerate(c.compress_ratios) if r]
    if compressed or c.kv_source_layers or c.index_source_layers or c.n_encoder_layers:
        raise ValueError("config key arch = 'dense': the dense control has no compressed "
                         "layers, kv or index sources, or CED split")


def _validate_draft(c: ModelConfig) -> None:
    for key in ("dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank",
                "dspark_n_routed_experts", "dspark_n_activated_experts"):
        value = getattr(c, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"config key {key} = {value!r}: must be a non-negative integer")
    if not c.has_draft:
        return
    if c.arch != "v41" or (c.hc_mult > 1 and not c.single_pass_hc):
        raise ValueError("config key dspark_block_size: DSpark's draft stages are V4.1 layers "
                         "(window-only attention, single-pass hyper-connections where the "
                         "trunk has several residual copies); this model's are not")
    targets = list(c.dspark_target_layer_ids)
    if not targets or targets != sorted(set(targets)) or \
            not all(0 <= i < c.n_layers for i in targets):
        raise ValueError(f"config key dspark_target_layer_ids: must be strictly increasing "
                         f"layers in 0..{c.n_layers - 1}, got {targets}")
    if not c.dspark_noise_token_id < c.vocab_size:
        raise ValueError(f"config key dspark_noise_token_id = {c.dspark_noise_token_id}: "
                         f"must be a token id in 0..{c.vocab_size - 1}")
    if c.dspark_markov_rank == 0:
        raise ValueError("config key dspark_markov_rank = 0: the Markov head needs a rank")
    routed, active = c.draft_experts
    if active > routed:
        raise ValueError(f"config key dspark_n_activated_experts = {active}: more than the "
                         f"draft stages' {routed} routed experts")


def _validate_vision(c: ModelConfig) -> None:
    for key in ("vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim",
                "vision_patch_size", "vision_downsample_ratio", "vision_max_n_token",
                "vision_min_pixels", "image_token_id"):
        value = getattr(c, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"config key {key} = {value!r}: must be a non-negative integer")
    ratio = c.vision_max_wh_ratio
    if ratio is not None and (not isinstance(ratio, int) or isinstance(ratio, bool)
                              or ratio < 1):
        raise ValueError(f"config key vision_max_wh_ratio = {ratio!r}: must be a positive "
                         "integer or null")
    if not c.has_vision:
        return
    if c.arch != "v41":
        raise ValueError("config key vision_n_layers: the dense control takes text only")
    for key in ("vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
                "vision_downsample_ratio"):
        if getattr(c, key) == 0:
            raise ValueError(f"config key {key} = 0: the vision tower needs it positive")
    if c.vision_dim % c.vision_n_heads or (c.vision_dim // c.vision_n_heads) % 4:
        raise ValueError(f"config key vision_n_heads = {c.vision_n_heads}: the head width "
                         f"vision_dim / vision_n_heads must be a multiple of 4 (its 2-D "
                         f"rotation turns pairs along height and width), got "
                         f"{c.vision_dim} / {c.vision_n_heads}")
    if c.vision_max_n_token < 4:
        raise ValueError(f"config key vision_max_n_token = {c.vision_max_n_token}: an image "
                         "needs at least 4 positions (start, one token, newline, end)")
    if not c.image_token_id < c.vocab_size:
        raise ValueError(f"config key image_token_id = {c.image_token_id}: must be a token "
                         f"id in 0..{c.vocab_size - 1}")


def _resolve_layers(c: ModelConfig) -> tuple[LayerSpec, ...]:
    """Resolve every layer's mode and sources, enforcing design.md section 2's rules."""
    n_total = c.n_layers + c.n_mtp_layers
    if len(c.compress_ratios) != n_total:
        raise ValueError(
            f"config key compress_ratios: has {len(c.compress_ratios)} entries, expected "
            f"n_layers + n_mtp_layers = {n_total}"
        )
    for i, r in enumerate(c.compress_ratios):
        if r < 0:
            raise ValueError(f"config key compress_ratios: layer {i} has negative ratio {r}")
        if i >= c.n_layers and r != 0:
            raise ValueError(
                f"config key compress_ratios: draft layer {i} has ratio {r}; draft layers "
                "are window-only"
            )
    ratios = c.compress_ratios[: c.n_layers]

    for key in ("kv_source_layers", "index_source_layers"):
        listed = getattr(c, key)
        if list(listed) != sorted(set(listed)):
            raise ValueError(f"config key {key}: must be strictly increasing, got {list(listed)}")
        for i in listed:
            if not 0 <= i < c.n_layers:
                raise ValueError(f"config key {key}: layer {i} is out of range 0..{c.n_layers - 1}")
            if ratios[i] == 0:
                raise ValueError(
                    f"config key {key}: layer {i} has compress ratio 0 (window-only) and "
                    "cannot be a source"
                )
    kv_sources, index_sources = set(c.kv_source_layers), set(c.index_source_layers)
    for i in c.kv_source_layers:
        if i not in index_sources:
            raise ValueError(
                f"config key index_source_layers: layer {i} is a kv source, so it must also "
                "be an index source (a Full layer indexes the stream it writes)"
            )

    cand = c.candidate_source_layer
    if cand is not None and cand not in index_sources:
        raise ValueError(
            f"config key candidate_source_layer: layer {cand} is not in index_source_layers"
        )

    enc = c.n_encoder_layers
    if enc > 0:
        if enc not in kv_sources or ratios[enc] != 1:
            raise ValueError(
                f"config key kv_source_layers: with CED (n_encoder_layers={enc}) the first "
                f"decoder layer {enc} must be a kv source of ratio 1"
            )
        extra = sorted(i for i in kv_sources if i > enc)
        if extra:
            raise ValueError(
                f"config key kv_source_layers: decoder layer {extra[0]} is a kv source; with "
                f"CED only the first decoder layer ({enc}) may be one"
            )

    # Every kv source is an index source, so the nearest index source at or before a
    # compressed layer always reads that layer's stream.
    layers = []
    kv_src: int | None = None
    idx_src: int | None = None
    for i, r in enumerate(ratios):
        if i in kv_sources:
            kv_src = i
        if i in index_sources:
            idx_src = i
        if r == 0:
            layers.append(LayerSpec(i, 0, Mode.WINDOW, i < enc, None, None, False, False))
            continue
        if kv_src is None:
            raise ValueError(
                f"config key kv_source_layers: layer {i} (ratio {r}) has no kv source at or "
                "before it"
            )
        if ratios[kv_src] != r:
            raise ValueError(
                f"config key compress_ratios: layer {i} has ratio {r} but reads kv source "
                f"layer {kv_src} of ratio {ratios[kv_src]}"
            )
        if i == kv_src:
            mode = Mode.FULL
        elif i == idx_src:
            mode = Mode.REINDEX
        else:
            mode = Mode.REUSE
        uses_candidates = mode is not Mode.REUSE and cand is not None and i > cand
        if uses_candidates and kv_src != layers[cand].kv_source:
            raise ValueError(
                f"config key candidate_source_layer: index source layer {i} comes after "
                f"candidate source layer {cand} but reads kv source layer {kv_src}, and the "
                f"candidate pool is over layer {layers[cand].kv_source}'s stream"
            )
        layers.append(
            LayerSpec(i, r, mode, i < enc, kv_src, idx_src, i == cand, uses_candidates)
        )
    return tuple(layers)


# ---- presets -------------------------------------------------------------------------

# DeepSeek-V4.1-Flash's public inference/config.json.
_V41_FLASH = dict(
    vocab_size=129280, dim=5120, n_layers=40, n_heads=64, head_dim=512, rope_head_dim=64,
    q_lora_rank=1280, o_groups=8, o_lora_rank=1024, window_size=128,
    compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
    kv_source_layers=[2, 8, 14, 20], index_source_layers=[2, 8, 14, 20, 24, 28, 32, 36],
    index_n_heads=32, index_head_dim=128, index_topk=512,
    candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8,
    n_routed_experts=384, n_shared_experts=1, n_activated_experts=6, moe_inter_dim=2304,
    score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=10.0, norm_eps=1e-20,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, max_seq_len=1048576,
    rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0,
    original_seq_len=65536, beta_fast=32, beta_slow=1, n_mtp_layers=3,
    dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=[37, 38, 39],
    dspark_markov_rank=256, dspark_n_routed_experts=128, dspark_n_activated_experts=3,
    engram_layer_ids=[1, 14], engram_vocab_size=16000000,
    engram_num_embeddings=[384006168, 384016682], engram_max_ngram_size=4, engram_n_heads=8,
    engram_head_dim=256, engram_pad_id=2, engram_compressed_vocab_size=99092,
    vision_n_layers=32, vision_dim=1024, vision_n_heads=16, vision_inter_dim=2816,
    vision_patch_size=14, vision_rope_theta=10000.0, vision_downsample_ratio=3,
    vision_max_n_token=1024, vision_min_pixels=544 * 544, image_token_id=129264,
)

# Every mechanism in 8 layers: window-only (0); ratio-2 Full (1), Reuse (2), Reindex (3)
# in the encoder; the CED stream at 4 (ratio 1, Full, candidate source), Reuse (5),
# Reindex inside the candidate pool (6), Reuse (7) in the decoder. MoE and
# hyper-connections on.
_TINY = dict(
    vocab_size=512, dim=64, n_layers=8, n_heads=4, head_dim=32, rope_head_dim=8,
    q_lora_rank=32, o_groups=2, o_lora_rank=32, window_size=8,
    compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1],
    kv_source_layers=[1, 4], index_source_layers=[1, 3, 4, 6],
    index_n_heads=2, index_head_dim=32, index_topk=4,
    candidate_source_layer=4, candidate_topk_blocks=2, candidate_block_size=2,
    n_routed_experts=4, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=32,
    score_func="sqrtsoftplus", route_scale=1.0, hc_mult=2, max_seq_len=512,
    rope_factor=4.0, original_seq_len=128, n_encoder_layers=4,
)

# The tiny layout with the rest of V4.1's trunk: four residual copies (single-pass
# hyper-connections) and Engram before an encoder layer and the first decoder layer. Its
# Engram hashes token ids as they are (no tokenizer to normalise them), so the compressed
# vocabulary is the vocabulary.
_TINY_V41 = {
    **_TINY,
    **dict(
        hc_mult=4, engram_layer_ids=[1, 4], engram_vocab_size=50,
        engram_num_embeddings=[240, 306], engram_max_ngram_size=3, engram_n_heads=2,
        engram_head_dim=32, engram_pad_id=0, engram_compressed_vocab_size=512,
    ),
}

# tiny-v41 with DSpark's draft: three stages as V4.1 has them (the first projects the
# target layers, the last holds the heads), reading the last three layers, with their own
# expert counts.
_TINY_V41_DSPARK = {
    **_TINY_V41,
    **dict(
        compress_ratios=_TINY["compress_ratios"] + [0] * 3, n_mtp_layers=3,
        dspark_block_size=4, dspark_noise_token_id=511, dspark_target_layer_ids=[5, 6, 7],
        dspark_markov_rank=16, dspark_n_routed_experts=3, dspark_n_activated_experts=2,
    ),
}

# tiny-v41 with a two-layer vision tower: 14-pixel patches merged 3 x 3 as V4.1 does, at
# most 64 positions an image, images scaled up to at least 84 x 84 pixels.
_TINY_V41_VISION = {
    **_TINY_V41,
    **dict(
        vision_n_layers=2, vision_dim=32, vision_n_heads=2, vision_inter_dim=48,
        vision_patch_size=14, vision_downsample_ratio=3, vision_max_n_token=64,
        vision_min_pixels=84 * 84, image_token_id=510,
    ),
}

# V4.1-Flash's exact layer pattern, head_dim, index_head_dim and window (so the cache
# layout is the real one, 890 B/token) on a tiny, dense trunk.
_V41_LAYOUT_SMALL = {
    **_V41_FLASH,
    **dict(
        vocab_size=512, dim=64, n_heads=2, q_lora_rank=32, o_groups=1, o_lora_rank=32,
        index_n_heads=2, n_routed_experts=0, n_activated_experts=0, moe_inter_dim=0,
        inter_dim=128, hc_mult=1, norm_eps=1e-6, max_seq_len=65536, rope_factor=1.0,
        original_seq_len=0, n_mtp_layers=0, compress_ratios=[0, 0] + [2] * 18 + [1] * 20,
        engram_layer_ids=[], engram_num_embeddings=[], vision_n_layers=0,
    ),
}

def dense_control(config: ModelConfig) -> ModelConfig:
    """The dense control of a model: same vocabulary, width, depth, heads and FFN, with
    ordinary per-layer GQA keys and values in bf16 (one KV head per 8 query heads), full
    RoPE, no compression, no CED, no hyper-connections, no Engram, no indexer."""
    return config.replace(
        arch="dense", n_kv_heads=max(1, config.n_heads // 8),
        compress_ratios=[0] * config.n_layers, n_mtp_layers=0,
        kv_source_layers=[], index_source_layers=[], candidate_source_layer=None,
        n_encoder_layers=0, rope_head_dim=config.head_dim, index_head_dim=config.head_dim,
        rope_factor=1.0, original_seq_len=0, hc_mult=1,
        engram_layer_ids=[], engram_num_embeddings=[], index_query_format="none",
        vision_n_layers=0,
        kv_format="bf16", index_format="bf16", window_format="bf16",
    )


# The bundled model's shape: every mechanism of the stack at a size one GPU trains in
# minutes (window-only, ratio-2 Full/Reuse/Reindex in the encoder, the CED stream with a
# candidate pool and Reindex inside it in the decoder, FP4 caches). Two heads of 128, not
# four of 64: the one KV vector is key and value at once, and at 64 wide the model never
# learnt to copy from far back as the dense control does (docs/training-on-a-gpu.md).
_DEFAULT = dict(
    vocab_size=2048, dim=128, n_layers=8, n_heads=2, head_dim=128, rope_head_dim=16,
    q_lora_rank=64, o_groups=2, o_lora_rank=64, window_size=128,
    compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1],
    kv_source_layers=[1, 4], index_source_layers=[1, 3, 4, 6],
    index_n_heads=2, index_head_dim=32, index_topk=32,
    candidate_source_layer=4, candidate_topk_blocks=16, candidate_block_size=8,
    # The bundled model is this preset trained on 512-token windows, then on 2,048-token
    # ones with YaRN over the compressed layers' rotations (its config.json adds
    # rope_factor 16 and original_seq_len 2048: LONG_CONTEXT below); it serves 32K.
    inter_dim=384, max_seq_len=32768, n_encoder_layers=4,
    # The bundled model was trained before V4.1's FP4 indexer queries were modelled; the
    # preset stays what its model card's command trains.
    index_query_format="none",
)

# What the bundled model's long-context stage sets on top of the `default` preset (its
# model card has the commands): YaRN stretches the slow rotations 16-fold, so 32K tokens
# turn them no further than the 2,048 of that stage's windows did.
LONG_CONTEXT = {"rope_factor": 16.0, "original_seq_len": 2048}

_PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "deepseek-v4.1-flash": lambda: ModelConfig.from_dict(_V41_FLASH),
    "tiny": lambda: ModelConfig.from_dict(_TINY),
    "tiny-v41": lambda: ModelConfig.from_dict(_TINY_V41),
    "tiny-v41-dspark": lambda: ModelConfig.from_dict(_TINY_V41_DSPARK),
    "tiny-v41-vision": lambda: ModelConfig.from_dict(_TINY_V41_VISION),
    "v41-layout-small": lambda: ModelConfig.from_dict(_V41_LAYOUT_SMALL),
    "dense-v4.1-flash": lambda: dense_control(preset("deepseek-v4.1-flash")),
    "dense-tiny": lambda: dense_control(preset("tiny")),
    "default": lambda: ModelConfig.from_dict(_DEFAULT),
    # Pinned to the shape the dense control in kvstack/data/dense-default was trained with (four
    # query heads of 64 over one KV head of 64; the window is unused by dense attention but
    # kept as it was), so that this preset reproduces that config exactly.
    "dense-default": lambda: dense_control(
        preset("default").replace(n_heads=4, head_dim=64, window_size=64)),
}
PRESETS = tuple(_PRESETS)


def preset(name: str) -> ModelConfig:
    """A named config: deepseek-v4.1-flash, tiny, tiny-v41, tiny-v41-dspark (with DSpark's
    draft), tiny-v41-vision (with a vision tower), v41-layout-small, default (the bundled
    model's shape), and the dense controls dense-v4.1-flash, dense-tiny, dense-default."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(_PRESETS)}")
    return _PRESETS[name]()
