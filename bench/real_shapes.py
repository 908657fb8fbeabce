"""DeepSeek's V4.1-Flash weights at their real widths: what multiplying them packed costs,
against the memory floor, beside dequantise-then-matmul.

A checkpoint in the published layout (FP8 E4M3 dense projections with 32x32 UE8M0 scales,
FP4 E2M1 routed experts with UE8M0 per 32, bf16 embeddings and head) is written with
random codes at V4.1-Flash's widths -- dim 5120, 64 heads of 512, q_lora_rank 1280, 8 wo_a
groups of 1024, experts of 2304 -- and four layers: a ratio-2 Full and a Reuse layer in
the encoder, the ratio-1 Full (CED, candidate pool) and a Reuse layer in the decoder. The
routed experts are `--experts` (default 16 of V4.1's 384: a batch-1 token reads the 6 it
picks whatever the count). It is loaded by `Model.from_pretrained`, so the weights are
the loader's, packed and mapped from the shards; no float model is ever built.

Measured, each against its floor (the bytes it reads divided by the copy bandwidth
measured in the same run): every FP8 projection of layer 0, the MoE block (6 routed + the
shared expert), each whole layer inside `Model.decode` after a context of `--context`
tokens (random cache rows in the stored formats), and the bf16 head; at batch 1 and 8;
with the C kernels (what runs by default) and with dequantise-then-matmul, their outputs
compared before either is timed. Then the MoE block on each packed-weight path the CPU
has (AVX-512, AVX2, portable C), its batch-8 compute floor (its float32 multiply-adds at
torch's GEMM rate measured in the same run), a whole layer with two threads beside what a
second thread adds to torch's copy and GEMM, the rate the batch-1 layers read at beside
torch's own read rate (a copy writes what it reads, so its floor is the looser one), the
resident memory after loading, and the 40-layer estimate: tokens/s here and per 100 GB/s
of bandwidth.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvstack import native
from kvstack.cache.contiguous import ContiguousCache
from kvstack.config import Mode, ModelConfig, preset
from kvstack.engine.tokenizer import byte_level_tokenizer_json
from kvstack.model import Model
from kvstack.model.checkpoint import INDEX_FILE, STORED_DTYPES, inference_config, v41_names
from kvstack.model.packed import PackedExpert, PackedExperts, PackedLinear

V41_LAYERS = 40  # V4.1-Flash's trunk, for the whole-model estimate
GB = 1e9


def bench_config(experts: int) -> ModelConfig:
    """V4.1-Flash's widths in four layers (Full and Reuse in each half), no Engram (its
    tables are read 24 rows a token: nothing a matmul kernel changes)."""
    return preset("deepseek-v4.1-flash").replace(
        n_layers=4, n_encoder_layers=2, compress_ratios=[2, 2, 1, 1], kv_source_layers=[0, 2],
        index_source_layers=[0, 2], candidate_source_layer=2, n_routed_experts=experts,
        n_mtp_layers=0, engram_layer_ids=[], engram_num_embeddings=[], max_seq_len=65536)


def random_tensor(dtype: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random bytes in a stored dtype: FP8 codes never NaN, scales 2^-12 .. 2^-9 (what
    DeepSeek's weights carry), bf16 / f32 values of magnitude 2^-7 .. 2^-3."""
    if dtype == "F8_E4M3":
        codes = torch.randint(0, 0x7F, shape, generator=g, dtype=torch.uint8)
        return (codes | (torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7)).view(
            torch.float8_e4m3fn)
    if dtype == "F8_E8M0":
        return torch.randint(115, 119, shape, generator=g, dtype=torch.uint8).view(
            torch.float8_e8m0fnu)
    if dtype == "I8":
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    # bf16 bits: a random sign and mantissa, exponent 120..124.
    bits = (torch.randint(0, 1 << 16, shape, generator=g, dtype=torch.int32) & 0x807F) | (
        torch.randint(120, 125, shape, generator=g, dtype=torch.int32) << 7)
    values = bits.to(torch.int16).view(torch.bfloat16)
    return values if dtype == "BF16" else values.to(STORED_DTYPES[dtype])


