"""Quantized checkpoints over tensor-parallel ranks: which part of each tensor of a quantized layer
a rank reads, and the shards refused because they would cut a packed word, a scale group or an
FP8 block.

A rank's quantized layer is the single-device layer of its shapes, filled with its part of the
checkpoint's tensors, so it runs the same formulation and kernels. Which dimension is cut follows
the dense split of the layer (`ShardLayout.slice_of` of its `weight`):

* Column-parallel (q/k/v, gate/up; output rows `[s, s + l)`): every tensor is cut along the
  outputs. Codes and scales by rows; what is packed along the outputs (compressed-tensors'
  `weight_zero_point`, GPTQ's `qzeros`, AWQ's `qweight` and `qzeros`, whose interleaved order
  stays inside a word) by whole words, `s / pack` to `(s + l) / pack`. Inputs are whole, so
  `g_idx` is read whole. FP8: weights and per-channel scales by rows, block scales by row blocks,
  per-tensor scales whole (a stacked layer keeps each projection's own, as on one device).
* Row-parallel (o_proj, down_proj; input columns `[s, s + l)`): codes cut along the inputs (by
  words where they are packed along them: compressed-tensors' `weight_packed`, GPTQ's
  `qweight`), group scales and zeros by groups `s / group_size` to `(s + l) / group_size`,
  per-channel ones whole. With activation order the rank reads its inputs' `g_idx`, which name
  arbitrary groups, and the whole scale and zero table. FP8: weights by columns, block scales by
  column blocks, per-channel and per-tensor scales whole. The bias is read whole and added once,
  after the all-reduce (`IntWeightLinear` / `Fp8CheckpointLinear` with `reduce`).
* Layers the layout replicates (none split) read every tensor whole.

Refused by `check_shard`, when the quantized layers are placed (before a tensor is read), with the
layer and the sizes named: shards whose start or size is not a multiple of the pack factor along
a packed dimension, of the group size along a row-parallel layer's inputs (without activation
order), of the FP8 block along the split dimension, or of the activation group of dynamic
per-group FP8 activations along the inputs (each rank's groups must be the single device's).
Repacking codes across words would lift the first; it is not done, as head sizes of 64 or 128 and
the intermediate sizes of released models give shards that are multiples of 8 at the usual sizes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.distributed.sharding import PartOf, ShardLayout, TensorPart, TensorSlice
from pagedserve.quantization.checkpoint_config import IntWeightScheme, WeightScheme
from pagedserve.quantization.fp8_linear import Fp8CheckpointLinear
from pagedserve.quantization.int_formats import num_groups
from pagedserve.quantization.int_linear import IntWeightLinear

# Where each layout packs its codes: along the inputs (K) or the outputs (N).
_PACKED_ALONG_INPUTS = {"compressed-tensors": "weight_packed", "gptq": "qweight", "gptq_v2": "qweight"}


@dataclass(frozen=True, slots=True)
class ShapeEntry:
    """compressed-tensors' `weight_shape` (N, K) of a rank: entry `dim` says the rank's `length`."""

    dim: int
    length: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole checkpoint's shape with this rank's size. Does not mutate `tensor`."""
        local = tensor.clone()
        local[self.dim] = self.length
        return local

    def read(self, lazy: Any) -> torch.Tensor:
        return self.take(lazy[:])


def _dimension(split: TensorSlice) -> str:
    return "output rows" if split.dim == 0 else "input columns"


def _require(layer: str, world_size: int, split: TensorSlice, unit: int, why: str) -> None:
    """Raise `ValueError` unless the rank's part starts and ends on a multiple of `unit`."""
    if split.start % unit == 0 and split.length % unit == 0:
        return
    what = _dimension(split)
    raise ValueError(
        f"tensor_parallel_size={world_size} cannot shard the quantized layer {layer}: a rank holds "
        f"{split.length} of its {what} (from {split.start}), not a multiple of {unit} ({why}). "
        f"Use a tensor_parallel_size that gives every rank a multiple of {unit} {what}, or "
        "tensor_parallel_size=1"
    )


def check_shard(scheme: WeightScheme, layer: str, split: TensorSlice, world_size: int) -> None:
    """Raise `ValueError` naming `layer` and the sizes when the rank's part `split` of its dense
    weight would cut a packed word, a scale group or an FP8 block (module docstring). Pure."""
    column = split.dim == 0
    if isinstance(scheme, IntWeightScheme):
        pack = 32 // scheme.bits
        along_inputs = _PACKED_ALONG_INPUTS.get(scheme.layout)
        if column:
            packed_outputs = {
                "compressed-tensors": None if scheme.symmetric else "weight_zero_point",
                "gptq": "qzeros",
                "gptq_v2": "qzeros",
                "awq": "qweight and qzeros",
            }[scheme.layout]
            if packed_outputs is not None:
                why = f"{packed_outputs} pack {pack} outputs per int32 word"
                _require(layer, world_size, split, pack, why)
            return
        if along_inputs is not None:
            _require(layer, world_size, split, pack, f"{along_inputs} packs {pack} inputs per int32 word")
        if scheme.group_size is not None and not scheme.act_order:
            why = f"its scales and zero points are per group of {scheme.group_size} inputs"
            _require(layer, world_size, split, scheme.group_size, why)
        return
    if scheme.block is not None:
        size = scheme.block[0] if column else scheme.block[1]
        why = f"its FP8 scales are per block of {scheme.block[0]} x {scheme.block[1]}"
        _require(layer, world_size, split, size, why)
    if not column and scheme.activation_group is not None:
        why = f"its activations are quantized per group of {scheme.activation_group} inputs"
        _require(layer, world_size, split, scheme.activation_group, why)


