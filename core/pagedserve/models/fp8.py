"""FP8 weights (`quantization="fp8"`): the decoder's linear layers (and, with `quantize_lm_head`,
the LM head) quantized per output channel.

Weights are quantized at load time; activations get dynamic per-token scales.
A decode step streams every weight once, so FP8 weights halve the bytes a step must read next to
bfloat16. Each `nn.Linear` of the decoder layers (fused qkv, o, fused gate/up, down) becomes an
`Fp8Linear`:

* weight: `float8_e4m3fn` `[out, in]`, one float32 scale per output row: `amax(row) / 448`, so
  each row uses the whole e4m3 range (per-channel scales are what keep the error small: one
  outlier row does not flatten every other row);
* activations: quantized on the fly, one scale per token row (`amax(row) / 448`);
* the GEMM: `torch._scaled_mm(x_fp8, w_fp8.T, scale_a=[M, 1], scale_b=[1, N])` ("row-wise"
  scaling), accumulating in float32 and writing the model's dtype; the bias is added after.

The embedding stays in the model's dtype (it is looked up, not multiplied), and by default so does
the LM head: the logits are the most sensitive output, and an FP8 head puts its error into them
directly. `quantize_lm_head=True` quantizes the head too, in the same format (an `Fp8Linear` of
one scale per vocabulary row; `DecoderForCausalLM.quantize_head_fp8`), which halves the head's
bytes per decode step (1.05 GB -> 0.53 GB on an 8B Llama); a tied head keeps its embedding and
adds an FP8 copy of the matrix (vocab x hidden bytes).

Where it runs: `torch._scaled_mm` with row-wise scales needs an NVIDIA GPU of compute capability
8.9 or newer (Ada, Hopper) or a torch whose CPU build implements it (torch 2.13's does);
`check_fp8_support` probes the device once and names what is missing otherwise. Weights are
quantized here from a bfloat16/float16/float32 checkpoint at load time; FP8 checkpoints load
through `pagedserve.quantization` instead (`Fp8CheckpointLinear`, an `Fp8Linear` filled as stored).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedserve.platforms.api import LinearKernel

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
# Scales multiply by the float32 reciprocal rather than divide: torch on CUDA computes a tensor
# divided by a Python number that way, torch on CPU divides, so only the product is the same
# float32 result on every device (and in the fused Triton quantization).
INV_FP8_MAX = 1.0 / FP8_MAX
MIN_SM = (8, 9)  # FP8 tensor cores: Ada (sm_89) and Hopper (sm_90)
AMAX_FLOOR = 1e-12  # an all-zero row gets this amax, so its scale is positive and its codes zero


def _row_scales(x: torch.Tensor) -> torch.Tensor:  # [rows, 1] float32
    """One scale per row: amax / FP8_MAX (floored so that zero rows divide safely). Pure."""
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32).clamp_min(AMAX_FLOOR)
    return amax * INV_FP8_MAX


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [rows, cols] as FP8 codes [rows, cols] and per-row float32 scales [rows, 1], with
    `codes * scales ~= x`. Pure."""
    scales = _row_scales(x)
    codes = (x.to(torch.float32) / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_WEIGHT_DTYPE)
    return codes, scales


def scaled_linear(
    x: torch.Tensor,  # [M, in_features] in the activations' dtype
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    weight_scale: torch.Tensor,  # [out_features] float32, per output channel
    bias: torch.Tensor | None,  # [out_features]
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:  # [M, out_features] in x's dtype
    """The FP8 GEMM of `quantization="fp8"`: `x` quantized per row (`quantize_rows`, or a
    `quantize` computing exactly the same codes and scales faster), `torch._scaled_mm` with
    row-wise scales. Pure."""
    codes, scales = (quantize or quantize_rows)(x)
    y = torch._scaled_mm(
        codes,
        weight.t(),  # column-major [in, out], as _scaled_mm wants its second operand
        scale_a=scales,
        scale_b=weight_scale.reshape(1, -1),
        out_dtype=x.dtype,
    )
    return y if bias is None else y + bias


class Fp8Linear(nn.Module):
    """`y = x @ W.T + b` with `W` stored in FP8 per output channel and `x` quantized per token."""

    # Buffers (registered in __init__; annotated here for the type checker).
    weight: torch.Tensor  # [out_features, in_features] float8_e4m3fn
    weight_scale: torch.Tensor  # [1, out_features] float32
    bias: torch.Tensor | None  # [out_features] in the activations' dtype

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantize `weight` [out, in] (any float dtype). Does not keep `weight`."""
        super().__init__()
        codes, scales = quantize_rows(weight)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", codes)
        self.register_buffer("weight_scale", scales.reshape(1, -1).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.kernel: LinearKernel | None = None  # set by `platform_linear.route_linear_layers`

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., out_features] in x's dtype
        """Does not mutate `x`."""
        rows = x.reshape(-1, self.in_features)
        if self.kernel is not None:  # the platform's operator (`models.platform_linear`)
            y = self.kernel.op(rows, self.weight, self.weight_scale.reshape(-1), self.bias)
        else:
            y = scaled_linear(rows, self.weight, self.weight_scale, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def per_channel(self) -> bool:
        """Whether `weight_scale` alone scales the weight and activations get per-token scales:
        the FP8 form `LinearKernel.op` takes. Layers that keep other scales say False."""
        return True

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 per-channel"


def check_fp8_support(device: torch.device, dtype: torch.dtype) -> None:
    """Raise `ValueError` naming the requirement when FP8 GEMMs cannot run on `device` with
    activations in `dtype`. On a CUDA device reads its capability; elsewhere runs one tiny
    `_scaled_mm`. Does not mutate."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"quantization='fp8' computes with bfloat16, float16 or float32 activations, not {dtype}: "
            "pass dtype='bfloat16'"
        )
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_SM:
            name = torch.cuda.get_device_name(device)
            raise ValueError(
                f"quantization='fp8' needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper or "
                f"newer) for torch._scaled_mm; {name} is sm_{capability[0]}{capability[1]}. Load the "
                "model without quantization= (bfloat16 weights) on this GPU"
            )
        return
    try:
        layer = Fp8Linear(torch.ones(16, 16, device=device), None)
        layer(torch.ones(1, 16, dtype=dtype, device=device))
    except (RuntimeError, NotImplementedError) as exc:
        raise ValueError(
            f"quantization='fp8' needs torch._scaled_mm with row-wise scales on {device.type}, which "
            f"torch {torch.__version__} does not provide there ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); use an NVIDIA GPU with compute "
            "capability 8.9+, a torch whose CPU build has it (2.13 does), or no quantization="
        ) from exc


def quantize_linear_layers(model: nn.Module, keep: tuple[type[nn.Module], ...] = ()) -> int:
    """Replace every `nn.Linear` inside `model` (fused ones included) with an `Fp8Linear` made
    from its weights, except instances of `keep` (MoE routers); returns how many were replaced.
    Pass the decoder (`model.model`), not the whole causal LM, to keep the LM head in the model's
    dtype (`quantize_lm_head` quantizes it separately, tied heads included). Mutates `model`."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or isinstance(module, keep):
            continue
        owner, _, attr = name.rpartition(".")
        fp8 = Fp8Linear(module.weight.data, None if module.bias is None else module.bias.data)
        setattr(model.get_submodule(owner) if owner else model, attr, fp8)
        replaced += 1
    return replaced
