"""Engram: DeepSeek-V4.1's n-gram hash memory (design.md section 2).

Each token hashes the 2-, 3-, ..., N-gram that ends at it (over a normalised, "compressed"
token map) into `n_heads` prime-sized bucket ranges per n-gram size, fetches one FP8 table row
per (n-gram size, head), projects the rows to a key per residual copy plus one shared value,
and adds the value to each copy through a sigmoid gate that measures how well the key matches
that copy of the residual stream.

The hash is bit-exact with DeepSeek's reference inference code (`inference/engram.py`): the
primes, their order, the multipliers, the token map and the padding at the start of a sequence
all decide which of the ~384M rows a token reads, so any deviation silently reads other rows.

Shapes: B batch, n new tokens in this call, L engram layers, N max n-gram size, H hash heads,
C = (N - 1) * H hash columns (rows read per token and layer), D head_dim, h = hc_mult.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from kvstack.formats import Quantized, dequantize, quantize

if TYPE_CHECKING:
    import tokenizers

TABLE_FORMAT = "fp8_ue8m0_32"  # E4M3 codes + one UE8M0 scale per 32 along a row
TABLE_BLOCK = 32  # elements per scale of TABLE_FORMAT
INIT_STD = 0.02  # std of a fresh table (before quantisation)
INIT_FLOATS = 1 << 20  # float32 values generated and quantised at once when filling a table
GATE_CLAMP = 1e-6  # |dot| floor before the signed square root of the gate (reference value)
HASH_SEED = 10007  # the multipliers of engram layer `i` come from default_rng(HASH_SEED * i)

# Bases 2..37 make Miller-Rabin exact for every n < 3.18e23, so for every 64-bit integer.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
# The smallest strong pseudoprime to all of them, where exactness ends.
_MR_LIMIT = 318_665_857_834_031_151_167_461


# ---- primes and multipliers ----------------------------------------------------------------


def is_prime(n: int) -> bool:
    """Exact primality of an integer below 3.18e23 (deterministic Miller-Rabin).

    The bucket moduli must be exactly the primes DeepSeek's code drew (with sympy), so a
    probabilistic test is not good enough: one wrong answer shifts every later prime.
    """
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    if n >= _MR_LIMIT:
        raise ValueError(f"is_prime: {n} is beyond the range where the test is exact")
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(start: int, taken: set[int]) -> int:
    """The smallest prime above `start` that is not in `taken`.

    Skipping primes already handed out keeps every (layer, n-gram size, head) bucket range a
    distinct modulus, as the reference's `find_next_prime` does.
    """
    candidate = start + 1
    while candidate in taken or not is_prime(candidate):
        candidate += 1
    return candidate


def engram_primes(
    vocab_size: int, n_layers: int, max_ngram_size: int, n_heads: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Bucket moduli [engram layer][n-gram size 2..N][head], in the reference's draw order.

    Every (layer, n-gram size) restarts the search just above `vocab_size - 1` and walks up
    through its heads, skipping primes already handed out (across layers too). The order is
    part of the checkpoint format: the per-layer sums are the published
    `engram_num_embeddings`.
    """
    taken: set[int] = set()
    layers = []
    for _ in range(n_layers):
        per_ngram = []
        for _ in range(max_ngram_size - 1):
            current, heads = vocab_size - 1, []
            for _ in range(n_heads):
                current = next_prime(current, taken)
                taken.add(current)
                heads.append(current)
            per_ngram.append(tuple(heads))
        layers.append(tuple(per_ngram))
    return tuple(layers)


def multiplier_bound(compressed_vocab_size: int) -> int:
    """Exclusive bound of the raw multiplier draws: `id * (2 * draw + 1)` stays below 2^63
    for every compressed id, so the hash never overflows int64."""
    return max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)


def hash_multipliers(
    layer_ids: tuple[int, ...], max_ngram_size: int, compressed_vocab_size: int
) -> torch.Tensor:
    """Odd hash multipliers, int64 [n_engram_layers, max_ngram_size] (one per look-back).

    Drawn from numpy's `default_rng(10007 * layer_id)` exactly as the reference does, so each
    layer hashes differently; odd so a product never loses the low bits of the id, bounded by
    `multiplier_bound` so it never overflows.
    """
    bound = multiplier_bound(compressed_vocab_size)
    rows = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(HASH_SEED * layer_id)
        draws = rng.integers(low=0, high=bound, size=(max_ngram_size,), dtype=np.int64)
        rows.append(draws * 2 + 1)
    if not rows:
        return torch.zeros((0, max_ngram_size), dtype=torch.int64, device="cpu")
    return torch.tensor(np.stack(rows), dtype=torch.int64, device="cpu")


