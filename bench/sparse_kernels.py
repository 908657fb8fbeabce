"""The Triton decode kernels on a GPU: effective GB/s on their bytes, beside the device's
copy bandwidth and torch's dequantise-then-compute of the same packed bytes.

For each context length it builds one decode step's packed state at a model's shapes
(default: DeepSeek-V4.1-Flash's: 64 heads of 512, window 128, top-k 512, an indexer of
32 heads of 128 over a ratio-`--ratio` stream): window rings of FP8 rows, a pool of FP4
KV rows and FP4 index keys reached through block tables, `--batch` sequences. It times

- `sparse_attention` (the window ring plus the selected compressed rows, dequantised in
  registers, attended with the sink) against torch gathering the same rows, dequantising
  them to float32 and attending (what the torch backend does);
- `index_scores` (every entry's FP4 key scored by the indexer's heads) against torch
  dequantising every key and scoring them.

Then the packed-weight kernels of `kvstack.model.weight_kernels`, at 1 token and at
`--batch` tokens (a decode step's rows), on random bytes in the checkpoint's layout
(E4M3 codes never 0x7F or 0xFF, UE8M0 scales near 2^-10, E2M1 pairs any byte):

- `fp8_linear` on the FP8 projections, y = x W^T: the attention's wq_b, wo_b and wo_a
  (block-diagonal: "8x1024x4096" is o_groups blocks of 1024 rows, each reading its 4096
  columns of x) and the FFN's first projection (the shared expert's w1);
- `fp4_grouped` on w1 of the routed experts one decode step uses ("6x2304x5120": 6
  experts): at 1 token its n_activated experts, a row each; at `--batch` tokens, tokens x
  n_activated (token, expert) pairs, each token's experts drawn from the first 64, only
  the experts drawn built and passed (one group each);

each against torch dequantising the whole weight to float32 and multiplying
(`x @ dequantize(W).T`; an expert at a time over its rows). With `--preset tiny` the
widths are the tiny model's (dim 64), for the interpreter.

The bytes a kernel must move are counted from the layout (packed rows read once per
sequence, queries and outputs; a weight's code and scale bytes read once, x and y; not
the split-K workspace, which is the kernel's overhead), and GB/s = bytes / time. The
device's copy bandwidth (bytes read and written by a copy of 1 GiB on a GPU, measured in
the same run) is the roof printed beside each kernel: "of copy" is the share of it the
kernel reaches. "programs" is the kernel's grid (head blocks x splits x sequences; runs x
sequences), what `attention_plan` and `index_plan` chose for this device; for the weight
kernels output tiles x row tiles x splits as `weight_kernels.plan` chooses them
(`fp4_grouped`'s row tiles are the grid's bound, cdiv(rows, tile rows) + groups, of which
the surplus programs do nothing). "batch" is sequences for the cache kernels, tokens for
the weight kernels. Before anything is timed, each kernel's outputs are checked against
torch's (the weight kernels' within float32 rounding: |got - want| <= 1e-4 (|x| @ |W|^T)
+ 1e-6), so on a new GPU the run doubles as a correctness check: a mismatch exits
non-zero, naming the kernel.

    python bench/sparse_kernels.py            # on a CUDA device, V4.1-Flash shapes
    TRITON_INTERPRET=1 python bench/sparse_kernels.py --device cpu --preset tiny \\
        --batch 2 --contexts 256 --repeat 1   # the interpreter: a check, no speeds
"""

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from math import ceil

import torch
from formats import best_seconds  # bench/ is on the path: one way of timing
from rich.console import Console
from rich.table import Table

from kvstack.cache.kernels import (  # triton: the kernels extra (pip install -e '.[kernels]')
    INDEX_FORMAT,
    KV_FORMAT,
    WINDOW_FORMAT,
    attention_plan,
    device_sms,
    index_plan,
    index_scores,
    sparse_attention,
)
from kvstack.cache.rows import PackedRows
from kvstack.config import ModelConfig, preset
from kvstack.formats import Quantized, bytes_per_entry, dequantize
from kvstack.formats.weights import EXPERT_FORMAT, dequantize_fp8_blocks, fp8_block_scale_shape
from kvstack.model.weight_kernels import expert_pointers, fp4_grouped, fp8_linear, plan