def write_checkpoint(directory: Path, config: ModelConfig) -> int:
    """The published layout of config with random bytes, one shard per layer; bytes."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, entry in v41_names(config).items():
        shard = name.split(".")[1] if name.startswith("layers.") else "other"
        shards.setdefault(shard, {})[name] = random_tensor(entry.dtype, entry.shape, g)
    weight_map, total = {}, 0
    for shard, tensors in shards.items():
        file = f"model-{shard}.safetensors"
        save_file(tensors, str(directory / file))
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                    "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(inference_config(config)))
    (directory / "tokenizer.json").write_text(byte_level_tokenizer_json())
    return total


def copy_bandwidth() -> float:
    """Bytes a second torch copies between two 256 MiB buffers (best of five)."""
    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return src.numel() / best_time(lambda: dst.copy_(src), 5)


def read_bandwidth() -> float:
    """Bytes a second torch reads summing 256 MiB of float32 (best of five): a matmul's
    stream reads, where a copy also writes, so this is the tighter ceiling."""
    values = torch.ones(64 << 20, dtype=torch.float32)
    return values.numel() * 4 / best_time(values.sum, 5)


def multiply_add_rate() -> float:
    """float32 multiply-adds a second torch's GEMM reaches on these threads (1024-square
    matrices, best of five): the compute floor's rate."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return 1024**3 / best_time(lambda: a @ b, 5)