# ---- token map -----------------------------------------------------------------------------


def _token_normalizer() -> tokenizers.normalizers.Normalizer:
    """The reference's normaliser: NFKC, NFD, strip accents, lowercase, whitespace runs to one
    space, strip, except that a token that is exactly one space stays one space (a private-use
    sentinel carries it through Strip, so it does not merge with the empty string)."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )


def build_token_map(tokenizer: tokenizers.Tokenizer) -> tuple[torch.Tensor, int]:
    """Compressed ids of every token id: (int64 [n_tokens], compressed vocabulary size).

    N-grams are hashed over these ids so that " The", "the" and "THE" hash alike. Each id is
    decoded alone (special tokens kept), normalised, and numbered by first appearance of its
    normalised text; a decode holding U+FFFD (a partial UTF-8 byte token) is keyed by its raw
    token string instead, and an empty normalisation by the decoded text. This is the
    reference's `build_compressed_token_map` on the raw `tokenizers.Tokenizer` it decodes with.
    """
    normalizer = _token_normalizer()
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    key_to_new: dict[str | None, int] = {}
    lookup = [0] * n_tokens
    for token_id in range(n_tokens):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key: str | None = tokenizer.id_to_token(token_id)
        else:
            normalized = normalizer.normalize_str(text)
            key = normalized if normalized else text
        lookup[token_id] = key_to_new.setdefault(key, len(key_to_new))
    return torch.tensor(lookup, dtype=torch.int64, device="cpu"), len(key_to_new)


# ---- the hash ------------------------------------------------------------------------------


class EngramHash(nn.Module):
    """Maps each new token to the global table rows of the n-grams ending at it.

    Ids go through the compressed token map; each position is hashed with the N - 1 tokens
    before it (XOR of id * multiplier, one look-back at a time, so the running value after
    look-back i is the hash of the (i+1)-gram), and each (n-gram size, head) lands in its own
    prime-sized range of the layer's table. Look-back stops at the start of the sequence: a
    slot before position 0 takes the pad token's compressed id. It stops at an image
    position too (`dead_id`, the image token: an n-gram never reaches across an image): that slot
    and every one further back take the pad's id.

    Everything here is derived from the config and the tokenizer, so the buffers are
    non-persistent (never in a checkpoint) and always built on the CPU, even under a
    `torch.device("meta")` context (the model is built on meta and loaded later, but the hash
    has nothing to load).
    """

    primes: torch.Tensor
    offsets: torch.Tensor
    multipliers: torch.Tensor
    token_map: torch.Tensor

    def __init__(
        self,
        layer_ids: tuple[int, ...],
        num_embeddings: tuple[int, ...],
        vocab_size: int,
        max_ngram_size: int,
        n_heads: int,
        compressed_vocab_size: int,
        pad_id: int,
        token_map: torch.Tensor,
        dead_id: int | None = None,
    ) -> None:
        super().__init__()
        layer_ids, num_embeddings = tuple(layer_ids), tuple(num_embeddings)
        if len(layer_ids) != len(num_embeddings):
            raise ValueError(
                f"engram: {len(layer_ids)} layer ids but {len(num_embeddings)} table sizes "
                "(engram_num_embeddings needs one per engram layer)"
            )
        if max_ngram_size < 2:
            raise ValueError(f"engram: max_ngram_size must be at least 2, got {max_ngram_size}")
        if n_heads < 1:
            raise ValueError(f"engram: n_heads must be at least 1, got {n_heads}")
        if vocab_size < 1:
            raise ValueError(f"engram: vocab_size must be positive, got {vocab_size}")
        if compressed_vocab_size < 1:
            raise ValueError(
                f"engram: compressed_vocab_size must be positive, got {compressed_vocab_size}"
            )
        if token_map.dim() != 1 or token_map.numel() == 0 or token_map.is_floating_point():
            raise ValueError(
                "engram: token_map must be a non-empty 1-D integer tensor, got "
                f"{token_map.dtype} {list(token_map.shape)}"
            )
        if token_map.device.type == "meta":
            raise ValueError("engram: token_map is on the meta device; build it on the CPU "
                             "(build_token_map does) so the hash has real ids")
        token_map = token_map.to(device="cpu", dtype=torch.int64)
        low, high = int(token_map.min()), int(token_map.max())
        if low < 0 or high >= compressed_vocab_size:
            raise ValueError(
                f"engram: token_map values span {low}..{high}, outside "
                f"0..{compressed_vocab_size - 1} (compressed_vocab_size {compressed_vocab_size})"
            )
        if high + 1 != compressed_vocab_size:
            raise ValueError(
                f"engram: the token map has {high + 1} compressed ids but "
                f"compressed_vocab_size is {compressed_vocab_size}; every hash multiplier "
                "derives from that size, so a mismatch would silently rehash the whole table "
                "(wrong tokenizer for this checkpoint?)"
            )
        if not 0 <= pad_id < token_map.numel():
            raise ValueError(
                f"engram: pad_id {pad_id} is not a token id of the token map "
                f"(0..{token_map.numel() - 1})"
            )

        primes = engram_primes(vocab_size, len(layer_ids), max_ngram_size, n_heads)
        for i, (layer_id, rows) in enumerate(zip(layer_ids, num_embeddings, strict=True)):
            need = sum(p for per_ngram in primes[i] for p in per_ngram)
            if rows < need:
                raise ValueError(
                    f"engram layer {layer_id}: num_embeddings {rows} is below {need}, the sum "
                    "of its bucket primes (the table must hold every bucket)"
                )

        self.layer_ids = layer_ids
        self.num_embeddings = num_embeddings
        self.vocab_size = vocab_size
        self.max_ngram_size = max_ngram_size
        self.n_heads = n_heads
        self.compressed_vocab_size = compressed_vocab_size
        self.pad_id = pad_id
        self.pad_compressed = int(token_map[pad_id])  # what a slot before position 0 holds
        self.dead_id = dead_id
        self.prime_values = primes

        # [L, N-1, H]; flat per layer [L, C], columns n-gram size major, head minor
        primes_t = torch.tensor(primes, dtype=torch.int64, device="cpu").view(
            len(layer_ids), max_ngram_size - 1, n_heads
        )
        flat = primes_t.flatten(1)
        offsets = flat.cumsum(1) - flat  # [L, C]: start of each bucket range in the table
        self.register_buffer("primes", primes_t, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)
        self.register_buffer(
            "multipliers",
            hash_multipliers(layer_ids, max_ngram_size, compressed_vocab_size),
            persistent=False,
        )  # [L, N]
        self.register_buffer("token_map", token_map.clone(), persistent=False)  # [n_tokens]

    @property
    def n_columns(self) -> int:
        """Rows each token reads per engram layer: one per (n-gram size, head)."""
        return (self.max_ngram_size - 1) * self.n_heads

    def forward(
        self, ids: torch.Tensor, history: torch.Tensor, start: int | torch.Tensor,
        check: bool = True,
    ) -> torch.Tensor:
        """Global table rows int64 [B, n, L, C] for the new tokens.

        ids: int64 [B, n], raw ids at positions start..start+n-1; history: int64 [B, N-1],
        raw ids at positions start-N+1..start-1 (entries at positions < 0 are ignored, so
        they may hold anything); start: one int or int64 [B] (a start per sequence).
        check=False skips looking at the values (starts not negative, ids inside the token
        map), which reads them back from the device: for a decode step, whose ids and
        positions were checked on the host.
        """
        if ids.dim() != 2:
            raise ValueError(f"engram hash: ids must be [B, n], got {list(ids.shape)}")
        batch, n = ids.shape
        k = self.max_ngram_size - 1
        if history.shape != (batch, k):
            raise ValueError(
                f"engram hash: history must be [B, {k}] = [{batch}, {k}], "
                f"got {list(history.shape)}"
            )
        device = self.token_map.device
        if isinstance(start, torch.Tensor):
            if start.numel() != batch:
                raise ValueError(
                    f"engram hash: start must be one int or a tensor [{batch}], "
                    f"got {list(start.shape)}"
                )
            starts = start.to(device=device, dtype=torch.int64).reshape(batch)  # [B]
        else:
            starts = torch.full((batch,), int(start), dtype=torch.int64, device=device)
        if check and batch and int(starts.min()) < 0:
            raise ValueError(f"engram hash: negative start {int(starts.min())}")

        raw = torch.cat((history.to(device, torch.int64), ids.to(device, torch.int64)), dim=1)
        positions = starts[:, None] + torch.arange(-k, n, device=device)  # [B, k+n]
        # a slot before the sequence start reads as the pad token, and so does every slot
        # further back (the reference's cumulative `positions < shift` block)
        raw = torch.where(positions >= 0, raw, self.pad_id)  # [B, k+n]
        if n == 0:
            return torch.zeros((batch, 0, len(self.layer_ids), self.n_columns),
                               dtype=torch.int64, device=device)
        size = self.token_map.numel()
        bad = (raw < 0) | (raw >= size)
        if check and bool(bad.any()):
            raise ValueError(
                f"engram hash: token id {int(raw[bad][0])} is outside the token map "
                f"(ids 0..{size - 1}, {size} tokens)"
            )
        compressed = self.token_map[raw]  # [B, k+n]
        # window of token t: positions t-k..t; look-back s (0 = the token itself) at -1-s
        tokens = compressed.unfold(1, k + 1, 1).flip(-1)  # [B, n, N]
        if self.dead_id is not None:
            dead = (raw == self.dead_id).unfold(1, k + 1, 1).flip(-1)  # [B, n, N]
            # a look-back past an image position reads the pad, as every one beyond it
            tokens = torch.where(dead.cummax(-1).values, self.pad_compressed, tokens)

        products = tokens.unsqueeze(2) * self.multipliers  # [B, n, L, N]
        rolling = products[..., 0]  # [B, n, L]
        hashes = []
        for i in range(1, self.max_ngram_size):
            rolling = torch.bitwise_xor(rolling, products[..., i])
            hashes.append(rolling.unsqueeze(-1) % self.primes[:, i - 1])  # [B, n, L, H]
        return torch.cat(hashes, dim=-1) + self.offsets  # [B, n, L, C]


# ---- one layer's Engram --------------------------------------------------------------------


class Engram(nn.Module):
    """One layer's Engram: packed FP8 table lookup, key/value projection and gated write.

    The table is kept as E4M3 codes with a UE8M0 scale per 32 along each row (the format the
    published checkpoint stores, ~100 GB per layer at V4.1 scale), and a lookup dequantises
    only the rows it reads. The projected rows give one key per residual copy and one shared
    value; each copy gets the value through its own gate, a sigmoid of the signed square root
    of a normalised dot product of that copy against its key.
    """

    table_codes: torch.Tensor
    table_scales: torch.Tensor

    def __init__(
        self, dim: int, hc_mult: int, n_rows: int, n_columns: int, head_dim: int, eps: float
    ) -> None:
        super().__init__()
        if head_dim <= 0 or head_dim % TABLE_BLOCK:
            raise ValueError(
                f"engram: head_dim {head_dim} is not a positive multiple of {TABLE_BLOCK} "
                f"(the table's {TABLE_FORMAT} scale block)"
            )
        if n_rows < 1 or n_columns < 1 or dim < 1 or hc_mult < 1:
            raise ValueError(
                f"engram: n_rows {n_rows}, n_columns {n_columns}, dim {dim} and hc_mult "
                f"{hc_mult} must all be positive"
            )
        self.dim = dim
        self.hc_mult = hc_mult
        self.n_rows = n_rows
        self.n_columns = n_columns
        self.head_dim = head_dim
        self.eps = eps
        # every row is written by reset_table (or a checkpoint load on meta), so empty
        self.register_buffer("table_codes", torch.empty(n_rows, head_dim, dtype=torch.uint8))
        self.register_buffer(
            "table_scales", torch.empty(n_rows, head_dim // TABLE_BLOCK, dtype=torch.uint8)
        )
        self.wkv = nn.Linear(n_columns * head_dim, (hc_mult + 1) * dim, bias=False)
        # the reference only ever uses q_weight * k_weight; both are kept for the checkpoint
        self.q_weight = nn.Parameter(torch.ones(hc_mult, dim))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, dim))
        # Sharded (`kvstack.parallel`): the table holds rows first_row.. of the n_rows, a
        # lookup reads those and zeros elsewhere, and the ranks' rows add up (exactly: one
        # rank holds each).
        self.first_row = 0
        self.shard = None
        if self.table_codes.device.type != "meta":  # on meta the table is loaded later
            self.reset_table()

    @property
    def table_bytes(self) -> int:
        """Bytes the packed table holds (codes + scales)."""
        return (self.table_codes.numel() * self.table_codes.element_size()
                + self.table_scales.numel() * self.table_scales.element_size())

    def _fill(self, values_of: Callable[[int, int], torch.Tensor], n_rows: int) -> None:
        """Quantise rows chunk by chunk into the table, so no float copy of the whole table
        (4x its packed size) is ever held."""
        chunk = max(1, INIT_FLOATS // self.head_dim)
        with torch.no_grad():
            for lo in range(0, n_rows, chunk):
                hi = min(lo + chunk, n_rows)
                q = quantize(values_of(lo, hi), TABLE_FORMAT)
                self.table_codes[lo:hi] = q.codes.to(self.table_codes.device)
                self.table_scales[lo:hi] = q.scales.to(self.table_scales.device)

    def reset_table(self) -> None:
        """Fill the table with quantised normal(0, 0.02) rows from torch's global RNG, so a
        fresh module is usable (and seeded like every other module init)."""
        device = self.table_codes.device

        def values_of(lo: int, hi: int) -> torch.Tensor:
            out = torch.empty(hi - lo, self.head_dim, dtype=torch.float32, device=device)
            return out.normal_(0.0, INIT_STD)

        self._fill(values_of, self.n_rows)

    def set_table(self, values: torch.Tensor) -> None:
        """Set the table from float rows [n_rows, head_dim], quantised with fp8_ue8m0_32."""
        if values.shape != (self.n_rows, self.head_dim):
            raise ValueError(
                f"engram: table values must be [{self.n_rows}, {self.head_dim}], "
                f"got {list(values.shape)}"
            )
        self._fill(lambda lo, hi: values[lo:hi], self.n_rows)

    def lookup(self, rows: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Float32 table rows [..., head_dim] for global row indices rows [...] (int64).

        Only the rows read are dequantised. Float32 holds an E4M3 value times a power-of-two
        scale exactly (so does the reference's bf16), so the rows are the stored values.
        check=False trusts the indices (EngramHash's are in range by construction) and
        reads nothing back from the device.
        """
        flat = rows.reshape(-1).to(self.table_codes.device)
        if check and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.n_rows):
            raise ValueError(
                f"engram: row indices span {int(flat.min())}..{int(flat.max())}, outside the "
                f"table's 0..{self.n_rows - 1}"
            )
        held = self.table_codes.shape[0]
        if self.shard is not None:
            local = flat - self.first_row
            mine = (local >= 0) & (local < held)
            flat = torch.where(mine, local, 0)
        codes = self.table_codes.index_select(0, flat)  # [R, D]
        scales = self.table_scales.index_select(0, flat)  # [R, D / 32]
        values = dequantize(Quantized(TABLE_FORMAT, codes, scales))  # [R, D]
        if self.shard is not None:
            values = self.shard.all_reduce(values * mine[:, None])
        return values.view(*rows.shape, self.head_dim)

    def forward(self, x: torch.Tensor, rows: torch.Tensor,
                live: torch.Tensor | None = None) -> torch.Tensor:
        """New residual [B, n, h, dim] (x's dtype) from the residual x [B, n, h, dim] and this
        layer's hash rows [B, n, C] (int64, from EngramHash). Computed in float32. `live`
        [B, n] bool: where False (image positions) the gate is shut and x passes as it is."""
        if rows.shape[-1] != self.n_columns or rows.shape[:-1] != x.shape[:2]:
            raise ValueError(
                f"engram: rows must be [B, n, {self.n_columns}] matching x {list(x.shape)}, "
                f"got {list(rows.shape)}"
            )
        if x.shape[2:] != (self.hc_mult, self.dim):
            raise ValueError(
                f"engram: x must be [B, n, {self.hc_mult}, {self.dim}], got {list(x.shape)}"
            )
        embedded = self.lookup(rows, check=False).flatten(-2)  # rows from EngramHash: in range
        kv = self.wkv(embedded)  # [B, n, (h + 1) * dim]
        key, value = kv.split([self.hc_mult * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.dim))  # [B, n, h, dim]
        value = value.float().unsqueeze(-2)  # [B, n, 1, dim]: shared by every copy
        weight = self.q_weight.float() * self.k_weight.float()  # [h, dim]
        h = x.float()
        # normalised per (token, copy) over dim, not jointly over the copies
        rstd = (torch.rsqrt(h.square().mean(-1) + self.eps)
                * torch.rsqrt(key.square().mean(-1) + self.eps))  # [B, n, h]
        dot = (h * weight * key).sum(-1) * rstd * self.dim**-0.5  # [B, n, h]
        # signed square root before the sigmoid, as DeepSeek's training kernel does
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
        if live is not None:
            gate = gate.masked_fill(~live.unsqueeze(-1), 0.0)
        return (h + gate.unsqueeze(-1) * value).to(x.dtype)