EXPERT_POOL = 64  # a batch's tokens route to the first this many experts


@dataclass(frozen=True)
class Result:
    kernel: str
    context: int | None  # None for the weight kernels, which read no cache
    batch: int  # sequences (the cache kernels), tokens (the weight kernels)
    bytes: int  # what the kernel must move for the whole batch
    programs: int  # the kernel's grid
    kernel_ms: float
    torch_ms: float
    kernel_gbps: float
    of_copy: float  # kernel GB/s over the device's copy GB/s
    speedup: float  # torch ms over kernel ms


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v4.1-flash", help="model shapes")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 65536, 131072])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ratio", type=int, default=1,
                        help="the compressed stream's ratio (tokens per entry)")
    parser.add_argument("--block-entries", type=int, default=64,
                        help="compressed entries per pool block")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs; the best is kept")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    for name in ("batch", "ratio", "block_entries", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.contexts) < args.ratio:
        parser.error("every context must hold at least one compressed entry (>= --ratio)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here; on a CPU the kernels run only under Triton's "
                     "interpreter: TRITON_INTERPRET=1 ... --device cpu (a check, no speeds)")
    if not args.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error(f"--device {args.device}: Triton kernels run on CUDA devices, or on "
                     "the CPU with TRITON_INTERPRET=1 set")
    return args


