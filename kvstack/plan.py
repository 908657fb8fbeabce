"""The memory planner behind `kvstack plan`: cache layout, bytes per token, parameter
counts and capacity, all computed from a config (a plan, not a measurement: the engine
measures what it allocates), plus what each of the four mechanisms buys, and with tensor
parallelism, what each device holds."""

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kvstack.cache.layout import CacheLayout
from kvstack.config import ModelConfig, dense_control
from kvstack.image_grid import plan_grid, segment_length
from kvstack.model.params import (
    count_parameters,
    draft_parameter_shapes,
    engram_columns,
    engram_table_bytes,
    parameter_shapes,
    vision_parameter_shapes,
)
from kvstack.parallel.plan import ShardingPlan

BASIS = "computed from the config (a plan; the engine measures what it allocates)"
GIB = 1 << 30
# Of each device's memory, what the planner keeps from weights and cache: activations,
# the MoE dispatch and attention workspaces, collective buffers and the CUDA context (the
# share vLLM's default gpu_memory_utilization of 0.9 leaves).
RESERVE_FRACTION = 0.1

# How DeepSeek's published V4.1 checkpoint stores each of kvstack's tensors (by its name
# within a layer). `kvstack.model.checkpoint.v41_names` is the authority; it imports
# torch, so the planner keeps this rule, and the tests hold it to that table.
_FP8 = frozenset({
    "attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight",
    "attn.wo_b.weight", "attn.indexer.wq.weight", "engram.wkv.weight",
    *(f"ffn.{part}w{i}.weight" for part in ("shared.", "") for i in (1, 2, 3)),
    "draft.main_proj.weight",
})
_F32 = frozenset({"attn.sink", "ffn.gate.bias", "ffn.gate.bias_vl",
                  *(f"hc_{site}.{p}" for site in ("attn", "ffn") for p in ("fn", "base", "scale"))})
_TABLES = frozenset({"engram.table_codes", "engram.table_scales"})
_WEIGHT_BLOCK = 32  # kvstack.formats.weights.WEIGHT_BLOCK (that module imports torch)
_EXPERT_SCALE_BLOCK = 32  # FP4 experts: a UE8M0 scale per 32 weights along each row


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _local(name: str) -> str:
    """A tensor's name within its layer or draft stage (a top-level name as it is)."""
    if name.startswith("layers."):
        return name.split(".", 2)[2]
    return name.split(".", 3)[3] if name.startswith("draft.stages.") else name


def stored_bytes(name: str, shape: tuple[int, ...]) -> int:
    """Bytes of kvstack's tensor `name` of `shape` (whole, or one rank's piece) packed as
    DeepSeek publishes V4.1: dense projections FP8 E4M3 with a UE8M0 scale per 32x32
    block, routed experts FP4 with a scale per 32 along each row, Engram tables as kvstack
    holds them (a code byte per value, a scale byte per 32), hyper-connections, sinks, the
    routing biases and the vision tower's norms float32, the rest bf16. A piece off the
    32-row grid keeps the scales of the blocks it touches."""
    local, n = _local(name), math.prod(shape)
    if local in _FP8:
        out_f, in_f = shape
        return n + _ceil_div(out_f, _WEIGHT_BLOCK) * _ceil_div(in_f, _WEIGHT_BLOCK)
    if local.startswith("ffn.experts."):
        *rows, in_f = shape
        return math.prod(rows) * (_ceil_div(in_f, 2) + _ceil_div(in_f, _EXPERT_SCALE_BLOCK))
    if local in _TABLES:
        return n
    # hc_head_*: per-site hyper-connections (not in the published layout), kept like the
    # layers' own.
    if local in _F32 or local.startswith("hc_head_") or _is_vision_norm(name):
        return 4 * n
    return 2 * n


def _is_vision_norm(name: str) -> bool:
    """The vision tower's norms, which it builds (and publishes) in float32."""
    return name.startswith("vision.") and name.endswith(("norm1.weight", "norm2.weight",
                                                         "norm.weight"))


@dataclass(frozen=True)
class RankWeights:
    """The weight bytes one rank holds, packed as V4.1 is published."""

    total: int
    tables: int  # of which Engram tables: what can live on the host instead
    replicated: int  # of which tensors every rank holds whole


