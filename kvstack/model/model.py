"""The DeepSeek-V4.1 model family, top to bottom (design.md section 2).

Shapes: B batch, n new tokens in this call, H heads of head_dim D (rope on the last R
dims), N entries in a compressed stream, Hi indexer heads of width Di, h = hc_mult.

Every call runs layers over a chunk of new tokens at positions p0..p0+n-1 against a
`KVStore`, which holds everything about earlier tokens. The reference forward is one chunk
of the whole sequence over a `ReferenceStore`; prefill, decode and replay are chunks over
any store (a `ContiguousCache` stores the real bytes). One code path, so the cache and the
reference cannot drift apart.
"""

import hashlib
import itertools
import math
import operator
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvstack import native
from kvstack.cache.batch import DecodeBatch
from kvstack.cache.reference import ReferenceStore
from kvstack.cache.store import KVStore
from kvstack.config import NUMERICS, REPLAY_MODES, LayerSpec, Mode, ModelConfig
from kvstack.formats import straight_through
from kvstack.model.engram import Engram, EngramHash
from kvstack.model.instruments import Instruments
from kvstack.model.packed import Experts, PackedExperts, PackedLinear, weight_backend
from kvstack.model.params import check_fits_memory
from kvstack.model.vision import Aligner, EncodedImages, ImageRows, ImageSegment, ViT

QUERY_TILE = 256  # queries scored at once: bounds the [tile, keys] score matrices
KEY_CHUNK = 4096  # stream rows dequantised at once: no float copy of a whole stream
GATHER_FLOATS = 1 << 22  # per-query gathers of selected rows: floats held at once


# ---- sharded over ranks ----------------------------------------------------------------


class Shard(Protocol):
    """A rank's place among the ranks that each hold a shard of one model
    (`kvstack.parallel`): the collectives that rejoin what the shards computed."""

    rank: int
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of t over the ranks (every rank gets the same bytes)."""

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's t, joined along the last dim in rank order."""


def all_reduce(t: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    return t if shard is None else shard.all_reduce(t)


# ---- small pieces ---------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native.fuses(x, self.weight):
            return native.rmsnorm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).type_as(x)


