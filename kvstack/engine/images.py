"""Images into a prompt, as DeepSeek's V4.1 `inference/image_processor.py` prepares them.

An image is decoded (Pillow, the `vision` extra), sized to a grid of patch_size pixel
patches that costs at most vision_max_n_token prompt positions (scaled up first when it
holds fewer than vision_min_pixels pixels), padded with grey to that size keeping its
aspect (or stretched, when wider than vision_max_wh_ratio times its height), scaled to
[-1, 1] in bf16 and cut into patches. Each image placeholder (the image token id) in a
prompt's token ids becomes the image's whole segment (`kvstack.model.vision`).

Nothing is fetched: an image comes as bytes, a file path, or a `data:` URL.
"""

import base64
import binascii
import io
from pathlib import Path
from typing import Any

import torch

from kvstack.config import ModelConfig
from kvstack.image_grid import plan_grid
from kvstack.model.vision import ImageInput, ImageSegment

# Bytes of one encoded image accepted by default (the server's --max-image-bytes).
MAX_IMAGE_BYTES = 10 << 20
# Pixels of one decoded image accepted (a decompression bomb is refused before decoding).
MAX_IMAGE_PIXELS = 64 << 20
GREY = (127, 127, 127)


class ImageError(ValueError):
    """An image that cannot be taken: undecodable, too large, fetched from the network, or
    given to a model without a vision tower."""


def read_image_bytes(source: Any, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The encoded bytes of an image given as bytes, a file path or a `data:` URL (base64);
    an http(s) URL is refused: nothing is fetched."""
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
    elif isinstance(source, Path) or (isinstance(source, str) and not source.startswith(
            ("data:", "http://", "https://"))):
        try:
            with open(source, "rb") as f:
                data = f.read(max_bytes + 1)
        except OSError as e:
            raise ImageError(f"image {source}: cannot read ({e.strerror})") from e
    elif isinstance(source, str) and source.startswith("data:"):
        header, comma, payload = source.partition(",")
        if not comma or ";base64" not in header:
            raise ImageError(f"image data URL: expected 'data:<type>;base64,<data>', got "
                             f"{header[:40]!r}")
        if len(payload) > max_bytes * 4 // 3 + 4:
            raise ImageError(f"image: over {max_bytes:,} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"image data URL: not valid base64 ({e})") from e
    elif isinstance(source, str):
        raise ImageError(f"image URL {source[:60]!r}: only data: URLs are taken (kvstack "
                         "fetches nothing); send the image's bytes base64 in a data URL")
    else:
        raise ImageError(f"image: expected bytes, a path, a data: URL or a PIL image, got "
                         f"{type(source).__name__}")
    if len(data) > max_bytes:
        raise ImageError(f"image: over {max_bytes:,} bytes")
    return data


def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError as e:
        raise ImageError("images need Pillow: pip install 'kvstack[vision]'") from e
    return Image, ImageOps


def decode_image(source: Any, max_bytes: int = MAX_IMAGE_BYTES) -> Any:
    """An RGB PIL image from bytes, a path, a data URL or a PIL image."""
    Image, _ = _pil()
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    data = read_image_bytes(source, max_bytes)
    try:
        with Image.open(io.BytesIO(data)) as opened:
            if opened.width * opened.height > MAX_IMAGE_PIXELS:
                raise ImageError(f"image: {opened.width} x {opened.height} pixels, over "
                                 f"{MAX_IMAGE_PIXELS:,}")
            return opened.convert("RGB")
    except ImageError:
        raise
    except Exception as e:  # Pillow raises many kinds for a broken file
        raise ImageError(f"image: cannot decode ({type(e).__name__}: {e})") from e


def image_input(source: Any, config: ModelConfig,
                max_bytes: int = MAX_IMAGE_BYTES) -> ImageInput:
    """One image as the vision tower takes it (patches in bf16, as the reference's)."""
    if not config.has_vision:
        raise ImageError("this model has no vision tower (vision_n_layers is 0): it takes "
                         "text only")
    image = decode_image(source, max_bytes)
    _, ImageOps = _pil()
    c = config
    plan = plan_grid(image.width, image.height, c)
    if c.vision_max_wh_ratio is not None and image.width >= c.vision_max_wh_ratio * image.height:
        image = image.resize((plan.width, plan.height))
    else:
        image = ImageOps.pad(image, (plan.width, plan.height), color=GREY)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    x = pixels.view(plan.height, plan.width, 3).permute(2, 0, 1).float() / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)  # [3, H, W]
    p = c.vision_patch_size
    gh, gw = plan.height // p, plan.width // p
    patches = x.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
    return ImageInput(patches.contiguous(), gh, gw, c.vision_downsample_ratio)


def expand_images(token_ids: list[int], images: list[ImageInput],
                  config: ModelConfig) -> tuple[list[int], list[ImageSegment]]:
    """A prompt's ids with each image placeholder (the image token id, one per image, in
    order) widened to its image's whole segment, and the segments' places."""
    marker = config.image_token_id
    slots = [i for i, t in enumerate(token_ids) if t == marker]
    if images and not config.has_vision:
        raise ImageError("this model has no vision tower (vision_n_layers is 0): it takes "
                         "text only")
    if len(slots) != len(images):
        raise ImageError(f"the prompt holds {len(slots)} image placeholders (token "
                         f"{marker}) and {len(images)} images were given")
    out: list[int] = []
    segments: list[ImageSegment] = []
    images_left = iter(images)
    for t in token_ids:
        if t != marker:
            out.append(t)
            continue
        image = next(images_left)
        segments.append(ImageSegment(len(out), image))
        out.extend([marker] * image.n_positions)
    return out, segments