def scale_groups(scheme: IntWeightScheme, in_features: int, input_shards: int) -> int:
    """Scale groups per output row of a rank's integer layer of `in_features` inputs, the layer's
    inputs split over `input_shards` ranks (1: not split): an activation-ordered layer of split
    inputs keeps the whole table (its inputs name any group of it), every other layer the groups
    of its own inputs. Pure."""
    if scheme.act_order:
        return num_groups(scheme, in_features * input_shards)
    return num_groups(scheme, in_features)


def _cut(dim: int, split: TensorSlice, unit: int = 1) -> TensorSlice:
    """`split` along `dim` of a tensor holding one entry per `unit` of the split dimension
    (alignment checked by `check_shard`)."""
    return TensorSlice(dim, split.start // unit, split.length // unit)


def tensor_part(scheme: WeightScheme, field: str, split: TensorSlice | None) -> TensorPart | None:
    """The part of the layer's checkpoint tensor `field` ("qweight", "weight_scale", "bias", ...)
    a rank holds, given the part `split` of its dense weight; None: the whole tensor (replicated,
    or a field the layer itself refuses by name). Pure."""
    if split is None:
        return None
    column = split.dim == 0
    if field == "bias":
        return _cut(0, split) if column else None  # row-parallel: added once, after the sum
    if not isinstance(scheme, IntWeightScheme):
        if field == "weight":
            return _cut(split.dim, split)
        if field != "weight_scale" or scheme.strategy == "tensor":
            return None
        if scheme.strategy == "channel":
            return _cut(0, split) if column else None
        assert scheme.block is not None
        return _cut(split.dim, split, scheme.block[split.dim])
    pack = 32 // scheme.bits
    awq = scheme.layout == "awq"  # AWQ packs its codes along the outputs, the others along the inputs
    parts: dict[str, TensorPart | None]
    if column:  # the inputs are whole: `g_idx` and `weight_g_idx` too
        parts = {
            "weight_packed": _cut(0, split),
            "weight_scale": _cut(0, split),
            "weight_zero_point": _cut(0, split, pack),
            "weight_shape": ShapeEntry(0, split.length),
            "qweight": _cut(1, split, pack if awq else 1),
            "qzeros": _cut(1, split, pack),
            "scales": _cut(1, split),
        }
        return parts.get(field)
    # Group scales and zeros follow the inputs; per-channel ones and, with activation order, the
    # whole table stay whole. compressed-tensors keeps groups as columns [N, G], GPTQ/AWQ as rows.
    size = None if scheme.act_order else scheme.group_size  # None: the table is read whole
    parts = {
        "weight_packed": _cut(1, split, pack),
        "weight_scale": _cut(1, split, size) if size else None,
        "weight_zero_point": _cut(1, split, size) if size else None,
        "weight_shape": ShapeEntry(1, split.length),
        "weight_g_idx": _cut(0, split),
        "qweight": _cut(0, split, 1 if awq else pack),
        "qzeros": _cut(0, split, size) if size else None,
        "scales": _cut(0, split, size) if size else None,
        "g_idx": _cut(0, split),
    }
    return parts.get(field)


def _checkpoint_projections(modules: Iterable[nn.Module]) -> dict[str, WeightScheme]:
    """checkpoint projection name -> scheme, of every quantized layer in `modules`."""
    projections: dict[str, WeightScheme] = {}
    for module in modules:
        if isinstance(module, IntWeightLinear | Fp8CheckpointLinear):
            for shard in module.shard_offsets:
                name = f"{module.checkpoint_name}.{shard}" if shard else module.checkpoint_name
                projections[name] = module.scheme
    return projections


def quantized_part_of(model: nn.Module, layout: ShardLayout) -> PartOf:
    """The part of every checkpoint tensor a rank of `layout` reads, for a sharded model whose
    quantized layers are placed (`place_quantized_layers` with the layout): the quantized layers'
    tensors by `tensor_part`, every other tensor by `layout.slice_of`. Pure."""
    projections = _checkpoint_projections(model.modules())

    def part_of(name: str) -> TensorPart | None:
        layer, _, field = name.rpartition(".")
        scheme = projections.get(layer)
        if scheme is None:
            return layout.slice_of(name)
        return tensor_part(scheme, field, layout.slice_of(f"{layer}.weight"))

    return part_of
