"""Every parameter of a model of the family, by name and shape, derived from its config.

This is the model's parameter contract (design.md section 2): the module tree of
`kvstack.model` creates exactly these tensors (kvstack's own checkpoint layout), and the
planner counts them. DSpark's draft and the vision tower are not part of the trunk:
`draft_parameter_shapes` and `vision_parameter_shapes` list them apart.
Engram tables are listed as stored: E4M3 codes and UE8M0 scales (uint8).
"""

import math
import os
from dataclasses import dataclass

from kvstack.config import LayerSpec, ModelConfig


def check_fits_memory(config: ModelConfig, element_bytes: int) -> None:
    """Refuse, before anything is allocated, a model whose parameters cannot fit this
    machine's memory (a config with a million experts would otherwise allocate until
    MemoryError, or until the kernel's OOM killer ends the process). `element_bytes`: of
    a float parameter as it will be allocated; Engram tables are stored as bytes."""
    shapes = (parameter_shapes(config) | draft_parameter_shapes(config)
              | vision_parameter_shapes(config))
    needed = sum(math.prod(shape) * (1 if name.endswith(_ENGRAM_TABLES) else element_bytes)
                 for name, shape in shapes.items())
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # a system that does not say
        return
    if needed > physical:
        raise ValueError(f"this config's parameters need {needed / 2**30:,.1f} GiB, more than "
                         f"this machine's {physical / 2**30:,.1f} GiB of memory "
                         f"({sum(math.prod(s) for s in shapes.values()):,} parameters)")


_ENGRAM_TABLES = ("table_codes", "table_scales")


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    c = config
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (c.vocab_size, c.dim)}
    hc_dim = c.hc_mult * c.dim
    for spec in c.layers:
        _layer_shapes(c, spec, f"layers.{spec.index}.", shapes)
    if c.hc_mult > 1 and not c.single_pass_hc:
        shapes["hc_head_fn"] = (c.hc_mult, hc_dim)
        shapes["hc_head_base"] = (c.hc_mult,)
        shapes["hc_head_scale"] = (1,)
    shapes["norm.weight"] = (c.dim,)
    shapes["head.weight"] = (c.vocab_size, c.dim)
    return shapes


def draft_parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """DSpark's draft (`kvstack.model.dspark.Draft`, under `draft.`): its stages, window-only
    layers with the draft's expert counts, and its projection and heads; {} without one."""
    c = config
    if not c.has_draft:
        return {}
    routed, active = c.draft_experts
    stage = c.replace(n_routed_experts=routed, n_activated_experts=active)
    shapes: dict[str, tuple[int, ...]] = {
        "draft.main_proj.weight": (c.dim, len(c.dspark_target_layer_ids) * c.dim),
        "draft.main_norm.weight": (c.dim,),
    }
    for s, spec in enumerate(c.draft_layers):
        _layer_shapes(stage, spec, f"draft.stages.{s}.", shapes)
    r = c.dspark_markov_rank
    shapes["draft.norm.weight"] = (c.dim,)
    shapes["draft.markov_embed.weight"] = (c.vocab_size, r)
    shapes["draft.markov_head.weight"] = (c.vocab_size, r)
    shapes["draft.confidence.weight"] = (1, c.dim + r)
    return shapes


