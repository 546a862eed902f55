"""Linear layers on the platform's own GEMM (`LinearKernel`, API 1.2/1.3), routed after loading.

Why. A decode step of a small batch is a stream of weight reads; the GEMM library's tile choice
for one activation row leaves bandwidth unused on some shapes (on an H100, cuBLAS reads the
4096 x 4096 output projection of an 8B model at 2.0 TB/s, a weight-streaming Triton kernel at
2.4; `benchmarks/kernel_benchmarks/skinny_gemm.py`). FP8 weights gain most: the platform can
stream one byte per weight with bf16 activations, where `torch._scaled_mm` first quantizes the activations.

How. `route_linear_layers` swaps every `nn.Linear` of the decoder (fused ones included) for a
`PlatformLinear` holding the same parameters, hands the kernel to every `Fp8Linear`, and gives
tensor-parallel `RowParallelLinear`s the kernel for their local product (their all-reduce stays),
SiLU-gated MLPs the kernel's fused activation when it has one: `LinearKernel.silu_gate_op` (the
gate/up product with SiLU and the multiply in its epilogue; API 1.3), else `gated_op` (the down
projection applying them as it loads its input), one elementwise kernel fewer per layer. The LM
head lives outside the decoder: `route_lm_head` hands the kernel to the model's logits computation
(`DecoderForCausalLM.head_kernel`) when the kernel takes the head's weights (an FP8 head of
`quantize_lm_head` only if `weight_dtypes` lists `float8_e4m3fn`). The platform's
operator is opaque to `torch.compile` and decides per call, from the row count, whether it runs
its own kernel or the library's, so one compiled graph serves every step size.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.distributed.layers import RowParallelLinear
from pagedserve.models.decoder import DecoderForCausalLM
from pagedserve.models.fp8 import Fp8Linear
from pagedserve.models.layers import GatedMLP, MergedLinear
from pagedserve.platforms.api import LinearKernel


class PlatformLinear(nn.Module):
    """`y = x @ W.T + b` through a platform's `LinearKernel`, with the parameters of the
    `nn.Linear` it replaces (shared, not copied)."""

    def __init__(self, linear: nn.Linear, kernel: LinearKernel) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # [out_features, in_features]
        self.bias = linear.bias  # [out_features] or None
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., out_features]
        """Does not mutate `x`."""
        rows = x.reshape(-1, self.in_features)
        y = self.kernel.op(rows, self.weight, None, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel.name}"


def _routable(module: nn.Module, kernel: LinearKernel, dtype: torch.dtype) -> bool:
    """Whether `module` runs on `kernel`: an `Fp8Linear` whose weights the kernel takes, or exactly
    an `nn.Linear` / `MergedLinear` in `dtype` (subclasses with a forward of their own, like the
    tensor-parallel RowParallelLinear, which all-reduces, keep it). Pure."""
    if isinstance(module, Fp8Linear):
        return module.weight.dtype in kernel.weight_dtypes and module.per_channel()
    return type(module) in (nn.Linear, MergedLinear) and module.weight.dtype == dtype


def route_linear_layers(decoder: nn.Module, kernel: LinearKernel, dtype: torch.dtype) -> int:
    """Route every linear layer inside `decoder` through `kernel`: `nn.Linear` modules in `dtype`
    are replaced by `PlatformLinear`s, `Fp8Linear`s get the kernel when it takes FP8 weights.
    Returns how many layers were routed. Mutates `decoder`."""
    routed = 0
    for name, module in list(decoder.named_modules()):  # parents before children
        if isinstance(module, GatedMLP) and module.hidden_act == "silu":  # before its layers are swapped
            if kernel.silu_gate_op is not None and _routable(module.gate_up_proj, kernel, dtype):
                module.silu_gate = kernel.silu_gate_op
            elif kernel.gated_op is not None and _routable(module.down_proj, kernel, dtype):
                module.gated_down = kernel.gated_op
        if isinstance(module, RowParallelLinear) and module.weight.dtype == dtype:
            module.kernel = kernel  # its local product; the all-reduce stays the layer's
            routed += 1
            continue
        if not _routable(module, kernel, dtype):
            continue
        routed += 1
        if isinstance(module, Fp8Linear):
            module.kernel = kernel
            continue
        owner, _, attr = name.rpartition(".")
        setattr(decoder.get_submodule(owner) if owner else decoder, attr, PlatformLinear(module, kernel))
    return routed


def route_lm_head(model: DecoderForCausalLM, kernel: LinearKernel, dtype: torch.dtype) -> bool:
    """Give `model`'s LM head `kernel` when the kernel takes its weights: a plain head (or the tied
    embedding) in `dtype`, or the FP8 head of `quantize_lm_head` when `weight_dtypes` lists
    `float8_e4m3fn`; otherwise the head keeps torch's product (`F.linear` / `scaled_linear`).
    A packed 4-bit head keeps its own product; a vocabulary-parallel head routes its rank's slice
    (the all-gather follows). Returns whether the head was routed. Mutates `model.head_kernel`."""
    if model.packed_head is not None:
        return False
    head = model.lm_head
    if isinstance(head, Fp8Linear):
        routable = head.weight.dtype in kernel.weight_dtypes
    else:
        weight = model.model.embed_tokens.weight if head is None else head.weight
        routable = weight.dtype == dtype
    model.head_kernel = kernel if routable else None
    return routable
