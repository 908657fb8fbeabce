"""Cut a model down to one rank's shard of it (the plan in `kvstack.parallel.plan`), and
the collectives over torch.distributed that rejoin what the shards compute."""

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from kvstack.formats.weights import WEIGHT_BLOCK
from kvstack.model.checkpoint import V41Tensor, _load_v41, v41_names
from kvstack.model.engram import Engram
from kvstack.model.model import Attention, DenseFFN, Indexer, Model, MoE
from kvstack.model.packed import PackedExperts, PackedLinear
from kvstack.parallel.plan import ShardingPlan, Split


class TorchShard:
    """This process's place in a torch.distributed group: the `Shard` the model's layers
    call (gloo on CPUs, NCCL on GPUs)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=-1)


# How long the ranks a process spawns may take to join: a cold start (Python, torch) on a
# busy machine takes far longer than a collective may wait once they run.
START_TIMEOUT_S = 120.0


def init_group(rank: int, world_size: int, address: str | None, port: int | None,
               device: torch.device, timeout_s: float) -> None:
    """Join the group of `world_size` processes rendezvousing at address:port (None:
    where torchrun's environment says, MASTER_ADDR and MASTER_PORT, on any number of
    machines); a collective that waits longer than timeout_s for a rank fails instead of
    hanging. Spawned ranks get START_TIMEOUT_S (at least) to join."""
    if address is None and int(os.environ.get("WORLD_SIZE", "0")) != world_size:
        raise ValueError(f"tensor_parallel_size {world_size} under torchrun needs that many "
                         f"ranks; WORLD_SIZE is {os.environ.get('WORLD_SIZE', 'unset')}")
    if device.type == "cuda":  # NCCL's collectives run on the rank's current device
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if address is None:
        dist.init_process_group(backend, init_method="env://", rank=rank,
                                world_size=world_size, timeout=timeout)
        return
    # Rank 0's store waits for every rank to connect under the start-up deadline; the
    # group's collectives keep timeout_s.
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=max(timeout_s, START_TIMEOUT_S)))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)


def _cut(t: torch.Tensor, split: Split, rank: int, pad_to: int | None = None) -> torch.Tensor:
    lo, hi = split.range(rank)
    piece = t.narrow(split.dim, lo, hi - lo)
    if pad_to is not None and hi - lo < pad_to:
        pad = [0, 0] * (t.dim() - 1 - split.dim) + [0, pad_to - (hi - lo)]
        piece = F.pad(piece, pad)
    return piece.contiguous()


def _scale_split(split: Split, rank: int, what: str) -> tuple[int, int]:
    """The run of block scales that covers a cut: it must start and end on a block."""
    lo, hi = split.range(rank)
    if lo % WEIGHT_BLOCK or (hi % WEIGHT_BLOCK and hi != split.size):
        raise ValueError(f"{what}: rank {rank}'s rows {lo}..{hi} do not fall on the "
                         f"{WEIGHT_BLOCK}-wide blocks its packed scales cover")
    return lo // WEIGHT_BLOCK, -(-hi // WEIGHT_BLOCK)


def _replace(module: nn.Module, name: str, t: torch.Tensor) -> None:
    old = getattr(module, name)
    if isinstance(old, nn.Parameter):
        setattr(module, name, nn.Parameter(t, requires_grad=old.requires_grad))
    else:
        module.register_buffer(name, t)


def shard_model(model: Model, plan: ShardingPlan, shard: TorchShard) -> Model:
    """Cut `model` (whole, on any device, or on the meta device) in place to rank
    shard.rank's tensors and wire its layers to the collectives."""
    if plan.world_size != shard.world_size:
        raise ValueError(f"a plan for {plan.world_size} ranks, a group of {shard.world_size}")
    rank = shard.rank
    model.draft = None  # DSpark's draft is not sharded: a sharded model runs without it
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(module, PackedLinear):
            _cut_packed_linear(module, plan, f"{prefix}weight", rank)
            continue
        if isinstance(module, PackedExperts):
            _cut_packed_experts(module, plan, path, rank)
            continue
        for name, t in [*module.named_parameters(recurse=False),
                        *module.named_buffers(recurse=False)]:
            split = plan.split(prefix + name, tuple(t.shape))
            if split is not None:
                vocab = prefix + name in ("embed.weight", "head.weight")
                _replace(module, name, _cut(t.data, split, rank, split.piece if vocab else None))
    return wire(model, plan, shard)


