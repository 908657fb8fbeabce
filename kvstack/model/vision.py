"""V4.1's vision tower: a ViT over an image's pixel patches and the aligner that turns its
output into the language model's embedding rows, as DeepSeek's V4.1 `inference/vision.py`
defines them.

An image of n_vit_h x n_vit_w patches (`kvstack.engine.images` makes them) becomes a grid
of n_h x n_w tokens, the aligner merging each downsample_ratio x downsample_ratio square of
patches into one (n_h = ceil(n_vit_h / ratio)). The prompt holds the image as a segment of
n_h (n_w + 1) + 2 positions, every one carrying `image_token_id`:

    IMAGE_START, (IMAGE x n_w, IMAGE_NEW_LINE) x n_h, IMAGE_END

The IMAGE positions take the aligner's rows in reading order; the three delimiters take
learned embeddings (`Model.image_start`, `image_newline`, `image_end`). Image positions are
cache positions like text: they cost the same bytes a token.

Computed in float32 (the reference runs in bf16; its noise is the bar the tests hold this
to).
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvstack.config import ModelConfig
from kvstack.image_grid import segment_length

# What each position of an image segment holds (the reference's token types).
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)
# The ViT's norms are the reference's own, not the trunk's norm_eps.
VISION_NORM_EPS = 1e-6


def segment_types(n_h: int, n_w: int) -> torch.Tensor:
    """The segment's position types int64 [segment_length]: reading order, a newline a row."""
    row = [IMAGE] * n_w + [IMAGE_NEW_LINE]
    return torch.tensor([IMAGE_START, *(row * n_h), IMAGE_END], dtype=torch.int64)


@dataclass(frozen=True)
class ImageInput:
    """One image as the tower takes it: patches [n_vit_h * n_vit_w, 3, p, p] (normalised
    pixels, rows of patches in reading order) and the patch grid. `digest` names the
    image's content (SHA-256 of the patches' bytes and grid): the prefix cache names image
    blocks by it, so the same picture hits and a different one never does."""

    patches: torch.Tensor
    n_vit_h: int
    n_vit_w: int
    ratio: int  # the aligner's downsample ratio the grid is for
    digest: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        p = self.patches
        if p.dim() != 4 or p.shape[1] != 3 or p.shape[2] != p.shape[3] \
                or p.shape[0] != self.n_vit_h * self.n_vit_w or self.n_vit_h < 1 \
                or self.n_vit_w < 1:
            raise ValueError(f"image patches must be [n_vit_h * n_vit_w, 3, p, p] for a "
                             f"{self.n_vit_h} x {self.n_vit_w} grid, got {list(p.shape)}")
        if not self.digest:
            h = hashlib.sha256(f"{self.n_vit_h}x{self.n_vit_w}:{p.dtype}".encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            object.__setattr__(self, "digest", h.hexdigest())

    @property
    def grid(self) -> tuple[int, int]:
        """The token grid (n_h, n_w) the aligner makes of the patches."""
        r = self.ratio
        return -(-self.n_vit_h // r), -(-self.n_vit_w // r)

    @property
    def n_positions(self) -> int:
        return segment_length(*self.grid)


@dataclass(frozen=True)
class ImageSegment:
    """An image placed in a sequence: its segment starts at position `start`."""

    start: int
    image: ImageInput

    @property
    def stop(self) -> int:
        return self.start + self.image.n_positions


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True)
                                              + VISION_NORM_EPS))