def rank_weights(config: ModelConfig, sharding: ShardingPlan) -> list[RankWeights]:
    """What each rank of `sharding` holds (one rank: the whole published checkpoint; a
    sharded model runs without DSpark's draft; every rank holds the vision tower)."""
    shapes = parameter_shapes(config) | vision_parameter_shapes(config)
    if sharding.world_size == 1:
        shapes |= draft_parameter_shapes(config)
    whole = {name for name, shape in shapes.items() if sharding.split(name, shape) is None}
    out = []
    for rank in range(sharding.world_size):
        total = tables = replicated = 0
        for name, shape in sharding.rank_shapes(shapes, rank).items():
            size = stored_bytes(name, shape)
            total += size
            tables += size if _local(name) in _TABLES else 0
            replicated += size if name in whole else 0
        out.append(RankWeights(total, tables, replicated))
    return out


def decode_read_bytes(config: ModelConfig) -> int:
    """Weight bytes one decoded token reads, packed as V4.1 is published: every tensor
    whole but the embedding (one row), the routed experts (the n_activated a token
    picks, of n_routed) and the Engram tables (the rows its n-grams hash to)."""
    total = 0
    for name, shape in parameter_shapes(config).items():
        local = _local(name)
        if local in _TABLES:
            continue
        size = stored_bytes(name, shape)
        if name == "embed.weight":
            size //= shape[0]
        elif local.startswith("ffn.experts."):
            size = size * config.n_activated_experts // config.n_routed_experts
        total += size
    row = config.engram_head_dim + config.engram_head_dim // 32
    return total + len(config.engram_layer_ids) * engram_columns(config) * row


def cpu_run(config: ModelConfig, layout: CacheLayout, context: int) -> dict[str, Any]:
    """What a CPU run of the published checkpoint needs: RAM with the Engram tables read
    into it or left memory-mapped from the checkpoint on disk (each token reads a few
    rows of them), the checkpoint's disk, and the bytes a decoded token reads (the memory
    floor of a step: those bytes over the memory bandwidth)."""
    weights = rank_weights(config, ShardingPlan(config, 1))[0]
    sequence = layout.sequence_bytes(context)
    read = decode_read_bytes(config)
    return {"checkpoint_bytes": weights.total, "engram_table_bytes": weights.tables,
            "cache_bytes_one_sequence": sequence,
            "ram_bytes_tables_in_ram": weights.total + sequence,
            "ram_bytes_tables_on_disk": weights.total - weights.tables + sequence,
            "disk_bytes": weights.total, "decode_read_bytes_per_token": read,
            "floor_tokens_per_s_per_100gb_s": 100e9 / read}


