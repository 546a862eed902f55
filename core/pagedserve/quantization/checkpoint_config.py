"""A checkpoint's `quantization_config`, read into what each linear layer's tensors are.

Three families are read, each with no engine flag (the config alone decides):

* compressed-tensors (`quant_method: compressed-tensors`, what llm-compressor writes):
  `pack-quantized` 4- or 8-bit integer weights per group or per channel, symmetric or with zero
  points, activations unquantized (W4A16, W8A16); `float-quantized` FP8 weights per tensor, per
  channel or in blocks, with dynamic per-token, dynamic per-group or static per-tensor FP8
  activations (FP8_DYNAMIC, FP8_BLOCK, FP8). `config_groups` target linear layers by class
  (`Linear`), exact name or `re:` regular expression; `ignore` lists the layers left dense.
* GPTQ (`quant_method: gptq`): 4- or 8-bit, any group size (or per channel), symmetric or not,
  with activation order (`desc_act`, a `g_idx` per layer); the `gptq` and `gptq_v2` checkpoint
  formats.
* AWQ (`quant_method: awq`, `version: gemm`): 4-bit with zero points per group.

Everything else is refused by `QuantizationConfigError`, which names the field and its value:
an unknown method, an unknown field, or a known one whose value changes what the tensors mean and
is not read here (sparsity, transforms, KV-cache scales, int8 activations, quantized LM heads...).
Fields that only record how the checkpoint was calibrated (observers, damping) are accepted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

IntLayout = Literal["compressed-tensors", "gptq", "gptq_v2", "awq"]
Fp8Activations = Literal["dynamic_token", "dynamic_group", "static_tensor"]


class QuantizationConfigError(ValueError):
    """A `quantization_config` this engine does not read; the message names the field."""


@dataclass(frozen=True, slots=True)
class IntWeightScheme:
    """Integer weights, activations in the model's dtype: `w = (q - zero) * scale`, one scale (and
    zero) per `group_size` consecutive inputs of an output row (or per `g_idx[k]`'s group)."""

    layout: IntLayout  # how the checkpoint packs codes, scales and zeros
    bits: int  # 4 or 8
    group_size: int | None  # None: one group spanning the row (per output channel)
    symmetric: bool  # no zero points: q is signed around 0
    act_order: bool  # the checkpoint gives each input column its group (`g_idx`)


@dataclass(frozen=True, slots=True)
class Fp8WeightScheme:
    """FP8 (`float8_e4m3fn`) weights with float32 scales, and FP8 activations."""

    strategy: Literal["tensor", "channel", "block"]
    block: tuple[int, int] | None  # (rows, columns) of a block's scale, for "block"
    activations: Fp8Activations  # per token or per group computed at run time, or one stored scale
    activation_group: int | None  # inputs per activation scale, for "dynamic_group"


WeightScheme = IntWeightScheme | Fp8WeightScheme


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    """What a checkpoint's linear layers hold, by layer name (transformers' names)."""

    method: str  # "compressed-tensors", "gptq" or "awq"
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # (targets, scheme), first match wins
    ignore: tuple[str, ...]  # layers kept dense: exact names, `re:` patterns, or (AWQ) substrings
    # compressed-tensors `kv_cache_scheme`: each attention layer stores one FP8 scale for its keys
    # and one for its values (`quantization.kv_scales`)
    kv_cache_scales: bool = False

    def scheme_for(self, name: str) -> WeightScheme | None:
        """The scheme of linear layer `name` ("model.layers.0.self_attn.q_proj"), or None when it
        is dense in the checkpoint. Pure."""
        if self.method == "awq":
            if any(key in name for key in self.ignore):
                return None
        elif any(_matches(pattern, name) for pattern in self.ignore):
            return None
        if self.method in ("gptq", "awq") and name == "lm_head":
            return None  # GPTQ/AWQ leave the head dense (a quantized head is refused when read)
        for targets, scheme in self.groups:
            if any(_matches(target, name) for target in targets):
                return scheme
        return None

    def describe(self) -> str:
        """One line for the load log. Pure."""
        schemes = ", ".join(_describe(scheme) for _, scheme in self.groups)
        return f"{self.method} ({schemes})"


def _describe(scheme: WeightScheme) -> str:
    if isinstance(scheme, IntWeightScheme):
        groups = "per channel" if scheme.group_size is None else f"groups of {scheme.group_size}"
        zeros = "symmetric" if scheme.symmetric else "zero points"
        order = ", activation order" if scheme.act_order else ""
        return f"int{scheme.bits} weights {groups}, {zeros}{order}"
    block = f" {scheme.block[0]}x{scheme.block[1]}" if scheme.block else ""
    return f"FP8 weights per {scheme.strategy}{block}, {scheme.activations.replace('_', ' ')} activations"


def _matches(pattern: str, name: str) -> bool:
    """compressed-tensors' target rule: `Linear` is every linear layer, `re:P` a regular
    expression matched from the start of the name, anything else the exact name."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def _refuse(field: str, value: Any, why: str) -> QuantizationConfigError:
    return QuantizationConfigError(f"quantization_config.{field}={value!r}: {why}")


def _check_fields(raw: Mapping[str, Any], where: str, known: set[str]) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        name = unknown[0]
        prefix = f"{where}." if where else ""
        raise _refuse(
            f"{prefix}{name}",
            raw[name],
            f"an unknown field of this quantization format (known: {sorted(known)})",
        )


def parse_quantization_config(raw: Mapping[str, Any]) -> CheckpointQuantization:
    """Read a checkpoint's `quantization_config` (module docstring). Raises
    `QuantizationConfigError` naming the first field that is not read. Pure."""
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "gptq":
        return _gptq(raw)
    if method == "awq":
        return _awq(raw)
    raise _refuse(
        "quant_method", method, "not a format this engine reads (compressed-tensors, gptq and awq are)"
    )


# --- compressed-tensors ---------------------------------------------------------------------

_CT_TOP = {
    "quant_method", "format", "config_groups", "ignore", "kv_cache_scheme", "quantization_status",
    "sparsity_config", "transform_config", "global_compression_ratio", "version",
}  # fmt: skip
_CT_GROUP = {"targets", "weights", "input_activations", "output_activations", "format"}
# Fields of one tensor's quantization args; observers and dtypes only record the calibration.
_CT_ARGS = {
    "num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
    "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype",
}  # fmt: skip


def _compressed_tensors(raw: Mapping[str, Any]) -> CheckpointQuantization:
    _check_fields(raw, "", _CT_TOP)
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(
            "quantization_status",
            status,
            "only compressed checkpoints are read (their tensors hold the codes)",
        )
    for field in ("sparsity_config", "transform_config"):
        if raw.get(field):
            raise _refuse(field, raw[field], "sparse and transformed weights are not read")
    kv_cache_scales = raw.get("kv_cache_scheme") is not None
    if kv_cache_scales:
        _check_kv_cache_scheme(raw["kv_cache_scheme"])
    groups_raw = raw.get("config_groups")
    if not isinstance(groups_raw, Mapping) or not groups_raw:
        raise _refuse("config_groups", groups_raw, "a compressed-tensors config needs at least one group")
    groups = []
    for group_name, group in groups_raw.items():
        where = f"config_groups.{group_name}"
        if not isinstance(group, Mapping):
            raise _refuse(where, group, "each group is a mapping")
        _check_fields(group, where, _CT_GROUP)
        targets = group.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
            raise _refuse(f"{where}.targets", targets, "a non-empty list of layer names or patterns")
        for target in targets:
            if target != "Linear" and not target.startswith("re:") and target[:1].isupper():
                raise _refuse(f"{where}.targets", targets, f"{target!r}: only the Linear class is read")
        if group.get("output_activations") is not None:
            raise _refuse(f"{where}.output_activations", group["output_activations"], "not read")
        fmt = group.get("format") or raw.get("format")
        groups.append((tuple(targets), _ct_scheme(group, where, fmt)))
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise _refuse("ignore", ignore, "a list of layer names or `re:` patterns")
    return CheckpointQuantization("compressed-tensors", tuple(groups), tuple(ignore), kv_cache_scales)


def _check_kv_cache_scheme(scheme: Any) -> None:
    """The one KV-cache scheme read: static FP8 (e4m3) scales, one per tensor, symmetric."""
    where = "kv_cache_scheme"
    if not isinstance(scheme, Mapping):
        raise _refuse(where, scheme, "a mapping of quantization args")
    _check_fields(scheme, where, _CT_ARGS)
    wanted = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    # compressed-tensors' defaults for fields a config leaves out
    defaults = {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": True}
    for field, value in wanted.items():
        got = scheme.get(field, defaults[field])
        if got != value:
            raise _refuse(
                f"{where}.{field}",
                got,
                "only static FP8 KV-cache scales, one per tensor and symmetric, are read "
                f"({', '.join(f'{k}={v!r}' for k, v in wanted.items())})",
            )


def _ct_scheme(group: Mapping[str, Any], where: str, fmt: Any) -> WeightScheme:
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise _refuse(f"{where}.weights", weights, "every group quantizes weights")
    _check_fields(weights, f"{where}.weights", _CT_ARGS)
    kind = weights.get("type", "int")
    if kind == "int":
        return _ct_int(weights, group.get("input_activations"), f"{where}.weights", fmt)
    if kind == "float":
        return _ct_float(weights, group.get("input_activations"), where, fmt)
    raise _refuse(f"{where}.weights.type", kind, "int and float weights are read")


def _ct_int(weights: Mapping[str, Any], activations: Any, where: str, fmt: Any) -> IntWeightScheme:
    if fmt != "pack-quantized":
        raise _refuse("format", fmt, "integer weights are read in the pack-quantized format")
    if activations is not None:
        raise _refuse(
            f"{where.rpartition('.')[0]}.input_activations",
            activations,
            "integer weights with quantized activations (W8A8, W4A8) are not read; "
            "weight-only W4A16/W8A16 are",
        )
    bits = weights.get("num_bits")
    if bits not in (4, 8):
        raise _refuse(f"{where}.num_bits", bits, "4- and 8-bit integer weights are read")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(f"{where}.strategy", strategy, "integer weights per group or per channel are read")
    group_size = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(group_size, int) or group_size < 1):
        raise _refuse(f"{where}.group_size", group_size, "a positive group size")
    if weights.get("dynamic"):
        raise _refuse(f"{where}.dynamic", weights["dynamic"], "weights have stored scales")
    if weights.get("block_structure") is not None:
        raise _refuse(f"{where}.block_structure", weights["block_structure"], "not read for integer weights")
    actorder = weights.get("actorder")
    if actorder not in (None, False, True, "static", "weight", "group"):
        raise _refuse(f"{where}.actorder", actorder, "one of null, static, weight, group")
    return IntWeightScheme(
        layout="compressed-tensors",
        bits=bits,
        group_size=group_size,
        symmetric=bool(weights.get("symmetric", True)),
        # "static" and "weight" orders only change the calibration; "group" stores a g_idx.
        act_order=actorder in ("group", True),
    )


def _ct_float(weights: Mapping[str, Any], activations: Any, where: str, fmt: Any) -> Fp8WeightScheme:
    if fmt != "float-quantized":
        raise _refuse("format", fmt, "FP8 weights are read in the float-quantized format")
    w = f"{where}.weights"
    if weights.get("num_bits") != 8:
        raise _refuse(f"{w}.num_bits", weights.get("num_bits"), "float weights are read as FP8 (8 bits)")
    if weights.get("symmetric", True) is not True:
        raise _refuse(f"{w}.symmetric", weights.get("symmetric"), "FP8 weights are symmetric")
    if weights.get("dynamic"):
        raise _refuse(f"{w}.dynamic", weights["dynamic"], "weights have stored scales")
    strategy = weights.get("strategy")
    block: tuple[int, int] | None = None
    if strategy == "block":
        structure = weights.get("block_structure")
        if (
            not isinstance(structure, list)
            or len(structure) != 2
            or not all(isinstance(n, int) and n > 0 for n in structure)
        ):
            raise _refuse(f"{w}.block_structure", structure, "[rows, columns] of a block")
        block = (structure[0], structure[1])
    elif strategy not in ("tensor", "channel"):
        raise _refuse(f"{w}.strategy", strategy, "FP8 weights per tensor, per channel or in blocks are read")
    a = f"{where}.input_activations"
    if not isinstance(activations, Mapping):
        raise _refuse(
            a, activations, "FP8 weights are read with FP8 activations (FP8_DYNAMIC, FP8_BLOCK, FP8)"
        )
    _check_fields(activations, a, _CT_ARGS)
    if activations.get("type") != "float" or activations.get("num_bits") != 8:
        raise _refuse(a, dict(activations), "FP8 activations (type float, 8 bits) are read")
    if activations.get("symmetric", True) is not True:
        raise _refuse(f"{a}.symmetric", activations.get("symmetric"), "FP8 activations are symmetric")
    act_strategy, dynamic = activations.get("strategy"), activations.get("dynamic")
    kind: Fp8Activations
    group = None
    if dynamic is True and act_strategy == "token":
        kind = "dynamic_token"
    elif dynamic is True and act_strategy == "group":
        group = activations.get("group_size")
        if not isinstance(group, int) or group < 1:
            raise _refuse(f"{a}.group_size", group, "a positive group size")
        kind = "dynamic_group"
    elif dynamic is False and act_strategy == "tensor":
        kind = "static_tensor"
    else:
        raise _refuse(
            f"{a}.strategy",
            act_strategy,
            f"with dynamic={dynamic!r}; read are dynamic per token or per group, and static per tensor",
        )
    return Fp8WeightScheme(strategy, block, kind, group)


# --- GPTQ and AWQ ---------------------------------------------------------------------------

# Fields AutoGPTQ / GPTQModel write that only record the calibration or the writer.
_GPTQ_INFORMATIONAL = {
    "damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "model_name_or_path",
    "model_file_base_name", "meta", "mse", "v2", "v2_alpha", "act_group_aware", "hyb_act", "adapter",
    "format", "pack_dtype", "quantizer", "tokenizer", "offload_to_disk", "offload_to_disk_path",
}  # fmt: skip
_GPTQ = {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "lm_head",
         "dynamic", "is_marlin_format", "modules_in_block_to_quantize"} | _GPTQ_INFORMATIONAL  # fmt: skip


def _group_size(raw: Mapping[str, Any]) -> int | None:
    size = raw.get("group_size", -1)
    if size == -1:
        return None
    if not isinstance(size, int) or size < 1:
        raise _refuse("group_size", size, "a positive group size, or -1 for one per output channel")
    return size


def _gptq(raw: Mapping[str, Any]) -> CheckpointQuantization:
    _check_fields(raw, "", _GPTQ)
    bits = raw.get("bits")
    if bits not in (4, 8):
        raise _refuse("bits", bits, "4- and 8-bit GPTQ weights are read")
    fmt = raw.get("checkpoint_format", raw.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "the gptq and gptq_v2 layouts are read")
    if raw.get("is_marlin_format"):
        raise _refuse("is_marlin_format", raw["is_marlin_format"], "Marlin-repacked weights are not read")
    if raw.get("lm_head"):
        raise _refuse("lm_head", raw["lm_head"], "a quantized LM head is not read")
    if raw.get("dynamic"):
        raise _refuse("dynamic", raw["dynamic"], "per-layer overrides are not read")
    if raw.get("modules_in_block_to_quantize"):
        raise _refuse(
            "modules_in_block_to_quantize",
            raw["modules_in_block_to_quantize"],
            "partial quantization is not read",
        )
    scheme = IntWeightScheme(
        layout=fmt,
        bits=bits,
        group_size=_group_size(raw),
        symmetric=bool(raw.get("sym", True)),
        act_order=bool(raw.get("desc_act", False)),
    )
    return CheckpointQuantization("gptq", ((("re:model\\.layers\\.",), scheme),), ())


_AWQ = {"quant_method", "bits", "group_size", "zero_point", "version", "modules_to_not_convert", "backend",
        "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config"}  # fmt: skip


def _awq(raw: Mapping[str, Any]) -> CheckpointQuantization:
    _check_fields(raw, "", _AWQ)
    if raw.get("bits") != 4:
        raise _refuse("bits", raw.get("bits"), "AWQ weights are read in 4 bits")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(
            "version", raw.get("version"), "the GEMM layout is read (not GEMV, ExLlama, Marlin or IPEX)"
        )
    if raw.get("zero_point", True) is not True:
        raise _refuse("zero_point", raw.get("zero_point"), "AWQ weights are read with zero points")
    for field in ("do_fuse", "modules_to_fuse", "exllama_config"):
        if raw.get(field):
            raise _refuse(field, raw[field], "AWQ's fused-module options are not read (drop them)")
    ignore = raw.get("modules_to_not_convert") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise _refuse("modules_to_not_convert", ignore, "a list of layer-name fragments")
    scheme = IntWeightScheme("awq", 4, _group_size(raw), symmetric=False, act_order=False)
    return CheckpointQuantization("awq", ((("re:model\\.layers\\.",), scheme),), tuple(ignore))