def vision_parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The vision tower (`kvstack.model.vision`): the ViT under `vision.`, the aligner under
    `aligner.`, the image segment's three learned embeddings; {} without one. (The routers'
    image bias, `bias_vl`, is a trunk parameter.)"""
    c = config
    if not c.has_vision:
        return {}
    d, inter, p = c.vision_dim, c.vision_inter_dim, c.vision_patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "vision.patch_embed.proj.weight": (d, 3 * p * p),
        "vision.patch_embed.proj.bias": (d,),
    }
    for i in range(c.vision_n_layers):
        b = f"vision.blocks.{i}."
        shapes[b + "norm1.weight"] = (d,)
        shapes[b + "attn.wqkv.weight"] = (3 * d, d)
        shapes[b + "attn.wqkv.bias"] = (3 * d,)
        shapes[b + "attn.wo.weight"] = (d, d)
        shapes[b + "attn.wo.bias"] = (d,)
        shapes[b + "norm2.weight"] = (d,)
        shapes[b + "mlp.w1.weight"] = (2 * inter, d)
        shapes[b + "mlp.w2.weight"] = (d, inter)
    shapes["vision.norm.weight"] = (d,)
    merged = d * c.vision_downsample_ratio ** 2
    shapes["aligner.w1.weight"] = (c.dim, merged)
    shapes["aligner.w1.bias"] = (c.dim,)
    shapes["aligner.w2.weight"] = (c.dim, c.dim)
    shapes["aligner.w2.bias"] = (c.dim,)
    for name in ("image_start", "image_end", "image_newline"):
        shapes[name] = (c.dim,)
    return shapes


def _layer_shapes(c: ModelConfig, spec: LayerSpec, p: str,
                  shapes: dict[str, tuple[int, ...]]) -> None:
    hc_dim = c.hc_mult * c.dim
    n_mix = (2 + c.hc_mult) * c.hc_mult  # pre weights, post weights, residual mixing
    shapes[p + "attn_norm.weight"] = (c.dim,)
    shapes[p + "ffn_norm.weight"] = (c.dim,)
    if spec.index in c.engram_layer_ids:
        _engram_shapes(c, c.engram_layer_ids.index(spec.index), p + "engram.", shapes)
    if c.hc_mult > 1:
        for site in ("attn", "ffn"):
            shapes[p + f"hc_{site}.fn"] = (n_mix, hc_dim)
            shapes[p + f"hc_{site}.base"] = (n_mix,)
            shapes[p + f"hc_{site}.scale"] = (3,)
    a = p + "attn."
    if c.arch == "dense":
        kv_width = c.n_kv_heads * c.head_dim
        shapes[a + "wq.weight"] = (c.n_heads * c.head_dim, c.dim)
        shapes[a + "wk.weight"] = (kv_width, c.dim)
        shapes[a + "wv.weight"] = (kv_width, c.dim)
        shapes[a + "wo.weight"] = (c.dim, c.n_heads * c.head_dim)
    else:
        _v41_attention_shapes(c, spec, a, shapes)
    f = p + "ffn."
    if c.uses_moe:
        shapes[f + "gate.weight"] = (c.n_routed_experts, c.dim)
        shapes[f + "gate.bias"] = (c.n_routed_experts,)
        if c.has_vision:
            shapes[f + "gate.bias_vl"] = (c.n_routed_experts,)
        shapes[f + "experts.w1"] = (c.n_routed_experts, c.moe_inter_dim, c.dim)
        shapes[f + "experts.w2"] = (c.n_routed_experts, c.dim, c.moe_inter_dim)
        shapes[f + "experts.w3"] = (c.n_routed_experts, c.moe_inter_dim, c.dim)
        shared = c.n_shared_experts * c.moe_inter_dim
        if shared:
            shapes[f + "shared.w1.weight"] = (shared, c.dim)
            shapes[f + "shared.w2.weight"] = (c.dim, shared)
            shapes[f + "shared.w3.weight"] = (shared, c.dim)
    else:
        shapes[f + "w1.weight"] = (c.inter_dim, c.dim)
        shapes[f + "w2.weight"] = (c.dim, c.inter_dim)
        shapes[f + "w3.weight"] = (c.inter_dim, c.dim)


def engram_columns(c: ModelConfig) -> int:
    """Table rows an Engram layer reads per token: (max n-gram size - 1) x heads."""
    return (c.engram_max_ngram_size - 1) * c.engram_n_heads


def engram_table_bytes(c: ModelConfig) -> list[int]:
    """Bytes of each Engram layer's table as stored: a code byte per entry and a scale
    byte per 32 (V4.1-Flash: ~203 GB for its two tables)."""
    return [rows * (c.engram_head_dim + c.engram_head_dim // 32)
            for rows in c.engram_num_embeddings]


def _engram_shapes(c: ModelConfig, i: int, e: str, shapes: dict[str, tuple[int, ...]]) -> None:
    rows = c.engram_num_embeddings[i]
    shapes[e + "table_codes"] = (rows, c.engram_head_dim)
    shapes[e + "table_scales"] = (rows, c.engram_head_dim // 32)
    shapes[e + "wkv.weight"] = ((c.hc_mult + 1) * c.dim, engram_columns(c) * c.engram_head_dim)
    shapes[e + "q_weight"] = (c.hc_mult, c.dim)
    shapes[e + "k_weight"] = (c.hc_mult, c.dim)


def _v41_attention_shapes(c: ModelConfig, spec: LayerSpec, a: str,
                          shapes: dict[str, tuple[int, ...]]) -> None:
    shapes[a + "wq_a.weight"] = (c.q_lora_rank, c.dim)
    shapes[a + "q_norm.weight"] = (c.q_lora_rank,)
    shapes[a + "wq_b.weight"] = (c.n_heads * c.head_dim, c.q_lora_rank)
    shapes[a + "wkv.weight"] = (c.head_dim, c.dim)
    shapes[a + "kv_norm.weight"] = (c.head_dim,)
    shapes[a + "sink"] = (c.n_heads,)
    group_width = c.n_heads * c.head_dim // c.o_groups
    shapes[a + "wo_a.weight"] = (c.o_groups * c.o_lora_rank, group_width)
    shapes[a + "wo_b.weight"] = (c.dim, c.o_groups * c.o_lora_rank)
    if spec.kv_source == spec.index:
        k = a + "compressor."
        shapes[k + "wkv.weight"] = (c.head_dim, c.dim)
        if spec.ratio > 1:
            shapes[k + "wgate.weight"] = (c.head_dim, c.dim)
        shapes[k + "norm.weight"] = (c.head_dim,)
        shapes[k + "wk_index.weight"] = (c.index_head_dim, c.head_dim)
        shapes[k + "index_norm.weight"] = (c.index_head_dim,)
    if spec.index_source == spec.index:
        shapes[a + "indexer.wq.weight"] = (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        shapes[a + "indexer.wweights.weight"] = (c.index_n_heads, c.dim)


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every trunk parameter (Engram's projections, not its tables)
    active_decode: int  # used for one decoded token (routed experts: only the chosen k)
    active_prefill: int  # used for each prompt token under CED prefill
    engram: int = 0  # Engram table entries (one per stored code), apart from the trunk
    engram_active: int = 0  # of those, what one token reads (every Engram layer)
    draft: int = 0  # DSpark's draft stages and heads, apart from the trunk
    vision: int = 0  # the vision tower, aligner and image embeddings, apart from the trunk


def count_parameters(config: ModelConfig) -> ParamCounts:
    """Total and active parameter counts.

    Active per decoded token: everything but the routed experts a token is not sent to.
    Active per prefilled token under CED: the embedding, the encoder layers, and the first
    decoder layer's Engram, input mixing, norm and stream projections (the decoder runs
    over only the last few prompt tokens, and the head over the last one). Without CED,
    every layer. Engram tables are counted apart, as V4.1's figures count them (552B trunk
    beside 196B of tables); their scales are not parameters. So is DSpark's draft.
    """
    shapes = parameter_shapes(config)
    expert_share = (
        config.n_activated_experts / config.n_routed_experts if config.uses_moe else 1.0
    )
    enc = config.n_encoder_layers
    stream_layer_prefixes = (
        f"layers.{enc}.attn_norm.",
        f"layers.{enc}.hc_attn.",
        f"layers.{enc}.attn.compressor.",
        f"layers.{enc}.engram.",
    )
    total = engram = 0
    decode = prefill = 0.0
    for name, shape in shapes.items():
        if name.endswith(".engram.table_scales"):
            continue
        n = math.prod(shape)
        if name.endswith(".engram.table_codes"):
            engram += n
            continue
        active = n * expert_share if ".ffn.experts." in name else n
        total += n
        decode += active
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            if enc == 0 or layer < enc or name.startswith(stream_layer_prefixes):
                prefill += active
        elif name == "embed.weight":
            prefill += active
    engram_active = len(config.engram_layer_ids) * engram_columns(config) * config.engram_head_dim
    draft = sum(math.prod(shape) for shape in draft_parameter_shapes(config).values())
    vision = sum(math.prod(shape) for shape in vision_parameter_shapes(config).values())
    return ParamCounts(total, round(decode), round(prefill), engram, engram_active, draft,
                       vision)
