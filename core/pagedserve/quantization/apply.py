"""Giving a built model the quantized layers its checkpoint's `quantization_config` describes,
before the checkpoint is read into them.

Each linear layer of the decoder is looked up under the checkpoint's names: a stacked layer
(`qkv_proj`, `gate_up_proj`) under each projection it stacks, which must share one scheme. Layers
the checkpoint quantizes become `IntWeightLinear` (integer weights) or `Fp8CheckpointLinear` (FP8);
the others stay dense. What is not read is refused by name: a quantized LM head, quantized MoE
experts, and checkpoints of the transformers fallback.

A model sharded over tensor-parallel ranks (`models.tensor_parallel.shard_model`) gets each rank's
quantized layers: of its local shapes, row-parallel ones summing over the group, activation-ordered
row-parallel ones with the whole scale table; shards that would cut a packed word, a scale group
or an FP8 block are refused here, before a tensor is read (`quantization.tensor_parallel`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from pagedserve.distributed.layers import RowParallelLinear
from pagedserve.distributed.sharding import ShardLayout
from pagedserve.models.decoder import DecoderForCausalLM
from pagedserve.models.layers import MergedLinear
from pagedserve.moe.layer import QuantizedExpertReader, RouterLinear, SparseMoE
from pagedserve.quantization.checkpoint_config import (
    CheckpointQuantization,
    IntWeightScheme,
    WeightScheme,
    parse_quantization_config,
)
from pagedserve.quantization.fp8_linear import Fp8CheckpointLinear, Fp8ExpertReader
from pagedserve.quantization.int_linear import IntWeightLinear
from pagedserve.quantization.kv_scales import place_kv_scale_readers
from pagedserve.quantization.tensor_parallel import check_shard, scale_groups

logger = logging.getLogger(__name__)


def checkpoint_quantization(hf_config: Any) -> CheckpointQuantization | None:
    """The checkpoint's quantization (`quantization_config` of its transformers config), or None
    for a dense checkpoint. Raises `QuantizationConfigError` naming what is not read. Pure."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        to_dict = getattr(raw, "to_dict", None)
        if to_dict is None:
            raise ValueError(f"quantization_config of type {type(raw).__name__} cannot be read")
        raw = to_dict()
    return parse_quantization_config(raw)


def _checkpoint_name(path: str, renames: tuple[tuple[str, str], ...]) -> str:
    """Our module path under the checkpoint's names (`checkpoint_renames` undone)."""
    for fragment, ours in renames:
        path = path.replace(ours, fragment)
    return path


def _scheme_of(quant: CheckpointQuantization, names: list[str], path: str) -> WeightScheme | None:
    schemes = {name: quant.scheme_for(name) for name in names}
    distinct = set(schemes.values())
    if len(distinct) > 1:
        shown = ", ".join(f"{name}: {scheme}" for name, scheme in schemes.items())
        raise ValueError(
            f"{path} stacks projections that the checkpoint quantizes differently ({shown}); "
            "they must share one scheme"
        )
    return distinct.pop()


def _checked_row_parallel(names: list[str], scheme: WeightScheme, layout: ShardLayout | None) -> bool:
    """Whether a rank's layer of the projections `names` holds a slice of their inputs (o_proj,
    down_proj) rather than of their outputs or all of them. Raises `ValueError` naming the first
    projection whose shard would cut a packed word, a scale group or an FP8 block (`check_shard`).
    Pure."""
    row_parallel = False
    for name in names:
        split = None if layout is None else layout.slice_of(f"{name}.weight")
        if split is not None:
            assert layout is not None
            check_shard(scheme, name, split, layout.world_size)
            row_parallel |= split.dim == 1
    return row_parallel


