"""Writes a small checkpoint in DeepSeek's published V4.1 layout, from the published spec
alone (tensor names, dtypes and shapes as the released shards hold them), with random
values: what the loader must read. Written independently of kvstack's own name table, so
that a wrong entry there shows up as a load error or a wrong logit."""

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvstack.config import ModelConfig
from kvstack.engine.tokenizer import byte_level_tokenizer_json

# DeepSeek's inference config.json keys kvstack shares the names of.
INFERENCE_KEYS = (
    "vocab_size", "dim", "moe_inter_dim", "n_layers", "n_mtp_layers", "n_heads",
    "n_routed_experts", "n_shared_experts", "n_activated_experts", "score_func",
    "route_scale", "swiglu_limit", "q_lora_rank", "head_dim", "rope_head_dim", "norm_eps",
    "o_groups", "o_lora_rank", "window_size", "compress_ratios", "kv_source_layers",
    "index_source_layers", "compress_rope_theta", "original_seq_len", "rope_theta",
    "rope_factor", "beta_fast", "beta_slow", "index_n_heads", "index_head_dim", "index_topk",
    "candidate_source_layer", "candidate_topk_blocks", "candidate_block_size", "hc_mult",
    "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids", "engram_vocab_size",
    "engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim",
    "engram_pad_id", "engram_compressed_vocab_size", "max_seq_len", "dspark_block_size",
    "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_n_activated_experts",
)


