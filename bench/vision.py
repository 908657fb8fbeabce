"""The vision tower at V4.1-Flash's widths: seconds a picture takes through the ViT and the
aligner, beside the floor of its arithmetic.

The tower is compute-bound (every patch meets every weight, and every patch attends every
other), so its floor is its multiply-adds divided by the rate this machine's float32
matmul reaches, measured in the same run on the same threads (a 2048 x 2048 x 2048
torch.mm). No other engine runs V4.1's tower on a CPU (HF transformers has no V4.1 model,
vLLM's CPU build refuses V4.1, llama.cpp's port is stalled), so there is no peer row.
Random weights, float32, as `Model.vision` holds them after loading; `--layers` times that
many of the 32 blocks and scales to 32 (the blocks are identical in shape), saying so.

    python bench/vision.py [--size 1024x768] [--layers 4] [--threads 1] [--json]
"""

import argparse
import json
import time

import torch

from kvstack.cli.plan import image_size
from kvstack.config import preset
from kvstack.image_grid import plan_grid, segment_length
from kvstack.model.vision import Aligner, ViT


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=image_size, default=(1024, 768), metavar="WxH",
                        help="the picture's pixels (default 1024x768)")
    parser.add_argument("--layers", type=int, default=4,
                        help="ViT blocks timed (of 32; the time is scaled to 32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs; the best is kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not 1 <= args.layers <= 32 or args.repeat < 1 or args.threads < 1:
        parser.error("--layers must be 1..32, --repeat and --threads at least 1")
    return args


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    flash = preset("deepseek-v4.1-flash")
    c = flash.replace(vision_n_layers=args.layers)
    grid = plan_grid(*args.size, c)
    n_h, n_w = grid.height // c.vision_patch_size, grid.width // c.vision_patch_size
    n = n_h * n_w  # patches
    torch.manual_seed(0)
    with torch.no_grad():
        vit, aligner = ViT(c).eval(), Aligner(c).eval()
        for p in [*vit.parameters(), *aligner.parameters()]:
            p.normal_(0, 0.02)
        patches = torch.randn(n, 3, c.vision_patch_size, c.vision_patch_size)
        vit(patches, n_h, n_w)  # warm-up
        seconds = best(lambda: vit(patches, n_h, n_w), args.repeat)
        features = vit(patches, n_h, n_w)
        aligner_s = best(lambda: aligner(features, n_h, n_w), args.repeat)
        a = torch.randn(2048, 2048)
        torch.mm(a, a)
        mm_s = best(lambda: torch.mm(a, a), args.repeat + 1)
    d, inter = c.vision_dim, c.vision_inter_dim
    per_block = n * (3 * d * d + d * d + 2 * inter * d + inter * d) + 2 * n * n * d
    tokens = grid.n_h * grid.n_w
    aligner_macs = tokens * (d * 9 * c.dim + c.dim * c.dim)
    macs = flash.vision_n_layers * per_block + aligner_macs
    rate = 2048 ** 3 / mm_s  # multiply-adds per second of a large float32 matmul
    tower_s = seconds * flash.vision_n_layers / args.layers + aligner_s
    result = {
        "size": list(args.size), "patches": n, "tokens": [grid.n_h, grid.n_w],
        "positions": segment_length(grid.n_h, grid.n_w), "threads": args.threads,
        "layers_timed": args.layers, "seconds_per_block": seconds / args.layers,
        "aligner_seconds": aligner_s, "tower_seconds": tower_s, "multiply_adds": macs,
        "matmul_gmacs": rate / 1e9, "floor_seconds": macs / rate,
        "vs_floor": tower_s / (macs / rate),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"V4.1-Flash vision tower, a {args.size[0]} x {args.size[1]} picture: {n:,} patches "
          f"({n_h} x {n_w}), {grid.n_h} x {grid.n_w} tokens, {result['positions']} prompt "
          f"positions; {args.threads} thread(s), {args.layers} of 32 blocks timed")
    print(f"  a block {seconds / args.layers:.2f} s, the aligner {aligner_s:.3f} s: the tower "
          f"{tower_s:.1f} s (32 blocks)")
    print(f"  {macs / 1e12:.2f} x 10^12 multiply-adds; float32 matmul here "
          f"{rate / 1e9:.1f} G/s (2048^3 torch.mm, same threads): floor {macs / rate:.1f} s, "
          f"the tower at {tower_s / (macs / rate):.2f}x its floor")


if __name__ == "__main__":
    main()
