"""The memory planner behind `kvstack plan`: cache layout, bytes per token, parameter
counts and capacity, all computed from a config (a plan, not a measurement: the engine
measures what it allocates), plus what each of the four mechanisms buys."""

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kvstack.cache.layout import CacheLayout
from kvstack.config import ModelConfig, dense_control
from kvstack.model.params import count_parameters, engram_columns, engram_table_bytes

BASIS = "computed from the config (a plan; the engine measures what it allocates)"
GIB = 1 << 30


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


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


def make_plan(
    config: ModelConfig, name: str, context: int | None = None, hbm_gib: float | None = None
) -> dict[str, Any]:
    """Everything `kvstack plan` shows, as one JSON-ready dict."""
    if context is None:
        context = config.max_seq_len
    if context <= 0:
        raise ValueError(f"context must be a positive number of tokens, got {context}")
    if hbm_gib is not None and not hbm_gib > 0:
        raise ValueError(f"hbm-gib must be a positive number of GiB, got {hbm_gib}")
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
        "draft_layers_excluded": config.n_mtp_layers,
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
