"""Projections whose weights stay in their checkpoint format and are multiplied packed.

DeepSeek's V4.1 checkpoint holds its dense projections in FP8 (E4M3, one UE8M0 scale per
32x32 block) and its routed experts in FP4 (E2M1 packed two per byte, one UE8M0 scale per
row per 32): ~510 GB that expand to ~1.1 TB as bf16. The loader swaps these modules in
for `nn.Linear` and the float experts, so resident memory stays close to the checkpoint's
bytes. The kernels read the packed bytes once per call and decode them in registers, so a
decode step reads the checkpoint's bytes, not a float copy: on a CPU the C kernels
(`kvstack.native.packed_linear`, `fp4_grouped`), on a CUDA device the Triton ones
(`kvstack.model.weight_kernels`, FP8 and FP4; the bf16 head is dequantised there).
Elsewhere (autograd, a traced graph, a CPU without a C compiler) a weight is dequantised to
float32 when a call uses it (one projection, or one selected expert, at a time) and
dropped after. `weight_backend` makes that choice.

`round_inputs`: DeepSeek's kernels multiply FP8 activations (UE8M0 per 32) by these
weights; with `numerics="reference"` the input is rounded the same way first. kvstack's
default multiplies the float32 activations, which serves better on hardware without FP8
GEMMs.
"""

import importlib.util
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kvstack import native
from kvstack.formats import Quantized, dequantize, fake_quantize
from kvstack.formats.weights import EXPERT_FORMAT, dequantize_fp8_blocks

ACTIVATION_FORMAT = "fp8_ue8m0_32"  # what DeepSeek's kernels round activations to
WEIGHT_FORMATS = ("fp8", "bf16")


def linear(x: torch.Tensor, weight: torch.Tensor, round_inputs: bool = False) -> torch.Tensor:
    if round_inputs:
        x = fake_quantize(x, ACTIVATION_FORMAT)
    return F.linear(x, weight)


