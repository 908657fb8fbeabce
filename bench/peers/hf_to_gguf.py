"""Write an HF `LlamaForCausalLM` directory (config.json, model.safetensors, a byte-level
BPE tokenizer.json) as a GGUF file that llama.cpp loads.

Runs in the llama.cpp venv (bench/.peers/llamacpp: numpy, gguf, safetensors). It does what
llama.cpp's convert_hf_to_gguf.py does for a plain Llama with a GPT-2-style tokenizer, on
the `gguf` package's writer alone: that script needs torch (from PyPI, the CUDA build and
its gigabytes of wheels) and transformers, and names the pre-tokenizer by hashing what it
makes of a test text, a table kvstack's bundled tokenizer is not in. Its pre-tokenizer is
GPT-2's byte-level one, so "gpt-2" is named here directly. Checked: llama.cpp's logits of
the f32 GGUF match transformers' on the same tokens to 6e-4 (logits of magnitude ~1).

    python hf_to_gguf.py HF_DIR OUT.gguf [--outtype f16|f32]
"""

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotary layout (halves) to GGML's (interleaved pairs) for q_proj and k_proj rows,
    as convert_hf_to_gguf.py's LlamaModel.permute: without it llama.cpp would rotate other
    pairs of dimensions and compute another model."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--outtype", choices=("f16", "f32"), default="f16")
    args = parser.parse_args()

    cfg = json.loads((args.hf_dir / "config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    # transformers 5 keeps rope_theta under rope_parameters.
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)
    tensors = {}
    for f in sorted(args.hf_dir.glob("*.safetensors")):
        tensors |= load_file(f)

    w = gguf.GGUFWriter(str(args.out), "llama")
    w.add_name("kvstack-bench-llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    f16 = args.outtype == "f16"
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)

    # The tokenizer: byte-level BPE, GPT-2's pre-tokenizer; ids past vocab_size dropped
    # (the caller may give a Llama a prefix of the tokenizer's vocabulary).
    tok = json.loads((args.hf_dir / "tokenizer.json").read_text())
    vocab = {t: i for t, i in tok["model"]["vocab"].items() if i < cfg["vocab_size"]}
    for added in tok.get("added_tokens", []):
        if added["id"] < cfg["vocab_size"]:
            vocab[added["content"]] = added["id"]
    if sorted(vocab.values()) != list(range(cfg["vocab_size"])):
        raise SystemExit("tokenizer ids do not cover 0..vocab_size-1")
    tokens = sorted(vocab, key=vocab.get)
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    merges = []
    for m in tok["model"]["merges"]:
        a, b = m.split(" ") if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(f"{a} {b}")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges(merges)
    for name, add in (("<|bos|>", w.add_bos_token_id), ("<|eos|>", w.add_eos_token_id),
                      ("<|pad|>", w.add_pad_token_id)):
        if name in vocab:
            add(vocab[name])
    w.add_add_bos_token(False)

    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    if "lm_head.weight" not in tensors:  # tied embeddings
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    for hf, gg in names.items():
        t = tensors[hf].astype(np.float32)
        if hf.endswith("q_proj.weight"):
            t = permute(t, n_head)
        elif hf.endswith("k_proj.weight"):
            t = permute(t, n_kv)
        # Norms stay float32, as llama.cpp's converter keeps 1-D tensors.
        w.add_tensor(gg, t.astype(np.float16) if f16 and t.ndim > 1 else t)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
