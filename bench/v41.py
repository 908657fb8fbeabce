"""DeepSeek's V4.1 checkpoint layout: loading cost and what packed weights cost to run.

1. Loading. A random checkpoint in the published layout (FP8 dense projections with
   32x32 UE8M0 scales, FP4 experts, FP8 Engram tables) is written at each size, then
   loaded in a fresh process by kvstack's loader, which keeps the weights packed and
   mapped from the shards. Printed: checkpoint bytes, the process's resident growth
   (RSS, measured) and load seconds; beside them the bytes the same weights take
   expanded to bf16, as a loader that dequantises at load time holds them (counted
   from the loaded model's weights: 2 bytes each).
2. Running. Prefill and decode throughput of a tiny V4.1-format model (four residual
   copies, Engram, MoE) with its weights packed, beside the same weights as floats and
   beside the bundled model: what multiplying FP8/FP4 weights packed costs at tiny widths
   (bench/real_shapes.py measures it at V4.1-Flash's).

One thread (torch.set_num_threads(1)): a shared 2-core machine is noisy, and the ratios
measured in one run are what to compare.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from kvstack.cache.contiguous import ContiguousCache
from kvstack.config import ModelConfig, preset
from kvstack.engine.loading import bundled_model
from kvstack.engine.tokenizer import byte_level_tokenizer_json
from kvstack.model import Model
from kvstack.model.checkpoint import (
    INDEX_FILE,
    STORED_DTYPES,
    float_state_dict,
    inference_config,
    v41_names,
)

ROOT = Path(__file__).resolve().parents[1]


def checkpoint_config(experts: int) -> ModelConfig:
    """tiny-v41's layout at dim 256 with `experts` routed experts of width 1024: ~3 MB of
    FP4 expert bytes per expert across its 8 layers."""
    return preset("tiny-v41").replace(dim=256, n_routed_experts=experts, moe_inter_dim=1024,
                                      q_lora_rank=128, o_lora_rank=128)


def write_random_v41(directory: Path, config: ModelConfig, shard_bytes: int = 1 << 28) -> int:
    """Random values in the published layout of config (kvstack's name table); bytes."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map, shard, size, total, index = {}, {}, 0, 0, 1

    def flush() -> None:
        nonlocal shard, size, index
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(directory / name))
        weight_map.update(dict.fromkeys(shard, name))
        shard, size, index = {}, 0, index + 1

    for name, entry in v41_names(config).items():
        dtype = STORED_DTYPES[entry.dtype]
        if entry.dtype == "F8_E4M3":
            t = (torch.randn(entry.shape, generator=g) * 100).clamp(-448, 448).to(dtype)
        elif entry.dtype == "F8_E8M0":
            t = torch.randint(116, 120, entry.shape, generator=g, dtype=torch.uint8).view(dtype)
        elif entry.dtype == "I8":
            t = torch.randint(-128, 128, entry.shape, generator=g, dtype=torch.int8)
        else:
            t = (torch.randn(entry.shape, generator=g) * 0.05).to(dtype)
        shard[name] = t
        size += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                    "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(inference_config(config)))
    (directory / "tokenizer.json").write_text(byte_level_tokenizer_json())
    return total


LOAD_SCRIPT = textwrap.dedent("""
    import gc, json, sys, time
    import torch
    torch.set_num_threads(1)
    import kvstack.model.checkpoint as ck
    from kvstack.config import preset
    from kvstack.model import Model
    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
    with torch.device("meta"):
        Model(preset("tiny"))  # torch's meta kernels load once, whatever the checkpoint
    gc.collect()
    base = rss()
    t0 = time.perf_counter()
    model = Model.from_pretrained(sys.argv[1])
    load_s = time.perf_counter() - t0
    gc.collect()
    packed = rss() - base
    bf16 = sum(2 * t.numel() for t in ck.float_state_dict(model).values()
               if t.is_floating_point())
    print(json.dumps({"packed_rss": packed, "load_s": load_s, "bf16_bytes": bf16}))
""")