def weight_backend(x: torch.Tensor, stored: torch.Tensor) -> str:
    """What multiplies x by a packed weight: "c" (both in host memory and the C kernels
    built here), "triton" (both on one CUDA device, Triton installed) or "torch"
    (dequantise-then-matmul: anything else, a gradient asked of x, a traced graph)."""
    if (x.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return "torch"
    if x.device.type == "cpu" and stored.device.type == "cpu":
        return "c" if native.packed_enabled() else "torch"
    if (x.device.type == "cuda" and stored.device == x.device
            and importlib.util.find_spec("triton") is not None):
        return "triton"
    return "torch"


class PackedLinear(nn.Module):
    """y = x W^T for W [out, in] held as stored: "fp8" (E4M3 codes uint8 [out, in] and
    UE8M0 scales uint8 [ceil(out/32), ceil(in/32)]) or "bf16" (`stored` is bf16)."""

    def __init__(self, fmt: str, stored: torch.Tensor, scales: torch.Tensor | None = None,
                 round_inputs: bool = False) -> None:
        super().__init__()
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(WEIGHT_FORMATS)}")
        self.fmt = fmt
        self.out_features, self.in_features = stored.shape
        self.register_buffer("stored", stored)
        self.register_buffer("scales", scales)
        # Whether DeepSeek's code runs this weight as an FP8/FP4 GEMM (it dequantises some
        # FP8 weights to bf16 at load), and whether to mimic that now (set_numerics).
        self.quantized_matmul = round_inputs
        self.round_inputs = False
        # Whether the FP8 codes hold a NaN, asked once for each version of them: the kernel
        # skips looking for NaN codes where there are none (a checkpoint's weights).
        self._nan_codes: tuple[tuple[int, int], bool] | None = None

    def _packed(self, x: torch.Tensor, backend: str, groups: int = 1) -> torch.Tensor:
        if backend == "triton":
            from kvstack.model import weight_kernels  # Triton: the `kernels` extra

            return weight_kernels.fp8_linear(x, self.stored, self.scales, groups)
        version = (self.stored.data_ptr(), self.stored._version)
        if self._nan_codes is None or self._nan_codes[0] != version:
            self._nan_codes = version, self.fmt == "fp8" and native.fp8_has_nan(self.stored)
        return native.packed_linear(x, self.fmt, self.stored, self.scales, groups,
                                    self._nan_codes[1])

    @property
    def weight(self) -> torch.Tensor:
        """The float32 weight [out, in], dequantised now."""
        if self.fmt == "bf16":
            return self.stored.float()
        return dequantize_fp8_blocks(self.stored, self.scales)

    def backend(self, x: torch.Tensor) -> str:
        backend = weight_backend(x, self.stored)
        # Triton multiplies the FP8 format; a bf16 weight on a GPU is dequantised.
        return "torch" if backend == "triton" and self.fmt != "fp8" else backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        backend = self.backend(x)
        if backend == "torch":
            return linear(x, self.weight, self.round_inputs)
        if self.round_inputs:
            x = fake_quantize(x, ACTIVATION_FORMAT)
        y = self._packed(x.reshape(-1, self.in_features), backend)
        return y.view(*x.shape[:-1], self.out_features)

    def block_diagonal(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., G, in] times this weight [G * R, in] as G blocks (V4.1's wo_a: group g
        of the heads meets rows g*R .. g*R + R - 1): [..., G, R]."""
        groups = x.shape[-2]
        backend = self.backend(x)
        if backend == "torch":
            return torch.einsum("...gd,grd->...gr", x.float(),
                                self.weight.unflatten(0, (groups, -1)))
        y = self._packed(x.float().reshape(-1, groups * self.in_features), backend, groups)
        return y.view(*x.shape[:-1], self.out_features // groups)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"


class Experts(nn.Module):
    """The routed experts' SwiGLU weights as parameters: w1, w3 [E, inter, dim] and w2 [E,
    dim, inter], float32, or bf16 once `Model.narrow_matrices` ran (widened per call)."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, inter_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, inter_dim, dim))

    def projections(self, e: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
        """Expert e's w1, w2, w3 as functions of their input."""
        return tuple(partial(F.linear, weight=w[e].float()) for w in (self.w1, self.w2, self.w3))


class PackedExpert(nn.Module):
    """One routed expert as DeepSeek stores it: per projection, E2M1 codes uint8
    [out, in/2] and UE8M0 scales uint8 [out, in/32]."""

    NAMES = ("w1", "w2", "w3")

    def __init__(self, codes: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name in self.NAMES:
            self.register_buffer(f"{name}_codes", codes[name])
            self.register_buffer(f"{name}_scales", scales[name])

    def weight(self, name: str) -> torch.Tensor:
        return dequantize(Quantized(EXPERT_FORMAT, getattr(self, f"{name}_codes"),
                                    getattr(self, f"{name}_scales")))


class PackedExperts(nn.ModuleList):
    """The routed experts, each held packed as read (one tensor per expert and
    projection, as the checkpoint holds them: a loader maps them, never copies them into
    one stack). Where `weight_backend` picks kernels, `swiglu` runs every expert a step
    routes to in three grouped calls; elsewhere only a selected expert is dequantised,
    when a token is routed to it."""

    def __init__(self, experts: list[PackedExpert]) -> None:
        super().__init__(experts)
        self.quantized_matmul = True
        self.round_inputs = False
        self._addresses: dict[torch.device, torch.Tensor] = {}

    def addresses(self, device: torch.device) -> torch.Tensor:
        """int64 [3 (w1, w2, w3), E, 2] on `device`: where each expert's codes and scales
        lie, for the kernels (the experts' tensors never move once loaded; made on first
        use)."""
        if device not in self._addresses:
            self._addresses[device] = torch.tensor(
                [[[getattr(e, f"{name}_codes").data_ptr(), getattr(e, f"{name}_scales").data_ptr()]
                  for e in self] for name in PackedExpert.NAMES], dtype=torch.int64,
                device=device)
        return self._addresses[device]

    def backend(self, x: torch.Tensor) -> str:
        return weight_backend(x, self[0].w1_codes)

    def swiglu(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
               limit: float) -> torch.Tensor:
        """The routed experts' weighted sum [T, dim] for tokens x [T, dim] routed to
        chosen [T, k] with weights [T, k], in the kernels: the (token, expert) pairs sorted
        by expert, then one grouped call per projection over the experts used (on a GPU,
        over every expert, the unused ones with no rows: no shape depends on the routing,
        so nothing is read back to the host)."""
        from kvstack.model.model import swiglu  # the model's SwiGLU, clamps and all

        backend = self.backend(x)
        pairs = chosen.flatten()
        order = pairs.argsort(stable=True)
        if backend == "c":
            used, counts = torch.unique_consecutive(pairs[order], return_counts=True)
            grouped = native.fp4_grouped
        else:
            from kvstack.model import weight_kernels  # Triton: the `kernels` extra

            used = torch.arange(len(self), device=x.device)
            counts = torch.bincount(pairs, minlength=len(self))
            grouped = weight_kernels.fp4_grouped
        ends, token = counts.cumsum(0), order // chosen.shape[1]
        addresses = self.addresses(x.device)
        inter, dim = self[0].w1_codes.shape[0], self[0].w2_codes.shape[0]

        def projection(index: int, out_features: int) -> Callable[[torch.Tensor], torch.Tensor]:
            def run(v: torch.Tensor) -> torch.Tensor:
                if self.round_inputs:
                    v = fake_quantize(v.float(), ACTIVATION_FORMAT)
                return grouped(v, addresses[index], used, ends, out_features)
            return run

        y = swiglu(x.float().index_select(0, token), projection(0, inter), projection(1, dim),
                   projection(2, inter), limit, weights.flatten()[order, None])
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token, y)

    def projections(self, e: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
        expert = self[e]
        return tuple(partial(linear, weight=expert.weight(name), round_inputs=self.round_inputs)
                     for name in PackedExpert.NAMES)
