"""`Fp8CheckpointLinear`: the FP8 weights of a compressed-tensors `float-quantized` checkpoint,
run as they are stored (no requantization).

* Per-channel weights with dynamic per-token activations (FP8_DYNAMIC) are exactly the format
  of `quantization="fp8"` (`models.fp8.Fp8Linear`): the layer is one, so the platform's FP8
  GEMM runs it where there is one. Per-tensor weight scales become per-channel ones (each row
  repeats its projection's scale: the same products).
* Static per-tensor activation scales (FP8): the activations are quantized with the stored
  scale instead of their own; a stacked q/k/v or gate/up layer uses the largest of its
  projections' scales (one quantization of the shared input; the others' codes lose at most
  their lowest bit), as vLLM does.
* Block scales (FP8_BLOCK: a float32 scale per `block` of the weight, dynamic activations per
  group of inputs): `block_fp8_linear`, the dequantize-then-multiply formulation in float32. No
  faster kernel exists for it yet on any platform.
* Row-parallel shards (tensor parallelism, `reduce`; `quantization.tensor_parallel` reads a rank's
  columns): the partial products are summed over the group and the bias added once after. Dynamic
  per-token activation scales are taken over the whole input row, every rank's amax exchanged in
  one small all-reduce, so a rank's codes are the single device's (a scale from its own slice
  would round differently); these layers therefore keep `torch._scaled_mm`, not the platform's
  FP8 kernel, which computes its own scales. Per-group activation scales need no exchange: a rank's
  inputs start on a group boundary (`check_shard`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.models.fp8 import AMAX_FLOOR, FP8_MAX, FP8_WEIGHT_DTYPE, INV_FP8_MAX, Fp8Linear, scaled_linear
from pagedserve.quantization.checkpoint_config import Fp8WeightScheme
from pagedserve.quantization.stacking import copy_checked, row_ranges

if TYPE_CHECKING:
    from pagedserve.distributed.group import TensorParallelGroup


def block_fp8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    block_scale: torch.Tensor,  # [ceil(N / rows), ceil(K / cols)] float32
    block: tuple[int, int],  # (rows, cols) of one scale's block
    group: int,  # inputs per dynamic activation scale
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """`q(x) @ (weight * scale per block).T + bias` in float32, where `q(x)` rounds each group of
    `group` inputs of a row to FP8 with its own scale (amax / 448). Pure."""
    n, k = weight.shape
    rows, cols = block
    scale = block_scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    w = weight.to(torch.float32) * scale
    m = x.shape[0]
    pad = -k % group
    xf = F.pad(x.to(torch.float32), (0, pad)).reshape(m, -1, group)
    s = xf.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR) * INV_FP8_MAX
    xq = ((xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_WEIGHT_DTYPE).to(torch.float32) * s).reshape(m, -1)[:, :k]
    y = xq @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


class Fp8CheckpointLinear(Fp8Linear):
    """An `Fp8Linear` filled from a checkpoint's FP8 tensors (module docstring)."""

    block_scale: torch.Tensor | None  # [ceil(N / rows), ceil(K / cols)] float32, for block weights
    input_scale: torch.Tensor | None  # [1] float32, for static activation scales

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],  # checkpoint projection -> output rows, in stacking order ("" alone)
        scheme: Fp8WeightScheme,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        name: str = "",  # the checkpoint's name of the layer (of the stacked projections' owner), for errors
        reduce: TensorParallelGroup | None = None,  # row-parallel: the group summing the partial products
    ) -> None:
        nn.Module.__init__(self)  # Fp8Linear's own __init__ quantizes a dense weight: not here
        self.in_features = in_features
        self.out_features = n = sum(shard_sizes.values())
        self.scheme = scheme
        self.kernel = None
        self.checkpoint_name = name
        self.reduce = reduce
        self.shard_offsets = row_ranges(shard_sizes)  # projection -> (first row, rows)
        for shard, (start, _) in self.shard_offsets.items():
            if scheme.block is not None and start % scheme.block[0]:
                raise ValueError(
                    f"FP8 block scales of {scheme.block[0]} rows: a stacked layer's projections must "
                    f"start on a block boundary, but {shard!r} starts at row {start}"
                )
        self.register_buffer("weight", torch.empty((n, in_features), dtype=FP8_WEIGHT_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.empty((1, n), dtype=torch.float32, device=device))
        block_scale = None
        if scheme.block is not None:
            rows, cols = scheme.block
            shape = (-(-n // rows), -(-in_features // cols))
            block_scale = torch.empty(shape, dtype=torch.float32, device=device)
        self.register_buffer("block_scale", block_scale)
        static = scheme.activations == "static_tensor"
        self.register_buffer(
            "input_scale", torch.zeros(1, dtype=torch.float32, device=device) if static else None
        )
        self.register_buffer("bias", torch.empty(n, dtype=dtype, device=device) if bias else None)

    def per_channel(self) -> bool:
        """Block scales and stored activation scales are not the form platform kernels take, nor
        row-parallel shards (their activation scales span every rank's inputs)."""
        return self.block_scale is None and self.input_scale is None and self.reduce is None

    def extra_repr(self) -> str:
        parallel = f", row-parallel over {self.reduce.world_size}" if self.reduce is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}{parallel}"

    @torch.no_grad()
    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str | None:
        """Write checkpoint tensor `name` ("weight", "q_proj.weight_scale", ...) into its rows;
        returns the key filled. Raises `ValueError` for an unknown tensor or a wrong shape.
        Mutates the buffers."""
        shard, _, field = name.rpartition(".")
        name = f"{self.checkpoint_name}.{name}" if self.checkpoint_name else name
        if shard not in self.shard_offsets:
            raise ValueError(f"checkpoint tensor {name!r} has no place in this FP8 layer")
        start, rows = self.shard_offsets[shard]
        prefix = f"{shard}:" if shard else ""
        if field == "weight":
            if tensor.dtype != FP8_WEIGHT_DTYPE:
                raise ValueError(
                    f"checkpoint tensor {name!r} is {tensor.dtype}, expected float8_e4m3fn weights"
                )
            copy_checked(self.weight[start : start + rows], tensor, name)
        elif field == "weight_scale":
            self._write_scale(start, rows, tensor.to(torch.float32), name)
        elif field == "input_scale":
            if self.input_scale is None:
                return f"{prefix}input_scale"  # written for dynamic schemes too; unused there
            if tensor.numel() != 1:
                raise ValueError(
                    f"checkpoint tensor {name!r} has {tensor.numel()} values; a per-tensor scale has 1"
                )
            self.input_scale.copy_(torch.maximum(self.input_scale, tensor.reshape(1).to(torch.float32)))
        elif field == "bias":
            if self.bias is None:
                raise ValueError(f"checkpoint has a bias {name!r} but the model was built without biases")
            copy_checked(self.bias[start : start + rows], tensor, name)
        else:
            raise ValueError(f"checkpoint tensor {name!r} is not a tensor of an FP8 float-quantized layer")
        return f"{prefix}{field}"

    def _write_scale(self, start: int, rows: int, scale: torch.Tensor, name: str) -> None:
        strategy = self.scheme.strategy
        if strategy == "block":
            assert self.scheme.block is not None and self.block_scale is not None
            r, c = self.scheme.block
            shape = (-(-rows // r), -(-self.in_features // c))
            copy_checked(self.block_scale[start // r : start // r + shape[0]], scale, name)
            return
        if strategy == "tensor":
            if scale.numel() != 1:
                raise ValueError(
                    f"checkpoint tensor {name!r} has {scale.numel()} values; a per-tensor scale has 1"
                )
            self.weight_scale[0, start : start + rows] = scale.reshape(())
            return
        if scale.numel() != rows:
            raise ValueError(
                f"checkpoint tensor {name!r} has {scale.numel()} values; {rows} channel scales expected"
            )
        self.weight_scale[0, start : start + rows] = scale.reshape(rows)

    def missing_checkpoint_keys(self, loaded: set[str]) -> list[str]:
        """The keys still to fill: each projection's weight and scale (and input scale, bias). Pure."""
        missing = []
        for shard in self.shard_offsets:
            prefix = f"{shard}:" if shard else ""
            wanted = ["weight", "weight_scale"]
            if self.input_scale is not None:
                wanted.append("input_scale")
            if self.bias is not None:
                wanted.append("bias")
            missing += [f"{prefix}{key}" for key in wanted if f"{prefix}{key}" not in loaded]
        return missing

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., out_features] in x's dtype
        """Does not mutate `x`."""
        if self.per_channel():
            return super().forward(x)  # FP8_DYNAMIC: `quantization="fp8"`'s format and kernels
        rows = x.reshape(-1, self.in_features)
        # Row-parallel: the bias joins after the sum (added before it, it would count once per rank).
        bias = self.bias if self.reduce is None else None
        if self.block_scale is not None:
            assert self.scheme.block is not None and self.scheme.activation_group is not None
            y = block_fp8_linear(
                rows,
                self.weight,
                self.block_scale,
                self.scheme.block,
                self.scheme.activation_group,
                bias,
            )
        elif self.input_scale is not None:
            scale = self.input_scale

            def static(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                codes = (a.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_WEIGHT_DTYPE)
                return codes, scale.expand(a.shape[0], 1).contiguous()  # _scaled_mm wants real rows

            y = scaled_linear(rows, self.weight, self.weight_scale, bias, quantize=static)
        else:
            y = scaled_linear(rows, self.weight, self.weight_scale, None, quantize=self._rows_over_ranks)
        if self.reduce is not None:
            y = self.reduce.all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _rows_over_ranks(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`quantize_rows` of the whole input row, of which `a` [M, in_features] is this rank's
        slice: the same codes and scales as on one device. Pure but for the collective."""
        assert self.reduce is not None
        group = self.reduce
        local = a.abs().amax(dim=-1, keepdim=True).to(torch.float32)  # [M, 1]
        # Each rank's amax in its own column, zeros elsewhere: the sum over the ranks holds every
        # rank's amax exactly (a sum is the one collective the group has), their max the row's.
        spread = F.pad(local, (group.rank, group.world_size - group.rank - 1))
        amax = group.all_reduce(spread).amax(dim=-1, keepdim=True)
        scales = amax.clamp_min(AMAX_FLOOR) * INV_FP8_MAX
        codes = (a.to(torch.float32) / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_WEIGHT_DTYPE)
        return codes, scales


class Fp8ExpertReader:
    """One MoE expert projection of an FP8 checkpoint (`moe.layer.QuantizedExpertReader`): its
    codes and scales (and a static input scale, read and not used: the block's experts compute
    with activations in the model's dtype), dequantized once all are in."""

    def __init__(
        self, in_features: int, rows: int, scheme: Fp8WeightScheme, device: torch.device, name: str
    ) -> None:
        self.layer = Fp8CheckpointLinear(
            in_features, {"": rows}, scheme, bias=False, dtype=torch.float32, device=device, name=name
        )
        self._loaded: set[str] = set()

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str | None:
        """Read `name` ("weight", "weight_scale", "input_scale"); returns "weight" once the
        projection is complete, else the key of what it read ("codes" for the weight). Raises
        `ValueError` as `Fp8CheckpointLinear` does."""
        key = self.layer.load_checkpoint_tensor(name, tensor)
        assert key is not None  # the layer fills a key for every tensor it takes
        self._loaded.add(key)
        if not self.layer.missing_checkpoint_keys(self._loaded):
            return "weight"
        return "codes" if key == "weight" else key

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K]: codes times their channel, tensor or block scales, exact in float32,
        rounded once to `dtype`. Pure."""
        layer = self.layer
        codes = layer.weight.to(torch.float32)
        if layer.block_scale is None:
            scale = layer.weight_scale.reshape(-1, 1)
        else:
            assert layer.scheme.block is not None
            (rows, cols), (n, k) = layer.scheme.block, codes.shape
            scale = layer.block_scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
        return (codes * scale).to(dtype)