def wire(model: Model, plan: ShardingPlan, shard: TorchShard) -> Model:
    """Tell the layers of a model that holds rank shard.rank's tensors which heads,
    experts and rows those are, and where their partial results rejoin."""
    rank, c, n = shard.rank, model.config, plan.world_size
    for module in model.modules():
        if isinstance(module, Attention):
            module.n_local_heads, module.local_groups = c.n_heads // n, c.o_groups // n
        elif isinstance(module, Indexer):
            module.n_local_heads = c.index_n_heads // n
        elif isinstance(module, MoE):
            if plan.expert_parallel:
                module.first_expert = rank * (c.n_routed_experts // n)
        elif isinstance(module, Engram):
            module.first_row = Split(0, module.n_rows, 1, n, ragged=True).range(rank)[0]
        else:
            continue
        module.shard = shard
    for block in model.layers:
        if isinstance(block.ffn, DenseFFN):
            block.ffn.shard = shard
    model.first_token = Split(0, c.vocab_size, 1, n, ragged=True).range(rank)[0]
    model.shard = shard
    return model


def _cut_packed_linear(module: PackedLinear, plan: ShardingPlan, name: str, rank: int) -> None:
    split = plan.split(name, (module.out_features, module.in_features))
    if split is None:
        return
    vocab = name == "head.weight"
    module.stored = _cut(module.stored, split, rank, split.piece if vocab else None)
    if module.scales is not None:
        lo, hi = _scale_split(split, rank, name)
        module.scales = module.scales.narrow(split.dim, lo, hi - lo).contiguous()
    module.out_features, module.in_features = module.stored.shape


def _cut_packed_experts(experts: PackedExperts, plan: ShardingPlan, path: str,
                        rank: int) -> None:
    c = plan.config
    if plan.expert_parallel:
        lo, hi = Split(0, c.n_routed_experts, 1, plan.world_size).range(rank)
        del experts[hi:]
        del experts[:lo]
        return
    # Each expert's rows of w1 and w3 (a scale per row and 32 inputs), columns of w2 (two
    # FP4 codes per byte, a scale per 32 of them).
    for proj, dim in (("w1", 0), ("w2", 1), ("w3", 0)):
        inner = Split(dim, c.moe_inter_dim, 1, plan.world_size)  # within one expert
        lo, hi = inner.range(rank)
        for expert in experts:
            codes, scales = (getattr(expert, f"{proj}_{k}") for k in ("codes", "scales"))
            if dim == 0:
                codes, scales = codes[lo:hi], scales[lo:hi]
            else:
                s_lo, s_hi = _scale_split(inner, rank, f"{path}.{proj}")
                codes, scales = codes[:, lo // 2 : hi // 2], scales[:, s_lo:s_hi]
            expert.register_buffer(f"{proj}_codes", codes.contiguous())
            expert.register_buffer(f"{proj}_scales", scales.contiguous())


class V41RankCut:
    """A rank's slices of DeepSeek's published tensors, in their stored coordinates:
    the loader reads only these (and only the rank's experts, with expert parallelism)."""

    def __init__(self, plan: ShardingPlan, rank: int) -> None:
        self.plan, self.rank = plan, rank
        c = plan.config
        self.experts = (range(*Split(0, c.n_routed_experts, 1, plan.world_size).range(rank))
                        if plan.expert_parallel else range(c.n_routed_experts))
        # Each FP8 projection's [out, in], which its scales' entry does not show.
        self.linear_shapes = {e.target: e.shape for e in v41_names(c).values()
                              if e.kind == "linear"}

    def _split(self, entry: V41Tensor) -> tuple[Split | None, str]:
        c, kind = self.plan.config, entry.kind
        if kind in ("linear", "linear_scale"):
            name = entry.target + ".weight"
            return self.plan.split(name, self.linear_shapes[entry.target]), name
        if kind in ("expert", "expert_scale"):
            if self.plan.expert_parallel:
                return None, entry.target
            dim = 1 if entry.proj == "w2" else 0  # the inter dim within one expert
            return Split(dim, c.moe_inter_dim, 1, self.plan.world_size), entry.target
        name = ("head.weight" if kind == "head" else
                entry.target + ".weight" if kind == "bf16_linear" else entry.target)
        return self.plan.split(name, entry.shape), name

    def index(self, entry: V41Tensor) -> tuple[slice, ...] | None:
        split, name = self._split(entry)
        if split is None:
            return None
        lo, hi = split.range(self.rank)
        if entry.kind in ("linear_scale", "expert_scale") and (
                entry.kind == "linear_scale" or split.dim == 1):
            lo, hi = _scale_split(split, self.rank, name)
        elif entry.kind == "expert" and split.dim == 1:  # two FP4 codes per byte
            lo, hi = lo // 2, hi // 2
        return (*[slice(None)] * split.dim, slice(lo, hi))

    def finish(self, entry: V41Tensor, piece: torch.Tensor) -> torch.Tensor:
        split, name = self._split(entry)
        if split is not None and name in ("embed.weight", "head.weight"):
            piece = F.pad(piece, [0, 0, 0, split.piece - piece.shape[0]])
        return piece.contiguous()


def load_v41_shard(directory: Path, plan: ShardingPlan, shard: TorchShard) -> Model:
    """Rank shard.rank's shard of a DeepSeek V4.1 checkpoint, reading only its slices."""
    model = _load_v41(directory, V41RankCut(plan, shard.rank))
    return wire(model, plan, shard)


def load_shard(directory: Path, plan: ShardingPlan, shard: TorchShard) -> Model:
    """Rank shard.rank's shard of a kvstack checkpoint, reading from the memory-mapped
    model.safetensors only the slices it holds."""
    from kvstack.model.checkpoint import (
        SINGLE_FILE,
        _check_materialised,
        _file_digest,
        _token_map,
        widened,
    )
    from kvstack.model.params import parameter_shapes

    c = plan.config
    token_map = _token_map(directory, c)
    with torch.device("meta"):
        model = Model(c, token_map)
    shard_model(model, plan, shard)
    state = {}
    weights = directory / SINGLE_FILE
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        held = set(f.keys())
        for name, shape in parameter_shapes(c).items():
            if name not in held:
                raise ValueError(f"checkpoint {weights}: {name} is missing")
            stored = tuple(f.get_slice(name).get_shape())
            if stored != shape:
                raise ValueError(f"checkpoint {weights}: {name} has shape {list(stored)}, "
                                 f"the config needs {list(shape)}")
            split = plan.split(name, shape)
            if split is None:
                state[name] = f.get_tensor(name)
                continue
            lo, hi = split.range(shard.rank)
            index = tuple([slice(None)] * split.dim + [slice(lo, hi)])
            piece = f.get_slice(name)[index]
            if name in ("embed.weight", "head.weight"):
                piece = F.pad(piece, [0, 0] * (piece.dim() - 1) + [0, split.piece - (hi - lo)])
            state[name] = piece
    model.load_state_dict(widened(state), assign=True)
    _check_materialised(model, weights)
    model.checkpoint_digest = _file_digest([directory / "config.json", weights])
    return model