def best_ms(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """best_seconds after one warm-up call (which also compiles a Triton kernel), in ms."""
    fn()
    return best_seconds(fn, device, repeat) * 1e3


def copy_gbps(device: torch.device, repeat: int) -> float:
    """Bytes read plus bytes written per second by a copy of 1 GiB (the roof a streaming
    kernel can reach here), in GB/s; 64 MiB off a GPU, where the interpreter's speeds mean
    nothing and the copy would only slow the check down."""
    src = torch.ones((1 << 28) if device.type == "cuda" else (1 << 24), device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_ms(lambda: dst.copy_(src), device, repeat) / 1e6


def packed_pool(fmt: str, n_blocks: int, per: int, width: int, device: torch.device,
                g: torch.Generator) -> PackedRows:
    """A pool of n_blocks blocks of `per` packed random rows and a last null block. A few
    distinct blocks are packed and repeated: the kernels' speed does not depend on the
    values, and 128K entries a sequence would be gigabytes of floats to pack."""
    pool = PackedRows(fmt, width, (n_blocks + 1, per), device)
    distinct = min(n_blocks, 64)
    packed, _ = pool.pack(torch.randn(distinct, per, width, generator=g).to(device))
    pool.data[:n_blocks] = packed[torch.arange(n_blocks, device=device) % distinct]
    return pool


def step_state(c: ModelConfig, context: int, batch: int, ratio: int, per: int,
               device: torch.device, g: torch.Generator) -> dict:
    """One decode step's packed state: every sequence at position context - 1, its own
    window ring slot and its own run of pool blocks (shuffled, as a paged pool's are)."""
    entries = context // ratio
    blocks_each = -(-entries // per)
    n_blocks = batch * blocks_each
    window = c.window_size
    ring = PackedRows(WINDOW_FORMAT, c.head_dim, (batch, window), device)
    ring.data[:], _ = ring.pack(torch.randn(batch, window, c.head_dim, generator=g).to(device))
    held = torch.arange(context - window, context, device=device)
    ring_positions = torch.empty(batch, window, dtype=torch.long, device=device)
    ring_positions[:, held % window] = held
    k = min(c.index_topk, entries)
    selected = torch.stack([torch.randperm(entries, generator=g)[:k] for _ in range(batch)])
    return {
        "kv": packed_pool(KV_FORMAT, n_blocks, per, c.head_dim, device, g),
        "index": packed_pool(INDEX_FORMAT, n_blocks, per, c.index_head_dim, device, g),
        "ring": ring, "ring_positions": ring_positions,
        "block_table": torch.randperm(n_blocks, generator=g).view(batch, blocks_each)
        .to(device),
        "positions": torch.full((batch,), context - 1, device=device),
        "slots": torch.arange(batch, device=device), "selected": selected.to(device),
        "entries": entries, "per": per,
        "q": torch.randn(batch, c.n_heads, c.head_dim, generator=g).to(device),
        "sink": torch.randn(c.n_heads, generator=g).to(device),
        "iq": torch.randn(batch, c.index_n_heads, c.index_head_dim, generator=g).to(device),
        "iw": torch.randn(batch, c.index_n_heads, generator=g).to(device),
    }


def kernel_attention(s: dict, window: int) -> torch.Tensor:
    return sparse_attention(s["q"], s["sink"], s["ring"].data, s["ring_positions"], s["slots"],
                            s["positions"], s["kv"].data, s["block_table"], s["selected"],
                            window)


def kernel_index_scores(s: dict, ratio: int) -> torch.Tensor:
    return index_scores(s["iq"], s["iw"], s["index"].data, s["block_table"], s["positions"],
                        s["entries"], ratio)


def torch_attention(s: dict, window: int) -> torch.Tensor:
    """The torch backend's way: gather the ring's rows and the selected rows, dequantise
    them to float32, attend with the sink. [B, H, D]"""
    b, h, d = s["q"].shape
    kv, per = s["kv"], s["per"]
    chosen = s["selected"]
    blocks = s["block_table"].gather(1, chosen // per)
    rows = torch.cat((s["ring"].read(s["ring"].data[s["slots"]]),  # [B, window, D]
                      kv.read(kv.data[blocks, chosen % per])), dim=1)  # [B, window + k, D]
    logits = torch.einsum("bhd,bnd->bhn", s["q"], rows) * d**-0.5
    logits = torch.cat((logits, s["sink"].view(1, h, 1).expand(b, h, 1)), dim=2)
    return torch.einsum("bhn,bnd->bhd", logits.softmax(-1)[..., :-1], rows)


def torch_index_scores(s: dict) -> torch.Tensor:
    """Every entry's key dequantised to float32 and scored: [B, entries]."""
    index, per = s["index"], s["per"]
    entry = torch.arange(s["entries"], device=s["q"].device)
    keys = index.read(index.data[s["block_table"][:, entry // per], entry % per])
    scores = torch.einsum("bhd,bnd->bhn", s["iq"], keys).relu()
    return (scores * s["iw"][..., None]).sum(1)


def attention_programs(c: ModelConfig, s: dict) -> int:
    batch, k = s["selected"].shape
    rows = s["ring"].data.shape[1] + k
    return attention_plan(rows, batch, c.n_heads, c.head_dim, device_sms(s["q"].device))[2]


def index_programs(c: ModelConfig, s: dict) -> int:
    batch = s["block_table"].shape[0]
    return index_plan(s["entries"], batch, c.index_n_heads, c.index_head_dim,
                      device_sms(s["q"].device))[2]


def attention_bytes(c: ModelConfig, s: dict) -> int:
    """What sparse attention must move: each sequence's window ring rows and selected
    rows read once, the ring's positions, the selections, the query and the output."""
    batch, k = s["selected"].shape
    rows = c.window_size * bytes_per_entry(WINDOW_FORMAT, c.head_dim) \
        + k * bytes_per_entry(KV_FORMAT, c.head_dim)
    small = c.window_size * 8 + k * 8 + 2 * c.n_heads * c.head_dim * 4
    return batch * (rows + small)


def index_bytes(c: ModelConfig, s: dict) -> int:
    """What index scoring must move: every entry's FP4 key, the query, weights, scores."""
    batch, entries = s["block_table"].shape[0], s["entries"]
    keys = entries * bytes_per_entry(INDEX_FORMAT, c.index_head_dim)
    small = c.index_n_heads * (c.index_head_dim + 1) * 4 + entries * 4
    return batch * (keys + small)


def fp8_shapes(c: ModelConfig) -> list[tuple[str, int, int, int]]:
    """(name, out features, in features a group, groups) of the FP8 projections timed: the
    attention's wq_b, wo_b and wo_a (block-diagonal, o_groups blocks) and the FFN's first
    projection (the shared expert's w1, or a dense FFN's w1)."""
    ffn = c.n_shared_experts * c.moe_inter_dim if c.n_routed_experts else c.inter_dim
    shapes = [("wq_b", c.n_heads * c.head_dim, c.q_lora_rank, 1),
              ("wo_b", c.dim, c.o_groups * c.o_lora_rank, 1),
              ("wo_a", c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim // c.o_groups,
               c.o_groups),
              ("shared w1" if c.n_routed_experts else "w1", ffn, c.dim, 1)]
    return [shape for shape in shapes if shape[1] > 0]


def random_bytes(shape: tuple[int, ...], low: int, high: int, g: torch.Generator,
                 device: torch.device) -> torch.Tensor:
    """uint8 bytes drawn uniformly from low..high - 1."""
    return torch.randint(low, high, shape, generator=g, dtype=torch.uint8).to(device)


def scale_bytes(shape: tuple[int, ...], g: torch.Generator, device: torch.device) -> torch.Tensor:
    """UE8M0 scales 2^-12 .. 2^-8 (bytes 115..119), around a checkpoint's 2^-10."""
    return random_bytes(shape, 115, 120, g, device)


def fp8_state(name: str, out_features: int, in_features: int, groups: int, tokens: int,
              device: torch.device, g: torch.Generator) -> dict:
    """An FP8 weight [out, in] (E4M3 codes, never the NaN codes 0x7F and 0xFF, and its
    32x32 blocks' scales) and x [tokens, groups * in]."""
    codes = random_bytes((out_features, in_features), 0, 254, g, device)
    codes += (codes >= 0x7F).to(torch.uint8)  # 0..126, 128..254
    scales = scale_bytes(fp8_block_scale_shape(out_features, in_features), g, device)
    blocks = f"{groups}x{out_features // groups}" if groups > 1 else f"{out_features}"
    return {"name": f"fp8_linear {name} {blocks}x{in_features}", "codes": codes,
            "scales": scales, "groups": groups,
            "x": torch.randn(tokens, groups * in_features, generator=g).to(device)}


def block_matmul(x: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
    """x [N, groups * K] times w [O, K]^T as `groups` blocks of O / groups rows, block g
    reading x's columns g*K .. g*K + K - 1 (one block: x @ w.T)."""
    if groups == 1:
        return x @ w.T
    (n, _), (o, k) = x.shape, w.shape
    return torch.einsum("ngk,grk->ngr", x.view(n, groups, k),
                        w.view(groups, o // groups, k)).reshape(n, o)


def kernel_fp8(s: dict) -> torch.Tensor:
    return fp8_linear(s["x"], s["codes"], s["scales"], s["groups"])


def torch_fp8(s: dict, magnitudes: bool = False) -> torch.Tensor:
    """The weight dequantised to float32, then multiplied; magnitudes: |x| @ |W|^T, the
    scale of float32 rounding's error."""
    w = dequantize_fp8_blocks(s["codes"], s["scales"])
    if magnitudes:
        return block_matmul(s["x"].abs(), w.abs(), s["groups"])
    return block_matmul(s["x"], w, s["groups"])


def fp8_programs(s: dict, sms: int) -> int:
    """fp8_linear's grid: output tiles (per group) x row tiles x splits."""
    (n, _), (o, k), groups = s["x"].shape, s["codes"].shape, s["groups"]
    group_rows = o // groups

    def tiles(block_o: int, block_n: int) -> int:
        return groups * -(-group_rows // block_o) * -(-n // block_n)

    p = plan(n, tiles, k, sms)
    return tiles(p.block_o, p.block_n) * p.split


def fp8_bytes(s: dict) -> int:
    """The weight's codes and scales, read once, x and y."""
    (n, _), o = s["x"].shape, s["codes"].shape[0]
    return s["codes"].numel() + s["scales"].numel() + s["x"].nbytes + n * o * 4


def moe_state(c: ModelConfig, tokens: int, device: torch.device, g: torch.Generator) -> dict:
    """w1 of the routed experts one decode step of `tokens` tokens uses: each token routed
    to n_activated distinct experts of the first EXPERT_POOL, only the experts drawn built
    (E2M1 codes [inter, dim / 2], any byte, and scales [inter, dim / 32]), and x [pairs,
    dim], its rows the (token, expert) pairs sorted by expert."""
    pool = min(EXPERT_POOL, c.n_routed_experts)
    chosen = torch.stack([torch.randperm(pool, generator=g)[:c.n_activated_experts]
                          for _ in range(tokens)])
    used, expert_of = chosen.flatten().unique(return_inverse=True)
    counts = torch.bincount(expert_of, minlength=len(used))
    o, k = c.moe_inter_dim, c.dim
    codes = random_bytes((len(used), o, k // 2), 0, 256, g, device)
    scales = scale_bytes((len(used), o, k // 32), g, device)
    ends = counts.cumsum(0)
    return {"name": f"fp4_grouped w1 {len(used)}x{o}x{k}", "codes": codes, "scales": scales,
            "pointers": expert_pointers(list(zip(codes, scales, strict=True))),
            "experts": torch.arange(len(used), dtype=torch.int32, device=device),
            "ends": ends.to(torch.int32).to(device), "row_ends": ends.tolist(),
            "x": torch.randn(int(counts.sum()), k, generator=g).to(device)}


def kernel_fp4(s: dict) -> torch.Tensor:
    return fp4_grouped(s["x"], s["pointers"], s["experts"], s["ends"], s["codes"].shape[1])


def torch_fp4(s: dict, magnitudes: bool = False) -> torch.Tensor:
    """An expert at a time: its weight dequantised to float32, times its rows of x;
    magnitudes: |x| @ |W|^T instead."""
    x = s["x"].abs() if magnitudes else s["x"]
    out = x.new_empty(x.shape[0], s["codes"].shape[1])
    start = 0
    for e, end in enumerate(s["row_ends"]):
        w = dequantize(Quantized(EXPERT_FORMAT, s["codes"][e], s["scales"][e]))
        out[start:end] = x[start:end] @ (w.abs() if magnitudes else w).T
        start = end
    return out


def fp4_programs(s: dict, sms: int) -> int:
    """fp4_grouped's grid: (row tiles of all rows + one a group, a bound) x output tiles
    x splits."""
    (m, k), groups, o = s["x"].shape, len(s["row_ends"]), s["codes"].shape[1]

    def tiles(block_o: int, block_m: int) -> int:
        return -(-m // block_m) * -(-o // block_o)

    p = plan(max(1, ceil(m / groups)), tiles, k, sms, k_step=2)
    return (-(-m // p.block_n) + groups) * -(-o // p.block_o) * p.split


def fp4_bytes(s: dict) -> int:
    """Every expert's codes and scales, read once, x and y."""
    m, o = s["x"].shape[0], s["codes"].shape[1]
    return s["codes"].numel() + s["scales"].numel() + s["x"].nbytes + m * o * 4


def weight_cases(c: ModelConfig, batch: int, device: torch.device) -> list[tuple]:
    """(name, tokens, kernel, torch, torch's |x| @ |W|^T, bytes, programs) of every weight
    kernel timed, at 1 token and at `batch`."""
    sms = device_sms(device) or 1  # the interpreter: weight_kernels plans for one SM
    cases = []
    for tokens in sorted({1, batch}):
        g = torch.Generator().manual_seed(tokens)
        for shape in fp8_shapes(c):
            s = fp8_state(*shape, tokens, device, g)
            cases.append((s["name"], tokens, partial(kernel_fp8, s), partial(torch_fp8, s),
                          partial(torch_fp8, s, True), fp8_bytes(s), fp8_programs(s, sms)))
        if c.n_routed_experts:
            s = moe_state(c, tokens, device, g)
            cases.append((s["name"], tokens, partial(kernel_fp4, s), partial(torch_fp4, s),
                          partial(torch_fp4, s, True), fp4_bytes(s), fp4_programs(s, sms)))
    return cases


def timed(kernel: str, context: int | None, batch: int, fn: Callable[[], object],
          peer: Callable[[], object], moved: int, programs: int, roof: float,
          device: torch.device, repeat: int) -> Result:
    kernel_ms = best_ms(fn, device, repeat)
    torch_ms = best_ms(peer, device, repeat)
    kernel_gbps = moved / kernel_ms / 1e6
    return Result(kernel, context, batch, moved, programs, round(kernel_ms, 4),
                  round(torch_ms, 4), round(kernel_gbps, 1), round(kernel_gbps / roof, 3),
                  round(torch_ms / kernel_ms, 2))


def run(args: argparse.Namespace) -> tuple[float, list[Result]]:
    c = preset(args.preset)
    device = torch.device(args.device)
    roof = None
    results = []
    for context in args.contexts:
        s = step_state(c, context, args.batch, args.ratio, args.block_entries, device,
                       torch.Generator().manual_seed(context))
        pairs = (("sparse attention", partial(kernel_attention, s, c.window_size),
                  partial(torch_attention, s, c.window_size), attention_bytes(c, s),
                  attention_programs(c, s)),
                 ("index scores", partial(kernel_index_scores, s, args.ratio),
                  partial(torch_index_scores, s), index_bytes(c, s), index_programs(c, s)))
        # Checked first: a wrong kernel's speed is no result, so it stops the run here.
        for name, fn, peer, _, _ in pairs:
            kernel_out, torch_out = fn(), peer()
            if not torch.allclose(kernel_out, torch_out, atol=1e-3, rtol=1e-3):
                raise SystemExit(f"{name} at context {context}: the kernel's output differs "
                                 f"from torch's (max |difference| "
                                 f"{float((kernel_out - torch_out).abs().max()):.3g})")
        if roof is None:
            roof = copy_gbps(device, args.repeat)
        for name, fn, peer, moved, programs in pairs:
            results.append(timed(name, context, args.batch, fn, peer, moved, programs, roof,
                                 device, args.repeat))
        del s, pairs  # the pools, before the next context's
    cases = weight_cases(c, args.batch, device)
    for name, tokens, fn, peer, magnitudes, _, _ in cases:
        got, want = fn(), peer()
        excess = (got - want).abs() - (1e-4 * magnitudes() + 1e-6)
        if not bool((excess <= 0).all()):  # NaN fails too
            raise SystemExit(f"{name} at {tokens} token(s): the kernel's output differs from "
                             f"torch's beyond float32 rounding (max |difference| "
                             f"{float((got - want).abs().max()):.3g})")
    for name, tokens, fn, peer, _, moved, programs in cases:
        results.append(timed(name, None, tokens, fn, peer, moved, programs, roof, device,
                             args.repeat))
    return roof, results


def main() -> None:
    args = parse_args()
    roof, results = run(args)
    where = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
             else "CPU, Triton's interpreter (speeds mean nothing)")
    if args.json:
        json.dump({"device": where, "preset": args.preset, "ratio": args.ratio,
                   "copy_gbps": round(roof, 1), "results": [asdict(r) for r in results]},
                  sys.stdout, indent=1)
        print()
        return
    table = Table(title=f"Triton decode kernels, {args.preset} shapes, {where}")
    for col in ("kernel", "context", "batch", "MB moved", "programs", "kernel ms", "GB/s",
                "of copy", "torch ms", "torch / kernel"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for r in results:
        table.add_row(r.kernel, "-" if r.context is None else f"{r.context:,}", f"{r.batch:,}",
                      f"{r.bytes / 1e6:.2f}", f"{r.programs:,}", f"{r.kernel_ms:.3f}",
                      f"{r.kernel_gbps:,.1f}", f"{r.of_copy:.1%}", f"{r.torch_ms:.3f}",
                      f"{r.speedup:.2f}x")
    console = Console()
    console.print(table)
    size = "1 GiB" if args.device.startswith("cuda") else "64 MiB"
    console.print(f"copy: {roof:,.0f} GB/s (bytes read and written by a {size} copy, this "
                  f"run); outputs equal torch's (checked before timing). batch: sequences "
                  f"(attention, index), tokens (weights)")


if __name__ == "__main__":
    main()
