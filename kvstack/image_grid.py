"""Where an image goes in a prompt, in plain Python (no torch, so the planner reads it):
the token grid an image of some pixel size takes and the positions its segment holds, as
DeepSeek's V4.1 `inference/image_processor.py` plans them."""

import math
from dataclasses import dataclass

from kvstack.config import ModelConfig


def segment_length(n_h: int, n_w: int) -> int:
    """Positions an image of n_h x n_w tokens takes in the prompt: a start, each row's
    tokens and its newline, an end."""
    return n_h * (n_w + 1) + 2


@dataclass(frozen=True)
class GridPlan:
    """Where an image of some pixel size goes: the token grid and the pixel size the
    patches are cut from (a multiple of the patch size each way)."""

    n_h: int
    n_w: int
    height: int
    width: int


def _token_grid(height: int, width: int, patch: int, ratio: int) -> tuple[int, int]:
    return math.ceil((height // patch) / ratio), math.ceil((width // patch) / ratio)


def _largest_fit(height: float, width: float, patch: int, ratio: int,
                 max_tokens: int) -> tuple[int, int]:
    """The largest pixel size of the image's aspect whose segment fits max_tokens: the
    token grid's width w solves h (w + 1) + 2 = max_tokens with h = w * height / width."""
    aspect = height / width
    w_max = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    h_max = w_max * aspect
    cell = patch * ratio
    if w_max < 1.0:  # very tall: one column
        return (max_tokens - 2) // 2 * cell, cell
    if h_max < 1.0:  # very wide: one row
        return cell, (max_tokens - 3) * cell
    scale = min(math.floor(w_max) * cell / width, math.floor(h_max) * cell / height)
    return (math.floor(height * scale / patch) * patch,
            math.floor(width * scale / patch) * patch)


def plan_grid(width: int, height: int, config: ModelConfig) -> GridPlan:
    """The grid an image of width x height pixels takes (a pure function of its size)."""
    c = config
    p, r = c.vision_patch_size, c.vision_downsample_ratio
    w, h = float(width), float(height)
    if c.vision_max_wh_ratio is not None and w > h * c.vision_max_wh_ratio:
        w = h * c.vision_max_wh_ratio
    if 0 < w * h < c.vision_min_pixels:
        scale = (c.vision_min_pixels / (w * h)) ** 0.5
        w, h = int(w * scale), int(h * scale)
    best_w, best_h = math.ceil(w / p) * p, math.ceil(h / p) * p
    n_h, n_w = _token_grid(best_h, best_w, p, r)
    if segment_length(n_h, n_w) > c.vision_max_n_token:
        best_h, best_w = _largest_fit(h, w, p, r, c.vision_max_n_token)
        n_h, n_w = _token_grid(best_h, best_w, p, r)
    return GridPlan(n_h, n_w, best_h, best_w)