def vision_rotation(n_h: int, n_w: int, dim: int, theta: float,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_h n_w, 1, dim] of the 2-D rotation: the first half of the angles turns
    with a patch's row, the second with its column (dim = half a head)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rows = torch.arange(n_h).repeat_interleave(n_w)
    cols = torch.arange(n_w).repeat(n_h)
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=1)
    return angles.cos().unsqueeze(1).to(device), angles.sin().unsqueeze(1).to(device)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head] turned as pairs (i, i + head/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.n_heads = c.vision_n_heads
        self.wqkv = nn.Linear(c.vision_dim, 3 * c.vision_dim)
        self.wo = nn.Linear(c.vision_dim, c.vision_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, self.n_heads, -1) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        # Every patch sees every patch of its image.
        o = full_attention(q.transpose(0, 1), k.transpose(0, 1),
                           v.transpose(0, 1))  # [heads, n, head]
        return self.wo(o.transpose(0, 1).reshape(n, -1))


# Queries a CPU attention scores at once: the scores of a tile, [heads, tile, n], stay a
# few hundred MB at the largest picture (16 heads x 256 x ~8,600 patches x 4 bytes).
QUERY_TILE = 256


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d) v over every key, q, k, v [heads, n, head]. On a CPU a tile of
    queries at a time by two matmuls: torch's scaled_dot_product_attention took 3.8 s
    where this takes 2.5 s for 4,070 patches at V4.1's widths, one thread
    (bench/vision.py's picture). Elsewhere torch's fused attention."""
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v)
    out = torch.empty_like(q)
    keys = k.transpose(1, 2) * q.shape[-1] ** -0.5
    for i in range(0, q.shape[1], QUERY_TILE):
        scores = torch.bmm(q[:, i : i + QUERY_TILE], keys)  # [heads, tile, n]
        out[:, i : i + QUERY_TILE] = torch.bmm(scores.softmax(-1), v)
    return out


class VisionMLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.vision_dim, 2 * c.vision_inter_dim, bias=False)
        self.w2 = nn.Linear(c.vision_inter_dim, c.vision_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(c.vision_dim)
        self.attn = VisionAttention(c)
        self.norm2 = VisionRMSNorm(c.vision_dim)
        self.mlp = VisionMLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * c.vision_patch_size ** 2, c.vision_dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1))


class ViT(nn.Module):
    """Bidirectional attention over one image's patches with a 2-D rotation."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.rotation_dim = c.vision_dim // c.vision_n_heads // 2
        self.theta = c.vision_rope_theta
        self.patch_embed = PatchEmbed(c)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.vision_n_layers))
        self.norm = VisionRMSNorm(c.vision_dim)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """[n_h n_w, vision_dim] from patches [n_h n_w, 3, p, p]."""
        x = self.patch_embed(patches)
        cos, sin = vision_rotation(n_h, n_w, self.rotation_dim, self.theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """Each ratio x ratio square of patch features (the grid padded with zeros on the
    right and bottom) concatenated, channel major, and taken to the model's width by a
    two-layer GELU MLP."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.ratio = c.vision_downsample_ratio
        self.w1 = nn.Linear(c.vision_dim * self.ratio ** 2, c.dim)
        self.w2 = nn.Linear(c.dim, c.dim)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """[ceil(n_h / r) ceil(n_w / r), dim] in reading order from x [n_h n_w, vision_dim]."""
        r = self.ratio
        grid = x.view(n_h, n_w, -1).permute(2, 0, 1)  # [C, n_h, n_w]
        grid = F.pad(grid, (0, -n_w % r, 0, -n_h % r))
        squares = F.unfold(grid.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)
        return self.w2(F.gelu(self.w1(squares)))


def segment_rows(model: nn.Module, image: ImageInput) -> torch.Tensor:
    """The embedding rows float32 [segment_length, dim] of an image's segment: the delimiters'
    learned embeddings and the aligner's rows in reading order."""
    vision, aligner = model.vision, model.aligner
    weight = aligner.w2.weight
    patches = image.patches.to(device=weight.device, dtype=weight.dtype)
    tokens = aligner(vision(patches, image.n_vit_h, image.n_vit_w),
                     image.n_vit_h, image.n_vit_w).float()  # [n_h n_w, dim]
    n_h, n_w = image.grid
    rows = torch.empty(segment_length(n_h, n_w), tokens.shape[1], device=tokens.device)
    types = segment_types(n_h, n_w).to(tokens.device)
    rows[types == IMAGE_START] = model.image_start.float()
    rows[types == IMAGE_END] = model.image_end.float()
    rows[types == IMAGE_NEW_LINE] = model.image_newline.float()
    rows[types == IMAGE] = tokens
    return rows


class EncodedImages:
    """The segment rows of the pictures encoded last, by content: a prompt prefilled over
    several engine steps, a replay over part of a segment, or the same picture in another
    request encodes it once. Held up to `limit_bytes` (least recently used first out); an
    entry is used only while the tower's weights are as they were when it was made (their
    in-place version counters) and on the same device."""

    def __init__(self, limit_bytes: int = 256 << 20) -> None:
        self.limit_bytes = limit_bytes
        self.entries: OrderedDict[str, tuple[tuple, torch.Tensor]] = OrderedDict()
        self.encoded = 0  # pictures run through the tower

    @property
    def nbytes(self) -> int:
        return sum(rows.numel() * rows.element_size() for _, rows in self.entries.values())

    def rows(self, model: nn.Module, image: ImageInput) -> torch.Tensor:
        weights = (str(model.aligner.w2.weight.device),
                   *(p._version for m in (model.vision, model.aligner) for p in m.parameters()),
                   *(getattr(model, name)._version
                     for name in ("image_start", "image_end", "image_newline")))
        held = self.entries.get(image.digest)
        if held is not None and held[0] == weights:
            self.entries.move_to_end(image.digest)
            return held[1]
        rows = segment_rows(model, image)
        self.encoded += 1
        self.entries[image.digest] = (weights, rows)
        while self.nbytes > self.limit_bytes and len(self.entries) > 1:
            self.entries.popitem(last=False)
        return rows


@dataclass
class ImageRows:
    """The image rows a call over positions first..first + n - 1 of one sequence puts in
    place of token embeddings: rows float32 [n, dim], where `covered` [n] is True."""

    first: int
    rows: torch.Tensor
    covered: torch.Tensor

    @staticmethod
    def of(model: nn.Module, segments: list[ImageSegment], first: int,
           n: int) -> "ImageRows | None":
        """Encodes each image whose segment meets first..first + n - 1 (whole: the tower sees
        the whole image even where the call holds part of its segment)."""
        inside = [s for s in segments if s.start < first + n and s.stop > first]
        if not inside:
            return None
        dim = model.config.dim
        device = model.embed.weight.device
        rows = torch.zeros(n, dim, device=device)
        covered = torch.zeros(n, dtype=torch.bool, device=device)
        for segment in inside:
            lo, hi = max(segment.start, first), min(segment.stop, first + n)
            encoded = model.encoded_images.rows(model, segment.image)
            rows[lo - first : hi - first] = encoded[lo - segment.start : hi - segment.start]
            covered[lo - first : hi - first] = True
        return ImageRows(first, rows, covered)

    def at(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, covered) of positions start..start + n - 1."""
        lo = start - self.first
        return self.rows[lo : lo + n], self.covered[lo : lo + n]