def measure_load(experts: list[int]) -> list[dict]:
    rows = []
    for n in experts:
        with tempfile.TemporaryDirectory() as tmp:
            size = write_random_v41(Path(tmp), checkpoint_config(n))
            out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, tmp], check=True,
                                 capture_output=True, text=True, cwd=ROOT,
                                 env={"OMP_NUM_THREADS": "1", "PATH": ""})
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"experts": n, "checkpoint_bytes": size, **r,
                         "packed_per_byte": r["packed_rss"] / size,
                         "bf16_per_byte": r["bf16_bytes"] / size})
    return rows


def throughput(model: Model, prompt: int, decode: int, repeat: int) -> tuple[float, float]:
    """Best prefill and decode tokens/s over `repeat` runs (one sequence)."""
    c = model.config
    ids = torch.randint(0, min(c.vocab_size, 256), (1, prompt + decode),
                        generator=torch.Generator().manual_seed(0))
    best_p = best_d = 0.0
    for _ in range(repeat):
        cache = ContiguousCache(c, 1, prompt + decode)
        t0 = time.perf_counter()
        model.prefill(ids[:, :prompt], cache)
        t1 = time.perf_counter()
        for t in range(prompt, prompt + decode):
            model.decode(ids[:, t], cache)
        t2 = time.perf_counter()
        best_p, best_d = max(best_p, prompt / (t1 - t0)), max(best_d, decode / (t2 - t1))
    return best_p, best_d


def measure_speed(prompt: int, decode: int, repeat: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        from kvstack.model.checkpoint import export_v41

        export_v41(Model(preset("tiny-v41")), Path(tmp))
        (Path(tmp) / "tokenizer.json").write_text(byte_level_tokenizer_json())
        packed = Model.from_pretrained(tmp).eval()
    unpacked = Model(packed.config)
    unpacked.load_state_dict(float_state_dict(packed))
    models = {"tiny-v41, V4.1 layout (FP8/FP4 packed)": packed,
              "tiny-v41, same weights as float32": unpacked.eval(),
              "bundled model (float32)": Model.from_pretrained(bundled_model()).eval()}
    rows = []
    for label, model in models.items():
        p, d = throughput(model, prompt, decode, repeat)
        rows.append({"model": label, "prefill_tok_s": p, "decode_tok_s": d})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[32, 128],
                        help="routed experts of the written checkpoints (~3 MB each)")
    parser.add_argument("--prompt", type=int, default=448,
                        help="prompt tokens (with --decode within tiny-v41's 512)")
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"threads": 1, "load": measure_load(args.experts),
              "speed": measure_speed(args.prompt, args.decode, args.repeat)}
    if args.json:
        print(json.dumps(result))
        return
    print("Loading a V4.1-layout checkpoint (1 thread; RSS growth in a fresh process)")
    print(f"{'checkpoint':>12} {'packed RSS':>11} {'x ckpt':>7} {'load s':>7} "
          f"{'as bf16':>10} {'x ckpt':>7}")
    for r in result["load"]:
        print(f"{r['checkpoint_bytes'] / 1e6:>10.0f}MB {r['packed_rss'] / 1e6:>9.0f}MB "
              f"{r['packed_per_byte']:>7.2f} {r['load_s']:>7.2f} "
              f"{r['bf16_bytes'] / 1e6:>8.0f}MB {r['bf16_per_byte']:>7.2f}")
    base = result["speed"][1]
    print(f"\nPrefill {args.prompt} tokens, then decode {args.decode} (1 thread, best of "
          f"{args.repeat})")
    for r in result["speed"]:
        print(f"{r['model']:<42} prefill {r['prefill_tok_s']:>8.0f} tok/s "
              f"({r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x)  decode "
              f"{r['decode_tok_s']:>6.1f} tok/s ({r['decode_tok_s'] / base['decode_tok_s']:.2f}x)")


if __name__ == "__main__":
    main()
