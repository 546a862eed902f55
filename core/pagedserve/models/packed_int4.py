"""GGUF block-quantized weights kept packed in 4 bits for CPU decode (`quantization="gguf"`).

A decode step must stream every weight once, so on a CPU its time is the weight bytes over the
memory bandwidth. The bundled SmolLM2 GGUF stores its projections as Q4_1 (per 32 weights: a
float16 scale `d` and minimum `m`, 4-bit codes `q`: w = d*q + m) and its tied embedding/head as
Q8_0 (per 32 weights: a float16 scale, 8-bit codes: w = d*q). Dequantized to bfloat16 they cost
2 bytes a weight; kept as codes they cost 0.5 (plus 4 bytes of scale and zero per 32).

torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) computes x @ W.T with
W = (c - 8) * scale + zero per group of 32 inputs, c in [0, 15]. Both GGUF formats map onto it:
  * Q4_1: c = q, scale = d, zero = m + 8d;
  * Q8_0: split q + 128 = 16h + l into two 4-bit codes; then w = d*q is the sum of
    (h - 8) * 16d + 0 and (l - 8) * d + 8d: one int4 matmul of [x | x] against [W_h | W_l].
The codes are recovered from the dequantized float32 tensors the GGUF reader yields, and a tensor
is packed only when its codes reproduce it exactly (`recover_q4_1`, `recover_q8_0`); anything else
stays dense. What changes is the arithmetic, not the weights' codes: the kernel needs bfloat16
activations and rounds each float16 scale and zero to bfloat16, which moves a weight by at most
1/64 of its quantization step.

The kernel is fast only for a few rows (it is a GEMV); above `MAX_PACKED_ROWS` tokens the layer
uses its dense bfloat16 copy, which is where batched steps and prefill are compute-bound anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

GROUP_SIZE = 32  # weights per GGUF block (Q4_1 and Q8_0 alike), along the input dimension
# Measured on the development CPU (Zen 4, one thread): the int4 kernel beats a dense bfloat16
# GEMM up to about 6 rows and loses 2.5x at 32; 4 keeps a margin.
MAX_PACKED_ROWS = 4


@dataclass(frozen=True, slots=True)
class Q4Codes:
    """One weight matrix as 4-bit codes with per-group scale and zero: W = (codes - 8) * scale + zero."""

    codes: torch.Tensor  # [out_features, in_features] int32 in [0, 15]
    scale: torch.Tensor  # [out_features, in_features // GROUP_SIZE] float32
    zero: torch.Tensor  # [out_features, in_features // GROUP_SIZE] float32


def _grouped(weight: torch.Tensor) -> torch.Tensor | None:
    """[N, K] float32 -> [N, K // 32, 32] view, or None when the shape has no 32-wide groups."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % GROUP_SIZE:
        return None
    return weight.reshape(weight.shape[0], -1, GROUP_SIZE)


def recover_q4_1(weight: torch.Tensor) -> Q4Codes | None:
    """The Q4_1 codes of a dequantized float32 [N, K] tensor, or None if it is not exactly Q4_1.

    llama.cpp's Q4_1 quantizer maps each group's minimum to code 0 and maximum to code 15, so m is
    the group minimum and d = (max - min) / 15, both float16. Exact check: d*q + m == weight
    (in float32, the arithmetic the GGUF reader used). Does not mutate `weight`."""
    groups = _grouped(weight)
    if groups is None:
        return None
    m16 = groups.amin(-1).half()
    d16 = ((groups.amax(-1) - m16.float()) / 15).half()
    d, m = d16.float(), m16.float()
    safe_d = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round((groups - m[..., None]) / safe_d[..., None]).clamp_(0, 15)
    if not torch.equal(d[..., None] * q + m[..., None], groups):
        return None
    n, k = weight.shape
    return Q4Codes(q.to(torch.int32).reshape(n, k), d, m + 8 * d)


def recover_q8_0(weight: torch.Tensor) -> tuple[Q4Codes, Q4Codes] | None:
    """The Q8_0 codes of a dequantized float32 [N, K] tensor as a (high, low) pair of 4-bit
    matrices whose sum is the tensor, or None if it is not exactly Q8_0.

    Q8_0 scales each group by d = max|w| / 127 (float16) and rounds w / d to int8. Exact check:
    d*q == weight. Does not mutate `weight`."""
    groups = _grouped(weight)
    if groups is None:
        return None
    d16 = (groups.abs().amax(-1) / 127).half()
    d = d16.float()
    safe_d = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(groups / safe_d[..., None]).clamp_(-128, 127)
    if not torch.equal(d[..., None] * q, groups):
        return None
    unsigned = (q + 128).to(torch.int32)
    n, k = weight.shape
    high = Q4Codes((unsigned // 16).reshape(n, k), 16 * d, torch.zeros_like(d))
    low = Q4Codes((unsigned % 16).reshape(n, k), d, 8 * d)
    return high, low


def concat_rows(parts: list[Q4Codes]) -> Q4Codes:
    """Stack several matrices' codes along the output dimension (fused q/k/v, gate/up)."""
    return Q4Codes(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.zero for p in parts]),
    )


def dequantize(codes: Q4Codes) -> torch.Tensor:
    """[N, K] float32 weights of `codes` (what the packed kernel multiplies by, before its
    bfloat16 rounding of scale and zero). Does not mutate."""
    scale = codes.scale.repeat_interleave(GROUP_SIZE, dim=1)
    zero = codes.zero.repeat_interleave(GROUP_SIZE, dim=1)
    return (codes.codes - 8).float() * scale + zero


class PackedInt4Linear(nn.Module):
    """y = x @ W.T (+ bias), W the sum of one or two packed 4-bit matrices, for CPU bfloat16.

    Two terms (Q8_0) are laid side by side along the input dimension, [W_high | W_low], and the
    input repeated, [x | x]: one kernel call then sums both in its float32 accumulator, instead of
    two calls whose bfloat16 results would be rounded once more when added.
    Steps of at most `MAX_PACKED_ROWS` tokens run the int4 kernel; larger ones the dense copy.
    Holds no trainable parameters (buffers only)."""

    # Buffers (registered in __init__; annotated here for the type checker).
    packed: torch.Tensor  # [N, terms * K // 2] uint8: the terms' codes side by side, kernel layout
    scale_zero: torch.Tensor  # [terms * K // 32, N, 2] bfloat16
    dense: torch.Tensor  # [N, K] bfloat16: the same weights, for steps of many rows
    bias: torch.Tensor | None  # [N]

    def __init__(self, terms: list[Q4Codes], dense: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if dense.dtype != torch.bfloat16 or dense.device.type != "cpu":
            raise ValueError(
                "packed 4-bit weights run on the CPU with bfloat16 activations; load the model with "
                f"dtype='bfloat16' on the cpu (got {dense.dtype} on {dense.device})"
            )
        if not 1 <= len(terms) <= 2:
            raise ValueError(f"a packed layer has one or two terms, got {len(terms)}")
        out_features, in_features = dense.shape
        for term in terms:
            if tuple(term.codes.shape) != (out_features, in_features):
                raise ValueError(
                    f"packed codes {tuple(term.codes.shape)} do not match weight {tuple(dense.shape)}"
                )
        self.in_features = in_features
        self.out_features = out_features
        self.num_terms = len(terms)
        codes = torch.cat([t.codes for t in terms], dim=1)
        # [terms * K // 32, N, 2]: the kernel's scale-and-zero layout, in the activations' dtype.
        scale_zero = torch.cat([torch.stack([t.scale.t(), t.zero.t()], dim=-1) for t in terms])
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.register_buffer("scale_zero", scale_zero.contiguous().bfloat16())
        self.register_buffer("dense", dense)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in_features] bfloat16 -> [T, out_features]. Does not mutate."""
        if x.shape[0] > MAX_PACKED_ROWS:
            return F.linear(x, self.dense, self.bias)
        if self.num_terms > 1:
            x = x.repeat(1, self.num_terms)
        out = torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scale_zero)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, terms={self.num_terms}"


RecoveredCodes = list[Q4Codes]  # one term (Q4_1) or two (Q8_0's high and low halves)


def recover(weight: torch.Tensor) -> RecoveredCodes | None:
    """The exact 4-bit form of a dequantized GGUF tensor (Q4_1, else Q8_0), or None."""
    q4 = recover_q4_1(weight)
    if q4 is not None:
        return [q4]
    q8 = recover_q8_0(weight)
    return None if q8 is None else list(q8)


def pack_linear_layers(model: nn.Module, recovered: dict[str, RecoveredCodes], prefix: str = "") -> int:
    """Replace every `nn.Linear` (fused ones included) whose checkpoint tensors were all recovered
    with a `PackedInt4Linear`; returns how many were replaced. `recovered` maps checkpoint names
    (`prefix` + `...q_proj.weight`) to codes; a fused layer is packed only if all its shards were recovered
    as one-term (Q4_1) codes. Mutates `model`."""
    from pagedserve.models.layers import MergedLinear

    replaced = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        owner, _, attr = name.rpartition(".")
        if isinstance(module, MergedLinear):
            shards = [recovered.get(f"{prefix}{owner}.{shard}.weight") for shard in module.shard_offsets]
            if any(s is None or len(s) != 1 for s in shards):
                continue
            terms = [concat_rows([s[0] for s in shards if s is not None])]
        else:
            found = recovered.get(f"{prefix}{name}.weight")
            if found is None:
                continue
            terms = found
        packed = PackedInt4Linear(
            terms, module.weight.data, None if module.bias is None else module.bias.data
        )
        setattr(model.get_submodule(owner) if owner else model, attr, packed)
        replaced += 1
    return replaced