def published_tensors(c: ModelConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    """name -> tensor, in the released checkpoint's dtypes."""
    out: dict[str, torch.Tensor] = {}

    def normal(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def bf16(name: str, *shape: int, std: float = 0.05, mean: float = 0.0) -> None:
        out[name] = (normal(*shape, std=std) + mean).to(torch.bfloat16)

    def f32(name: str, *shape: int, std: float = 0.05) -> None:
        out[name] = normal(*shape, std=std)

    def e8m0(*shape: int, low: int, high: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=g, dtype=torch.uint8).view(
            torch.float8_e8m0fnu)

    def fp8(name: str, out_f: int, in_f: int) -> None:
        # Codes from values of magnitude up to ~448 (never NaN), scales 2^-12 .. 2^-9.
        out[name + ".weight"] = (normal(out_f, in_f, std=120.0).clamp(-448, 448)
                                 .to(torch.float8_e4m3fn))
        out[name + ".scale"] = e8m0(math.ceil(out_f / 32), math.ceil(in_f / 32),
                                    low=127 - 12, high=127 - 8)

    def fp4(name: str, out_f: int, in_f: int) -> None:
        out[name + ".weight"] = torch.randint(0, 256, (out_f, in_f // 2), generator=g,
                                              dtype=torch.uint8).view(torch.int8)
        out[name + ".scale"] = e8m0(out_f, in_f // 32, low=127 - 8, high=127 - 5)

    d, h, mix = c.dim, c.hc_mult, (2 + c.hc_mult) * c.hc_mult
    out["embed.weight"] = normal(c.vocab_size, d, std=1.0).to(torch.bfloat16)
    kv_sources, index_sources = set(c.kv_source_layers), set(c.index_source_layers)

    def block(p: str, layer: int, experts: int) -> None:
        """One layer (or DSpark stage, whose attention is window-only) under p."""
        a = p + "attn."
        for sub in ("attn", "ffn"):
            bf16(f"{p}{sub}_norm.weight", d, mean=1.0)
            f32(f"{p}hc_{sub}_fn", mix, h * d, std=0.02)
            f32(f"{p}hc_{sub}_base", mix, std=0.5)
            f32(f"{p}hc_{sub}_scale", 3, std=0.5)
        f32(a + "attn_sink", c.n_heads, std=0.5)
        fp8(a + "wq_a", c.q_lora_rank, d)
        bf16(a + "q_norm.weight", c.q_lora_rank, mean=1.0)
        fp8(a + "wq_b", c.n_heads * c.head_dim, c.q_lora_rank)
        fp8(a + "wkv", c.head_dim, d)
        bf16(a + "kv_norm.weight", c.head_dim, mean=1.0)
        fp8(a + "wo_a", c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim // c.o_groups)
        fp8(a + "wo_b", d, c.o_groups * c.o_lora_rank)
        if layer in kv_sources:
            bf16(a + "compressor.wkv.weight", c.head_dim, d)
            if c.compress_ratios[layer] > 1:
                bf16(a + "compressor.wgate.weight", c.head_dim, d)
            bf16(a + "compressor.norm.weight", c.head_dim, mean=1.0)
            bf16(a + "indexer.wk.weight", c.index_head_dim, c.head_dim, std=0.2)
            bf16(a + "indexer.k_norm.weight", c.index_head_dim, mean=1.0)
        if layer in index_sources:
            fp8(a + "indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            bf16(a + "indexer.weights_proj.weight", c.index_n_heads, d, std=0.2)
        if layer in c.engram_layer_ids:
            rows = c.engram_num_embeddings[c.engram_layer_ids.index(layer)]
            out[p + "engram.embed.weight"] = (normal(rows, c.engram_head_dim, std=100.0)
                                              .to(torch.float8_e4m3fn))
            out[p + "engram.embed.scale"] = e8m0(rows, c.engram_head_dim // 32,
                                                 low=127 - 9, high=127 - 6)
            cols = (c.engram_max_ngram_size - 1) * c.engram_n_heads
            fp8(p + "engram.wkv", (h + 1) * d, cols * c.engram_head_dim)
            bf16(p + "engram.q_weight", h, d, mean=1.0)
            bf16(p + "engram.k_weight", h, d, mean=1.0)
        bf16(p + "ffn.gate.weight", experts, d, std=0.2)
        f32(p + "ffn.gate.bias", experts, std=0.1)
        f32(p + "ffn.gate.bias_vl", experts, std=1.0)  # skipped without a vision tower
        i = c.moe_inter_dim
        for e in range(experts):
            for proj, out_f, in_f in (("w1", i, d), ("w2", d, i), ("w3", i, d)):
                fp4(f"{p}ffn.experts.{e}.{proj}", out_f, in_f)
        for proj, out_f, in_f in (("w1", i, d), ("w2", d, i), ("w3", i, d)):
            fp8(f"{p}ffn.shared_experts.{proj}", out_f, in_f)

    for layer in range(c.n_layers):
        block(f"layers.{layer}.", layer, c.n_routed_experts)
    bf16("norm.weight", d, mean=1.0)
    bf16("head.weight", c.vocab_size, d)
    if c.n_mtp_layers and c.dspark_block_size:
        # DSpark: n_mtp_layers stages with the draft's expert count; the first projects
        # the target layers' states, the last holds the norm, Markov and confidence heads.
        for stage in range(c.n_mtp_layers):
            block(f"mtp.{stage}.", c.n_layers + stage,
                  c.dspark_n_routed_experts or c.n_routed_experts)
        fp8("mtp.0.main_proj", d, len(c.dspark_target_layer_ids) * d)
        bf16("mtp.0.main_norm.weight", d, mean=1.0)
        last = f"mtp.{c.n_mtp_layers - 1}."
        bf16(last + "norm.weight", d, mean=1.0)
        bf16(last + "markov_head.embed.weight", c.vocab_size, c.dspark_markov_rank, std=1.0)
        bf16(last + "markov_head.head.weight", c.vocab_size, c.dspark_markov_rank, std=0.2)
        bf16(last + "confidence_head.proj.weight", 1, d + c.dspark_markov_rank, std=0.2)
    else:  # draft tensors of a config that builds no draft: skipped
        bf16("mtp.0.attn.wq_a.weight", 4, d)
        bf16("mtp.0.markov_head.embed.weight", 4, 4)
    if c.vision_n_layers:
        # The vision tower as DeepSeek's vision.py names and builds it: bf16 linears with
        # biases (the MLP's without), float32 norms, the image span's three embeddings.
        vd, vi, vp = c.vision_dim, c.vision_inter_dim, c.vision_patch_size
        bf16("vision.patch_embed.proj.weight", vd, 3 * vp * vp, std=0.1)
        bf16("vision.patch_embed.proj.bias", vd)
        for i in range(c.vision_n_layers):
            b = f"vision.blocks.{i}."
            f32(b + "norm1.weight", vd, std=0.1)
            out[b + "norm1.weight"] += 1.0
            bf16(b + "attn.wqkv.weight", 3 * vd, vd, std=0.2)
            bf16(b + "attn.wqkv.bias", 3 * vd)
            bf16(b + "attn.wo.weight", vd, vd, std=0.1)
            bf16(b + "attn.wo.bias", vd)
            f32(b + "norm2.weight", vd, std=0.1)
            out[b + "norm2.weight"] += 1.0
            bf16(b + "mlp.w1.weight", 2 * vi, vd, std=0.2)
            bf16(b + "mlp.w2.weight", vd, vi, std=0.1)
        f32("vision.norm.weight", vd, std=0.1)
        out["vision.norm.weight"] += 1.0
        r = c.vision_downsample_ratio
        bf16("aligner.w1.weight", d, vd * r * r, std=0.1)
        bf16("aligner.w1.bias", d)
        bf16("aligner.w2.weight", d, d, std=0.2)
        bf16("aligner.w2.bias", d)
        for name in ("image_start", "image_end", "image_newline"):
            bf16(name, d, std=1.0)
    else:  # what a model without the tower skips
        bf16("vision.patch_embed.proj.weight", 4, 4)
        bf16("image_newline", d)
    return out


def write_v41_checkpoint(directory: Path, config: ModelConfig, seed: int = 0,
                         shards: int = 3, hf_form: bool = False) -> dict[str, torch.Tensor]:
    """The published layout of `config` with random values in `shards` files plus
    model.safetensors.index.json (shards=0: one model.safetensors, no index), config.json
    and a byte-level tokenizer.json; returns the tensors written."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = published_tensors(config, torch.Generator().manual_seed(seed))
    names = list(tensors)
    if shards == 0:
        save_file(tensors, str(directory / "model.safetensors"))
        shards = -1  # no index below
    if shards > 0:
        per_shard = -(-len(names) // shards)
        weight_map = {}
        for s in range(shards):
            part = names[s * per_shard : (s + 1) * per_shard]
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n] for n in part}, str(directory / file))
            weight_map.update(dict.fromkeys(part, file))
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(
        hf_config(config) if hf_form else inference_config(config)))
    (directory / "tokenizer.json").write_text(byte_level_tokenizer_json())
    return tensors


def inference_config(c: ModelConfig) -> dict:
    out = {k: list(v) if isinstance(v := getattr(c, k), tuple) else v for k in INFERENCE_KEYS}
    if out["candidate_source_layer"] is None:
        out["candidate_source_layer"] = -1
    out.update(dtype="fp8", expert_dtype="fp4", vision_n_layers=c.vision_n_layers,
               image_token_id=c.image_token_id)
    if c.has_vision:
        out.update({k: getattr(c, k) for k in VISION_KEYS})
    return out


# DeepSeek's vision keys (ModelArgs) beside HF's names for them (vision_config).
VISION_KEYS = {
    "vision_dim": "hidden_size", "vision_n_heads": "num_attention_heads",
    "vision_inter_dim": "intermediate_size", "vision_patch_size": "patch_size",
    "vision_rope_theta": "rope_theta", "vision_downsample_ratio": "downsample_ratio",
    "vision_max_n_token": "max_image_tokens", "vision_min_pixels": "min_pixels",
    "vision_max_wh_ratio": "max_wh_ratio",
}


def hf_config(c: ModelConfig) -> dict:
    """The same model as HF transformers writes its config (DeepseekV41Config)."""
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": c.vocab_size, "hidden_size": c.dim,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": 1, "head_dim": c.head_dim, "q_lora_rank": c.q_lora_rank,
        "qk_rope_head_dim": c.rope_head_dim, "rope_theta": c.rope_theta,
        "compress_rope_theta": c.compress_rope_theta,
        "rope_scaling": {"rope_type": "yarn", "factor": c.rope_factor,
                         "beta_fast": c.beta_fast, "beta_slow": c.beta_slow,
                         "original_max_position_embeddings": c.original_seq_len},
        "max_position_embeddings": c.max_seq_len, "sliding_window": c.window_size,
        "compress_ratios": list(c.compress_ratios[: c.n_layers]),
        "kv_source_layer_ids": list(c.kv_source_layers),
        "index_source_layer_ids": list(c.index_source_layers),
        "candidate_source_layer_id": c.candidate_source_layer,
        "candidate_topk_blocks": c.candidate_topk_blocks,
        "candidate_block_size": c.candidate_block_size, "index_n_heads": c.index_n_heads,
        "index_head_dim": c.index_head_dim, "index_topk": c.index_topk,
        "o_groups": c.o_groups, "o_lora_rank": c.o_lora_rank,
        "moe_intermediate_size": c.moe_inter_dim, "n_routed_experts": c.n_routed_experts,
        "n_shared_experts": c.n_shared_experts, "num_experts_per_tok": c.n_activated_experts,
        "scoring_func": c.score_func, "gate_temp": c.gate_temp, "norm_topk_prob": True,
        "routed_scaling_factor": c.route_scale, "topk_method": "noaux_tc",
        "swiglu_limit": c.swiglu_limit, "hc_mult": c.hc_mult,
        "hc_sinkhorn_iters": c.hc_sinkhorn_iters, "hc_eps": c.hc_eps,
        "engram_layer_ids": list(c.engram_layer_ids),
        "engram_vocab_size": c.engram_vocab_size,
        "engram_num_embeddings": list(c.engram_num_embeddings),
        "engram_max_ngram_size": c.engram_max_ngram_size, "engram_n_heads": c.engram_n_heads,
        "engram_head_dim": c.engram_head_dim, "engram_pad_id": c.engram_pad_id,
        "engram_compressed_vocab_size": c.engram_compressed_vocab_size,
        "num_nextn_predict_layers": c.n_mtp_layers, "dspark_block_size": c.dspark_block_size,
        "dspark_noise_token_id": c.dspark_noise_token_id,
        "dspark_target_layer_ids": list(c.dspark_target_layer_ids),
        "dspark_markov_rank": c.dspark_markov_rank,
        "dspark_n_routed_experts": c.dspark_n_routed_experts,
        "dspark_num_experts_per_tok": c.dspark_n_activated_experts, "hidden_act": "silu",
        "initializer_range": 0.02, "rms_norm_eps": c.norm_eps, "use_cache": True,
        "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    }
    return {
        "model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": text,
        "vision_config": {"num_hidden_layers": c.vision_n_layers,
                          **{hf: getattr(c, k) for k, hf in VISION_KEYS.items()}},
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32],
                                "scale_fmt": "ue8m0", "expert_dtype": "fp4",
                                "activation_scheme": "dynamic"},
        "image_token_id": c.image_token_id,
        "tie_word_embeddings": False,
    }