def _fit(usable: int, weights: int, hbm_bytes: int, per_sequence: int) -> dict[str, Any]:
    room = max(usable - weights, 0)
    return {"weight_bytes": weights, "cache_bytes": room,
            "sequences_fit": room // per_sequence, "weights_exceed_hbm": weights > hbm_bytes}


def _parallel(config: ModelConfig, layout: CacheLayout, context: int, hbm_gib: float | None,
              world_size: int, expert_parallel: bool) -> dict[str, Any]:
    sharding = ShardingPlan(config, world_size, expert_parallel)
    ranks = rank_weights(config, sharding)
    single = rank_weights(config, ShardingPlan(config, 1))[0]
    # The device that fills first bounds what every device can give the cache: all ranks
    # hold the same sequences.
    on_device = max(r.total for r in ranks)
    on_host = max(r.total - r.tables for r in ranks)
    per_sequence = layout.sequence_bytes(context)
    out: dict[str, Any] = {
        **sharding.describe(),
        "weight_bytes_one_process": single.total,
        "weight_bytes_per_device": on_device,
        "weight_bytes_all_devices": sum(r.total for r in ranks),
        "replicated_bytes_per_device": ranks[0].replicated,
        "engram_table_bytes_per_device": max(r.tables for r in ranks),
        "engram_table_bytes_on_host": single.tables,
        "weight_bytes_per_device_tables_on_host": on_host,
        "cache_bytes_per_token_per_device": _number(layout.bytes_per_token),
        "cache_bytes_per_sequence_per_device": per_sequence,
    }
    if hbm_gib is not None:
        hbm = int(hbm_gib * GIB)
        usable = int(hbm * (1 - RESERVE_FRACTION))
        out.update(hbm_gib_per_device=hbm_gib, reserve_fraction=RESERVE_FRACTION,
                   reserve_bytes=hbm - usable,
                   fit={"tables_on_device": _fit(usable, on_device, hbm, per_sequence),
                        "tables_on_host": _fit(usable, on_host, hbm, per_sequence)})
    return out


@dataclass(frozen=True)
class Variant:
    label: str
    config: ModelConfig
    window_persisted: bool = False


def _own_sources(config: ModelConfig, layers: set[int]) -> ModelConfig:
    """The config with each of `layers` made Full: its own kv source and index source.
    The candidate pool spans one shared stream, so it goes when a later layer stops
    sharing that stream."""
    cand = config.candidate_source_layer
    if cand is not None and any(i > cand for i in layers):
        cand = None
    return config.replace(
        kv_source_layers=sorted(set(config.kv_source_layers) | layers),
        index_source_layers=sorted(set(config.index_source_layers) | layers),
        candidate_source_layer=cand,
    )


def _no_sharing(config: ModelConfig) -> ModelConfig:
    # Under CED the decoder's single stream is CED's mechanism, not CSA2's; it stays.
    enc = config.n_encoder_layers
    return _own_sources(
        config, {s.index for s in config.layers if s.ratio and (enc == 0 or s.index < enc)}
    )


def _no_ced(config: ModelConfig) -> ModelConfig:
    enc = config.n_encoder_layers
    decoder = {s.index for s in config.layers if s.ratio and s.index >= enc}
    return _own_sources(config.replace(n_encoder_layers=0), decoder)


def _bf16(config: ModelConfig) -> ModelConfig:
    return config.replace(kv_format="bf16", index_format="bf16", window_format="bf16")


def mechanism_variants(config: ModelConfig) -> list[Variant]:
    """The config, then the same model with each mechanism turned off in turn, then with
    all of them off. A mechanism the config does not use gets no row."""
    variants = [Variant("as configured", config)]
    if config.arch == "dense":
        return variants
    no_sharing = _no_sharing(config)
    if (config.kv_format, config.index_format, config.window_format) != ("bf16",) * 3:
        variants.append(Variant("bf16 cache", _bf16(config)))
    if no_sharing != config:
        variants.append(Variant("no sharing", no_sharing))
    if config.n_encoder_layers:
        variants.append(Variant("no CED", _no_ced(config)))
    variants.append(Variant("window persisted", config, True))
    all_off = _bf16(_no_ced(no_sharing) if config.n_encoder_layers else no_sharing)
    variants.append(Variant("all four off", all_off, True))
    variants.append(Variant("dense control", dense_control(config)))
    return variants


def _capacity(layout: CacheLayout, context: int, hbm_gib: float | None) -> dict[str, Any]:
    per_sequence = layout.sequence_bytes(context)
    row: dict[str, Any] = {"bytes_per_sequence": per_sequence}
    if hbm_gib is not None:
        row["sequences_fit"] = int(hbm_gib * GIB // per_sequence)
    return row


# The picture `kvstack plan` prices when not told one (width, height in pixels).
DEFAULT_IMAGE_SIZE = (1024, 768)


def vision_plan(config: ModelConfig, layout: CacheLayout,
                image_size: tuple[int, int]) -> dict[str, Any]:
    """The vision tower's weights (apart from the trunk) and what one image of
    `image_size` pixels costs in prompt positions and cache bytes: image positions are
    cache positions like text."""
    width, height = image_size
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive pixels, got {width} x {height}")
    grid = plan_grid(width, height, config)
    positions = segment_length(grid.n_h, grid.n_w)
    return {
        "layers": config.vision_n_layers,
        "params": count_parameters(config).vision,
        "weight_bytes": sum(stored_bytes(name, shape) for name, shape
                            in vision_parameter_shapes(config).items()),
        "image": {"width": width, "height": height, "grid": [grid.n_h, grid.n_w],
                  "positions": positions,
                  "cache_bytes": _number(positions * layout.bytes_per_token)},
    }


def make_plan(
    config: ModelConfig, name: str, context: int | None = None, hbm_gib: float | None = None,
    tensor_parallel_size: int | None = None, expert_parallel: bool = False,
    image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE,
) -> dict[str, Any]:
    """Everything `kvstack plan` shows, as one JSON-ready dict. With
    `tensor_parallel_size`, a "parallel" entry: what each of that many devices holds,
    and with `hbm_gib` (then one device's memory) how many sequences each fits."""
    if context is None:
        context = config.max_seq_len
    if context <= 0:
        raise ValueError(f"context must be a positive number of tokens, got {context}")
    if hbm_gib is not None and not hbm_gib > 0:
        raise ValueError(f"hbm-gib must be a positive number of GiB, got {hbm_gib}")
    if expert_parallel and tensor_parallel_size is None:
        raise ValueError("expert parallelism needs a tensor_parallel_size (the ranks the "
                         "experts are spread over)")
    layout = CacheLayout.from_config(config)
    params = count_parameters(config)
    plan: dict[str, Any] = {
        "basis": BASIS,
        "model": name,
        "arch": config.arch,
        "bytes_per_token": _number(layout.bytes_per_token),
        "streams": [
            {
                "layer": s.layer,
                "kind": s.kind,
                "format": s.fmt,
                "width": s.width,
                "ratio": s.ratio,
                "bytes_per_entry": s.entry_bytes,
                "bytes_per_token": _number(s.bytes_per_token),
            }
            for s in layout.streams
        ],
        "window_bytes_per_sequence": layout.window_bytes_per_sequence,
        "partial_group_bytes_per_sequence": layout.partial_bytes_per_sequence,
        "window": {
            "layers": len(layout.window_rings),
            "slots": config.window_size,
            "format": config.window_format,
            "width": config.head_dim,
        },
        "layers": [
            {
                "layer": s.index,
                "half": "encoder" if s.in_encoder else "decoder",
                "mode": s.mode.value,
                "ratio": s.ratio,
                "kv_source": s.kv_source,
                "index_source": s.index_source,
                "candidate_source": s.is_candidate_source,
                "uses_candidates": s.uses_candidates,
            }
            for s in config.layers
        ],
        "n_encoder_layers": config.n_encoder_layers,
        "draft_layers": len(config.draft_layers),
        "params_draft": params.draft,
        "draft_weight_bytes": sum(stored_bytes(name, shape) for name, shape
                                  in draft_parameter_shapes(config).items()),
        "params_vision": params.vision,
        "params_total": params.total,
        "params_active_decode": params.active_decode,
        "params_active_prefill": params.active_prefill,
        "context": context,
        **_capacity(layout, context, hbm_gib),
    }
    if hbm_gib is not None:
        plan["hbm_gib"] = hbm_gib
    if config.engram_layer_ids:
        # Weights, not cache: budgeted beside the KV cache, never in bytes per token.
        plan["engram"] = {
            "layers": list(config.engram_layer_ids),
            "rows": list(config.engram_num_embeddings),
            "row_bytes": config.engram_head_dim + config.engram_head_dim // 32,
            "rows_read_per_token_and_layer": engram_columns(config),
            "table_bytes": sum(engram_table_bytes(config)),
        }
    if config.has_vision:
        plan["vision"] = vision_plan(config, layout, image_size)
    if config.arch == "v41" and config.uses_moe and config.single_pass_hc:
        plan["cpu_run"] = cpu_run(config, layout, context)
    if tensor_parallel_size is not None:
        plan["parallel"] = _parallel(config, layout, context, hbm_gib, tensor_parallel_size,
                                     expert_parallel)

    base_hbm = layout.sequence_bytes(context)
    base_persistent = layout.bytes_per_token
    plan["mechanisms"] = []
    for v in mechanism_variants(config):
        vl = CacheLayout.from_config(v.config)
        persistent = vl.bytes_per_token + (
            vl.window_bytes_per_token_if_persisted if v.window_persisted else 0
        )
        row = {
            "variant": v.label,
            "hbm_bytes_per_token": _number(vl.bytes_per_token),
            "persistent_bytes_per_token": _number(persistent),
            "window_bytes_per_sequence": vl.window_bytes_per_sequence
            + vl.partial_bytes_per_sequence,
            **_capacity(vl, context, hbm_gib),
        }
        row["hbm_ratio"] = round(row["bytes_per_sequence"] / base_hbm, 3)
        row["persistent_ratio"] = (
            round(float(persistent / base_persistent), 3) if base_persistent else None
        )
        plan["mechanisms"].append(row)
    return plan
