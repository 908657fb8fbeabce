"""Throughput of the KV-cache storage formats in `kvstack.formats`, next to a plain copy.

For every format this times quantize+pack (what the engine does when it writes an entry)
and unpack+dequantize (what it does when it reads one) on one large seeded tensor. The
numbers are the baseline that later GPU kernels must beat. Every throughput is counted as
float32 input bytes per second so all rows compare, and each is also given as a ratio to
`x.clone()` measured in the same run, because the machines are shared and noisy: absolute
GB/s drift between runs, the ratio to copy drifts much less.
"""

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
from rich.console import Console
from rich.table import Table

from kvstack.cache.batch import KEY_FLOATS
from kvstack.engine.config import retain_freed_memory
from kvstack.formats import FORMATS, bytes_per_entry, dequantize, pack_rows, quantize, unpack_rows
from kvstack.formats.codecs import e2m1_decode_packed, ue8m0_decode

HEAD_DIM = 512  # width of a KV entry
INDEX_HEAD_DIM = 128  # width of an indexer key, the only use of fp4_ue8m0_32
WIDTHS = {name: HEAD_DIM for name in FORMATS} | {"fp4_ue8m0_32": INDEX_HEAD_DIM}


@dataclass(frozen=True)
class Result:
    format: str
    bytes_per_element: float
    quantize_pack_gbps: float
    unpack_dequantize_gbps: float
    quantize_pack_vs_copy: float
    unpack_dequantize_vs_copy: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=2**24, help="float32 elements in x")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs; the best is kept")
    parser.add_argument("--device", default="cpu", help='"cpu" or "cuda"')
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    if args.elements <= 0 or args.elements % HEAD_DIM:
        parser.error(f"--elements must be a positive multiple of {HEAD_DIM}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def best_seconds(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Minimum wall time of fn over repeat runs; the minimum is the least disturbed run."""
    times = []
    for _ in range(repeat):
        # CUDA launches are asynchronous: without a sync the clock would stop before the work.
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def gbps(elements: int, seconds: float) -> float:
    return elements * 4 / seconds / 1e9


def verify(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Packed rows of x, after checking that packing loses nothing; exits if it does."""
    q = quantize(x, fmt)
    rows = pack_rows(q)
    if not torch.equal(dequantize(unpack_rows(rows, fmt, x.shape[-1])), dequantize(q)):
        sys.exit(f"error: {fmt}: unpack_rows(pack_rows(q)) does not dequantize like q")
    return rows


def bench_format(
    x: torch.Tensor, fmt: str, copy_gbps: float, device: torch.device, repeat: int
) -> Result:
    d = WIDTHS[fmt]
    x = x.view(-1, d)
    # verify also serves as the warm-up run, so lazy initialisation stays out of the timings.
    rows = verify(x, fmt)
    write = gbps(x.numel(), best_seconds(lambda: pack_rows(quantize(x, fmt)), device, repeat))
    read = gbps(
        x.numel(),
        best_seconds(lambda: dequantize(unpack_rows(rows, fmt, d)), device, repeat),
    )
    per_element = bytes_per_entry(fmt, d) / d
    return Result(fmt, per_element, write, read, write / copy_gbps, read / copy_gbps)


def decoded_apart(rows: torch.Tensor, d: int) -> torch.Tensor:
    """fp4_ue8m0_32 rows read the way the other formats are: codes and scales decoded by
    their own tables, then multiplied (dequantize instead looks each code byte up in one
    table of every scale and code byte pair)."""
    q = unpack_rows(rows, "fp4_ue8m0_32", d)
    values = e2m1_decode_packed(q.codes).view(*q.scales.shape, FORMATS["fp4_ue8m0_32"].scale_block)
    return (values * ue8m0_decode(q.scales)[..., None]).flatten(-2)


def _calls(fn: Callable[[], object], n: int) -> None:
    for _ in range(n):
        fn()


def pair_table_speedup(device: torch.device, repeat: int) -> float:
    """How many times faster dequantize reads fp4_ue8m0_32 rows than decoded_apart, on one
    chunk of a decode step's index scoring (KEY_FLOATS floats of keys) with malloc keeping
    freed memory, as in the engine (else each call's page faults are most of what is
    timed); the two timed in turns, 20 calls a round, each keeping its best round, after
    checking that both give the same floats."""
    d = WIDTHS["fp4_ue8m0_32"]
    retain_freed_memory()
    keys = torch.randn(KEY_FLOATS // d, d, generator=torch.Generator().manual_seed(1))
    rows = verify(keys.to(device), "fp4_ue8m0_32")
    both = {"apart": lambda: decoded_apart(rows, d),
            "table": lambda: dequantize(unpack_rows(rows, "fp4_ue8m0_32", d))}
    if not torch.equal(both["apart"](), both["table"]()):
        sys.exit("error: fp4_ue8m0_32: the pair table and the separate codecs disagree")
    best = dict.fromkeys(both, float("inf"))
    for _ in range(repeat):
        for name, fn in both.items():
            twenty = partial(_calls, fn, 20)
            best[name] = min(best[name], best_seconds(twenty, device, 1))
    return best["apart"] / best["table"]


def render(console: Console, header: str, copy_gbps: float, results: list[Result]) -> None:
    # Short headers, explained in the caption, keep the table inside an 80-column terminal.
    table = Table(
        title=header,
        caption="write = quantize+pack, read = unpack+dequantize; "
        "GB/s of float32 input; copy = x.clone()",
    )
    table.add_column("format", no_wrap=True)
    table.add_column("B/elem", justify="right")
    table.add_column("write GB/s", justify="right")
    table.add_column("write", justify="right")
    table.add_column("read GB/s", justify="right")
    table.add_column("read", justify="right")
    table.add_row("copy", "4.000", f"{copy_gbps:.2f}", "1.00× copy", "", "")
    for r in results:
        table.add_row(
            r.format,
            f"{r.bytes_per_element:.3f}",
            f"{r.quantize_pack_gbps:.2f}",
            f"{r.quantize_pack_vs_copy:.2f}× copy",
            f"{r.unpack_dequantize_gbps:.2f}",
            f"{r.unpack_dequantize_vs_copy:.2f}× copy",
        )
    console.print(table)


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(args.elements // HEAD_DIM, HEAD_DIM).to(device)

    x.clone()  # warm-up: the first allocation of this size is not what a copy costs
    copy_gbps = gbps(args.elements, best_seconds(x.clone, device, args.repeat))
    results = [bench_format(x, fmt, copy_gbps, device, args.repeat) for fmt in FORMATS]
    speedup = pair_table_speedup(device, args.repeat)

    if args.json:
        report = {
            "device": str(device),
            "elements": args.elements,
            "copy_gbps": copy_gbps,
            "formats": [asdict(r) for r in results],
            "fp4_ue8m0_32_pair_table_speedup": speedup,
        }
        print(json.dumps(report, indent=2))
        return
    header = (
        f"torch {torch.__version__} · device {device} · {torch.get_num_threads()} threads · "
        f"{args.elements} elements · best of {args.repeat}"
    )
    render(Console(), header, copy_gbps, results)
    print(f"fp4_ue8m0_32 rows read through the table of scale and code byte pairs: "
          f"{speedup:.2f}x as fast as decoding codes and scales apart and multiplying "
          f"({KEY_FLOATS // WIDTHS['fp4_ue8m0_32']:,} rows of {WIDTHS['fp4_ue8m0_32']}, "
          "one chunk of a decode step's index scoring; timed in turns)")


if __name__ == "__main__":
    main()