def _read_quantized_experts(
    block: SparseMoE, quant: CheckpointQuantization, name: str, layout: ShardLayout | None
) -> bool:
    """Give `block` a reader of its experts' quantized tensors when the checkpoint quantizes them:
    integer codes are read with the layer's own formats, FP8 codes with their channel, tensor or
    block scales, and written dequantized to the model's dtype, so the experts run on the
    platform's MoE op as a dense checkpoint's do (their memory saving is not kept); returns
    whether it did. Raises `ValueError` for quantized experts under tensor parallelism. Mutates
    `block`."""
    names = [f"{name}.experts.0.{proj}" for proj in (block.names.gate, block.names.up, block.names.down)]
    if block.names.layout != "per_expert" or all(quant.scheme_for(n) is None for n in names):
        return False
    scheme = _scheme_of(quant, names, f"{name}.experts")  # one scheme for the three, or it raises
    assert scheme is not None  # some of the three are quantized, so all are
    if layout is not None and layout.world_size > 1:
        raise ValueError(
            f"the checkpoint quantizes the experts of {name}, which are not read under tensor "
            "parallelism yet: use tensor_parallel_size=1"
        )
    device = block.w13.device

    def reader(in_features: int, rows: int, where: str) -> QuantizedExpertReader:
        if isinstance(scheme, IntWeightScheme):
            return IntWeightLinear(
                in_features, {"": rows}, scheme, bias=False, dtype=block.w13.dtype, device=device,
                name=f"{name}.{where}",
            )  # fmt: skip
        return Fp8ExpertReader(in_features, rows, scheme, device, f"{name}.{where}")

    block.expert_reader = reader
    return True


def place_quantized_layers(
    model: DecoderForCausalLM, quant: CheckpointQuantization, layout: ShardLayout | None = None
) -> int:
    """Swap every linear layer that `quant` quantizes for its quantized layer, empty, on the
    model's device; returns how many. With the `layout` of a sharded model, the layers are that
    rank's (module docstring). Raises `ValueError` for layers that are not read quantized, or
    whose shards would cut what the checkpoint packs. Mutates `model`."""
    renames = type(model).checkpoint_renames
    dtype = model.model.embed_tokens.weight.dtype
    device = model.model.embed_tokens.weight.device
    if model.lm_head is not None and quant.scheme_for("lm_head") is not None:
        raise ValueError(
            "the checkpoint quantizes lm_head, which is not read quantized: requantize with lm_head "
            "in the ignore list (it stays in the model's dtype)"
        )
    replaced = 0  # layers and MoE blocks made quantized
    for path, module in model.named_modules():
        if isinstance(module, SparseMoE):
            replaced += _read_quantized_experts(module, quant, _checkpoint_name(path, renames), layout)
    for path, module in list(model.model.named_modules()):
        if not isinstance(module, nn.Linear) or isinstance(module, RouterLinear):
            continue
        full = f"model.{path}"
        owner = _checkpoint_name(full.rpartition(".")[0], renames)
        if isinstance(module, MergedLinear):
            sizes = {shard: rows for shard, (_, rows) in module.shard_offsets.items()}
            names = [f"{owner}.{shard}" for shard in sizes]
        else:
            sizes = {"": module.out_features}
            names = [_checkpoint_name(full, renames)]
        scheme = _scheme_of(quant, names, full)
        if scheme is None:
            continue
        options: dict[str, Any] = dict(bias=module.bias is not None, dtype=dtype, device=device)
        where = owner if isinstance(module, MergedLinear) else names[0]
        # Only the all-reduce of a sharded o_proj / down_proj is the layer's own: a row-parallel
        # shared expert's partial products are summed by its MoE block.
        options["reduce"] = module.group if isinstance(module, RowParallelLinear) else None
        row_parallel = _checked_row_parallel(names, scheme, layout)
        layer: nn.Module
        if isinstance(scheme, IntWeightScheme):
            world = 1 if layout is None else layout.world_size
            groups = scale_groups(scheme, module.in_features, world if row_parallel else 1)
            layer = IntWeightLinear(module.in_features, sizes, scheme, name=where, groups=groups, **options)
        else:
            layer = Fp8CheckpointLinear(module.in_features, sizes, scheme, name=where, **options)
        parent, _, attr = path.rpartition(".")
        setattr(model.model.get_submodule(parent) if parent else model.model, attr, layer)
        replaced += 1
    if quant.kv_cache_scales:
        place_kv_scale_readers(model)
    if replaced == 0:
        raise ValueError(
            f"the checkpoint's quantization_config ({quant.describe()}) quantizes none of this model's "
            "linear layers: its targets or ignore list do not match the layer names"
        )
    logger.info("quantized checkpoint: %d linear layers kept quantized, %s", replaced, quant.describe())
    return replaced