def rope_frequencies(config: ModelConfig, compressed: bool,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Inverse frequencies [R/2], computed in `dtype`, the precision `rotate` then forms
    its angles in. Layers with a compressed stream use compress_rope_theta, with YaRN
    when rope_factor > 1; window-only layers rope_theta."""
    dim = config.rope_head_dim
    base = config.compress_rope_theta if compressed else config.rope_theta
    # An explicit device: the model may be built on the meta device (checkpoint loading).
    steps = torch.arange(0, dim, 2, dtype=dtype, device="cpu")
    freqs = 1.0 / base ** (steps / dim)
    if compressed and config.rope_factor > 1:
        def correction(rotations: float) -> float:
            return (dim * math.log(config.original_seq_len / (rotations * 2 * math.pi))
                    / (2 * math.log(base)))
        low = max(math.floor(correction(config.beta_fast)), 0)
        high = min(math.ceil(correction(config.beta_slow)), dim - 1)
        ramp = (torch.arange(dim // 2, dtype=dtype, device="cpu") - low) / max(high - low, 1e-3)
        keep = 1 - ramp.clamp(0, 1)  # 1: high frequencies kept, 0: low ones scaled down
        freqs = freqs / config.rope_factor * (1 - keep) + freqs * keep
    return freqs


def rotate(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
           inverse: bool = False) -> torch.Tensor:
    """RoPE on the last len(freqs)*2 dims of x [B, n, ..., width], pairs interleaved;
    positions [P, n] with P = 1 or B. Angles in the precision of freqs (float64 by
    default, so a position rotates the same in any chunk)."""
    rd = freqs.shape[0] * 2
    if (freqs.dtype == torch.float64 and x.dim() in (3, 4) and positions.dim() == 2
            and positions.shape[1] == x.shape[1] and positions.shape[0] in (1, x.shape[0])
            and native.fuses(x)):  # the C kernel broadcasts positions over heads alone
        return native.rope(x, positions, freqs, inverse)
    angles = positions.to(freqs.dtype)[..., None] * freqs.to(positions.device)
    cos, sin = angles.cos().float(), angles.sin().float()
    if inverse:
        sin = -sin
    shape = (*positions.shape, *(1,) * (x.dim() - 3), rd // 2)
    cos, sin = cos.view(shape), sin.view(shape)
    rest, rot = x[..., :-rd], x[..., -rd:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return torch.cat((rest, rotated.flatten(-2).type_as(x)), dim=-1)


def token_positions(start: int | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """Positions of n new tokens: [1, n] from one start shared by the batch, [B, n] from
    per-sequence starts [B]."""
    if isinstance(start, torch.Tensor):
        if n == 1:  # a decode step: the starts themselves (two ops a layer fewer)
            return start.to(device)[:, None]
        return start.to(device)[:, None] + torch.arange(n, device=device)
    steps = torch.arange(n, device=device)
    return (start + steps)[None]


Projection = Callable[[torch.Tensor], torch.Tensor]
Weights3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # an FFN's (w1, w2, w3)


def c_matrix(module: nn.Module) -> torch.Tensor | None:
    """A projection's weight as the C calls of a step take it: a plain linear's float32
    weight, or the bf16 weight of a `PackedLinear("bf16")` (a checkpoint's bf16 matrix, or
    one the engine's `dtype="bfloat16"` narrowed), which they widen in registers; None for
    anything else (an FP8 weight, which its own kernels multiply). Read from the module
    dicts: asked several times a layer in every step."""
    kind = type(module)
    if kind is nn.Linear:
        weight = module._parameters["weight"]
        return weight if weight.dtype is torch.float32 else None
    if kind is PackedLinear and module.fmt == "bf16":
        return module._buffers["stored"]
    return None


def c_matrices(*modules: nn.Module) -> tuple[torch.Tensor, ...] | None:
    """`c_matrix` of each module where every one has one and all share a dtype (a C call
    takes its matrices all float32 or all bf16); else None."""
    out = tuple(c_matrix(m) for m in modules)
    first = out[0]
    for w in out:  # (not `None in out`: that compares tensors with None, a raised error each)
        if w is None or w.dtype is not first.dtype:
            return None
    return out


def swiglu(x: torch.Tensor, w1: Projection, w2: Projection, w3: Projection, limit: float,
           weights: torch.Tensor | None = None) -> torch.Tensor:
    """w2(silu(w1 x) * w3 x), the up branch clamped to +-limit and the gate from above;
    a routing weight [T, 1] scales the hidden activation before w2, as V4.1 does (its
    FP8 rounding of w2's input sees the scaled values)."""
    gate, up = w1(x).float(), w3(x).float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    hidden = F.silu(gate) * up
    if weights is not None:
        hidden = hidden * weights
    return w2(hidden)


class DenseFFN(nn.Module):
    def __init__(self, dim: int, inter_dim: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.shard: Shard | None = None  # a layer's FFN split by its inter dim: sums partials

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(swiglu(x, self.w1, self.w2, self.w3, self.limit), self.shard)

    def c_weights(self) -> Weights3 | None:
        """(w1, w2, w3) as the C calls take them (`c_matrices`), whole on this rank; else
        None."""
        mods = self._modules  # read from the dict: see MoE.fused_parts
        if self.shard is not None:
            return None
        return c_matrices(mods["w1"], mods["w2"], mods["w3"])

    def fused_parts(self, x: torch.Tensor) -> tuple[None, Weights3] | None:
        """As `MoE.fused_parts`: no router, the dense weights in the shared place."""
        weights = self.c_weights()
        if x.numel() // x.shape[-1] > FUSED_MOE_TOKENS or weights is None \
                or not weights[0].is_cpu or not native.fuses(x):
            return None
        return None, weights


class Gate(nn.Module):
    """Routing: top-k experts per token by score + bias (the bias only selects), weights
    from the scores of logits / gate_temp, renormalised over the chosen experts when more
    than one is chosen (norm_topk_prob), scaled by route_scale."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.dim))
        # Balanced by a rule outside backprop (the trainer), so no gradient.
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts), requires_grad=False)
        # Image positions choose their experts with their own bias (V4.1 trains them apart).
        self.bias_vl = (nn.Parameter(torch.zeros(config.n_routed_experts), requires_grad=False)
                        if config.has_vision else None)
        self.load: torch.Tensor | None = None  # tokens per expert since the last balancing

    def forward(self, x: torch.Tensor, image: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim]; image [T] bool, True at image positions (None: none)."""
        logits = self._logits(x.float()) / self.config.gate_temp  # [T, E]
        func = self.config.score_func
        if func == "softmax":
            scores = logits.softmax(-1)
        elif func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        bias = self.bias
        if image is not None and self.bias_vl is not None:
            bias = torch.where(image[:, None], self.bias_vl, bias)
        chosen = (scores + bias).topk(self.config.n_activated_experts, dim=-1).indices
        if self.training:
            load = torch.bincount(chosen.flatten(), minlength=self.config.n_routed_experts)
            self.load = load if self.load is None else self.load + load
        weights = scores.gather(-1, chosen)
        if self.config.norm_topk_prob and self.config.n_activated_experts > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)  # as V4.1 trains
        return weights * self.config.route_scale, chosen

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, dim] float32 times the weight: a checkpoint's bf16 weight as stored by
        the C kernels where they run (no float32 copy a call), else in float32."""
        w = self.weight
        if (w.dtype is torch.bfloat16 and not (torch.is_grad_enabled() and w.requires_grad)
                and weight_backend(x, w) == "c"):
            return native.packed_linear(x, "bf16", w)
        return F.linear(x, w.float())


# Up to this many tokens a float MoE sublayer runs as one C call (`native.moe`); from
# here on torch's grouped matmuls are as fast and keep the prefill chunks (bench/decode.py's
# model, one thread: 0.34 against 1.70 ms at 1 token, 1.5 against 3.2 at 8, 3.3 against
# 4.7 at 32, 6.0 against 5.9 at 64, 8.9 against 9.0 at 128).
FUSED_MOE_TOKENS = 64
# The most tokens whose attention projections in and out (with their norms and RoPE) run as
# one C call each (Attention._c_projections_for): each weight row read once for the tokens,
# against torch's ~15 ops. Measured on bench/decode.py's model, one thread, in / out, C
# against torch: 82 / 82 against 238 / 149 us at 1 token, 158 / 173 against 312 / 246 at
# 8, 243 / 277 against 360 / 293 at 16, 441 / 534 against 457 / 434 at 32.
FUSED_PROJECTION_TOKENS = 16


class MoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, d, i = config.n_routed_experts, config.dim, config.moe_inter_dim
        self.limit = config.swiglu_limit
        self.gate = Gate(config)
        self.experts: Experts | PackedExperts = Experts(e, d, i)
        shared = config.n_shared_experts * config.moe_inter_dim
        self.shared = DenseFFN(d, shared, self.limit) if shared else None
        # Sharded: this rank's experts are first_expert.. (expert parallelism; every
        # expert otherwise, each by a slice of its inter dim), and the routed and shared
        # partial sums are added over the ranks at once.
        self.first_expert = 0
        self.shard: Shard | None = None

    def forward(self, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., dim]; image [...] bool, True at image positions (their own routing bias),
        None where the tokens hold none."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        fused = self._fused(x) if image is None else None
        if fused is not None:
            return fused.type_as(x).view(shape)
        weights, chosen = self.gate(x, None if image is None else image.reshape(-1))
        held = len(self.experts) if isinstance(self.experts, PackedExperts) else \
            self.experts.w1.shape[0]
        if self.first_expert or held < self.gate.weight.shape[0]:
            # Pairs routed to another rank's experts: weight 0 on this rank's last expert
            # (a finite product, so they add exactly nothing, with no shape from routing).
            chosen = chosen - self.first_expert
            mine = (chosen >= 0) & (chosen < held)
            chosen, weights = torch.where(mine, chosen, held - 1), weights * mine
        if isinstance(self.experts, PackedExperts) and self.experts.backend(x) != "torch":
            out = self.experts.swiglu(x, weights, chosen, self.limit)
        elif isinstance(self.experts, Experts) and not torch.is_grad_enabled():
            # Up to half as many (token, expert) pairs as experts, gathering the weights of
            # each pair beats a grouped call that walks every expert (measured on a CPU).
            few = 2 * chosen.numel() <= held
            out = (self._gathered if few else self._grouped)(x, weights, chosen)
        else:  # each chosen expert on its tokens (packed experts off the CPU; autograd)
            out = torch.zeros_like(x, dtype=torch.float32)
            for e in torch.unique(chosen).tolist():
                token, slot = torch.nonzero(chosen == e, as_tuple=True)
                y = swiglu(x[token], *self.experts.projections(e), self.limit,
                           weights[token, slot, None])
                out.index_add_(0, token, y.float())
        if self.shared is not None:
            out = out + self.shared(x)
        return all_reduce(out, self.shard).type_as(x).view(shape)

    def _fused(self, x: torch.Tensor) -> torch.Tensor | None:
        """The whole sublayer in one C call (`native.moe`) for a decode step's few tokens
        where its weights are float and its experts all here; None elsewhere."""
        parts = self.fused_parts(x)
        return None if parts is None else native.moe(x, *parts, self.limit)

    def fused_parts(self, x: torch.Tensor) -> tuple[native.Router, Weights3 | None] | None:
        """What the C calls take of this sublayer for tokens x [..., dim] (the router and
        the shared expert's weights), where they run it: a few tokens, float weights, every
        expert on this rank; else None."""
        # Submodules and parameters are read from the module dicts: nn.Module's attribute
        # lookup costs about 2 us a name on a small CPU, and a decode step asks this of
        # every layer.
        mods = self._modules
        ex, gate = mods["experts"], mods["gate"]
        if x.numel() // x.shape[-1] > FUSED_MOE_TOKENS or not isinstance(ex, Experts) \
                or self.shard is not None or self.first_expert:
            return None
        w, g = ex._parameters, gate._parameters
        if w["w1"].shape[0] < g["weight"].shape[0]:
            return None
        shared = None
        if mods.get("shared") is not None:
            shared = mods["shared"].c_weights()
            if shared is None:
                return None
        # The experts' matrices float32 or bf16 as the shared expert's (the C call takes
        # them all one way); the router's float32.
        stored = w["w1"].dtype if shared is None else shared[0].dtype
        if stored not in (torch.float32, torch.bfloat16) or not w["w1"].is_cpu \
                or any(w[name].dtype is not stored for name in ("w1", "w2", "w3")) \
                or not native.fuses(x, g["weight"]):
            return None
        c = gate.config
        return native.Router(g["weight"], g["bias"], c.score_func, c.gate_temp,
                             c.n_activated_experts, c.norm_topk_prob, c.route_scale,
                             (w["w1"], w["w2"], w["w3"])), shared

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor,
                  chosen: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum [T, dim] for a few (token, expert) pairs (a small decode
        batch): each pair gathers its expert's weights and runs once."""
        pairs = chosen.flatten()  # [T k]
        # (A bf16 expert widened once gathered.)
        w1, w2, w3 = (w.index_select(0, pairs).float() for w in
                      (self.experts.w1, self.experts.w2, self.experts.w3))
        y = swiglu(x.repeat_interleave(chosen.shape[1], dim=0),  # [T k, dim]
                   lambda v: torch.einsum("pd,pid->pi", v, w1),
                   lambda v: torch.einsum("pi,pdi->pd", v, w2),
                   lambda v: torch.einsum("pd,pid->pi", v, w3), self.limit,
                   weights.reshape(-1, 1))
        return y.float().unflatten(0, chosen.shape).sum(1)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor,
                 chosen: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum [T, dim] by grouped matmuls: the (token, expert) pairs
        sorted by expert, each expert's run of rows times its weights, in one call per
        projection. No shape depends on the routing and nothing is read back to the host,
        so a traced step runs it as it is; it equals running each expert on its tokens."""
        n_experts = self.experts.w1.shape[0]
        pairs = chosen.flatten()  # [T k]
        order = pairs.argsort(stable=True)
        # Where each expert's rows end: counted by comparison, a shape bincount would not fix.
        ends = (pairs[:, None] == torch.arange(n_experts, device=x.device)).sum(0).cumsum(0)
        ends = ends.to(torch.int32)
        token = order // chosen.shape[1]
        # bf16 experts as stored: the C grouped matmul widens them in registers, torch's
        # paths widen them whole (`_grouped_mm`).
        w1, w2, w3 = (w.transpose(1, 2) for w in
                      (self.experts.w1, self.experts.w2, self.experts.w3))
        y = swiglu(x.index_select(0, token), lambda v: grouped_mm(v, w1, ends),
                   lambda v: grouped_mm(v, w2, ends), lambda v: grouped_mm(v, w3, ends),
                   self.limit, weights.flatten()[order, None])
        return torch.zeros_like(x, dtype=torch.float32).index_add_(0, token, y.float())


@torch.library.custom_op("kvstack::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return _grouped_mm(x, w, ends)


@_grouped_mm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    if (native.enabled() and x.device.type == "cpu" and x.dtype is torch.float32
            and w.dtype in (torch.float32, torch.bfloat16)
            and not (x.requires_grad or w.requires_grad)):
        return native.grouped_mm(x, w, ends)  # one call, where torch's makes one per group
    w = w.float()  # bf16 experts widened whole for torch's matmuls
    # torch's grouped GEMM takes bf16 alone on CUDA, and strides of whole 16 bytes: the
    # rest is one matmul per group.
    aligned = all(stride * t.element_size() % 16 == 0 for t in (x, w)
                  for stride in t.stride() if stride != 1)
    if x.device.type == "cpu" and aligned:
        return F.grouped_mm(x, w, offs=ends)
    return grouped_mm_by_group(x, w, ends)


def grouped_mm_by_group(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """grouped_mm as one matmul per group, the groups' bounds read back to the host."""
    bounds = [0, *ends.tolist()]
    return torch.cat([x[a:b] @ w[g] for g, (a, b) in enumerate(itertools.pairwise(bounds))])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ends[g-1]:ends[g] of x [M, K] times w[g] [K, N] (ends [G] int32): [M, N].
    Traced through an opaque op: torch's own meta function for it accepts bf16 alone,
    while its CPU kernel multiplies float32. (Eager calls it directly: a custom op's first
    call loads torch's compiler.)"""
    if torch.compiler.is_compiling():
        return _grouped_mm_op(x, w, ends)
    return _grouped_mm(x, w, ends)


# ---- hyper-connections ----------------------------------------------------------------


def hc_weights(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """Mixing logits from the h residual copies x [B, n, h, dim]: RMS-normalised, then
    projected by fn [m, h*dim] -> [B, n, m]."""
    flat = x.flatten(2).float()
    return F.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """One sublayer's hyper-connection, computed from the h residual copies: `pre` weights
    that collapse the copies into one sublayer input, `post` weights that spread the
    output back, and a doubly stochastic `comb` that mixes the copies.

    Which `pre` collapses which input is the residual's rule (`ModelConfig.hc_residual`):
    single-pass V4.1 collapses a sublayer's input with the previous sublayer's `pre`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hc_mult
        self.h, self.config = h, config
        self.fn = nn.Parameter(torch.empty((2 + h) * h, h * config.dim))
        self.base = nn.Parameter(torch.zeros((2 + h) * h))
        self.scale = nn.Parameter(torch.ones(3))

    def mixes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, n, h, dim] -> pre [B, n, h], post [B, n, h], comb [B, n, h, h]."""
        h, c = self.h, self.config
        if native.fuses(x, self.fn, self.scale, self.base):
            return native.hc_mixes(x, self.fn, self.scale, self.base, c.norm_eps, c.hc_eps,
                                   c.hc_sinkhorn_iters)
        mix = hc_weights(x, self.fn, c.norm_eps)
        pre = torch.sigmoid(mix[..., :h] * self.scale[0] + self.base[:h]) + c.hc_eps
        post = 2 * torch.sigmoid(mix[..., h : 2 * h] * self.scale[1] + self.base[h : 2 * h])
        comb = mix[..., 2 * h :].unflatten(-1, (h, h)) * self.scale[2]
        comb = (comb + self.base[2 * h :].view(h, h)).softmax(-1) + c.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + c.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
        return pre, post, comb

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fn, scale, base) for a C call, read from the module's dict (MoE.fused_parts
        says why)."""
        p = self._parameters
        return p["fn"], p["scale"], p["base"]

    @staticmethod
    def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """sum_i pre_i * copy i: [B, n, h, dim] -> [B, n, dim]."""
        if pre.shape == x.shape[:-1] and native.fuses(x, pre):
            return native.hc_collapse(x, pre)
        return (pre.unsqueeze(-1) * x.float()).sum(2).type_as(x)

    @staticmethod
    def post(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
        # copy i <- post_i * out + sum_k comb[k, i] * copy k
        if (post.shape == x.shape[:-1] and comb.shape == (*x.shape[:-1], x.shape[-2])
                and out.shape == (*x.shape[:-2], x.shape[-1]) and native.fuses(out, x, post, comb)):
            return native.hc_post(out, x, post, comb)
        mixed = torch.einsum("bnki,bnkd->bnid", comb, x.float())
        return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).type_as(x)


# ---- attention ------------------------------------------------------------------------


@dataclass
class StepContext:
    """What layers of one call hand to later layers for the same queries."""

    dense: bool = False  # attend to every visible compressed entry (training warm-up)
    collect: bool = False  # keep indexer scores and attention targets (indexer loss)
    # [B, R] query positions at which each index source also scores every visible entry
    # and keeps the trunk's attention over them as its target (index_scores,
    # attention_targets [B, R, N]), while attention stays sparse: dense indexer targets
    # for rows too long for a [T, N] matrix.
    target_rows: torch.Tensor | None = None
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [B,n,k]
    pool: dict[int, torch.Tensor] = field(default_factory=dict)  # kv source -> spans [B,n,kb]
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)  # [B,n,N or k]
    attention_targets: dict[int, torch.Tensor] = field(default_factory=dict)  # [B,n,N or k]
    index_entries: dict[int, torch.Tensor] = field(default_factory=dict)  # [B,n,k], sparse
    instruments: Instruments | None = None  # research probes (`kvstack eval`) only
    # Layers whose attention input (the mean of the residual copies, Engram added) the
    # draft reads, and what they recorded: layer -> [B, n, dim] of each call that ran it,
    # in order (the chunks of a prefill share one list). Empty unless asked for.
    draft_targets: frozenset[int] = frozenset()
    draft_inputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # (start, n, positions [1 or B, n]): the call's token positions, made by the first
    # layer that asks (`call_positions`), so later layers make none.
    positions: tuple[int | torch.Tensor, int, torch.Tensor] | None = None
    # A decode step of one row a sequence on the C kernels: each layer may run its kept
    # `DecodeRecipe` instead of resolving its calls again.
    recipes: bool = False


def call_positions(ctx: StepContext, start: int | torch.Tensor, n: int,
                   device: torch.device) -> torch.Tensor:
    """`token_positions(start, n)`, made once for the layers of one call."""
    held = ctx.positions
    if held is not None and held[1] == n and (
            held[0] is start or (type(start) is int and held[0] == start)):
        return held[2]
    positions = token_positions(start, n, device)
    ctx.positions = (start, n, positions)
    return positions


class Compressor(nn.Module):
    """A kv source's stream: ratio 1, c_t = norm(W x_t); ratio r, each group of r tokens
    pooled by a per-channel softmax gate. Entry j becomes its index key (from the
    pre-RoPE entry) and is rotated at position j*r."""

    def __init__(self, config: ModelConfig, spec: LayerSpec, freqs: torch.Tensor) -> None:
        super().__init__()
        self.layer, self.ratio, self.freqs = spec.index, spec.ratio, freqs
        d = config.head_dim
        self.wkv = nn.Linear(config.dim, d, bias=False)
        self.wgate = nn.Linear(config.dim, d, bias=False) if spec.ratio > 1 else None
        self.norm = RMSNorm(d, config.norm_eps)
        self.wk_index = nn.Linear(d, config.index_head_dim, bias=False)
        self.index_norm = RMSNorm(config.index_head_dim, config.norm_eps)

    def forward(self, x: torch.Tensor, start: int | torch.Tensor, store: KVStore) -> None:
        """Append the entries that tokens start..start+n-1 complete. Tokens the store
        already covers (replay over persisted streams) are skipped. Sequences at different
        positions (a decode batch, start [B]) complete groups at different tokens: every
        one is pooled and the store keeps the entries of those that complete."""
        if isinstance(start, torch.Tensor):
            self._compress_step(x, start, store)
        else:
            self._compress(x, start, store)

    def _compress_step(self, x: torch.Tensor, positions: torch.Tensor, store: KVStore) -> None:
        """One token per sequence, x [B, 1, dim] at positions [B]."""
        r = self.ratio
        weights = self._weights_in_c(x, store)
        if weights is not None:
            values, gates, slots = store.partial_groups(self.layer) if r > 1 else \
                (None, None, positions)
            wkv, wgate, norm, wk_index, index_norm = weights
            write = store.stream_writes(self.layer)  # the entries written in the same call
            seen = store.group_rows(self.layer) if r > 1 else None
            kv, keys = native.compress_step(
                x[:, 0], positions, slots, r, wkv, wgate,
                None if values is None else (values, gates), norm, self.norm.eps,
                wk_index, index_norm, self.index_norm.eps, self.freqs, write, seen)
            if seen is not None:
                store.saw_rows(self.layer, seen)
            if write is None:
                store.append_stream(self.layer, {"kv": kv[:, None], "index": keys[:, None]})
            return
        values = self.wkv(x)  # [B, 1, D]
        if r == 1:
            pooled = values
        else:
            gates = self.wgate(x)
            past_values, past_gates = store.partial(self.layer)  # [B, r - 1, D]
            # For a sequence whose token completes its group, the r - 1 rows before it are
            # that group; for the rest the pooled entry is discarded by the store.
            v = torch.cat((past_values.type_as(x), values), dim=1)
            g = torch.cat((past_gates.type_as(x), gates), dim=1).float().softmax(dim=1)
            pooled = (v * g.type_as(v)).sum(1, keepdim=True)  # [B, 1, D]
            store.set_partial(self.layer, values, gates)
        entry_positions = (((positions + 1) // r - 1) * r)[:, None]  # [B, 1]
        entries = self.norm(pooled)
        keys = rotate(self.index_norm(self.wk_index(entries.detach())), entry_positions,
                      self.freqs)
        store.append_stream(self.layer, {"kv": rotate(entries, entry_positions, self.freqs),
                                         "index": keys})

    def _weights_in_c(self, x: torch.Tensor, store: KVStore
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor,
                                 torch.Tensor] | None:
        """(wkv, wgate or None, norm, wk_index, index_norm), the weights a decode step's
        compression takes as one C call, where it runs so: a decode batch over the
        engine's pools, weights `c_weights` gives, inside a step that chose the C kernels;
        else None."""
        if not isinstance(store, DecodeBatch):
            return None
        weights = self.c_weights()
        if weights is None:
            return None
        wkv, _, norm, _, index_norm = weights
        # The projections may be bf16, which `fuses` (float32 tensors) does not take.
        return weights if wkv.is_cpu and native.fuses(x, norm, index_norm) else None

    def c_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                 torch.Tensor, torch.Tensor] | None:
        """The weights `_weights_in_c` hands a C compression step where the projections
        are plain float32 linear weights or all a checkpoint's bf16 ones (`PackedLinear`),
        the norms float32 and RoPE float64 (default numerics); else None."""
        if self.freqs.dtype is not torch.float64:
            return None
        mods = self._modules  # read from the dicts: see MoE.fused_parts
        parts = [mods["wkv"], mods["wk_index"]] + ([mods["wgate"]] if self.ratio > 1 else [])
        matrices = c_matrices(*parts)
        if matrices is None:
            return None
        wkv, wk_index, *wgate = matrices
        norm = mods["norm"]._parameters["weight"]
        index_norm = mods["index_norm"]._parameters["weight"]
        if any(w.dtype is not torch.float32 for w in (norm, index_norm)):
            return None
        return wkv, (wgate[0] if wgate else None), norm, wk_index, index_norm

    def _compress(self, x: torch.Tensor, start: int, store: KVStore) -> None:
        r = self.ratio
        partial_values, partial_gates = store.partial(self.layer)
        covered = store.stream_len(self.layer) * r + partial_values.shape[1]
        if covered < start:
            raise ValueError(
                f"layer {self.layer}: its stream covers {covered} tokens but the chunk "
                f"starts at position {start}"
            )
        x = x[:, covered - start :]
        if x.shape[1] == 0:
            return
        values = torch.cat((partial_values.type_as(x), self.wkv(x)), dim=1)  # [B, m, D]
        if r == 1:
            pooled = values
        else:
            gates = torch.cat((partial_gates.type_as(x), self.wgate(x)), dim=1)
            store.saw_group_rows(self.layer, values, gates)
            n_full = values.shape[1] // r
            store.set_partial(self.layer, values[:, n_full * r :], gates[:, n_full * r :])
            v = values[:, : n_full * r].unflatten(1, (n_full, r))
            g = gates[:, : n_full * r].unflatten(1, (n_full, r)).float().softmax(dim=2)
            pooled = (v * g.type_as(v)).sum(2)  # [B, n_full, D]
            if n_full == 0:
                return
        first = store.stream_len(self.layer)
        positions = ((first + torch.arange(pooled.shape[1], device=x.device)) * r)[None]
        entries = self.norm(pooled)
        # Index keys read the entries detached: the indexer's KL loss trains the index-key
        # projection, not the stream that attention reads as keys and values.
        keys = rotate(self.index_norm(self.wk_index(entries.detach())), positions, self.freqs)
        store.append_stream(self.layer, {"kv": rotate(entries, positions, self.freqs),
                                         "index": keys})


class Indexer(nn.Module):
    """Scores every visible entry of the stream for each query; publishes a top-k."""

    def __init__(self, config: ModelConfig, spec: LayerSpec, freqs: torch.Tensor) -> None:
        super().__init__()
        self.config, self.spec, self.freqs = config, spec, freqs
        hi, di = config.index_n_heads, config.index_head_dim
        self.wq = nn.Linear(config.q_lora_rank, hi * di, bias=False)
        self.wweights = nn.Linear(config.dim, hi, bias=False)
        self.n_local_heads = hi  # sharded: this rank's heads, whose partial scores add up
        self.shard: Shard | None = None
        # The C queries' kept addresses and buffers (native's `keep`: each call's queries
        # are scored before the next call).
        self.c_calls: dict = {}

    def _queries(self, x: torch.Tensor, qr: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries q [B, n, Hi, Di] and head weights w [B, n, Hi]."""
        c = self.config
        hi, di = c.index_n_heads, c.index_head_dim
        scale = di**-0.5 * hi**-0.5
        mods = self._modules  # read from the dict: see MoE.fused_parts
        matrices = c_matrices(mods["wq"], mods["wweights"])
        if (matrices is not None and self.freqs.dtype is torch.float64
                and qr.shape[0] * qr.shape[1] <= FUSED_PROJECTION_TOKENS
                and (c.index_query_format == "none" or native.decodes(c.index_query_format))
                and matrices[0].is_cpu and native.fuses(qr, x)):
            return native.index_queries(qr, x, positions, *matrices, self.n_local_heads,
                                        self.freqs, c.index_query_format, scale,
                                        self.c_calls)
        q = rotate(self.wq(qr).unflatten(-1, (self.n_local_heads, di)), positions,
                   self.freqs).float()
        if c.index_query_format != "none":  # V4.1 scores FP4 queries against FP4 keys
            # Unchecked: a query only ranks entries, and anything non-finite reaches the
            # logits, which the engine checks once per step.
            if native.fuses(q) and native.decodes(c.index_query_format):
                rounded = native.quantize(q, c.index_query_format, rows=False, check=False)[1]
                q = q + (rounded - q)  # straight_through's forward, rounding included
            else:
                q = straight_through(q, c.index_query_format, check=False)
        return q, self.wweights(x).float() * scale

    def scores(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
               store: KVStore, n_entries: int) -> torch.Tensor:
        """score(t, j) = sum_h w_th relu(q_th . k_j), invisible entries -inf: [B, n, N].
        The keys are read from the store KEY_CHUNK entries at a time."""
        q, w = self._queries(x, qr, positions)
        if store.scores_index_keys:  # a decode batch, over its packed keys
            # (invisible entries are -inf on every rank, and stay so summed)
            return all_reduce(store.index_scores(self.spec.kv_source, q, w, n_entries),
                              self.shard)
        chunks = []
        for start in range(0, n_entries, KEY_CHUNK):
            keys = store.read_stream(self.spec.kv_source, "index", start,
                                     min(start + KEY_CHUNK, n_entries))
            # Keys on the left: one matmul with the entries as its long side, which a CPU
            # runs at twice the speed of the queries-first product.
            s = (keys.float() @ q.flatten(1, 2).transpose(1, 2)).relu()  # [B, K, n * Hi]
            chunks.append(torch.einsum("bknh,bnh->bnk", s.unflatten(-1, q.shape[1:3]), w))
        s = torch.cat(chunks, dim=-1) if chunks else w.new_zeros(*w.shape[:2], 0)
        s = all_reduce(s, self.shard)
        visible = torch.arange(n_entries, device=x.device) < _visible(positions, self.spec)
        return s.masked_fill(~visible, float("-inf"))

    def select_in_pool(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
                       store: KVStore, spans: torch.Tensor, n_entries: int) -> torch.Tensor:
        """The top-k of each query's candidate pool, spans [B, n, kb] -> entries [B, n, k]
        (-1 for none), scoring only the kb * candidate_block_size keys the pool holds, so
        the work does not grow with the stream. It selects what scoring every entry and
        masking to the pool selects: the pool is scored in entry order, so ties still go
        to the earlier entry."""
        bs = self.config.candidate_block_size
        if (x.shape[1] == 1 and self.shard is None
                and store.scores_entries(self.spec.kv_source)):  # a decode step, one C call
            q, w = self._queries(x, qr, positions)
            return store.select_in_pool(self.spec.kv_source, q, w, spans, bs,
                                        self.config.index_topk)
        spans = spans.sort(dim=-1).values
        entries = (spans[..., None] * bs + torch.arange(bs, device=x.device)).flatten(-2)
        visible = entries < _visible(positions, self.spec)  # [B, n, K]
        s = self._scores_of(x, qr, positions, store, entries.clamp(max=n_entries - 1))
        chosen = select_topk(s.masked_fill(~visible, float("-inf")), self.config.index_topk)
        return torch.where(chosen >= 0, entries.gather(-1, chosen.clamp(min=0)), -1)

    def scores_at(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
                  store: KVStore, entries: torch.Tensor) -> torch.Tensor:
        """score(t, j) of each query's own entries [B, n, k] (-1 for none, scored -inf):
        [B, n, k], reading k keys a query rather than the stream (the indexer loss of
        sparse attention)."""
        s = self._scores_of(x, qr, positions, store, entries.clamp(min=0))
        return s.masked_fill(entries < 0, float("-inf"))

    def _scores_of(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
                   store: KVStore, entries: torch.Tensor) -> torch.Tensor:
        q, w = self._queries(x, qr, positions)
        if entries.shape[1] == 1 and store.scores_entries(self.spec.kv_source):
            # A decode step's pool, scored where its keys lie (-inf past a sequence's
            # entries, which the caller masks as invisible anyway).
            return all_reduce(store.index_scores_at(self.spec.kv_source, q, w, entries),
                              self.shard)
        keys = store.gather_stream(self.spec.kv_source, "index", entries).float()  # [B,n,K,Di]
        s = torch.einsum("bnhk,bnh->bnk", torch.einsum("bnhd,bnkd->bnhk", q, keys).relu(), w)
        return all_reduce(s, self.shard)


def _tile(t: torch.Tensor, tile: slice, n: int) -> torch.Tensor:
    """A query tile of t [B, n, ...]; all of it, with no op, where one tile covers n."""
    return t if n <= QUERY_TILE else t[:, tile]


def _joined(tiles: list[torch.Tensor]) -> torch.Tensor:
    """Query tiles' results [B, q, ...] along the queries; one tile as it is."""
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)


def _selected_rows(store: KVStore, source: int, chosen: torch.Tensor,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct entries each sequence's chosen [B, q, k] (-1 for none) select from a
    stream, read once each: rows [B, U, width], U the most any sequence selects (fewer
    padded with its entry 0), and for each choice its row's column [B, q, k] (-1 for
    none). Distinct per sequence: a decode batch's sequences share no entries, and rows
    distinct over the whole batch made each of B sequences read about B times its own k."""
    b = chosen.shape[0]
    valid = chosen >= 0
    if not bool(valid.any()):
        return chosen.new_empty(b, 0, width, dtype=torch.float32), torch.full_like(chosen, -1)
    none = torch.iinfo(chosen.dtype).max  # sorts after every entry
    keys, order = torch.where(valid, chosen, none).reshape(b, -1).sort(dim=-1)
    first = torch.ones_like(keys, dtype=torch.bool)
    first[:, 1:] = keys[:, 1:] != keys[:, :-1]
    first &= keys != none
    rank = first.cumsum(-1) - 1  # [B, q * k]: each sorted choice's distinct row
    u = int(first.sum(-1).max())
    distinct = keys.new_zeros(b, u + 1)  # column u takes the repeats, then is dropped
    distinct.scatter_(1, torch.where(first, rank, u), torch.where(first, keys, 0))
    columns = torch.empty_like(rank).scatter_(1, order, rank).view_as(chosen)
    rows = store.gather_stream(source, "kv", distinct[:, None, :u])[:, 0]
    return rows, torch.where(valid, columns, -1)


def _visible(positions: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """Entries visible to each query [P, n, 1]: j < (t+1) // r, its group complete."""
    return ((positions + 1) // spec.ratio)[..., None]


def candidate_pool(scores: torch.Tensor, positions: torch.Tensor, spec: LayerSpec,
                   config: ModelConfig) -> torch.Tensor:
    """Per query, its candidate pool as span indices: scores [B, q, N] -> [B, q, kb]. A
    span is a run of candidate_block_size entries (DeepSeek's "candidate block"); each
    scores its max, the span holding the newest visible entry is always kept, and the best
    candidate_topk_blocks spans form the pool."""
    bs = config.candidate_block_size
    total = scores.shape[-1]
    n_spans = -(-total // bs)
    if n_spans and native.fuses(scores):
        return native.candidate_pool(scores, positions, spec.ratio, bs,
                                     min(config.candidate_topk_blocks, n_spans))
    # Detached: the pool is indices, so no gradient flows through it. With a graph, the
    # in-place scatter_ below would make span_scores hold a graph that saved span_scores
    # (the gather), a cycle that backward never reaches to free: a leak every step.
    padded = F.pad(scores.detach(), (0, n_spans * bs - total), value=float("-inf"))
    span_scores = padded.unflatten(-1, (n_spans, bs)).amax(-1)  # [B, q, spans]
    newest = (_visible(positions, spec) - 1).expand(span_scores.shape[0], -1, -1)  # [B, q, 1]
    newest_span = newest.clamp(min=0) // bs
    kept = torch.where(newest >= 0, float("inf"), span_scores.gather(-1, newest_span))
    span_scores.scatter_(-1, newest_span, kept)
    return first_k_descending(span_scores, min(config.candidate_topk_blocks, n_spans))


def pool_mask(spans: torch.Tensor, total: int, config: ModelConfig) -> torch.Tensor:
    """Span indices [B, q, kb] -> the entries they hold, bool [B, q, total]."""
    bs = config.candidate_block_size
    n_spans = -(-total // bs)
    in_pool = torch.zeros(*spans.shape[:2], n_spans, dtype=torch.bool, device=spans.device)
    in_pool.scatter_(-1, spans, True)
    return in_pool.repeat_interleave(bs, dim=-1)[..., :total]


def first_k_descending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The first k indices of a stable descending sort of scores [..., N] along the last
    dim (ties to the earlier entry), in that order, by one top-k instead of a sort: each
    score becomes an int64 key that orders as the float in its high half and as the
    reversed index in its low half, so keys are unique and the top-k's order is the
    stable sort's. -0.0 is first made +0.0, which a float compare ties with it."""
    n = scores.shape[-1]
    bits = (scores.float() + 0.0).view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in the float
    keys = (ordered << 32) | (n - 1 - torch.arange(n, device=scores.device))
    return n - 1 - (keys.topk(k, dim=-1).values & 0xFFFFFFFF)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best entries per query in ascending position, -1 for missing ones (fewer
    visible than k). Ties go to the earlier entry, so every chunking selects alike."""
    k = min(k, scores.shape[-1])
    if k and native.fuses(scores):
        return native.select_topk(scores, k)
    order = first_k_descending(scores, k)
    n = scores.shape[-1]
    chosen = order.masked_fill(scores.gather(-1, order) == float("-inf"), n)
    chosen = chosen.sort(dim=-1).values
    return chosen.masked_fill(chosen == n, -1)


class SelectedEntries:
    """The compressed entries a tile of queries selected ([B, q, k], -1 for none), read
    from the store in bounded pieces and never as a float copy of the whole stream.

    With few heads, the distinct rows the tile shares are read KEY_CHUNK at a time and
    scored with matmuls (each row dequantised once per pass); with many heads, each query's
    own k rows are gathered, a few queries at a time. Logits and the weighted sum are two
    passes, so a piece is never kept."""

    def __init__(self, store: KVStore, source: int, selected: torch.Tensor, heads: int,
                 head_dim: int) -> None:
        self.store, self.source = store, source
        self.chosen = selected.clamp(min=0)
        k = self.chosen.shape[-1]
        self.queries_per_gather = max(1, GATHER_FLOATS // (k * head_dim))
        # One query (a decode step) shares nothing: its own rows, and no host look at them.
        self.shared = False
        if self.chosen.shape[1] > 1:
            self.distinct = torch.unique(self.chosen)
            self.shared = self.distinct.numel() * heads <= k * head_dim
            self.columns = torch.searchsorted(self.distinct, self.chosen)  # [B, q, k]

    def _pieces(self) -> Iterator[tuple[int, torch.Tensor]]:
        b = self.chosen.shape[0]
        for start in range(0, self.distinct.numel(), KEY_CHUNK):
            rows = self.distinct[start : start + KEY_CHUNK].view(1, 1, -1).expand(b, 1, -1)
            yield start, self.store.gather_stream(self.source, "kv", rows)[:, 0].float()

    def _in_piece(self, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = self.columns - start
        inside = (local >= 0) & (local < size)
        return local.clamp(0, size - 1)[:, None], inside[:, None]  # [B, 1, q, k]

    def logits(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, q, H, D] -> q . entry for every selected entry: [B, H, q, k]."""
        if not self.shared:
            return torch.cat([
                torch.einsum("bqhd,bqkd->bhqk", q[:, i : i + self.queries_per_gather],
                             self._gather(i))
                for i in range(0, q.shape[1], self.queries_per_gather)], dim=2)
        out = q.new_zeros(q.shape[0], q.shape[2], *self.chosen.shape[1:])
        for start, rows in self._pieces():
            local, inside = self._in_piece(start, rows.shape[1])
            scores = torch.einsum("bqhd,bud->bhqu", q, rows)
            picked = scores.gather(-1, local.expand(-1, q.shape[2], -1, -1))
            out = torch.where(inside, picked, out)
        return out

    def weighted_sum(self, p: torch.Tensor) -> torch.Tensor:
        """p [B, H, q, k] -> sum_k p * entry: [B, q, H, D]."""
        if not self.shared:
            return torch.cat([
                torch.einsum("bhqk,bqkd->bqhd", p[:, :, i : i + self.queries_per_gather],
                             self._gather(i))
                for i in range(0, p.shape[2], self.queries_per_gather)], dim=1)
        out = None
        for start, rows in self._pieces():
            local, inside = self._in_piece(start, rows.shape[1])
            spread = p.new_zeros(*p.shape[:3], rows.shape[1]).scatter_add_(
                -1, local.expand(-1, p.shape[1], -1, -1), p * inside)
            part = torch.einsum("bhqu,bud->bqhd", spread, rows)
            out = part if out is None else out + part
        return out

    def _gather(self, first: int) -> torch.Tensor:
        chosen = self.chosen[:, first : first + self.queries_per_gather]
        return self.store.gather_stream(self.source, "kv", chosen).float()  # [B, q', k, D]




class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        c = config
        self.config, self.spec = c, spec
        self.freqs = rope_frequencies(c, compressed=spec.ratio > 0)
        self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.head_dim, bias=False)
        self.wkv = nn.Linear(c.dim, c.head_dim, bias=False)
        self.kv_norm = RMSNorm(c.head_dim, c.norm_eps)
        self.sink = nn.Parameter(torch.zeros(c.n_heads))
        self.wo_a = nn.Linear(c.n_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank,
                              bias=False)  # block-diagonal: one [o_lora, H/G * D] per group
        self.wo_b = nn.Linear(c.o_groups * c.o_lora_rank, c.dim, bias=False)
        # Sharded: this rank's heads and the output groups they form; wo_b's partial
        # outputs add up over the ranks.
        self.n_local_heads, self.local_groups = c.n_heads, c.o_groups
        self.shard: Shard | None = None
        full = spec.mode is Mode.FULL
        self.compressor = Compressor(c, spec, self.freqs) if full else None
        own_index = spec.mode in (Mode.FULL, Mode.REINDEX)
        self.indexer = Indexer(c, spec, self.freqs) if own_index else None
        # The C attention's and output projection's kept addresses and buffers (native's
        # `keep`: their outputs are spent in this layer before the next call).
        self.c_calls: dict = {}

    def c_projections(self) -> tuple[torch.Tensor, ...] | None:
        """(wq_a, wq_b, wkv, wo_a, wo_b) as the C projections take them (`c_matrices`:
        all float32 or all bf16, not a checkpoint's FP8, which its own kernels multiply),
        with float32 norms; else None. Read from the module dicts: asked twice a layer in
        every step."""
        mods = self._modules
        matrices = c_matrices(mods["wq_a"], mods["wq_b"], mods["wkv"], mods["wo_a"],
                              mods["wo_b"])
        if (matrices is None or mods["q_norm"]._parameters["weight"].dtype is not torch.float32
                or mods["kv_norm"]._parameters["weight"].dtype is not torch.float32):
            return None
        return matrices

    def set_rope_precision(self, dtype: torch.dtype) -> None:
        """Form this layer's RoPE angles (its compressor's and indexer's too) in dtype."""
        self.freqs = rope_frequencies(self.config, self.spec.ratio > 0, dtype)
        for part in (self.compressor, self.indexer):
            if part is not None:
                part.freqs = self.freqs

    def forward(self, x: torch.Tensor, start: int, store: KVStore, ctx: StepContext,
                projected: tuple[torch.Tensor, ...] | None = None,
                spread: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """Attention over x [B, n, dim] at start: [B, n, dim]. `projected`: the
        (positions, qr, q, window) the C projections in already made of x
        (`native.attention_block_in`), and the matrices they used (`c_projections`).
        `spread`: the residual copies, post and comb of the layer's hyper-connection, to
        spread the output over (`HyperConnection.post`) before returning [B, n, h, dim]."""
        c, spec = self.config, self.spec
        n = x.shape[1]
        # In and out alike: the same tokens (`projected` comes from the C projections).
        matrices = projected[4] if projected is not None else self._c_projections_for(x, ctx)
        in_c = matrices is not None
        if projected is not None:
            positions, qr, q, window = projected[:4]  # positions [1 or B, n]
        elif in_c:
            positions = call_positions(ctx, start, n, x.device)
            wq_a, wq_b, wkv = matrices[:3]
            qr, q, window = native.attention_in(
                x, positions, wq_a, self.q_norm.weight, wq_b, wkv, self.kv_norm.weight,
                c.norm_eps, self.freqs, self.n_local_heads)
        else:
            positions = call_positions(ctx, start, n, x.device)
            qr = self.q_norm(self.wq_a(x))
            q = rotate(self.wq_b(qr).unflatten(-1, (self.n_local_heads, c.head_dim)),
                       positions, self.freqs)
            window = self._window_entries(x, positions)
        # A kernel backend reads the ring itself, once the new entry is in it: `attend`
        # writes it (nothing reads the ring before).
        kernel = store.attends() and ctx.instruments is None and not (ctx.collect or ctx.dense)
        if not kernel:
            window, window_positions = store.attend_window(spec.index, window, start)

        n_entries, score_pools = self._stream_step(x, start, store, ctx, n)
        all_kv = (store.read_stream(spec.kv_source, "kv", 0, n_entries)
                  if spec.ratio and ctx.dense else None)
        # Query tiles end to end (score, pool, top-k, attend), so no [n, N] matrix is
        # ever whole unless `collect` asks for the scores.
        outs, topks, pools, scores = [], [], [], []
        for i in range(0, n, QUERY_TILE):
            tile = slice(i, i + QUERY_TILE)
            # One tile (a decode step, a short chunk) takes the tensors whole: no slice ops.
            pos_t = positions if n <= QUERY_TILE else positions[:, tile]
            q_t = q if n <= QUERY_TILE else q[:, tile]
            selected = self._select(x, qr, q_t, pos_t, tile, store, ctx, n_entries,
                                    score_pools, (topks, pools, scores))
            if kernel:
                outs.append(store.attend(spec.index, spec.kv_source, q_t, selected,
                                         self.sink, window if i == 0 else None,
                                         self.c_calls))
            else:
                outs.append(self._attend(q_t, pos_t, window, window_positions, store,
                                         all_kv, selected, ctx, n_entries))
        if ctx.target_rows is not None and self.indexer is not None and n_entries:
            self._collect_rows(x, qr, q, positions, store, ctx, n_entries)
        self._publish(ctx, topks, pools, scores)
        out = _joined(outs)
        if in_c:
            wo_a, wo_b = matrices[3:]
        # `out` is this call's own (a kept buffer of the attention's, or a new tensor):
        # spent here, so the projection out may rotate it in place.
        if in_c and spread is not None and self.shard is None:  # projected and spread at once
            return native.attention_out(out, positions, self.freqs, wo_a, self.local_groups,
                                        wo_b, spread, self.c_calls, spent=True)
        if in_c:
            y = all_reduce(native.attention_out(out, positions, self.freqs, wo_a,
                                                self.local_groups, wo_b, None, self.c_calls,
                                                spent=True),
                           self.shard)
        else:
            y = self.project_out(out, positions)
        return y if spread is None else HyperConnection.post(y, *spread)

    def _stream_step(self, x: torch.Tensor, start: int | torch.Tensor, store: KVStore,
                     ctx: StepContext, n: int) -> tuple[int, bool]:
        """The compressor's entries of attention inputs x [B, n, dim] appended (a Full
        layer), then (the kv source's entries, whether a Reindex layer scores its
        candidate pools alone): where a query tile's pools hold fewer keys than the
        stream (a decode step, once the stream outgrows one pool), decided once per
        call, so every tile's top-k has one width."""
        c, spec = self.config, self.spec
        if self.compressor is not None:
            self.compressor(x, start, store)
        n_entries = store.stream_len(spec.kv_source) if spec.ratio else 0
        trunk_picks = ctx.instruments is not None and ctx.instruments.trunk_picks
        score_pools = (spec.uses_candidates and not (ctx.collect or trunk_picks)
                       and n_entries > 0
                       and min(n, QUERY_TILE) * c.candidate_topk_blocks
                       * c.candidate_block_size < n_entries)
        return n_entries, score_pools

    def _select(self, x: torch.Tensor, qr: torch.Tensor, q_t: torch.Tensor,
                pos_t: torch.Tensor, tile: slice, store: KVStore, ctx: StepContext,
                n_entries: int, score_pools: bool,
                found: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
                ) -> torch.Tensor | None:
        """The entries a query tile (q_t at pos_t, tile of the call's x [B, n, dim] and qr)
        attends beside its window: [B, q, k] entry indices, -1 for none; None for all
        visible (dense) or none (a window-only layer). A layer with an indexer appends its
        top-k, candidate pools and (collect) scores to `found`'s lists."""
        c, spec = self.config, self.spec
        n = x.shape[1]
        topks, pools, scores = found
        if self.indexer is not None:
            # Detached as in DeepSeek-V3.2: the KL loss trains the indexer alone (it
            # reached the trunk through qr and x otherwise, a third of the
            # cross-entropy's gradient on some compressors), and the cross-entropy
            # never reaches the indexer (its scores only pick entries).
            xi, qri = ((x, qr) if n <= QUERY_TILE and not torch.is_grad_enabled()
                       else (x[:, tile].detach(), qr[:, tile].detach()))
            pool = (_tile(ctx.pool[spec.kv_source], tile, n) if spec.uses_candidates
                    else None)
            if score_pools:
                topks.append(self.indexer.select_in_pool(xi, qri, pos_t, store, pool,
                                                         n_entries))
            else:
                # Sparse attention trains the indexer on the entries it selected
                # alone (scored again below, with a gradient), so the scores of the
                # whole stream need none: a [tile, N] graph kept for every tile
                # made a 16K-token training row outgrow 24 GB.
                trunk_picks = ctx.instruments is not None and ctx.instruments.trunk_picks
                with torch.set_grad_enabled(torch.is_grad_enabled() and ctx.dense):
                    s = (self._trunk_picks(q_t, pos_t, store, n_entries) if trunk_picks
                         else self.indexer.scores(xi, qri, pos_t, store, n_entries))
                if ctx.collect and ctx.dense:  # every visible entry is attended
                    scores.append(s)
                if spec.is_candidate_source:
                    pools.append(candidate_pool(s, pos_t, spec, c))
                elif pool is not None:
                    s = s.masked_fill(~pool_mask(pool, n_entries, c), float("-inf"))
                topks.append(select_topk(s, c.index_topk))
                if ctx.collect and not ctx.dense:
                    scores.append(self.indexer.scores_at(xi, qri, pos_t, store, topks[-1]))
        if spec.ratio and not ctx.dense:
            return topks[-1] if topks else _tile(ctx.topk[spec.index_source], tile, n)
        return None

    def write_window(self, x: torch.Tensor, start: int, store: KVStore) -> None:
        """The window entries of attention inputs x [B, n, dim] at start.. and the
        compressor's partial group: what `forward` leaves for later tokens, with no
        attention computed (the replay's last layer)."""
        positions = token_positions(start, x.shape[1], x.device)
        store.write_window(self.spec.index, self._window_entries(x, positions), start)
        if self.compressor is not None:
            self.compressor(x, start, store)

    def _window_entries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The window entries of attention inputs x [B, n, dim] at positions: [B, n, D]."""
        return rotate(self.kv_norm(self.wkv(x)), positions, self.freqs)

    def _c_projections_for(self, x: torch.Tensor,
                           ctx: StepContext) -> tuple[torch.Tensor, ...] | None:
        """The matrices (`c_projections`) where this call's projections in and out (and
        their norms and rotations) run as one C call each: in an engine step with the C
        kernels, for a few tokens (a decode batch: torch's matmuls win on a prefill
        chunk's) through float32 or bf16 weights; else None."""
        if (x.shape[0] * x.shape[1] > FUSED_PROJECTION_TOKENS or ctx.instruments is not None
                or not native.fuses(x) or self.freqs.dtype is not torch.float64):
            return None
        return self.c_projections()

    def project_out(self, out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [B, n, H, D] at `positions` -> [B, n, dim]: the queries'
        rotation taken off, then the grouped low-rank output projection."""
        b, n = out.shape[:2]
        out = rotate(out, positions, self.freqs, inverse=True)
        groups = out.reshape(b, n, self.local_groups, -1)
        if isinstance(self.wo_a, PackedLinear):
            low_rank = self.wo_a.block_diagonal(groups)  # [B, n, G, o_lora_rank]
        else:
            wo_a = self.wo_a.weight.unflatten(0, (self.local_groups, self.config.o_lora_rank))
            # One matmul per group over all the tokens: half einsum's time at a decode
            # step's size, and no copy of the weight per token at a prefill's.
            tokens = groups.reshape(b * n, self.local_groups, -1).transpose(0, 1)  # [G, T, d]
            low_rank = torch.bmm(tokens, wo_a.transpose(1, 2)).transpose(0, 1).view(
                b, n, self.local_groups, -1)
        return all_reduce(self.wo_b(low_rank.flatten(2)), self.shard)

    def _publish(self, ctx: StepContext, topks: list[torch.Tensor], pools: list[torch.Tensor],
                 scores: list[torch.Tensor]) -> None:
        """Hand the query tiles' top-k [B, n, k] and candidate pools [B, n, kb] to later
        layers, and, with collect, the indexer's scores to the output."""
        spec = self.spec
        if topks:
            ctx.topk[spec.index] = _joined(topks)
            if ctx.collect:
                ctx.index_scores[spec.index] = _joined(scores)
                if not ctx.dense:
                    ctx.index_entries[spec.index] = ctx.topk[spec.index]
        if pools:
            ctx.pool[spec.kv_source] = _joined(pools)

    def _attend(self, q: torch.Tensor, positions: torch.Tensor, window: torch.Tensor,
                window_positions: torch.Tensor, store: KVStore, all_kv: torch.Tensor | None,
                selected: torch.Tensor | None, ctx: StepContext,
                n_entries: int) -> torch.Tensor:
        """One softmax, with the sink, over the window and the chosen compressed entries
        for queries q [B, q, H, D] at `positions`."""
        c, spec, tools = self.config, self.spec, ctx.instruments
        scale = c.head_dim**-0.5
        if tools is not None:  # only here: instruments turn the kernel path off
            scale *= tools.logit_factor(spec.index)
            if spec.index in tools.window_only:
                all_kv = selected = None  # window and sink only
        if (tools is None and all_kv is None and not ctx.collect
                and native.fuses(q, window, self.sink)):
            return self._attend_in_c(q, positions, window, window_positions, store, selected)
        t, s = positions[:, :, None], window_positions[:, None, :]
        in_window = (s <= t) & (s > t - c.window_size)  # [P, q, m]
        if window.shape[1] > c.window_size + q.shape[1]:
            # A tile of a long chunk sees only part of its keys: cut to them (a decode
            # step's ring and token are all seen, and need no look at the mask).
            seen = torch.nonzero(in_window.flatten(0, 1).any(0)).flatten()
            lo, hi = int(seen[0]), int(seen[-1]) + 1
            window, in_window = window[:, lo:hi], in_window[..., lo:hi]
        logits = [torch.einsum("bqhd,bkd->bhqk", q.float(), window.float()) * scale]
        logits[0] = logits[0].masked_fill(~in_window[:, None], float("-inf"))
        entries = None
        if spec.ratio and all_kv is not None:
            entries = all_kv  # [B, N, D]
            visible = torch.arange(n_entries, device=q.device) < _visible(positions, spec)
            logits.append(torch.einsum("bqhd,bkd->bhqk", q.float(), entries.float()) * scale)
            logits[1] = logits[1].masked_fill(~visible[:, None], float("-inf"))
        elif spec.ratio and selected is not None and selected.shape[-1]:
            entries = SelectedEntries(store, spec.kv_source, selected, q.shape[2], c.head_dim)
            logits.append(entries.logits(q.float()) * scale)
            logits[1] = logits[1].masked_fill((selected < 0)[:, None], float("-inf"))
        sink = self.sink.float().view(1, -1, 1, 1).expand(*logits[0].shape[:3], 1)
        probs = torch.cat([*logits, sink], dim=-1).softmax(-1)
        m = window.shape[1]
        if tools is not None and tools.probe:
            tools.record_mass(spec, c.window_size, probs, m, positions, selected)
        out = torch.einsum("bhqk,bkd->bqhd", probs[..., :m], window.float())
        if entries is not None:
            p = probs[..., m:-1]
            if isinstance(entries, SelectedEntries):
                out = out + entries.weighted_sum(p)
            else:
                out = out + torch.einsum("bhqk,bkd->bqhd", p, entries.float())
            if ctx.collect and self.indexer is not None:
                self._collect_target(p, ctx)
        return out.type_as(q)

    def _attend_in_c(self, q: torch.Tensor, positions: torch.Tensor, window: torch.Tensor,
                     window_positions: torch.Tensor, store: KVStore,
                     selected: torch.Tensor | None) -> torch.Tensor:
        """`_attend`'s softmax in C (`native.prefill_attention`), a few queries at a time:
        the entries those queries selected are dequantised once each, however many of
        them share an entry, and never more than GATHER_FLOATS floats at once."""
        c, spec = self.config, self.spec
        b, n = q.shape[:2]
        if selected is None or not spec.ratio or not selected.shape[-1]:
            return native.prefill_attention(
                q, positions, window, window_positions, c.window_size,
                window.new_empty(b, 0, c.head_dim), selected.new_empty(b, n, 0)
                if selected is not None else positions.new_empty(b, n, 0), self.sink)
        per = max(1, GATHER_FLOATS // (selected.shape[-1] * c.head_dim))
        outs = []
        for i in range(0, n, per):
            chosen = selected[:, i : i + per]  # [B, q', k]
            rows, columns = _selected_rows(store, spec.kv_source, chosen, c.head_dim)
            outs.append(native.prefill_attention(q[:, i : i + per], positions[:, i : i + per],
                                                 window, window_positions, c.window_size,
                                                 rows, columns, self.sink))
        return torch.cat(outs, dim=1).type_as(q)

    def _collect_rows(self, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor,
                      positions: torch.Tensor, store: KVStore, ctx: StepContext,
                      n_entries: int) -> None:
        """At ctx.target_rows [B, R]: the indexer's scores of every visible entry (with
        its gradient) and, without gradient, the trunk's attention over them -- each
        head's softmax over the compressed entries alone, averaged over heads -- into
        ctx.index_scores and ctx.attention_targets, [B, R, N]."""
        rows = ctx.target_rows
        at = torch.arange(rows.shape[0], device=rows.device)[:, None]
        pos = positions.expand(rows.shape[0], -1).gather(1, rows)  # [B, R]
        with torch.no_grad():
            logits = self._trunk_logits(q[at, rows], pos, store, n_entries)
            # A row with no visible entry gets an all-zero target, which the loss skips.
            seen = logits.isfinite().any(-1, keepdim=True)
            target = torch.where(seen, logits.softmax(-1), 0.0)
        ctx.attention_targets[self.spec.index] = target.mean(1)
        ctx.index_scores[self.spec.index] = self.indexer.scores(
            x[at, rows].detach(), qr[at, rows].detach(), pos, store, n_entries)

    def _trunk_picks(self, q: torch.Tensor, positions: torch.Tensor, store: KVStore,
                     n_entries: int) -> torch.Tensor:
        """What a perfect indexer would rank entries by (Instruments.trunk_picks): the
        layer's own attention logits of queries q [B, q, H, D], logsumexp over heads:
        [B, q, N]."""
        return self._trunk_logits(q, positions, store, n_entries).logsumexp(1)

    def _trunk_logits(self, q: torch.Tensor, positions: torch.Tensor, store: KVStore,
                      n_entries: int) -> torch.Tensor:
        """Attention logits of queries q [B, q, H, D] at `positions` over every entry of
        the stream, -inf where not yet visible: [B, H, q, N]."""
        kv = store.read_stream(self.spec.kv_source, "kv", 0, n_entries)  # [B, N, D]
        logits = torch.einsum("bqhd,bnd->bhqn", q.float(), kv.float())
        visible = torch.arange(n_entries, device=q.device) < _visible(positions, self.spec)
        return (logits * self.config.head_dim**-0.5).masked_fill(~visible[:, None],
                                                                 float("-inf"))

    def _collect_target(self, p: torch.Tensor, ctx: StepContext) -> None:
        """The attention distribution over compressed entries, summed over heads and
        renormalised, without gradient: the indexer's training target [B, q, N] (dense)
        or [B, q, k] over the selected entries, as `ModelOutput.index_entries` says."""
        p = p.detach().sum(1)  # [B, q, N or k]
        target = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
        prev = ctx.attention_targets.get(self.spec.index)
        ctx.attention_targets[self.spec.index] = (
            target if prev is None else torch.cat((prev, target), dim=1)
        )


class DenseAttention(nn.Module):
    """The dense control's attention: causal GQA over every earlier token's keys and
    values of this layer (its "k" and "v" streams), RoPE on the whole head, no sink."""

    def __init__(self, config: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        c = config
        self.config, self.layer = c, spec.index
        self.freqs = rope_frequencies(c, compressed=False)
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        # The decode call's kept addresses and buffers (native's `keep`).
        self.c_calls: dict = {}

    def decode_block(self, x: torch.Tensor, norm: RMSNorm, start: int | torch.Tensor,
                     store: KVStore) -> torch.Tensor | None:
        """x + this attention of norm(x) for a decode step's x [B, 1, dim] as one C call
        (`native.dense_attention_block`: norm, projections, RoPE, the new rows packed
        into the store's pools, attention over them, output projection, residual) where
        the store reads its rows in C and the weights are float; else None."""
        mods = self._modules  # read from the dicts: see MoE.fused_parts
        if x.shape[1] != 1 or not isinstance(start, torch.Tensor) \
                or self.freqs.dtype is not torch.float64 or not store.attends_dense():
            return None
        weights = c_matrices(mods["wq"], mods["wk"], mods["wv"], mods["wo"])
        norm_weight = norm._parameters["weight"]
        if weights is None or not weights[0].is_cpu or not native.fuses(x, norm_weight):
            return None
        k_rows, v_rows, new_rows, lengths = store.dense_stream(self.layer)
        # A kept output: the layer's feed-forward half reads it before the next step.
        out = native.dense_attention_block(
            x[:, 0], norm_weight, norm.eps, *weights, self.config.n_heads, start,
            self.freqs, k_rows.data, v_rows.data, k_rows.fmt, store.block_table, new_rows,
            lengths, self.c_calls)
        return out[:, None]

    def forward(self, x: torch.Tensor, start: int, store: KVStore,
                ctx: StepContext) -> torch.Tensor:
        c = self.config
        positions = token_positions(start, x.shape[1], x.device)  # [1 or B, n]
        q = rotate(self.wq(x).unflatten(-1, (c.n_heads, c.head_dim)), positions, self.freqs)
        k = rotate(self.wk(x).unflatten(-1, (c.n_kv_heads, c.head_dim)), positions, self.freqs)
        store.append_stream(self.layer, {"k": k.flatten(2), "v": self.wv(x)})
        if x.shape[1] == 1 and store.attends_dense():  # a decode step, from the packed rows
            return self.wo(store.attend_dense(self.layer, q).flatten(2))
        total = store.stream_len(self.layer)
        group = c.n_heads // c.n_kv_heads

        def heads(kind: str) -> torch.Tensor:  # [B, H, total, D]
            kv = store.read_stream(self.layer, kind, 0, total).unflatten(-1, (c.n_kv_heads, -1))
            return kv.transpose(1, 2).repeat_interleave(group, dim=1).type_as(q)

        keys, values = heads("k"), heads("v")
        q = q.transpose(1, 2)  # [B, H, n, D]
        outs = []
        for i in range(0, q.shape[2], QUERY_TILE):
            tile = positions[:, i : i + QUERY_TILE]
            causal = (torch.arange(total, device=x.device) <= tile[..., None])[:, None]
            outs.append(F.scaled_dot_product_attention(q[:, :, i : i + QUERY_TILE], keys,
                                                       values, attn_mask=causal))
        return self.wo(torch.cat(outs, dim=2).transpose(1, 2).flatten(2))


# ---- the stack ------------------------------------------------------------------------


@dataclass
class TokenStates:
    """What runs through the layers for each token of a chunk: the residual x [B, n, dim],
    or [B, n, h, dim] with hyper-connections; with single-pass hyper-connections the `pre`
    mix [B, n, h] the next sublayer collapses x with; the Engram table rows
    [B, n, engram layers, columns] of the tokens (None without Engram); and which tokens are
    image positions, bool [B, n] (None where none is)."""

    x: torch.Tensor
    mix: torch.Tensor | None = None
    engram_rows: torch.Tensor | None = None
    image: torch.Tensor | None = None

    def __getitem__(self, tokens: slice) -> "TokenStates":
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, tokens]
        return TokenStates(self.x[:, tokens], cut(self.mix), cut(self.engram_rows),
                           cut(self.image))

    def replace(self, x: torch.Tensor, mix: torch.Tensor | None) -> "TokenStates":
        """The same tokens with a new residual and mix (what a layer hands on)."""
        return TokenStates(x, mix, self.engram_rows, self.image)

    @staticmethod
    def cat(parts: list["TokenStates"]) -> "TokenStates":
        def join(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            if all(t is None for t in ts):
                return None
            if any(t is None for t in ts):  # image marks: a part without any holds none
                ts = [torch.zeros(p.x.shape[:2], dtype=torch.bool, device=p.x.device)
                      if t is None else t for p, t in zip(parts, ts, strict=True)]
            return torch.cat(ts, dim=1)
        return TokenStates(torch.cat([p.x for p in parts], dim=1), join([p.mix for p in parts]),
                           join([p.engram_rows for p in parts]), join([p.image for p in parts]))


class Layer(nn.Module):
    """One transformer layer: attention and feed-forward, each behind its residual mix."""

    def __init__(self, config: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.single_pass = config.single_pass_hc
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = (Attention(config, spec) if config.arch == "v41"
                     else DenseAttention(config, spec))
        self.ffn = (MoE(config) if config.uses_moe
                    else DenseFFN(config.dim, config.inter_dim, config.swiglu_limit))
        self.hc_attn = HyperConnection(config) if config.hc_mult > 1 else None
        self.hc_ffn = HyperConnection(config) if config.hc_mult > 1 else None
        self.engram_index = (config.engram_layer_ids.index(spec.index)
                             if spec.index in config.engram_layer_ids else None)
        self.engram = None
        # The C attention half's kept weights' addresses and buffers (native's `keep`: its
        # outputs are spent in this layer before the next call).
        self.c_calls: dict = {}
        if self.engram_index is not None:
            self.engram = Engram(config.dim, config.hc_mult,
                                 config.engram_num_embeddings[self.engram_index],
                                 (config.engram_max_ngram_size - 1) * config.engram_n_heads,
                                 config.engram_head_dim, config.norm_eps)

    def _add_engram(self, s: TokenStates) -> torch.Tensor:
        """The residual with this layer's Engram lookup added (V4.1 adds it before the
        layer: its hyper-connection mixes are computed from the result)."""
        if self.engram is None:
            return s.x
        rows = s.engram_rows[:, :, self.engram_index]
        # Image positions take no part in an n-gram: their gate stays shut.
        live = None if s.image is None else ~s.image
        if self.hc_attn is None:  # one residual copy
            return self.engram(s.x.unsqueeze(2), rows, live).squeeze(2)
        return self.engram(s.x, rows, live)

    def forward(self, s: TokenStates, start: int | torch.Tensor, store: KVStore,
                ctx: StepContext) -> TokenStates:
        x = self._add_engram(s)
        if self.spec.index in ctx.draft_targets:  # the mean of the copies, if several
            ctx.draft_inputs[self.spec.index].append(x.mean(2) if x.dim() == 4 else x)
        if self.hc_attn is None:
            recipes = self.c_calls.setdefault("recipes", {}) if ctx.recipes else None
            recipe = None if recipes is None else recipes.get(x.shape)
            if recipe is not None and recipe.holds(self, x, store):
                return recipe.run(self, s, store)
            mods = self._modules  # read from the dicts: see MoE.fused_parts
            attn, norm = mods["attn"], mods["attn_norm"]
            x_in = x
            attended = (attn.decode_block(x, norm, start, store)
                        if isinstance(attn, DenseAttention) else None)
            x = attended if attended is not None else x + attn(norm(x), start, store, ctx)
            fused = self._ffn_in_c(x, None) if s.image is None else None
            x = fused[0] if fused is not None else x + self._ffn(self.ffn_norm(x), s)
            if recipes is not None:  # kept where both calls ran in C
                recipes[x_in.shape] = DenseRecipe.capture(
                    self, x_in, store, attended, None if fused is None else x)
            return s.replace(x, None)
        collapse_pre = s.mix if self.single_pass else None  # None: the mixes' own pre
        # A decode step's kept calls, one recipe per batch shape (a server's batch moves).
        recipes = self.c_calls.setdefault("recipes", {}) if ctx.recipes else None
        recipe = None if recipes is None else recipes.get(x.shape)
        if recipe is not None and recipe.holds(self, x, collapse_pre, store):
            return recipe.run(self, s, start, store, ctx)
        x_in = x
        fused = self._attention_in_c(x, collapse_pre, start, ctx)
        if fused is not None:
            attn_pre, post, comb, y, projected = fused
        else:
            attn_pre, post, comb = self.hc_attn.mixes(x)
            y = self.attn_norm(self.hc_attn.collapse(
                x, attn_pre if collapse_pre is None else collapse_pre))
            projected = None
        if isinstance(self.attn, Attention):
            x = self.attn(y, start, store, ctx, projected, spread=(x, post, comb))
        else:
            x = self.hc_attn.post(self.attn(y, start, store, ctx), x, post, comb)
        collapse_pre = attn_pre if self.single_pass else None
        fused = self._ffn_in_c(x, collapse_pre) if s.image is None else None
        if fused is not None:
            x, ffn_pre = fused
        else:
            ffn_pre, post, comb = self.hc_ffn.mixes(x)
            y = self.hc_ffn.collapse(x, ffn_pre if collapse_pre is None else collapse_pre)
            x = self.hc_ffn.post(self._ffn(self.ffn_norm(y), s), x, post, comb)
        if recipes is not None:  # kept where this step ran all four calls in C
            recipes[x_in.shape] = DecodeRecipe.capture(self, x_in, store, projected,
                                                       fused is not None and x)
        return s.replace(x, ffn_pre if self.single_pass else None)

    def _ffn(self, x: torch.Tensor, s: TokenStates) -> torch.Tensor:
        """The feed-forward sublayer; an MoE routes image positions with their own bias."""
        if s.image is not None and isinstance(self.ffn, MoE):
            return self.ffn(x, s.image)
        return self.ffn(x)

    def _attention_in_c(self, x: torch.Tensor, collapse_pre: torch.Tensor | None,
                        start: int | torch.Tensor, ctx: StepContext
                        ) -> tuple[torch.Tensor, ...] | None:
        """The attention half up to the attention, hyper-connection and norm included, as
        one C call (`native.attention_block_in`) where the attention's own projections run
        in C: (pre, post, comb, the attention input, (positions, qr, q, window, the
        matrices)); else None."""
        mods = self._modules  # read from the dicts: see MoE.fused_parts
        attn, hc = mods["attn"], mods["hc_attn"]
        matrices = attn._c_projections_for(x, ctx) if isinstance(attn, Attention) else None
        if matrices is None:
            return None
        mixing, norm = hc.weights(), mods["attn_norm"]._parameters["weight"]
        if not native.fuses(x, *mixing, norm):
            return None
        c, a = hc.config, attn._modules
        wq_a, wq_b, wkv = matrices[:3]
        positions = call_positions(ctx, start, x.shape[1], x.device)
        pre, post, comb, y, *projected = native.attention_block_in(
            x, mixing, c.hc_eps, c.hc_sinkhorn_iters, collapse_pre, norm, positions,
            wq_a, a["q_norm"]._parameters["weight"], wq_b, wkv,
            a["kv_norm"]._parameters["weight"], c.norm_eps, attn.freqs, attn.n_local_heads,
            self.c_calls)
        return pre, post, comb, y, (positions, *projected, matrices)

    def _ffn_in_c(self, x: torch.Tensor, collapse_pre: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The feed-forward half as one C call (`fused_ffn`), or None."""
        return fused_ffn(self, x, collapse_pre, self.c_calls)

    def write_window(self, s: TokenStates, start: int, store: KVStore) -> None:
        """Only what later tokens read of this layer at the tokens of s: their window
        entries and its partial groups (a replay's last layer, whose output nothing
        reads), from its attention input as `forward` makes it."""
        x = self._add_engram(s)
        if self.hc_attn is not None:
            x = self.hc_attn.collapse(x, s.mix if self.single_pass else self.hc_attn.mixes(x)[0])
        self.attn.write_window(self.attn_norm(x), start, store)

    def write_stream(self, s: TokenStates, start: int, store: KVStore) -> None:
        """Only this layer's compressed stream, for tokens no later layer runs on (the
        CED decoder's stream during prefill): its attention input as `forward` makes it."""
        x = self._add_engram(s)
        if self.hc_attn is not None:
            x = self.hc_attn.collapse(x, s.mix if self.single_pass else self.hc_attn.mixes(x)[0])
        self.attn.compressor(self.attn_norm(x), start, store)


def fused_ffn(layer: nn.Module, x: torch.Tensor, collapse_pre: torch.Tensor | None,
              keep: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A layer's feed-forward half (its `ffn`, `ffn_norm` and `hc_ffn` modules: the trunk's
    or a draft stage's), hyper-connection (if any) and norm included, as one C call
    (`native.ffn_block`, its plan kept in `keep`) where the sublayer's own C call would
    run: (the new residual, the mixes' pre or None without a hyper-connection); else
    None."""
    mods = layer._modules  # read from the dicts: see MoE.fused_parts
    hc, ffn, norm = mods.get("hc_ffn"), mods["ffn"], mods["ffn_norm"]
    parts = ffn.fused_parts(x) if isinstance(ffn, MoE | DenseFFN) else None
    if parts is None:
        return None
    mixing, weight = (None if hc is None else hc.weights()), norm._parameters["weight"]
    if not native.fuses(x, *(mixing or ()), weight):
        return None
    if hc is None:
        return native.ffn_block(x, None, norm.eps, 0.0, 0, None, weight, *parts,
                                ffn.limit, keep)
    c = hc.config
    return native.ffn_block(x, mixing, c.norm_eps, c.hc_eps, c.hc_sinkhorn_iters,
                            collapse_pre, weight, *parts, ffn.limit, keep)


class SelectionCalls:
    """A decode layer's compressor and indexer kept as two C calls (`native`'s
    `compress_write_block` and `index_select_block`) for one width of the block table,
    which the stream's length, and with it the selection's path and width, follow: what
    `Attention._stream_step` and `Attention._select` do on a decode batch of the C
    kernels, the same kernels in the same order. A step sets the slots that change (the
    positions, ring slots, new rows, the table, the top-k and pool buffers); a recipe makes
    new calls when the table widens. A layer that reads another's selection (a Reuse
    layer) or none (a window-only layer) keeps no calls, only that choice."""

    def __init__(self, attn: "Attention", store: DecodeBatch, width: int,
                 compress: tuple | None, select: tuple | None, mode: str, k: int,
                 kb: int) -> None:
        self.spec, self.width, self.mode, self.k, self.kb = attn.spec, width, mode, k, kb
        self.compress, self.compress_held = compress or (None, None)
        self.select, self.select_held = select or (None, None)
        spec = attn.spec
        # What the calls write or read in place, which a step checks is still the cache's.
        self.targets = (() if spec.kv_source is None else
                        (store.pools.rows[spec.kv_source, "kv"].data,
                         store.pools.rows[spec.kv_source, "index"].data))
        if self.compress is None:
            self.targets = self.targets[1:] if self.select is not None else ()
        elif spec.ratio > 1:
            self.targets += store.partial_groups(spec.index)[:2]

    @staticmethod
    def make(attn: "Attention", y: torch.Tensor, qr: torch.Tensor, store: DecodeBatch,
             ctx: StepContext) -> "SelectionCalls | None":
        """The calls of a layer whose attention input is y [B, 1, dim] (qr [B, 1, rank] its
        query's low rank), both buffers a recipe keeps, where this step's general path
        would run them in C as they do; else None."""
        if not SelectionCalls._plain(ctx) or store.triton or store.speculates():
            return None
        c, spec = attn.config, attn.spec
        b, width = y.shape[0], store.block_table.shape[1]
        compressor, indexer = attn.compressor, attn.indexer
        if indexer is None:
            if compressor is not None or (spec.ratio and spec.index_source is None):
                return None
            return SelectionCalls(attn, store, width, None, None, "", 0, 0)
        compress = None
        if compressor is not None:
            weights, write = compressor._weights_in_c(y, store), store.stream_writes(spec.index)
            if weights is None or write is None:
                return None
            wkv, wgate, norm, wk_index, index_norm = weights
            partial = store.partial_groups(spec.index)[:2] if spec.ratio > 1 else None
            compress = native.compress_write_block(
                y[:, 0], spec.ratio, wkv, wgate, partial, norm, compressor.norm.eps, wk_index,
                index_norm, compressor.index_norm.eps, compressor.freqs, write)
        n_entries = store.stream_len(spec.kv_source)
        mods = indexer._modules
        matrices = c_matrices(mods["wq"], mods["wweights"])
        index_rows = store.pools.rows[spec.kv_source, "index"]
        if (n_entries == 0 or indexer.shard is not None or matrices is None
                or indexer.freqs.dtype is not torch.float64 or b > FUSED_PROJECTION_TOKENS
                or not (c.index_query_format == "none"
                        or native.decodes(c.index_query_format))
                or not matrices[0].is_cpu or not native.fuses(qr, y)
                or not native.decodes(index_rows.fmt)):
            return None
        bs = c.candidate_block_size
        if spec.uses_candidates and c.candidate_topk_blocks * bs < n_entries:
            spans = ctx.pool.get(spec.kv_source)
            if spans is None or not store.scores_entries(spec.kv_source):
                return None
            mode, kb = "in_pool", spans.shape[-1]
            k = min(c.index_topk, kb * bs)
        elif spec.uses_candidates:  # a pool the stream fits: the masked path, not kept
            return None
        else:
            mode = "candidate_source" if spec.is_candidate_source else "scores"
            kb = min(c.candidate_topk_blocks, -(-n_entries // bs))
            k = min(c.index_topk, n_entries)
        di, hi = c.index_head_dim, c.index_n_heads
        select = native.index_select_block(
            qr, y, *matrices, indexer.n_local_heads, indexer.freqs, c.index_query_format,
            di**-0.5 * hi**-0.5, mode, index_rows.data, index_rows.fmt, n_entries,
            store.pools.ratios[spec.kv_source], kb, bs, k)
        return SelectionCalls(attn, store, width, compress, select, mode, k, kb)

    @staticmethod
    def _plain(ctx: StepContext) -> bool:
        """Whether a step's context asks for nothing the kept calls leave out."""
        return not (ctx.dense or ctx.collect or ctx.instruments is not None
                    or ctx.target_rows is not None)

    def holds(self, store: DecodeBatch, ctx: StepContext) -> bool:
        """Whether this step can make the kept calls."""
        spec = self.spec
        if (store.block_table.shape[1] != self.width or not self._plain(ctx)
                or (self.compress is not None and store.speculates())):
            return False
        if self.targets:
            rows = store.pools.rows
            live = (rows[spec.kv_source, "index"].data,)
            if self.compress is not None:
                live = (rows[spec.kv_source, "kv"].data, *live)
                if spec.ratio > 1:
                    live += store.partial_groups(spec.index)[:2]
            if not all(map(operator.is_, live, self.targets)):
                return False
        if self.mode == "in_pool":
            spans = ctx.pool.get(spec.kv_source)
            return (spans is not None and spans.shape[-1] == self.kb
                    and spans.dtype is torch.int64 and spans.is_contiguous())
        return self.select is not None or not spec.ratio or spec.index_source in ctx.topk

    def run(self, store: DecodeBatch, ctx: StepContext) -> torch.Tensor | None:
        """The step's compressor entries written and its selection [B, 1, k] (-1 for none;
        None for none at all), published to later layers as `Attention._publish` does."""
        spec, threads = self.spec, torch.get_num_threads()
        if self.select is None:
            return ctx.topk[spec.index_source] if spec.ratio else None
        positions = store.positions.data_ptr()
        if self.compress is not None:
            blocks, offsets = store.new_rows(spec.index)
            at = self.compress.slots
            at[3], at[4], at[34] = positions, store.slots.data_ptr(), blocks.data_ptr()
            at[35], at[39] = offsets.data_ptr(), threads
            self.compress()
        b = store.positions.shape[0]
        topk = torch.empty(b, 1, self.k, dtype=torch.int64)
        table = store.block_table
        at = self.select.slots
        at[10], at[25], at[26] = positions, table.data_ptr(), table.shape[1]
        at[38], at[39] = topk.data_ptr(), threads
        if self.mode == "in_pool":
            at[33] = store.stream_lens[spec.kv_source].data_ptr()
            at[34] = ctx.pool[spec.kv_source].data_ptr()
        elif self.mode == "candidate_source":
            spans = torch.empty(b, 1, self.kb, dtype=torch.int64)
            at[34] = spans.data_ptr()
            ctx.pool[spec.kv_source] = spans
        self.select()
        ctx.topk[spec.index] = topk
        return topk


class LayerWatch:
    """Whether a layer still reads what it read when a recipe was kept: every module,
    parameter and buffer of its tree the same object (replacing one, in place in its
    module or by a new module, is seen), each tensor at the same address (an in-place
    update is read as it is; `.data = ` is seen), and the RoPE tables of its attention,
    compressor and indexer the same. Checked each step in C-level loops."""

    def __init__(self, layer: "Layer") -> None:
        # Every (table, name, object) the calls read through.
        self.tables, self.names, self.objects = [], [], []
        for module in layer.modules():
            tables = (module._modules, module._parameters, module._buffers, module.__dict__)
            for table in tables:
                for name, obj in table.items():
                    if table is module.__dict__ and name != "freqs":
                        continue
                    self.tables.append(table)
                    self.names.append(name)
                    self.objects.append(obj)
        self.tensors = [t for t in self.objects if isinstance(t, torch.Tensor)]
        self.addresses = tuple(map(torch.Tensor.data_ptr, self.tensors))

    def unchanged(self) -> bool:
        live = map(dict.__getitem__, self.tables, self.names)
        return (all(map(operator.is_, live, self.objects))
                and tuple(map(torch.Tensor.data_ptr, self.tensors)) == self.addresses)


class DenseRecipe:
    """A decode step of a layer with no hyper-connections (the dense control's) kept
    between steps: its two C calls' argument blocks (`native.dense_attention_block`,
    `native.ffn_block`), as `DecodeRecipe` keeps a stack layer's. A step sets the
    residual, positions, block table, new rows, lengths and output, and makes both
    calls."""

    def __init__(self, layer: "Layer", x: torch.Tensor, store: DecodeBatch,
                 plans: tuple) -> None:
        self.shape = x.shape
        self.plans = plans  # whole: the blocks point into their buffers and scratch
        # Slots of their own, as `DecodeRecipe`'s.
        self.attend, self.ffn = plans[0][0].copy(), plans[1][0].copy()
        self.attended = plans[0][1]  # the attention's kept output [B, dim]
        index = layer.spec.index
        self.pools = (store.pools.rows[index, "k"].data, store.pools.rows[index, "v"].data)
        self.watch = LayerWatch(layer)

    @staticmethod
    def capture(layer: "Layer", x: torch.Tensor, store: KVStore, attended: torch.Tensor | None,
                out: torch.Tensor | None) -> "DenseRecipe | None":
        """The recipe of the step that just ran (x its input residual, attended the
        attention's C output or None, out the layer's C output or None) where both calls
        ran in C through plans they keep; else None."""
        attn = layer._modules["attn"]
        if (attended is None or out is None or layer.engram is not None
                or not isinstance(store, DecodeBatch) or not isinstance(attn, DenseAttention)):
            return None
        plans = (attn.c_calls.get("dense_attention_block"), layer.c_calls.get("ffn_block"))
        if any(p is None for p in plans):
            return None
        made = tuple(p[1] for p in plans)
        (attend, kept, _), (ffn, _) = made
        # Each block must be the one this step's call used.
        if (attend.slots[0] != x.data_ptr() or kept.data_ptr() != attended.data_ptr()
                or ffn.slots[0] != kept.data_ptr() or ffn.slots[33] != out.data_ptr()):
            return None
        return DenseRecipe(layer, x, store, made)

    def holds(self, layer: "Layer", x: torch.Tensor, store: KVStore) -> bool:
        """Whether this step of the layer can run the recipe."""
        if (x.shape != self.shape or not x.is_contiguous() or x.dtype is not torch.float32
                or not isinstance(store, DecodeBatch)):
            return False
        index = layer.spec.index
        return (store.pools.rows[index, "k"].data is self.pools[0]
                and store.pools.rows[index, "v"].data is self.pools[1]
                and self.watch.unchanged())

    def run(self, layer: "Layer", s: TokenStates, store: DecodeBatch) -> TokenStates:
        """`Layer.forward` of a decode step by the kept calls."""
        index, threads, table = layer.spec.index, torch.get_num_threads(), store.block_table
        blocks, offsets = store.new_rows(index)
        at = self.attend.slots  # kv_dense_attention_block's
        at[0], at[13], at[21] = s.x.data_ptr(), store.positions.data_ptr(), table.data_ptr()
        at[22], at[23], at[24] = table.shape[1], blocks.data_ptr(), offsets.data_ptr()
        at[25], at[34] = store.stream_lens[index].data_ptr(), threads
        self.attend()
        out = torch.empty_like(s.x)
        at = self.ffn.slots  # kv_ffn_block's
        at[33], at[34] = out.data_ptr(), threads
        self.ffn()
        return s.replace(out, None)


class DecodeRecipe:
    """A layer's decode step kept between steps: the argument blocks of its four C calls
    (attention in, the ring write and attention, attention out with the spread, the
    feed-forward half) as the last step's calls left them, with the buffers they write.
    A step then sets the few slots that change (the residual, the positions, the block
    table, the selection, new output buffers) and makes the three calls, where resolving
    the calls again (which matrices, which plan, which path) cost about as much host time
    as the calls' own work on a small model. The compressor and the indexer run their own
    code in between, as in `Attention.forward`.

    It holds while every module, parameter and buffer of the layer is the object it was
    (replacing one, in place in its module or by a new module, makes a new recipe), each
    tensor's address is the same (an in-place update is read as it is; `.data = ` is not),
    and the cache's ring and pool are the same tensors: `holds` checks all of it each
    step, in C-level loops."""

    def __init__(self, layer: "Layer", x: torch.Tensor, store: DecodeBatch,
                 matrices: tuple[torch.Tensor, ...], plans: tuple, k: int) -> None:
        self.shape = x.shape
        # The four plans whole: their blocks point into their buffers and scratch, which
        # must live as long as the recipe (a later shape's call replaces the plans kept in
        # the modules).
        self.plans = plans
        # Slots of their own: the modules keep these plans for calls of the same shape
        # outside a recipe (a one-token prefill), which set the slots they take per call
        # (an output buffer of theirs among them) that a recipe sets once.
        self.block_in, self.attend, self.out, self.ffn = (plan[0].copy() for plan in plans)
        self.outs = plans[0][1]  # attention in's kept (pre, post, comb, y, qr, q, window)
        self.k = k  # the selection's width the attention block was made for
        self.matrices = matrices  # (wq_a, wq_b, wkv, wo_a, wo_b) as the calls take them
        spec = layer.spec
        self.ring = store.rings.rows[spec.index].data
        self.ring_pos = store.rings.pos[spec.index]
        self.pool = store.pools.rows[spec.kv_source, "kv"].data if k else None
        self.watch = LayerWatch(layer)
        # The compressor's and indexer's calls (width of the block table, the calls).
        self.selection: tuple[int, SelectionCalls | None] = (-1, None)

    @staticmethod
    def capture(layer: "Layer", x: torch.Tensor, store: KVStore,
                projected: tuple | None, out: torch.Tensor | bool) -> "DecodeRecipe | None":
        """The recipe of the step that just ran (x its input residual, out its output)
        where all four calls ran in C through plans they keep; else None."""
        attn = layer._modules["attn"]
        if (projected is None or out is False or layer.engram is not None
                or not isinstance(store, DecodeBatch) or not isinstance(attn, Attention)):
            return None
        plans = (layer.c_calls.get("attention_block_in"),
                 attn.c_calls.get("sparse_attention"), attn.c_calls.get("attention_out"),
                 layer.c_calls.get("ffn_block"))
        if any(p is None for p in plans):
            return None
        made = tuple(p[1] for p in plans)
        (block_in, outs, _), (attend, attended, _), (spread, _, result, _), (ffn, _) = made
        # Each block must be the one this step's call used (a call whose plan could not
        # be kept leaves an older one behind).
        q, window = outs[5], outs[6]
        if (block_in.slots[0] != x.data_ptr() or attend.name != "kv_ring_write_attend"
                or attend.slots[3] != q.data_ptr() or attend.slots[0] != window.data_ptr()
                or spread.slots[0] != attended.data_ptr() or ffn.slots[33] != out.data_ptr()
                or ffn.slots[0] != result.data_ptr()):
            return None
        k = plans[1][0][1]  # the attention plan's key: (q's shape, k, ...)
        return DecodeRecipe(layer, x, store, projected[4], made, k)

    def holds(self, layer: "Layer", x: torch.Tensor, collapse_pre: torch.Tensor | None,
              store: KVStore) -> bool:
        """Whether this step of the layer can run the recipe."""
        if (x.shape != self.shape or not x.is_contiguous() or x.dtype is not torch.float32
                or not isinstance(store, DecodeBatch)
                or (collapse_pre is not None and not collapse_pre.is_contiguous())):
            return False
        spec = layer.spec
        if (store.rings.rows[spec.index].data is not self.ring
                or store.rings.pos[spec.index] is not self.ring_pos
                or (self.pool is not None
                    and store.pools.rows[spec.kv_source, "kv"].data is not self.pool)):
            return False
        return self.watch.unchanged()

    def run(self, layer: "Layer", s: TokenStates, start: torch.Tensor, store: DecodeBatch,
            ctx: StepContext) -> TokenStates:
        """`Layer.forward` of a decode step by the kept calls."""
        x, threads = s.x, torch.get_num_threads()
        single_pass, at_positions = layer.single_pass, store.positions.data_ptr()
        at = self.block_in.slots  # slots as native.attention_block_in sets them
        at[0], at[10] = x.data_ptr(), s.mix.data_ptr() if single_pass else 0
        at[20], at[31] = at_positions, threads
        self.block_in()
        attn_pre, post, comb, y, qr, q, window = self.outs
        attn = layer._modules["attn"]
        positions = call_positions(ctx, start, 1, x.device)  # [B, 1]: the starts' own
        width = store.block_table.shape[1]
        if self.selection[0] != width:
            self.selection = (width, SelectionCalls.make(attn, y, qr, store, ctx))
        calls = self.selection[1]
        if calls is not None and calls.holds(store, ctx):
            selected = calls.run(store, ctx)
        else:
            n_entries, score_pools = attn._stream_step(y, start, store, ctx, 1)
            found: tuple[list, list, list] = ([], [], [])
            selected = attn._select(y, qr, q, positions, slice(0, QUERY_TILE), store, ctx,
                                    n_entries, score_pools, found)
            attn._publish(ctx, *found)
        k = 0 if selected is None else selected.shape[-1]
        if k != self.k:  # another width (the table grew): the calls as forward makes them
            del layer.c_calls["recipes"][x.shape]
            out = store.attend(attn.spec.index, attn.spec.kv_source, q, selected, attn.sink,
                               window, attn.c_calls)
            x = native.attention_out(out, positions, attn.freqs, self.matrices[3],
                                     attn.local_groups, self.matrices[4], (x, post, comb),
                                     attn.c_calls, spent=True)
            x, ffn_pre = layer._ffn_in_c(x, attn_pre if single_pass else None)
            return s.replace(x, ffn_pre if single_pass else None)
        chosen = None if selected is None else native._as(selected, torch.int64)  # held
        at = self.attend.slots  # kv_ring_write_attend's: its three, then sparse attention's
        table = store.block_table
        at[8], at[9], at[19] = store.slots.data_ptr(), at_positions, table.data_ptr()
        at[20], at[21], at[34] = table.shape[1], 0 if chosen is None else chosen.data_ptr(), threads
        self.attend()
        at = self.out.slots  # kv_attention_out_spread's
        at[4], at[14], at[20] = at_positions, x.data_ptr(), threads
        self.out()
        out, ffn_pre = torch.empty_like(x), x.new_empty(x.shape[:-1])
        at = self.ffn.slots  # kv_ffn_block's
        at[32], at[33], at[34] = ffn_pre.data_ptr(), out.data_ptr(), threads
        self.ffn()
        return s.replace(out, ffn_pre if single_pass else None)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, vocab]
    # collect=True: index source layer -> the indexer's scores and the attention target,
    # [B, T, N] over every entry (dense), or [B, T, k] over each query's selected entries
    # (sparse), column c being entry index_entries[layer][..., c] (-1: none).
    index_scores: dict[int, torch.Tensor]
    attention_targets: dict[int, torch.Tensor]
    index_entries: dict[int, torch.Tensor] = field(default_factory=dict)
    # target_hidden=True: what DSpark's draft reads, the attention inputs of
    # dspark_target_layer_ids side by side [B, T, len(targets) * dim].
    target_hidden: torch.Tensor | None = None

    def dense_targets(self, layer: int, n_entries: int) -> torch.Tensor:
        """A layer's attention target over every entry [B, T, n_entries], whichever
        form it was collected in."""
        target = self.attention_targets[layer]
        entries = self.index_entries.get(layer)
        if entries is None:
            return target
        full = target.new_zeros(*target.shape[:2], n_entries + 1)
        return full.scatter_add_(-1, entries.masked_fill(entries < 0, n_entries),
                                 target)[..., :n_entries]


@dataclass
class Extension:
    """What `Model.extend` hands back."""

    logits: torch.Tensor  # [B, n_logits, vocab]
    target_hidden: torch.Tensor | None  # [B, <= target_hidden, len(targets) * dim]


class Model(nn.Module):
    def __init__(self, config: ModelConfig, token_map: torch.Tensor | None = None) -> None:
        """`token_map`: the normalised token map Engram hashes (`engram.build_token_map` of
        the tokenizer; `from_pretrained` builds it from tokenizer.json). Without one, token
        ids hash as they are, which needs engram_compressed_vocab_size == vocab_size."""
        super().__init__()
        if torch.empty(0).device.type != "meta":  # a checkpoint builds on meta: maps, no copy
            check_fits_memory(config, torch.get_default_dtype().itemsize)
        c = self.config = config
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.engram_hash = _engram_hash(c, token_map) if c.engram_layer_ids else None
        self.layers = nn.ModuleList(Layer(c, spec) for spec in c.layers)
        if c.hc_mult > 1 and not c.single_pass_hc:  # per-site: the head collapses on its own
            self.hc_head_fn = nn.Parameter(torch.empty(c.hc_mult, c.hc_mult * c.dim))
            self.hc_head_base = nn.Parameter(torch.zeros(c.hc_mult))
            self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.head: nn.Linear | PackedLinear = nn.Linear(c.dim, c.vocab_size, bias=False)
        # DSpark's draft stages (config.has_draft); they share embed and head. None on a
        # sharded model, which runs without them.
        from kvstack.model.dspark import Draft  # built from this module's layers

        self.draft = Draft(c) if c.has_draft else None
        # The vision tower (`kvstack.model.vision`): image segments' embedding rows.
        if c.has_vision:
            self.vision = ViT(c)
            self.aligner = Aligner(c)
            self.image_start = nn.Parameter(torch.empty(c.dim))
            self.image_end = nn.Parameter(torch.empty(c.dim))
            self.image_newline = nn.Parameter(torch.empty(c.dim))
            self.encoded_images = EncodedImages()
        # Sharded: embed and head hold vocabulary rows first_token.. (padded to one length
        # on every rank); embeddings add up over the ranks and logits are gathered.
        self.first_token = 0
        self.shard: Shard | None = None
        self.numerics = "default"
        # SHA-256 of the checkpoint files the weights came from (from_pretrained): the
        # fingerprint then needs no pass over the tensors.
        self.checkpoint_digest: str | None = None
        # The dtype the weight matrices (`matrix_names`) are held in: float32 as built and
        # as a kvstack checkpoint loads, bf16 once `narrow_matrices` ran.
        self.matrix_dtype = torch.float32
        # What the checkpoint stored them as (bf16 where it stored them all so: an
        # engine's dtype="auto" holds them so again); float32 for weights made in memory.
        self.stored_matrix_dtype = torch.float32
        self.checkpoint_report = None  # kvstack.model.checkpoint.CheckpointReport, if loaded
        self._compiled_step: Callable[..., TokenStates] | None = None  # compile_decode
        self._guarded_steps: set[tuple] = set()  # the step shapes whose guards have run
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style: normal(0.02) weights, residual outputs scaled by 1/sqrt(2 L)."""
        out_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "scale",
                                  "q_weight", "k_weight")):
                    p.fill_(1.0)
                elif name.endswith(("base", "sink", "gate.bias")):
                    p.zero_()
                else:
                    residual_out = name.endswith(("wo_b.weight", "wo.weight", "w2.weight", ".w2"))
                    p.normal_(0.0, out_std if residual_out else 0.02)

    def set_numerics(self, numerics: str) -> None:
        """"default" or "reference" (NUMERICS): how activations meet quantised weights and
        in what precision RoPE angles are formed."""
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        self.numerics = numerics
        reference = numerics == "reference"
        for m in self.modules():
            if isinstance(m, PackedLinear | PackedExperts):
                m.round_inputs = reference and m.quantized_matmul
            elif isinstance(m, Attention):
                m.set_rope_precision(torch.float32 if reference else torch.float64)

    def _matrices(self) -> Iterator[tuple[str, nn.Module]]:
        """(name, module) of what `narrow_matrices` narrows: each bias-free float linear of
        the layers, the head, each layer's routed experts, the embedding."""
        for name, module in self.named_modules():
            if (type(module) is nn.Linear and module.bias is None
                    and (name.startswith("layers.") or name == "head")) or (
                    type(module) is Experts and name.startswith("layers.")) or name == "embed":
                yield name, module

    def matrix_names(self) -> list[str]:
        """The state-dict names of the weights `narrow_matrices` holds in bf16."""
        return [f"{name}.{leaf}" for name, module in self._matrices()
                for leaf in (("w1", "w2", "w3") if type(module) is Experts else ("weight",))]

    def narrow_matrices(self) -> None:
        """Hold the weight matrices in bf16 for inference (an engine's `dtype="bfloat16"`):
        each bias-free linear of the layers and the head becomes a `PackedLinear("bf16")`
        of its weight rounded to bf16 (to nearest, ties to even), the routed experts'
        and the embedding's weights bf16. The norms, hyper-connections, routers, sinks and
        biases stay float32 (a few kB a layer, and routing is sensitive to rounding), and
        so do the activations: the C kernels widen a bf16 weight in registers, as they do
        a checkpoint's, and torch's paths widen it when a call uses it. Half the bytes a
        decode step reads; the weights take no gradient after."""
        for name, module in list(self._matrices()):
            if type(module) is nn.Linear:
                parent, _, leaf = name.rpartition(".")
                weight = module.weight.detach().to(torch.bfloat16)
                self.get_submodule(parent)._modules[leaf] = PackedLinear("bf16", weight)
                continue
            for leaf in ("w1", "w2", "w3") if type(module) is Experts else ("weight",):
                weight = module._parameters[leaf]
                module._parameters[leaf] = nn.Parameter(weight.detach().to(torch.bfloat16),
                                                        requires_grad=False)
        self.matrix_dtype = torch.bfloat16

    # ---- running layers over a chunk ---------------------------------------------------
    def _states(self, ids: torch.Tensor, start: int | torch.Tensor, store: KVStore,
                images: ImageRows | None = None) -> TokenStates:
        """The chunk's token states entering layer 0: each token's embedding (an image
        position's row from `images` instead; as h equal copies with hyper-connections;
        single-pass collapses the first with a one-hot mix on copy 0), its Engram rows and
        its image marks."""
        c = self.config
        x = self._embed(ids)
        image = self._place_images(x, ids, start, images) if c.has_vision else None
        mix = None
        if c.hc_mult > 1:
            x = x.unsqueeze(2).expand(-1, -1, c.hc_mult, -1).contiguous()
            if c.single_pass_hc:
                mix = x.new_zeros(x.shape[:3])
                mix[..., 0] = 1.0
        return TokenStates(x, mix, self._engram_rows(ids, start, store), image)

    def _place_images(self, x: torch.Tensor, ids: torch.Tensor, start: int | torch.Tensor,
                      images: ImageRows | None) -> torch.Tensor | None:
        """Writes the image rows into x [B, n, dim] where the chunk's ids are the image
        token; the chunk's image marks [B, n] (None where it holds no image position).
        A decode step's tokens (per-sequence starts) are the model's own: text."""
        if isinstance(start, torch.Tensor):
            return None
        marked = ids == self.config.image_token_id  # [B, n]
        if images is None:
            if bool(marked.any()):
                first = start + int(marked.nonzero()[0, 1])
                raise ValueError(f"position {first} holds the image token id "
                                 f"({self.config.image_token_id}) and no image was given "
                                 "for it")
            return None
        if ids.shape[0] != 1:
            raise ValueError(f"a call with images runs one sequence, got {ids.shape[0]}")
        rows, covered = images.at(start, ids.shape[1])
        if not torch.equal(marked[0], covered):
            first = start + int((marked[0] ^ covered).nonzero()[0, 0])
            raise ValueError(f"position {first}: the image token id "
                             f"({self.config.image_token_id}) must mark exactly the "
                             "positions of the images' segments")
        x[0, covered] = rows[covered]
        return marked if bool(marked.any()) else None

    def _engram_rows(self, ids: torch.Tensor, start: int | torch.Tensor,
                     store: KVStore) -> torch.Tensor | None:
        """Table rows of the chunk's n-grams [B, n, engram layers, columns]; the tokens
        before the chunk come from the store (which already holds the chunk's ids)."""
        if self.engram_hash is None:
            return None
        history = store.recent_ids(start, self.config.engram_max_ngram_size - 1)
        # A decode batch (per-sequence starts) had its ids and positions checked on the
        # host; looking again would read them back from the device.
        return self.engram_hash(ids, history.to(ids.device), start,
                                check=not isinstance(start, torch.Tensor))

    def _logits(self, s: TokenStates) -> torch.Tensor:
        c, x = self.config, s.x
        if c.single_pass_hc:
            x = HyperConnection.collapse(x, s.mix)
        elif c.hc_mult > 1:
            mix = hc_weights(x, self.hc_head_fn, c.norm_eps)
            pre = torch.sigmoid(mix * self.hc_head_scale + self.hc_head_base) + c.hc_eps
            x = HyperConnection.collapse(x, pre)
        return self.head_logits(self.norm(x))

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head over normalised states x [..., dim]: float32 logits [..., vocab]."""
        c = self.config
        logits = self.head(x).float()
        if self.shard is None:
            return logits
        return self.shard.all_gather(logits)[..., : c.vocab_size]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return self.embed(ids).float()
        local = ids - self.first_token
        mine = (local >= 0) & (local < self.embed.weight.shape[0])
        x = self.embed(torch.where(mine, local, 0)).float() * mine[..., None]
        return self.shard.all_reduce(x)

    def compile_decode(self, backend: str = "inductor") -> None:
        """Run decode steps through torch.compile, every layer in one graph (fullgraph: a
        graph break is an error, never a silent fall back to eager). Prefill and replay
        stay eager. The step compiles on its first decode of each batch size; the engine
        pads a batch to a few bucket sizes, so those are all it sees. Shapes are static
        but for the table's width (DecodeBatch.mark_dynamic), so a growing context
        compiles again only where a layer changes how it runs (a table of one block or
        more, a Reindex layer's stream outgrowing its pool). The traced MoE indexes the
        experts' float weights, so a checkpoint's packed experts are refused."""
        if self.shard is not None:
            raise ValueError("compiled decode runs in one process; a sharded model decodes "
                             "eager (its collectives are outside the traced graphs)")
        if any(isinstance(m, PackedExperts) for m in self.modules()):
            raise ValueError("compiled decode indexes a stack of float expert weights, and "
                             "this model's experts are packed (a V4.1 checkpoint's FP4): "
                             "decode it eager")
        # torch.compile keeps a function's graphs on its code object and tries each one's
        # guards in turn on every call; each call's guards re-check the store, the config
        # and the parameters. So the whole step is one graph per batch-size bucket, traced
        # from this model's own copy of `_decode_layers`' code: one guard check a step
        # (once per layer they cost 13 % of a batch-1 step), and no walk past another
        # model's graphs (when every layer of every model shared Layer.forward's code, a
        # second model's batch-1 step took 1.7x what it takes on its own code: 18.9
        # against 11.4 ms, one thread, the decode benchmark's model). A step's graphs are
        # a handful per bucket: room for more, and running out of it fails rather than
        # falling back to eager in silence.
        # dynamic=False: no automatic dynamic shapes. Once a step has seen two batch
        # sizes, torch would otherwise trace the batch dimension as a symbol everywhere,
        # and that graph ran batch 32 at 1.37x the time of one traced for its size (115.5
        # against 84.4 ms a step at 2K, after batch 1, one thread, the same model).
        # On a CPU the graph's wrapper is C++ (Inductor's cpp_wrapper) rather than Python,
        # which calls its few hundred kernels ~1 ms a step faster (6.1 -> 5.0 ms at 4K,
        # batch 1, one thread, the decode benchmark's model). CUDA keeps the Python
        # wrapper: the C++ one has not been measured there.
        on_cpu = self.embed.weight.device.type == "cpu"
        options = {"cpp_wrapper": True} if backend == "inductor" and on_cpu else None
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
        dynamo.fail_on_recompile_limit_hit = True
        fn = Model._decode_layers
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                 fn.__defaults__, fn.__closure__)
        self._compiled_step = torch.compile(types.MethodType(own, self), fullgraph=True,
                                            dynamic=False, backend=backend, options=options)
        self._guarded_steps.clear()

    def _run_compiled(self, s: TokenStates, start: torch.Tensor,
                      cache: DecodeBatch) -> TokenStates:
        """The compiled step, its guards checked only for a step shape not seen before.

        Each call's guards (~3,000 of them: every parameter's and buffer's dtype, shape
        and identity, the store's, the config's) took 0.7 ms of a 6 ms step at 4K. A
        step's graph is chosen by what varies between steps of one engine: the batch
        (its bucket) and the block table's width, whose symbolic guards mark where a
        layer changes how it runs; everything else the guards check is fixed once the
        model and its pools are built. So the first step of each (batch, width, grad
        mode) runs every guard, compiling if none matches, and a later step of that
        shape runs only the guards that tell this step's graphs apart
        (skip_guard_eval_unsafe)."""
        shape = (*cache.block_table.shape, torch.is_grad_enabled(),
                 torch.is_inference_mode_enabled())
        if shape not in self._guarded_steps:
            s = self._compiled_step(s, start, cache)
            self._guarded_steps.add(shape)
            return s
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return self._compiled_step(s, start, cache)

    def _decode_layers(self, s: TokenStates, start: torch.Tensor,
                       store: KVStore) -> TokenStates:
        """Every layer over a decode step's one token per sequence (what compile_decode
        traces as one graph)."""
        ctx = StepContext()
        for layer in self.layers:
            s = layer(s, start, store, ctx)
        return s

    def _run(self, s: TokenStates, start: int | torch.Tensor, store: KVStore, layers: range,
             ctx: StepContext | None = None) -> TokenStates:
        ctx = ctx or StepContext()
        for i in layers:
            s = self.layers[i](s, start, store, ctx)
        return s

    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"token ids must be an integer tensor [batch, seq], got "
                             f"{ids.dtype} {list(ids.shape)}")
        if ids.shape[1] == 0:
            raise ValueError("no tokens: the prompt is empty")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1}, got "
                             f"{int(ids.min())}..{int(ids.max())}")
        return ids.long().to(self.embed.weight.device)

    # ---- reference forward -------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, *, dense: bool = False, collect: bool = False,
                target_rows: torch.Tensor | None = None,
                instruments: Instruments | None = None,
                target_hidden: bool = False,
                images: list[ImageSegment] | None = None) -> ModelOutput:
        """Every layer over every token. Training asks for more: `dense`, attend to all
        visible compressed entries (the warm-up); `collect`, also return indexer scores
        and targets; `target_rows` [B, R], indexer scores and attention targets over every
        visible entry at these query positions alone, attention staying sparse. Research
        probes go through `instruments`, which records what they ask for. `target_hidden`:
        also return what DSpark's draft reads (`ModelOutput.target_hidden`). `images`: the
        images whose segments the ids hold (one sequence)."""
        ids = self._check_ids(input_ids)
        if target_rows is not None:
            if collect or dense:
                raise ValueError("target_rows collects at some positions; collect and "
                                 "dense at every one")
            if (target_rows.dim() != 2 or target_rows.shape[0] != ids.shape[0]
                    or not target_rows.numel() or int(target_rows.min()) < 0
                    or int(target_rows.max()) >= ids.shape[1]):
                raise ValueError(f"target_rows must be [{ids.shape[0]}, R] positions in "
                                 f"0..{ids.shape[1] - 1}, got {tuple(target_rows.shape)}")
            target_rows = target_rows.long().to(ids.device)
        if self.shard is not None and (collect or target_rows is not None):
            raise ValueError("collect and target_rows read every head's attention, and this "
                             "rank holds a shard of them")
        if instruments is not None:
            instruments.attach(self.config.n_layers, self.shard is not None)
        if ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"{ids.shape[1]} tokens exceed max_seq_len "
                             f"{self.config.max_seq_len}")
        store = ReferenceStore(self.config, ids.shape[0], ids.device)
        draft = self._draft_inputs(target_hidden)
        ctx = StepContext(dense=dense, collect=collect, target_rows=target_rows,
                          instruments=instruments, draft_targets=frozenset(draft or ()),
                          draft_inputs=draft or {})
        rows = self._image_rows(images, 0, ids.shape[1])
        s = self._run(self._states(ids, 0, store, rows), 0, store, range(self.config.n_layers),
                      ctx)
        hidden = _target_hidden(draft, ids.shape[1]) if draft else None
        return ModelOutput(self._logits(s), ctx.index_scores, ctx.attention_targets,
                           ctx.index_entries, hidden)

    def _draft_inputs(self, wanted: bool | int) -> dict[int, list[torch.Tensor]] | None:
        """What a call that hands DSpark its target states records them in (None: not
        asked for): one list per target layer."""
        if not wanted:
            return None
        if not self.config.has_draft:
            raise ValueError("target_hidden is what DSpark's draft reads, and this config "
                             "has no draft (n_mtp_layers, dspark_block_size)")
        return {i: [] for i in self.config.dspark_target_layer_ids}

    # ---- incremental -------------------------------------------------------------------
    def decoder_span(self, replay: str) -> int:
        """Tokens the decoder re-runs: window (bounded) or L_dec (window-1) + 1 (exact)."""
        _check_replay(replay)
        w = self.config.window_size
        return w if replay == "bounded" else self.config.n_decoder_layers * (w - 1) + 1

    def encoder_span(self, replay: str) -> int:
        """Tokens the layers that run over the whole prompt (the encoder; every layer
        without CED) re-run to rebuild their rings and partial groups: window (bounded),
        or, exact, enough for their own rings (L_enc (window-1) + 1) and for the exact
        encoder output the decoder span reads (the decoder span - 1 more)."""
        _check_replay(replay)
        c, w = self.config, self.config.window_size
        if replay == "bounded":
            return w
        head = c.n_encoder_layers if c.n_encoder_layers else c.n_layers
        tail = self.decoder_span(replay) - 1 if c.n_encoder_layers else 0
        return head * (w - 1) + 1 + tail

    def rebuild_spans(self, n: int, replay: str) -> tuple[int, int]:
        """Tokens `rebuild_window` re-runs over a cache of n tokens: (through the encoder,
        through the decoder); without CED every layer is the encoder and the second is 0.
        The encoder span also covers the longest partial group, which it must rebuild."""
        c = self.config
        longest_partial = max((s.ratio - 1 for s in c.layers), default=0)
        encoder = min(n, max(self.encoder_span(replay), longest_partial))
        decoder = min(self.decoder_span(replay), encoder) if c.n_encoder_layers else 0
        return encoder, decoder

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: KVStore, replay: str = "bounded",
                chunk_size: int = 512, images: list[ImageSegment] | None = None) -> torch.Tensor:
        """CED prefill of input_ids [B, n] after what the cache holds; last logits [B, V].

        The encoder runs over every token, the decoder's stream is written for every token,
        and the decoder layers run over the last `decoder_span` tokens only. Without CED
        every layer runs over every token. `images`: the images whose segments the new ids
        hold, at positions counted from the sequence's start (one sequence)."""
        return self.extend(input_ids, cache, replay, chunk_size, images=images).logits[:, -1]

    @torch.no_grad()
    def extend(self, input_ids: torch.Tensor, cache: KVStore, replay: str = "bounded",
               chunk_size: int = 512, n_logits: int = 1, target_hidden: int = 0,
               images: list[ImageSegment] | None = None) -> Extension:
        """`prefill` handing back more: the logits of the last `n_logits` tokens (a
        draft's verify reads one per drafted token), and with `target_hidden`, DSpark's
        target states (`ModelOutput.target_hidden`) of the last `target_hidden` tokens
        the target layers ran over (at most the decoder span where they are decoder
        layers)."""
        n = input_ids.shape[-1]
        span = min(self.decoder_span(replay), n)
        if span and not 0 < n_logits <= span:  # (no tokens at all: _encode says so)
            raise ValueError(f"n_logits must be 1..{span} (the tokens the decoder runs "
                             f"over), got {n_logits}")
        draft = self._draft_inputs(target_hidden)
        s = self._encode(input_ids, cache, chunk_size, keep=span, draft=draft, images=images)
        c = self.config
        if c.n_encoder_layers:
            s = self._run_chunked(s, cache.num_tokens - span, cache,
                                  range(c.n_encoder_layers, c.n_layers), chunk_size, draft)
        hidden = _target_hidden(draft, target_hidden) if draft else None
        return Extension(self._logits(s[-n_logits:]), hidden)

    @torch.no_grad()
    def prefill_part(self, input_ids: torch.Tensor, cache: KVStore,
                     chunk_size: int = 512, images: list[ImageSegment] | None = None) -> None:
        """A prompt's leading part, when it is prefilled over several calls (a long prompt
        spread over engine steps): the encoder over input_ids [B, n] and the decoder's
        stream, which is all a later `prefill` needs of these tokens as long as it holds at
        least `final_prefill_tokens(replay)` of its own. Together the calls compute what one
        `prefill` of the whole prompt computes."""
        self._encode(input_ids, cache, chunk_size, keep=0, images=images)

    def final_prefill_tokens(self, replay: str) -> int:
        """The fewest tokens the last call of a prompt prefilled in parts must hold: the
        decoder span it runs the decoder over (1 without CED)."""
        return self.decoder_span(replay) if self.config.n_encoder_layers else 1

    def _encode(self, input_ids: torch.Tensor, cache: KVStore, chunk_size: int,
                keep: int, draft: dict[int, list[torch.Tensor]] | None = None,
                images: list[ImageSegment] | None = None) -> "TokenStates | None":
        """Append input_ids to the cache and run the encoder (every layer without CED) over
        them in chunks, writing the decoder's stream; the token states of the last `keep`
        tokens as the encoder leaves them (without CED: the last chunk's), else None."""
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        ids = self._check_ids(input_ids)
        self._check_room(cache, ids)
        c = self.config
        start, n = cache.num_tokens, ids.shape[1]
        rows = self._image_rows(images, start, n)  # encoded once, whatever the chunks
        cache.append_tokens(ids)
        enc = c.n_encoder_layers if c.n_encoder_layers else c.n_layers
        tail = []  # token states of the last `keep` tokens as the encoder leaves them
        s = None
        for i in range(0, n, chunk_size):
            chunk = self._states(ids[:, i : i + chunk_size], start + i, cache, rows)
            s = self._run(chunk, start + i, cache, range(enc), _draft_context(draft))
            if c.n_encoder_layers:
                self.layers[enc].write_stream(s, start + i, cache)
                skip = max(0, n - keep - i)
                if skip < s.x.shape[1]:
                    tail.append(s[skip:])
        if not c.n_encoder_layers:
            return s
        return TokenStates.cat(tail) if tail else None

    @torch.no_grad()
    def decode(self, token_ids: torch.Tensor | list[int], cache: KVStore,
               logit_rows: list[int] | None = None) -> torch.Tensor:
        """One new token per sequence, token_ids [B] (host ints are checked on the host,
        so the step reads nothing back from the device); logits [B, V]. A `DecodeBatch`
        with several rows of a sequence takes one token a row; `logit_rows`: the rows
        whose logits are wanted (the head runs on those alone), in that order."""
        s = self._decode_states(token_ids, cache)
        if logit_rows is not None:
            s = _rows(s, logit_rows)
        return self._logits(s)[:, 0]

    @torch.no_grad()
    def verify(self, token_ids: list[int], batch: DecodeBatch,
               logit_rows: list[int] | None = None) -> Extension:
        """One decode step of a batch with several tokens of a sequence (`DecodeBatch`'s
        counts: DSpark's verify), token_ids one per row: the logits [rows, 1, V] of every
        row (or of `logit_rows`, in that order) and every row's DSpark target states
        [rows, 1, len(targets) * dim]."""
        draft = self._draft_inputs(True)
        s = self._decode_states(token_ids, batch, draft)
        if logit_rows is not None:
            s = _rows(s, logit_rows)
        return Extension(self._logits(s), _target_hidden(draft, 1))

    def _decode_states(self, token_ids: torch.Tensor | list[int], cache: KVStore,
                       draft: dict[int, list[torch.Tensor]] | None = None) -> TokenStates:
        """A decode step's token states after the last layer; `draft`: where DSpark's
        target states are recorded (the compiled step records none)."""
        if isinstance(token_ids, torch.Tensor):
            ids = self._check_ids(token_ids.reshape(-1, 1))
            appended: torch.Tensor | list[list[int]] = ids
        else:
            bad = [t for t in token_ids
                   if not isinstance(t, int) or not 0 <= t < self.config.vocab_size]
            if bad or not token_ids:
                raise ValueError(f"token ids must be integers in 0..{self.config.vocab_size - 1}"
                                 f", got {bad[:3] or 'none'}")
            appended = [[t] for t in token_ids]
            ids = torch.tensor(appended, dtype=torch.long, device=self.embed.weight.device)
        self._check_room(cache, ids)
        start = cache.start_positions()
        cache.append_tokens(appended)
        s = self._states(ids, start, cache)
        # A decode batch (per-sequence starts) runs the compiled step, if any.
        if draft is None and self._compiled_step is not None and isinstance(cache, DecodeBatch):
            return self._run_compiled(s, start, cache)
        ctx = _draft_context(draft) or StepContext()
        ctx.recipes = (isinstance(cache, DecodeBatch) and cache.c_attention and not cache.several
                       and not torch.is_grad_enabled() and not torch.compiler.is_compiling())
        return self._run(s, start, cache, range(self.config.n_layers), ctx)

    @torch.no_grad()
    def rebuild_window(self, cache: KVStore, replay: str = "bounded", chunk_size: int = 512,
                       logits: bool = True, images: list[ImageSegment] | None = None
                       ) -> torch.Tensor | None:
        """Rebuild every window ring and partial group from the persisted streams by
        re-running the last tokens (nothing new is written to the streams); returns the
        last position's logits [B, V]. Without `logits` (an engine, which prefills the next
        tokens anyway) the last layer only writes its rings and partial groups: nothing
        reads its attention or feed-forward output, and None is returned. `images`: the
        images of the sequence's segments (a replay over part of a segment encodes the image
        again)."""
        c = self.config
        n = cache.num_tokens
        if c.arch == "dense":
            raise ValueError("the dense control keeps every token's keys and values: it has "
                             "no window state to rebuild")
        if n == 0:
            raise ValueError("the cache holds no tokens to replay")
        span, dec_span = self.rebuild_spans(n, replay)
        cache.drop_window_state()
        enc = c.n_encoder_layers if c.n_encoder_layers else c.n_layers
        last = c.n_layers if logits else c.n_layers - 1  # layers run whole
        ids = cache.token_ids()[:, n - span :]
        rows = self._image_rows(images, n - span, span)
        s = self._run_chunked(self._states(ids, n - span, cache, rows), n - span, cache,
                              range(min(enc, last)), chunk_size)
        start = n - span
        if c.n_encoder_layers:
            s, start = s[span - dec_span :], n - dec_span
            s = self._run_chunked(s, start, cache, range(enc, last), chunk_size)
        if logits:
            return self._logits(s[-1:])[:, 0]
        for i in range(0, s.x.shape[1], chunk_size):
            self.layers[last].write_window(s[i : i + chunk_size], start + i, cache)
        return None

    def _image_rows(self, images: list[ImageSegment] | None, first: int,
                    n: int) -> ImageRows | None:
        if not images:
            return None
        if not self.config.has_vision:
            raise ValueError("this model has no vision tower (vision_n_layers is 0): it "
                             "takes text only")
        return ImageRows.of(self, images, first, n)

    def _run_chunked(self, s: TokenStates, start: int, store: KVStore, layers: range,
                     chunk_size: int, draft: dict[int, list[torch.Tensor]] | None = None
                     ) -> TokenStates:
        return TokenStates.cat([
            self._run(s[i : i + chunk_size], start + i, store, layers, _draft_context(draft))
            for i in range(0, s.x.shape[1], chunk_size)
        ])

    def _check_room(self, cache: KVStore, ids: torch.Tensor) -> None:
        if cache.batch_size != ids.shape[0]:
            raise ValueError(f"the cache holds {cache.batch_size} sequences, got a batch of "
                             f"{ids.shape[0]}")
        total = cache.num_tokens + ids.shape[1]
        if total > self.config.max_seq_len:
            raise ValueError(f"{total} tokens exceed max_seq_len {self.config.max_seq_len}")

    # ---- checkpoints -------------------------------------------------------------------
    def fingerprint(self) -> str:
        """What cached stream blocks were computed by, so that no other model reuses them:
        SHA-256 of the config (shapes and cache formats), the numerics, and the weights --
        the digest of the checkpoint files they were loaded from, or, for a model made in
        memory, every tensor. (A model changed in memory after loading should be saved and
        loaded again before its caches are shared.)"""
        digest = hashlib.sha256(self.config.to_json().encode())
        digest.update(self.numerics.encode())
        if self.matrix_dtype is not torch.float32:  # as loaded, then narrowed
            digest.update(str(self.matrix_dtype).encode())
        if self.checkpoint_digest is not None:
            digest.update(self.checkpoint_digest.encode())
            return digest.hexdigest()
        for name, tensor in self.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def save_pretrained(self, directory: str | Path) -> None:
        """kvstack's own layout: config.json + model.safetensors (float weights; weights
        loaded packed are written dequantised, Engram tables stay packed)."""
        from kvstack.model.checkpoint import save_kvstack

        save_kvstack(self, Path(directory))

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: torch.device | str = "cpu",
                        numerics: str = "default") -> "Model":
        """kvstack's own layout, or DeepSeek's published V4.1 checkpoint directory (sharded
        safetensors, FP8/FP4 weights kept packed). `numerics`: see NUMERICS."""
        from kvstack.model.checkpoint import load_pretrained

        return load_pretrained(Path(directory), torch.device(device), numerics)


def _engram_hash(config: ModelConfig, token_map: torch.Tensor | None) -> EngramHash:
    c = config
    if token_map is None:
        if c.engram_compressed_vocab_size != c.vocab_size:
            raise ValueError(
                f"Engram hashes a normalised token map of {c.engram_compressed_vocab_size} "
                "ids: give the model its tokenizer's map (Model.from_pretrained builds it from "
                "tokenizer.json); without one, ids hash as they are, which needs "
                f"engram_compressed_vocab_size == vocab_size ({c.vocab_size})")
        token_map = torch.arange(c.vocab_size, device="cpu")
    return EngramHash(c.engram_layer_ids, c.engram_num_embeddings, c.engram_vocab_size,
                      c.engram_max_ngram_size, c.engram_n_heads, c.engram_compressed_vocab_size,
                      c.engram_pad_id, token_map,
                      dead_id=c.image_token_id if c.has_vision else None)


def _rows(s: TokenStates, rows: list[int]) -> TokenStates:
    """The states of a decode step's rows `rows`, in that order."""
    at = torch.tensor(rows, device=s.x.device)
    mix = None if s.mix is None else s.mix.index_select(0, at)
    return TokenStates(s.x.index_select(0, at), mix)


def _draft_context(draft: dict[int, list[torch.Tensor]] | None) -> StepContext | None:
    """A chunk's own context, recording DSpark's target states into `draft` (None: a
    plain one)."""
    if draft is None:
        return None
    return StepContext(draft_targets=frozenset(draft), draft_inputs=draft)


def _target_hidden(draft: dict[int, list[torch.Tensor]], last: int) -> torch.Tensor:
    """The target layers' recorded inputs side by side over the last `last` positions
    that all of them ran: [B, <= last, len(targets) * dim]."""
    rows = [chunks[0] if len(chunks) == 1 else torch.cat(chunks, 1)
            for chunks in draft.values()]
    last = min([last] + [r.shape[1] for r in rows])
    return torch.cat([r[:, r.shape[1] - last :] for r in rows], -1)


def _check_replay(replay: str) -> None:
    if replay not in REPLAY_MODES:
        raise ValueError(f"replay must be one of {', '.join(REPLAY_MODES)}, got {replay!r}")
