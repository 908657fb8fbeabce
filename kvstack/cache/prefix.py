"""Prefix caching: the hash chain over full blocks of token ids (design.md section 5).

A full block's stream entries are a function of every token up to its end (attention is
causal and a block ends on a group boundary of every stream), so block i is named by
h_i = sha256(h_{i-1} || its token ids), with h_{-1} a seed made of the model's fingerprint
and the block size: a hit needs the same weights, the same cache formats (part of the
config the fingerprint covers), the same block size and the same tokens from the start.
Every position of an image's segment holds the same token id, so a block that holds part of
an image segment also hashes the image's content digest and where its segment starts: the same
picture hits, a different one never does.
"""

import hashlib
from collections.abc import Sequence

import numpy as np

# An image segment as the hash chain sees it: (start, stop, the image's content digest).
ImageKey = tuple[int, int, bytes]


def chain_seed(model_fingerprint: str, block_tokens: int) -> bytes:
    return hashlib.sha256(f"kvstack-prefix-v1|{model_fingerprint}|{block_tokens}".encode()).digest()


def salted_seed(seed: bytes, cache_salt: str | None) -> bytes:
    """The chain's seed for requests that share a cache salt: requests of different salts
    (tenants of one server) never find each other's blocks, so a hit reveals nothing of
    another tenant's prompts."""
    if cache_salt is None:
        return seed
    return hashlib.sha256(seed + b"|salt|" + cache_salt.encode("utf-8", "surrogatepass")).digest()


def block_hashes(seed: bytes, token_ids: list[int], block_tokens: int,
                 known: list[bytes] | None = None,
                 images: Sequence[ImageKey] = ()) -> list[bytes]:
    """Chain hashes of every full block of token_ids; `known` (the hashes of the first
    blocks, already computed) is extended rather than recomputed. `images`: the image
    segments of the sequence."""
    hashes = list(known or [])
    previous = hashes[-1] if hashes else seed
    for start in range(len(hashes) * block_tokens,
                       len(token_ids) - block_tokens + 1, block_tokens):
        block = np.asarray(token_ids[start : start + block_tokens], dtype=np.int64)
        content = block.tobytes() + b"".join(
            (first - start).to_bytes(8, "little", signed=True) + digest
            for first, stop, digest in images
            if first < start + block_tokens and stop > start)
        previous = hashlib.sha256(previous + content).digest()
        hashes.append(previous)
    return hashes
