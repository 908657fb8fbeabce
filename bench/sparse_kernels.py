"""The Triton decode kernels on a GPU: effective GB/s on their bytes, beside the device's
copy bandwidth and torch's gather-dequantise-compute of the same packed rows.

For each context length it builds one decode step's packed state at a model's shapes
(default: DeepSeek-V4.1-Flash's: 64 heads of 512, window 128, top-k 512, an indexer of
32 heads of 128 over a ratio-`--ratio` stream): window rings of FP8 rows, a pool of FP4
KV rows and FP4 index keys reached through block tables, `--batch` sequences. It times

- `sparse_attention` (the window ring plus the selected compressed rows, dequantised in
  registers, attended with the sink) against torch gathering the same rows, dequantising
  them to float32 and attending (what the torch backend does);
- `index_scores` (every entry's FP4 key scored by the indexer's heads) against torch
  dequantising every key and scoring them.

The bytes a kernel must move are counted from the layout (packed rows read once per
sequence, queries and outputs; not the split-K workspace, which is the kernel's overhead),
and GB/s = bytes / time. The device's copy bandwidth (bytes read and written by a copy of
1 GiB on a GPU, measured in the same run) is the roof printed beside each kernel: "of
copy" is the share of it the kernel reaches. "programs" is the kernel's grid (head
blocks x splits x sequences; runs x sequences), what `attention_plan` and `index_plan`
chose for this device. Before anything is timed, each context's kernel outputs are checked
against torch's, so on a new GPU the run doubles as a correctness check.

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
from kvstack.formats import bytes_per_entry


@dataclass(frozen=True)
class Result:
    kernel: str
    context: int
    batch: int
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
            kernel_ms = best_ms(fn, device, args.repeat)
            torch_ms = best_ms(peer, device, args.repeat)
            kernel_gbps = moved / kernel_ms / 1e6
            results.append(Result(name, context, args.batch, moved, programs,
                                  round(kernel_ms, 4), round(torch_ms, 4),
                                  round(kernel_gbps, 1), round(kernel_gbps / roof, 3),
                                  round(torch_ms / kernel_ms, 2)))
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
    table = Table(title=f"Triton decode kernels, {args.preset} shapes, batch {args.batch}, "
                        f"{where}")
    for col in ("kernel", "context", "MB moved", "programs", "kernel ms", "GB/s", "of copy",
                "torch ms", "torch / kernel"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for r in results:
        table.add_row(r.kernel, f"{r.context:,}", f"{r.bytes / 1e6:.2f}", f"{r.programs:,}",
                      f"{r.kernel_ms:.3f}", f"{r.kernel_gbps:,.1f}", f"{r.of_copy:.1%}",
                      f"{r.torch_ms:.3f}", f"{r.speedup:.2f}x")
    console = Console()
    console.print(table)
    size = "1 GiB" if args.device.startswith("cuda") else "64 MiB"
    console.print(f"copy: {roof:,.0f} GB/s (bytes read and written by a {size} copy, this "
                  f"run); outputs equal torch's (checked before timing)")


if __name__ == "__main__":
    main()
