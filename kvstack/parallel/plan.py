"""Which rank holds which part of a model: the sharding plan, in one place.

N ranks (one per device) run every layer in lockstep on the same tokens. Per rank:

- attention: its n_heads / N query heads (`wq_b` rows, `sink`) and their o_groups / N
  output groups (`wo_a` rows); `wo_b` by its input columns, the N partial outputs
  all-reduced. The indexer: index_n_heads / N heads (`wq` rows, `wweights` rows), each
  rank's partial scores all-reduced before the top-k, so every rank selects the same
  entries.
- experts: with expert parallelism n_routed_experts / N whole experts, else every expert's
  moe_inter_dim / N slice (w1, w3 rows; w2 columns); the shared expert (and a dense FFN)
  by its inter dim. The gate is replicated (every rank routes alike) and the partial sums
  of routed and shared experts are all-reduced once.
- Engram: a ceil(rows / N) run of each table's rows; a lookup reads the rows it holds,
  zeros for the rest, and the rows are all-reduced (one rank holds each, so exactly).
- embeddings and head: a ceil(vocab / N) run of vocabulary rows; embeddings all-reduced,
  logits all-gathered.
- replicated: norms, hyper-connections, `wq_a`, `wkv`, the compressor, the gate.

The cache: V4.1's attention reads one KV vector per token (and one index key per entry)
shared by every head, so each rank keeps the whole record of every token it serves: the
cache per token per rank is the single-process figure, N times that in all. What TP buys
is room for weights and N-fold bandwidth for them, not cache bytes.
"""

import math
from dataclasses import dataclass

from kvstack.config import ModelConfig

# The rules by tensor name (suffix within a layer, or a whole name at the top): the
# dimension cut and what it counts.
_HEADS = {"attn.wq_b.weight": 0, "attn.sink": 0}
_GROUPS = {"attn.wo_a.weight": 0, "attn.wo_b.weight": 1}
_INDEX_HEADS = {"attn.indexer.wq.weight": 0, "attn.indexer.wweights.weight": 0}
_DENSE_FFN = {"w1.weight": 0, "w2.weight": 1, "w3.weight": 0}
_EXPERT_INTER = {"ffn.experts.w1": 1, "ffn.experts.w2": 2, "ffn.experts.w3": 1}
_TABLE = ("engram.table_codes", "engram.table_scales")
_VOCAB = ("embed.weight", "head.weight")


@dataclass(frozen=True)
class Split:
    """One tensor cut along `dim` of length `size`; rank r holds [lo, hi) of it, in
    `unit`s (a head of head_dim rows, one expert, one row)."""

    dim: int
    size: int
    unit: int
    world: int
    ragged: bool = False  # ceil-div pieces (table and vocabulary rows): the last is short

    def range(self, rank: int) -> tuple[int, int]:
        units = self.size // self.unit
        per = -(-units // self.world) if self.ragged else units // self.world
        lo = min(rank * per, units) * self.unit
        return lo, min((rank + 1) * per, units) * self.unit

    @property
    def piece(self) -> int:
        """Length of the longest piece (what a padded all-gather exchanges)."""
        units = self.size // self.unit
        return -(-units // self.world) * self.unit


class ShardingPlan:
    """The plan for `config` over `world_size` ranks. Refuses, naming the setting, a
    config whose heads, groups or experts do not divide among the ranks."""

    def __init__(self, config: ModelConfig, world_size: int,
                 expert_parallel: bool = False) -> None:
        if world_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {world_size}")
        c, n = config, world_size
        if c.arch != "v41":
            raise ValueError("tensor parallelism shards V4.1's attention; the dense control "
                             "runs in one process")
        need = [("n_heads", c.n_heads), ("o_groups", c.o_groups),
                ("index_n_heads", c.index_n_heads)]
        if c.uses_moe:
            need.append(("n_routed_experts", c.n_routed_experts) if expert_parallel
                        else ("moe_inter_dim", c.moe_inter_dim))
        else:
            need.append(("inter_dim", c.inter_dim))
        for key, value in need:
            if value % n:
                raise ValueError(f"tensor_parallel_size {n} does not divide {key} ({value}) "
                                 "of this model")
        if expert_parallel and not c.uses_moe:
            raise ValueError("expert_parallel: this model has no routed experts")
        self.config, self.world_size, self.expert_parallel = c, n, expert_parallel

    def split(self, name: str, shape: tuple[int, ...]) -> Split | None:
        """How tensor `name` (kvstack's name, of the full `shape`) is cut; None: every
        rank holds all of it."""
        c, n = self.config, self.world_size
        if self.world_size == 1:
            return None
        if name in _VOCAB:
            return Split(0, shape[0], 1, n, ragged=True)
        if not name.startswith("layers."):
            return None
        local = name.split(".", 2)[2]
        if local in _HEADS:
            return Split(_HEADS[local], shape[_HEADS[local]],
                         shape[_HEADS[local]] // c.n_heads, n)
        if local in _GROUPS:
            return Split(_GROUPS[local], shape[_GROUPS[local]], c.o_lora_rank, n)
        if local in _INDEX_HEADS:
            d = _INDEX_HEADS[local]
            return Split(d, shape[d], shape[d] // c.index_n_heads, n)
        if local in _TABLE:
            return Split(0, shape[0], 1, n, ragged=True)
        if local in _EXPERT_INTER:
            if self.expert_parallel:
                return Split(0, shape[0], 1, n)
            d = _EXPERT_INTER[local]
            return Split(d, shape[d], 1, n)
        for prefix in ("ffn.shared.", "ffn."):
            rest = local.removeprefix(prefix)
            if local.startswith(prefix) and rest in _DENSE_FFN:
                return Split(_DENSE_FFN[rest], shape[_DENSE_FFN[rest]], 1, n)
        return None

    def rank_shapes(self, shapes: dict[str, tuple[int, ...]],
                    rank: int) -> dict[str, tuple[int, ...]]:
        """The shapes rank `rank` holds of tensors of the given full shapes; vocabulary
        rows are padded to the longest piece, so that the logits gather in one call."""
        out = {}
        for name, shape in shapes.items():
            s = self.split(name, shape)
            if s is None:
                out[name] = shape
                continue
            lo, hi = s.range(rank)
            length = s.piece if name in _VOCAB else hi - lo
            out[name] = (*shape[: s.dim], length, *shape[s.dim + 1 :])
        return out

    def describe(self) -> dict[str, object]:
        """What each rank holds, in counts (for logs, `memory_report` and `kvstack plan`)."""
        c, n = self.config, self.world_size
        return {
            "tensor_parallel_size": n,
            "expert_parallel": self.expert_parallel,
            "heads_per_rank": c.n_heads // n,
            "output_groups_per_rank": c.o_groups // n,
            "index_heads_per_rank": c.index_n_heads // n,
            "experts_per_rank": (c.n_routed_experts // n if self.expert_parallel
                                 else c.n_routed_experts),
            "expert_inter_per_rank": (c.moe_inter_dim if self.expert_parallel
                                      else c.moe_inter_dim // n),
            "vocab_rows_per_rank": math.ceil(c.vocab_size / n),
            "cache_per_rank": "the whole record of every token (one KV vector per token, "
                              "read by every head)",
        }
