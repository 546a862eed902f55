"""`IntWeightLinear`: a linear layer whose weights stay 4- or 8-bit integer codes with per-group
scales (and zero points), loaded from compressed-tensors, GPTQ or AWQ checkpoints.

Why keep the codes: a decode step streams every weight once, so its time and the model's memory
are the weights' bytes; 4-bit codes are a quarter of bfloat16's (a 70B model fits one 80 GB GPU).

Storage (one layout whatever the checkpoint's, `int_formats`): `packed` [N, ceil(K / pack)] int32
with the codes of each output row along the inputs (code i of a word in bits [i*b, (i+1)*b),
stored plus 2**(b-1): compressed-tensors' own layout, so its tensors are copied as they are),
`scales` [N, G] float32, `zeros` [N, G] int8 or none, and for activation-ordered checkpoints each
input's group per stacked projection (`g_idx` [P, K]).

Tensor parallelism: a rank's layer holds its output rows (column-parallel) or input columns
(row-parallel, `reduce`: the partial products summed over the group, the bias added once after),
read by `quantization.tensor_parallel`; a row-parallel activation-ordered layer keeps the whole
scale table (`groups`), which its inputs' `g_idx` index.

Activation order on the kernel: GPTQ's `desc_act` quantizes the inputs in an order of its own and
numbers the groups along it, so each group is `group_size` inputs scattered over K. When every
stacked projection shares one order (GPTQ's does: it comes from the inputs, which q/k/v and
gate/up share), `sort_inputs` stores the columns in that order, where the groups are contiguous
again, and the layer reads its inputs through the same permutation (`input_order`): one gather of
the activations per call, and the platform's kernel, which takes contiguous groups only, runs it.
Other activation-ordered layers (projections in different orders, a row-parallel shard's inputs)
keep `g_idx` and the core's formulation.

Computing: on the platform's `IntLinearKernel` where it takes the layer (`route_int_weight_layers`),
else the core's formulation: the weight dequantized (exact in float32, rounded once to the
activations' dtype) and one dense GEMM. The formulation is what every kernel must equal; it reads
the codes but writes a dense copy per call, so it saves memory, not time. Fused projections
(q/k/v, gate/up) stack their output rows in one layer, as `MergedLinear` does for dense weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.platforms.api import IntLinearKernel, PackedIntWeight
from pagedserve.quantization.checkpoint_config import IntWeightScheme
from pagedserve.quantization.int_formats import (
    IntWeights,
    num_groups,
    pack_codes,
    read_int_weights,
    unpack_codes,
)
from pagedserve.quantization.stacking import copy_checked, row_ranges

if TYPE_CHECKING:
    from pagedserve.distributed.group import TensorParallelGroup

# Tensors of one projection each layout needs (biases aside).
_REQUIRED = {
    "compressed-tensors": ("weight_packed", "weight_scale"),
    "gptq": ("qweight", "qzeros", "scales"),
    "gptq_v2": ("qweight", "qzeros", "scales"),
    "awq": ("qweight", "qzeros", "scales"),
}
_KNOWN = {
    "compressed-tensors": {
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_shape",
        "weight_g_idx",
    },
    "gptq": {"qweight", "qzeros", "scales", "g_idx"},
    "gptq_v2": {"qweight", "qzeros", "scales", "g_idx"},
    "awq": {"qweight", "qzeros", "scales"},
}


class IntWeightLinear(nn.Module):
    """`y = x @ W.T + b` with `W` kept as integer codes (module docstring)."""

    packed: torch.Tensor  # [N, ceil(K / pack)] int32
    scales: torch.Tensor  # [N, G] float32
    zeros: torch.Tensor | None  # [N, G] int8 (signed), or None for symmetric weights
    g_idx: torch.Tensor | None  # [P, K] int32: each input's group, per stacked projection
    input_order: torch.Tensor | None  # [K] int64: stored column j holds input input_order[j] (`sort_inputs`)
    bias: torch.Tensor | None  # [N] in the activations' dtype

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],  # checkpoint projection -> output rows, in stacking order ("" alone)
        scheme: IntWeightScheme,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        name: str = "",  # the checkpoint's name of the layer (of the stacked projections' owner), for errors
        groups: int | None = None,  # scale groups per row; None: those of `in_features`
        reduce: TensorParallelGroup | None = None,  # row-parallel: the group summing the partial products
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(shard_sizes.values())
        self.scheme = scheme
        self.checkpoint_name = name
        self.shard_offsets = row_ranges(shard_sizes)  # projection -> (first row, rows)
        self.reduce = reduce
        n, k = self.out_features, in_features
        pack = 32 // scheme.bits
        groups = num_groups(scheme, k) if groups is None else groups
        self.groups = groups
        self.register_buffer("packed", torch.empty((n, -(-k // pack)), dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty((n, groups), dtype=torch.float32, device=device))
        # Asymmetric schemes get zeros; GPTQ's symmetric ones arrive as explicit zeros of 0.
        has_zeros = not scheme.symmetric
        self.register_buffer(
            "zeros", torch.zeros((n, groups), dtype=torch.int8, device=device) if has_zeros else None
        )
        g_idx = (
            torch.empty((len(shard_sizes), k), dtype=torch.int32, device=device) if scheme.act_order else None
        )
        self.register_buffer("g_idx", g_idx)
        self.register_buffer("input_order", None)
        self.register_buffer("bias", torch.empty(n, dtype=dtype, device=device) if bias else None)
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # projection -> its tensors so far
        self.kernel: IntLinearKernel | None = None  # the platform's, set by `route_int_weight_layers`

    def extra_repr(self) -> str:
        groups = "channel" if self.scheme.group_size is None else f"group {self.scheme.group_size}"
        parallel = f", row-parallel over {self.reduce.world_size}" if self.reduce is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int{self.scheme.bits} {groups} ({self.scheme.layout}){parallel}"
        )

    # --- loading (the `CheckpointPart` protocol of `models.decoder`) --------------------------

    @torch.no_grad()
    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str | None:
        """Take checkpoint tensor `name` ("weight_packed", or "q_proj.weight_packed" for a stacked
        layer); once a projection's tensors are all here, write its rows. Returns the key filled.
        Raises `ValueError` for a tensor this layout does not have. Mutates the buffers."""
        shard, _, field = name.rpartition(".")
        name = f"{self.checkpoint_name}.{name}" if self.checkpoint_name else name
        if shard not in self.shard_offsets:
            raise ValueError(f"checkpoint tensor {name!r} has no place in this quantized layer")
        start, rows = self.shard_offsets[shard]
        prefix = f"{shard}:" if shard else ""
        if field == "bias":
            if self.bias is None:
                raise ValueError(f"checkpoint has a bias {name!r} but the model was built without biases")
            copy_checked(self.bias[start : start + rows], tensor, name)
            return f"{prefix}bias"
        layout = self.scheme.layout
        if field not in _KNOWN[layout]:
            hint = (
                " (a dense weight: the quantization config does not match the weights)"
                if field == "weight"
                else ""
            )
            raise ValueError(f"checkpoint tensor {name!r} is not a tensor of the {layout} layout{hint}")
        pending = self._pending.setdefault(shard, {})
        pending[field] = tensor
        if not self._complete(pending):
            return f"{prefix}{field}"
        del self._pending[shard]
        layer = name.rpartition(".")[0]
        # Unpacked and repacked where the layer lives: on two host cores the 8B shape's codes
        # took about 3 s a layer, a GPU does it in milliseconds.
        on_device = {field: t.to(self.packed.device) for field, t in pending.items()}
        weights = read_int_weights(on_device, self.scheme, rows, self.in_features, layer, self.groups)
        self._write(shard, start, rows, weights)
        return f"{prefix}weight"

    def _complete(self, pending: dict[str, torch.Tensor]) -> bool:
        scheme = self.scheme
        needed = list(_REQUIRED[scheme.layout])
        if scheme.layout == "compressed-tensors" and not scheme.symmetric:
            needed.append("weight_zero_point")
        if scheme.act_order:
            needed.append("weight_g_idx" if scheme.layout == "compressed-tensors" else "g_idx")
        return all(field in pending for field in needed)

    def _write(self, shard: str, start: int, rows: int, weights: IntWeights) -> None:
        offset = 1 << (self.scheme.bits - 1)
        unsigned = weights.codes.to(torch.int16) + offset
        self.packed[start : start + rows].copy_(pack_codes(unsigned, self.scheme.bits))
        self.scales[start : start + rows].copy_(weights.scales)
        if weights.zeros is not None:
            if self.zeros is None:
                raise ValueError(
                    f"checkpoint projection {shard or 'weight'!r} has zero points, "
                    "but its config says symmetric"
                )
            self.zeros[start : start + rows].copy_(weights.zeros)
        elif self.zeros is not None:
            self.zeros[start : start + rows].zero_()
        if self.g_idx is not None:
            assert weights.g_idx is not None  # act_order schemes read one (`read_int_weights`)
            self.g_idx[list(self.shard_offsets).index(shard)].copy_(weights.g_idx)

    def missing_checkpoint_keys(self, loaded: set[str]) -> list[str]:
        """The keys still to fill: each projection's weight (and bias). Pure."""
        missing = []
        for shard in self.shard_offsets:
            prefix = f"{shard}:" if shard else ""
            wanted = [f"{prefix}weight"] + ([f"{prefix}bias"] if self.bias is not None else [])
            missing += [key for key in wanted if key not in loaded]
        return missing

    # --- computing ------------------------------------------------------------------------

    @torch.no_grad()
    def sort_inputs(self) -> bool:
        """Store an activation-ordered layer's columns in its groups' order (module docstring):
        only when every stacked projection has the same `g_idx` and, sorted, it numbers whole
        groups of `group_size` in turn. Returns whether it did. Mutates the buffers."""
        g_idx, size, k = self.g_idx, self.scheme.group_size, self.in_features
        if g_idx is None or size is None or self.groups != num_groups(self.scheme, k):
            return False
        if not bool((g_idx == g_idx[0]).all()):
            return False
        order = torch.argsort(g_idx[0], stable=True)
        if not torch.equal(g_idx[0][order].long(), torch.arange(k, device=order.device) // size):
            return False
        bits = self.scheme.bits
        self.packed.copy_(pack_codes(unpack_codes(self.packed, bits, k, dim=1)[:, order], bits))
        self.input_order = order
        self.g_idx = None
        return True

    def packed_weight(self) -> PackedIntWeight:
        """The weight as the platform contract takes it (layers without `g_idx` only). Pure."""
        assert self.g_idx is None, "activation-ordered layers keep the core's formulation"
        size = self.in_features if self.scheme.group_size is None else self.scheme.group_size
        return PackedIntWeight(self.packed, self.scales, self.zeros, self.scheme.bits, size, self.in_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in `dtype`: `(codes - zeros) * scales`, exact in float32, rounded
        once. Pure."""
        if self.g_idx is None:
            stored = dequantize_packed(self.packed_weight(), dtype)
            if self.input_order is None:
                return stored
            inverse = torch.empty_like(self.input_order)
            inverse[self.input_order] = torch.arange(self.in_features, device=inverse.device)
            return stored[:, inverse]
        parts = []  # each stacked projection with its own input groups
        for row, (start, rows) in enumerate(self.shard_offsets.values()):
            stop = start + rows
            zeros = None if self.zeros is None else self.zeros[start:stop]
            shard = PackedIntWeight(self.packed[start:stop], self.scales[start:stop], zeros, self.scheme.bits,
                                    self.in_features, self.in_features)  # fmt: skip
            parts.append(dequantize_packed(shard, dtype, groups=self.g_idx[row]))
        return torch.cat(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., out_features] in x's dtype
        """Does not mutate `x`."""
        # Row-parallel: the bias joins after the sum (added before it, it would count once per rank).
        bias = self.bias if self.reduce is None else None
        if self.kernel is None:
            y = F.linear(x, self.dequantized(x.dtype), bias)
        else:
            rows = x.reshape(-1, self.in_features)
            if self.input_order is not None:
                rows = rows.index_select(1, self.input_order)
            y = self.kernel.op(rows, self.packed_weight(), bias).reshape(*x.shape[:-1], self.out_features)
        if self.reduce is None:
            return y
        y = self.reduce.all_reduce(y)
        return y if self.bias is None else y + self.bias


def dequantize_packed(
    weight: PackedIntWeight,
    dtype: torch.dtype,
    groups: torch.Tensor | None = None,  # [K] each input's group; None: k // group_size
) -> torch.Tensor:
    """`weight` [N, K] in `dtype`: `(q - zeros) * scales` per group, exact in float32 (int8 codes
    times bfloat16/float16/float32 scales), rounded once. Pure."""
    k, bits = weight.in_features, weight.bits
    values = (unpack_codes(weight.packed, bits, k, dim=1) - (1 << (bits - 1))).to(torch.float32)
    index = torch.arange(k, device=values.device) // weight.group_size if groups is None else groups.long()
    if weight.zeros is not None:
        values = values - weight.zeros.to(torch.float32)[:, index]
    return (values * weight.scales[:, index]).to(dtype)


def int_linear_reference(x: torch.Tensor, weight: PackedIntWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`IntLinearKernel.op` as the core computes it: the weight dequantized, one dense GEMM. Pure."""
    return F.linear(x, dequantize_packed(weight, x.dtype), bias)


REFERENCE_INT_LINEAR_KERNEL = IntLinearKernel(
    name="torch dequantize-then-multiply (the oracle)",
    op=int_linear_reference,
    bits=frozenset({4, 8}),
)


def route_int_weight_layers(model: nn.Module, kernel: IntLinearKernel | None) -> tuple[int, int]:
    """Give every `IntWeightLinear` in `model` that `kernel` takes the kernel, activation-ordered
    ones once `sort_inputs` has put their groups in order (those it cannot keep the core's
    formulation). Returns (layers routed, layers left). Mutates them."""
    routed = left = 0
    for module in model.modules():
        if not isinstance(module, IntWeightLinear):
            continue
        if kernel is not None and module.g_idx is not None:
            module.sort_inputs()
        takes = kernel is not None and module.g_idx is None and kernel.takes(module.packed_weight())
        module.kernel = kernel if takes else None
        routed += takes
        left += not takes
    return routed, left
