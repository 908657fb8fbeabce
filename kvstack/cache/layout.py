"""The cache layout of a config: which streams exist, their formats, and what they cost.

design.md section 4. Per kv source, two persistent streams (the KV stream and the indexer
keys), one entry per `ratio` tokens. Per sequence and never persisted: a window ring per
layer, and each ratio>1 source's partial group. The dense control has two streams per
layer (keys and values of its KV heads) and nothing else. The planner prints this layout; the paged
engine allocates its pools from it and measures what it allocated against it.
"""

from dataclasses import dataclass
from fractions import Fraction

from kvstack.config import Mode, ModelConfig
from kvstack.formats import bytes_per_entry

# A ratio>1 source keeps, for the tokens of its incomplete group, the projected values
# and the gate logits (head_dim each) in float32 until the group completes.
PARTIAL_GROUP_ELEMENT_BYTES = 4


@dataclass(frozen=True)
class Stream:
    layer: int  # the kv source that writes it
    kind: str  # "kv" | "index"; the dense control's per-layer "k" | "v"
    fmt: str
    width: int
    ratio: int

    @property
    def entry_bytes(self) -> int:
        return bytes_per_entry(self.fmt, self.width)

    @property
    def bytes_per_token(self) -> Fraction:
        return Fraction(self.entry_bytes, self.ratio)

    def entries(self, n_tokens: int) -> int:
        """Entries held for n_tokens tokens: complete groups only."""
        return n_tokens // self.ratio


@dataclass(frozen=True)
class WindowRing:
    layer: int
    fmt: str
    width: int
    slots: int  # window_size entries

    @property
    def bytes(self) -> int:
        return self.slots * bytes_per_entry(self.fmt, self.width)


@dataclass(frozen=True)
class PartialGroup:
    layer: int
    ratio: int
    width: int

    @property
    def bytes(self) -> int:
        return (self.ratio - 1) * 2 * self.width * PARTIAL_GROUP_ELEMENT_BYTES


@dataclass(frozen=True)
class CacheLayout:
    streams: tuple[Stream, ...]
    window_rings: tuple[WindowRing, ...]
    partial_groups: tuple[PartialGroup, ...]

    @classmethod
    def from_config(cls, config: ModelConfig) -> "CacheLayout":
        if config.arch == "dense":
            width = config.n_kv_heads * config.head_dim
            return cls(
                tuple(Stream(i, kind, config.kv_format, width, 1)
                      for i in range(config.n_layers) for kind in ("k", "v")),
                (), (),
            )
        streams = []
        partial = []
        for spec in config.layers:
            if spec.kv_source != spec.index:
                continue
            streams.append(Stream(spec.index, "kv", config.kv_format, config.head_dim, spec.ratio))
            streams.append(
                Stream(
                    spec.index, "index", config.index_format, config.index_head_dim, spec.ratio
                )
            )
            if spec.ratio > 1:
                partial.append(PartialGroup(spec.index, spec.ratio, config.head_dim))
        rings = tuple(
            WindowRing(spec.index, config.window_format, config.head_dim, config.window_size)
            for spec in config.layers
        )
        return cls(tuple(streams), rings, tuple(partial))

    @property
    def bytes_per_token(self) -> Fraction:
        """Persistent bytes per token: what the streams cost, the figure of design.md section 4."""
        return sum((s.bytes_per_token for s in self.streams), Fraction(0))

    @property
    def window_bytes_per_sequence(self) -> int:
        return sum(r.bytes for r in self.window_rings)

    @property
    def partial_bytes_per_sequence(self) -> int:
        return sum(p.bytes for p in self.partial_groups)

    @property
    def window_bytes_per_token_if_persisted(self) -> int:
        """What keeping every token's window entry (all layers) would add per token: the
        cost of restoring window state at any point without replay."""
        return sum(bytes_per_entry(r.fmt, r.width) for r in self.window_rings)

    def stream_bytes(self, n_tokens: int) -> int:
        """Bytes of all streams for one sequence of n_tokens tokens."""
        return sum(s.entries(n_tokens) * s.entry_bytes for s in self.streams)

    def sequence_bytes(self, n_tokens: int) -> int:
        """Device bytes of one sequence of n_tokens: streams, window rings, partial groups."""
        return (
            self.stream_bytes(n_tokens)
            + self.window_bytes_per_sequence
            + self.partial_bytes_per_sequence
        )


def decode_step_reads(config: ModelConfig, n_tokens: int) -> int:
    """The cache bytes one sequence's decode step must read at n_tokens of context, the
    floor of its cache traffic: per layer its window ring, the top-k rows it attends to
    and the index keys its indexer scores (every visible entry, or in a Reindex layer
    restricted to a candidate pool, the pool's entries), and the partial groups. The dense
    control reads every key and value."""
    layout = CacheLayout.from_config(config)
    if config.arch == "dense":
        return layout.stream_bytes(n_tokens)
    ring = bytes_per_entry(config.window_format, config.head_dim)
    row = bytes_per_entry(config.kv_format, config.head_dim)
    key = bytes_per_entry(config.index_format, config.index_head_dim)
    pool = config.candidate_topk_blocks * config.candidate_block_size
    total = layout.partial_bytes_per_sequence
    for spec in config.layers:
        total += min(n_tokens, config.window_size) * ring
        if not spec.ratio:
            continue
        visible = n_tokens // spec.ratio
        total += min(config.index_topk, visible) * row
        if spec.mode in (Mode.FULL, Mode.REINDEX):
            total += (min(visible, pool) if spec.uses_candidates else visible) * key
    return total