def best_time(run: Callable[[], object], repeat: int) -> float:
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def tensor_bytes(module: torch.nn.Module) -> int:
    """Weight bytes: parameters and packed weights (not the RoPE tables a step indexes)."""
    tensors = list(module.parameters())
    for m in module.modules():
        if isinstance(m, PackedLinear | PackedExpert):
            tensors += [t for t in m.buffers() if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def kernels(on: bool):
    """The C kernels (on) or dequantise-then-matmul (off), as an engine step would run."""
    return native.active(on)


def check_equal(fast: torch.Tensor, slow: torch.Tensor, what: str, within: float = 1e-3) -> None:
    """The kernels' output against dequantise-then-matmul's, before either is timed: equal
    within `within` of the largest magnitude (float32 rounding, summed in another order;
    through whole layers also an index score that rounds across a top-k boundary)."""
    if not torch.allclose(fast, slow, rtol=within, atol=within * float(slow.abs().max())):
        raise SystemExit(f"{what}: the kernels' output differs from dequantise-then-matmul's "
                         f"by {float((fast - slow).abs().max()):.3g}")


def measure(run: Callable[[], torch.Tensor], nbytes: int, bandwidth: float, repeat: int,
            repeat_torch: int, what: str) -> dict:
    with kernels(True):
        out = run()
        fast = best_time(run, repeat)
    with kernels(False):
        check_equal(out, run(), what)
        slow = best_time(run, repeat_torch)
    floor = nbytes / bandwidth
    return {"bytes": nbytes, "floor_ms": 1e3 * floor, "kernel_ms": 1e3 * fast,
            "kernel_x_floor": fast / floor, "dequant_ms": 1e3 * slow,
            "dequant_x_floor": slow / floor}


def projections(model: Model, batch: int, bandwidth: float, repeat: int) -> list[dict]:
    """Layer 0's FP8 projections, one call each on [batch, in] inputs."""
    layer = model.layers[0]
    c = model.config
    modules = {"wq_a": layer.attn.wq_a, "wq_b": layer.attn.wq_b, "wkv": layer.attn.wkv,
               "wo_a": layer.attn.wo_a, "wo_b": layer.attn.wo_b,
               "indexer wq": layer.attn.indexer.wq, "shared w1": layer.ffn.shared.w1,
               "shared w2": layer.ffn.shared.w2}
    g = torch.Generator().manual_seed(1)
    rows = []
    for name, module in modules.items():
        assert isinstance(module, PackedLinear) and module.fmt == "fp8"
        if name == "wo_a":  # block-diagonal: 8 groups of the heads
            x = torch.randn(batch, c.o_groups, module.in_features, generator=g)
            run = lambda m=module, x=x: m.block_diagonal(x)  # noqa: E731
        else:
            x = torch.randn(batch, module.in_features, generator=g)
            run = lambda m=module, x=x: m(x)  # noqa: E731
        what = f"{name} {module.out_features}x{module.in_features}"
        rows.append({"what": what, "batch": batch,
                     **measure(run, tensor_bytes(module), bandwidth, repeat, 1, what)})
    return rows


def weight_elements(module: torch.nn.Module) -> int:
    """Weights a token multiplies through the module's packed projections (out x in)."""
    return sum(m.out_features * m.in_features if isinstance(m, PackedLinear) else
               sum(codes.shape[0] * codes.shape[1] * 2 for codes in
                   (m.w1_codes, m.w2_codes, m.w3_codes))  # two E2M1 codes a byte
               for m in module.modules() if isinstance(m, PackedLinear | PackedExpert))


def moe_block(model: Model, batch: int, bandwidth: float, madd_rate: float,
              repeat: int) -> dict:
    """Layer 0's MoE on [batch, dim]: bytes = the router, the experts the batch picks, and
    the shared expert; multiply-adds = each token's routed experts and the shared one."""
    moe = model.layers[0].ffn
    assert isinstance(moe.experts, PackedExperts)
    x = torch.randn(batch, model.config.dim, generator=torch.Generator().manual_seed(2))
    _, chosen = moe.gate(x)
    picked = torch.unique(chosen).tolist()
    nbytes = (tensor_bytes(moe.gate) + tensor_bytes(moe.shared)
              + sum(tensor_bytes(moe.experts[e]) for e in picked))
    madds = sum(weight_elements(moe.experts[e]) for e in chosen.flatten().tolist()) + \
        batch * weight_elements(moe.shared)
    what = f"MoE: {len(picked)} routed + shared"
    return {"what": what, "batch": batch, "multiply_adds": madds,
            "compute_floor_ms": 1e3 * madds / madd_rate,
            **measure(lambda: moe(x), nbytes, bandwidth, repeat, 1, what)}


def moe_by_path(model: Model, repeat: int) -> list[dict]:
    """Layer 0's MoE at batch 1 and 8 on each packed-weight path this CPU has (the best
    runs by default; the others are what CPUs without its instructions run), the two
    batches timed in alternating rounds so that the machine's drift cancels in their
    ratio."""
    moe, rows = model.layers[0].ffn, []
    best = native.ISAS.index(native.best_weights_isa())
    inputs = {batch: torch.randn(batch, model.config.dim,
                                 generator=torch.Generator().manual_seed(2)) for batch in (1, 8)}
    for isa in native.ISAS[: best + 1]:
        times = dict.fromkeys(inputs, float("inf"))
        with native.weights_path(isa), kernels(True):
            for _ in range(repeat):
                for batch, x in inputs.items():
                    times[batch] = min(times[batch], best_time(lambda x=x: moe(x), 1))
        rows += [{"isa": isa, "batch": batch, "kernel_ms": 1e3 * t} for batch, t in times.items()]
    return rows


def expert_rates(model: Model, repeat: int) -> list[dict]:
    """Layer 0's expert 0, w1, times 1 .. 8 tokens in one grouped call (its codes hot in
    the caches): G multiply-adds a second by the tokens an expert gets, what sets the MoE's
    pace at batch 8 (three an expert on average), beside torch's GEMM rate."""
    experts = model.layers[0].ffn.experts
    addresses = experts.addresses(torch.device("cpu"))[0]
    inter, dim = experts[0].w1_codes.shape[0], model.config.dim
    g = torch.Generator().manual_seed(3)
    rows = []
    with kernels(True):
        for tokens in range(1, 9):
            x = torch.randn(tokens, dim, generator=g)
            t = best_time(lambda x=x, n=tokens: native.fp4_grouped(
                x, addresses, torch.tensor([0]), torch.tensor([n]), inter), repeat)
            rows.append({"tokens": tokens, "ms": 1e3 * t,
                         "g_multiply_adds_s": tokens * inter * dim / t / GB})
    return rows


def fill_context(model: Model, cache: ContiguousCache, n_tokens: int) -> None:
    """A context of n_tokens as the cache stores it, without running a prefill at these
    widths: random ids, stream rows and window entries written through the store (so
    quantised to their formats)."""
    g = torch.Generator().manual_seed(3)
    b = cache.batch_size
    cache.append_tokens(torch.randint(0, 256, (b, n_tokens), generator=g))
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for s in cache.layout.streams:
        by_layer.setdefault(s.layer, {})[s.kind] = torch.randn(b, s.entries(n_tokens), s.width,
                                                              generator=g)
    for layer, entries in by_layer.items():
        cache.append_stream(layer, entries)
    for ring in cache.layout.window_rings:
        cache.write_window(ring.layer, torch.randn(b, ring.slots, ring.width, generator=g),
                           n_tokens - ring.slots)


def layer_bytes(model: Model, index: int, chosen: set[int], context: int) -> int:
    """What layer `index` reads in a decode step: its weights but the routed experts no
    token picked, plus the cache rows it reads (window ring, index keys scored, entries
    attended)."""
    block = model.layers[index]
    experts = block.ffn.experts
    weights = tensor_bytes(block) - sum(tensor_bytes(e) for i, e in enumerate(experts)
                                        if i not in chosen)
    c, spec = model.config, model.config.layers[index]
    cache = c.window_size * (c.head_dim + c.head_dim // 32)  # FP8 ring rows
    if spec.ratio:
        entries = context // spec.ratio
        cache += min(c.index_topk, entries) * (c.head_dim // 2 + c.head_dim // 16)
        if spec.mode is not Mode.REUSE:
            cache += entries * (c.index_head_dim // 2 + c.index_head_dim // 32)
    return weights + cache


def whole_layers(model: Model, batch: int, context: int, bandwidth: float,
                 repeat: int) -> list[dict]:
    """Each layer's time inside Model.decode (forward hooks on the layer's block) after a
    context of `context` tokens, and the head's."""
    c = model.config
    spent: dict[str, list[float]] = {}
    started: dict[str, float] = {}
    picked: dict[int, set[int]] = {}

    def timed(name: str, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(lambda *_: started.__setitem__(name, time.perf_counter()))
        module.register_forward_hook(lambda *_: spent.setdefault(name, []).append(
            time.perf_counter() - started[name]))

    handles = [*model._forward_hooks, *model._forward_pre_hooks]
    assert not handles
    for i, block in enumerate(model.layers):
        timed(f"layer {i}", block)
        block.ffn.gate.register_forward_hook(
            lambda _m, _i, out, i=i: picked.setdefault(i, set()).update(out[1].flatten().tolist()))
    timed("head", model.head)

    def run_decode(on: bool, steps: int) -> tuple[dict[str, float], torch.Tensor]:
        spent.clear()
        cache = ContiguousCache(c, batch, context + steps + 1)
        fill_context(model, cache, context)
        ids = torch.randint(0, 256, (batch,), generator=torch.Generator().manual_seed(4))
        with kernels(on), torch.no_grad():
            first = model.decode(ids, cache)
            for _ in range(steps - 1):
                model.decode(ids, cache)
        return {name: min(times[1:] or times) for name, times in spent.items()}, first

    fast, fast_logits = run_decode(True, repeat + 1)
    slow, slow_logits = run_decode(False, 2)
    check_equal(fast_logits, slow_logits, f"Model.decode at batch {batch}: the first logits",
                within=2e-2)
    rows = []
    for i, spec in enumerate(c.layers):
        nbytes = layer_bytes(model, i, picked.get(i, set()), context)
        name = f"layer {i}"
        kind = f"{'encoder' if i < c.n_encoder_layers else 'decoder'} {spec.mode.value}"
        rows.append(layer_row(f"{name}: {kind}, ratio {spec.ratio}", batch, nbytes,
                              fast[name], slow[name], bandwidth))
    rows.append(layer_row("head (bf16)", batch, tensor_bytes(model.head), fast["head"],
                          slow["head"], bandwidth))
    for block in model.layers:
        for m in (block, block.ffn.gate):
            m._forward_hooks.clear()
            m._forward_pre_hooks.clear()
    model.head._forward_hooks.clear()
    model.head._forward_pre_hooks.clear()
    return rows


def layer_row(what: str, batch: int, nbytes: int, fast: float, slow: float,
              bandwidth: float) -> dict:
    floor = nbytes / bandwidth
    return {"what": what, "batch": batch, "bytes": nbytes, "floor_ms": 1e3 * floor,
            "kernel_ms": 1e3 * fast, "kernel_x_floor": fast / floor, "dequant_ms": 1e3 * slow,
            "dequant_x_floor": slow / floor}


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'what':<46} {'batch':>5} {'MB':>8} {'floor ms':>9} {'kernel ms':>10} "
          f"{'x floor':>8} {'dequant ms':>11} {'x floor':>8} {'speed-up':>9}")
    for r in rows:
        print(f"{r['what']:<46} {r['batch']:>5} {r['bytes'] / 1e6:>8.1f} {r['floor_ms']:>9.2f} "
              f"{r['kernel_ms']:>10.2f} {r['kernel_x_floor']:>8.2f} {r['dequant_ms']:>11.1f} "
              f"{r['dequant_x_floor']:>8.1f} {r['dequant_ms'] / r['kernel_ms']:>8.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16,
                        help="routed experts per layer (V4.1-Flash has 384; a batch-1 token "
                             "reads the 6 it picks)")
    parser.add_argument("--context", type=int, default=4096,
                        help="tokens in the cache before the timed decode steps")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of each kernel call")
    parser.add_argument("--threads", type=int, default=1,
                        help="compute threads of the main measurements")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    bandwidth = copy_bandwidth()
    read_rate = read_bandwidth()
    madd_rate = multiply_add_rate()
    with tempfile.TemporaryDirectory() as tmp:
        config = bench_config(args.experts)
        checkpoint_bytes = write_checkpoint(Path(tmp), config)
        before = rss()
        model = Model.from_pretrained(tmp).eval()
        loaded = rss() - before
        result: dict = {"threads": args.threads, "load_average": load,
                        "copy_bandwidth_gb_s": bandwidth / GB,
                        "read_bandwidth_gb_s": read_rate / GB,
                        "gemm_gflop_s": 2 * madd_rate / GB, "isa": native.weights_isa(),
                        "experts": args.experts, "context": args.context,
                        "checkpoint_bytes": checkpoint_bytes, "rss_after_load": loaded}
        with torch.no_grad():
            result["projections"] = [r for batch in (1, 8)
                                     for r in projections(model, batch, bandwidth, args.repeat)]
            result["moe"] = [moe_block(model, batch, bandwidth, madd_rate, args.repeat)
                             for batch in (1, 8)]
            result["moe_by_path"] = moe_by_path(model, args.repeat)
            result["expert_rates"] = expert_rates(model, 4 * args.repeat)
            result["layers"] = [r for batch in (1, 8) for r in
                                whole_layers(model, batch, args.context, bandwidth, args.repeat)]
            # Two threads against one on whole layers, batch 1, kernels only; beside what
            # a second thread adds to torch's copy and GEMM here (the ceiling when the two
            # compute threads share a physical core or a memory channel).
            threads, copy, gemm = {}, {}, {}
            for n in (1, 2):
                torch.set_num_threads(n)
                copy[n], gemm[n] = copy_bandwidth(), multiply_add_rate()
                rows = whole_layers(model, 1, args.context, bandwidth, args.repeat)
                threads[n] = sum(r["kernel_ms"] for r in rows if r["what"].startswith("layer"))
            torch.set_num_threads(args.threads)
            result["two_threads_speedup"] = threads[1] / threads[2]
            result["two_threads_copy_speedup"] = copy[2] / copy[1]
            result["two_threads_gemm_speedup"] = gemm[2] / gemm[1]
        result["rss_after_run"] = rss() - before
    layers = [r for r in result["layers"] if r["batch"] == 1 and r["what"].startswith("layer")]
    head = next(r for r in result["layers"] if r["batch"] == 1 and r["what"].startswith("head"))
    per_layer_bytes = statistics.fmean(r["bytes"] for r in layers)
    per_layer_ratio = statistics.fmean(r["kernel_x_floor"] for r in layers)
    token_bytes = V41_LAYERS * per_layer_bytes + head["bytes"]
    token_s = V41_LAYERS * statistics.fmean(r["kernel_ms"] for r in layers) / 1e3 + \
        head["kernel_ms"] / 1e3
    dequant_s = V41_LAYERS * statistics.fmean(r["dequant_ms"] for r in layers) / 1e3 + \
        head["dequant_ms"] / 1e3
    result["estimate_40_layers"] = {
        "bytes_per_token": token_bytes, "tokens_per_s": 1 / token_s,
        "dequant_tokens_per_s": 1 / dequant_s, "floor_tokens_per_s": bandwidth / token_bytes,
        "tokens_per_s_per_100gb_s": 100 * GB / (token_bytes * per_layer_ratio)}
    if args.json:
        print(json.dumps(result))
        return
    print(f"V4.1-Flash widths, {args.experts} routed experts a layer, context {args.context}; "
          f"{args.threads} thread(s), load average {load:.2f} at the start; copy bandwidth "
          f"{bandwidth / GB:.2f} GB/s; kernels: {result['isa']}")
    print_rows("FP8 projections (layer 0)", result["projections"])
    print_rows("MoE block (layer 0)", result["moe"])
    print("\nMoE block by packed-weight path: " + "; ".join(
        f"{r['isa']} batch {r['batch']} {r['kernel_ms']:.1f} ms" for r in result["moe_by_path"]))
    print_rows(f"Whole layers inside Model.decode, context {args.context}", result["layers"])
    _, b8 = result["moe"]
    alternated = {r["batch"]: r["kernel_ms"] for r in result["moe_by_path"]
                  if r["isa"] == result["isa"]}
    print(f"\nMoE at batch 8 takes {alternated[8] / alternated[1]:.2f}x batch 1's time (rounds "
          f"alternated); its {b8['multiply_adds'] / GB:.2f} G float32 multiply-adds alone take "
          f"{b8['compute_floor_ms'] / alternated[1]:.2f}x at torch's GEMM rate here "
          f"({result['gemm_gflop_s']:.1f} GFLOP/s), so batch 8 runs at "
          f"{alternated[8] / b8['compute_floor_ms']:.2f}x its compute floor")
    rates = ", ".join(f"{r['tokens']}: {r['g_multiply_adds_s']:.0f}"
                      for r in result["expert_rates"])
    print(f"One FP4 expert (layer 0's expert 0, w1, hot) by the tokens it gets: {rates} G "
          f"multiply-adds/s; torch's GEMM {result['gemm_gflop_s'] / 2:.0f}")
    print(f"Two threads run the whole layers {result['two_threads_speedup']:.2f}x as fast as one "
          f"(torch's copy {result['two_threads_copy_speedup']:.2f}x, its GEMM "
          f"{result['two_threads_gemm_speedup']:.2f}x)")
    layer_rate = sum(r["bytes"] for r in layers) / sum(r["kernel_ms"] for r in layers) * 1e3
    print(f"Batch-1 layers read {layer_rate / GB:.1f} GB/s: {layer_rate / read_rate:.0%} of what "
          f"torch reads a second summing 256 MiB here ({read_rate / GB:.1f} GB/s)")
    print(f"Resident memory: checkpoint {checkpoint_bytes / GB:.2f} GB; growth after loading "
          f"{loaded / GB:.2f} GB, after the run {result['rss_after_run'] / GB:.2f} GB "
          f"({result['rss_after_run'] / checkpoint_bytes:.2f}x the checkpoint)")
    e = result["estimate_40_layers"]
    print(f"40 layers + head: {e['bytes_per_token'] / GB:.1f} GB a token; here "
          f"{e['tokens_per_s']:.2f} tok/s with the kernels, {e['dequant_tokens_per_s']:.3f} "
          f"dequantising, floor {e['floor_tokens_per_s']:.2f}; at the kernels' ratio, "
          f"{e['tokens_per_s_per_100gb_s']:.1f} tok/s per 100 GB/s")


if __name__ == "__main__":
    main()
