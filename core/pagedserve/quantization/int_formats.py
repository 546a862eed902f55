"""Integer weight formats: how compressed-tensors, GPTQ and AWQ checkpoints pack one linear
layer's codes, scales and zero points, read into one form (`IntWeights`).

The one form: `w[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g]` with `g = g_idx[k]` when the
checkpoint orders groups by activation, else `k // group_size`; codes and zeros signed
(`-2**(bits-1) .. 2**(bits-1) - 1`), no zeros for symmetric weights.

The checkpoints' layouts (bits b, `pack = 32 // b` codes per int32 word, code i of a word in bits
`[i*b, (i+1)*b)`):

* compressed-tensors `pack-quantized`: `weight_packed` [N, K / pack] packed along the inputs,
  codes stored plus `2**(b-1)`; `weight_scale` [N, G]; `weight_zero_point` [N / pack, G] packed
  along the outputs, stored the same way; `weight_shape` (N, K); `weight_g_idx` [K].
* GPTQ: `qweight` [K / pack, N] packed along the inputs, unsigned; `qzeros` [G, N / pack] packed
  along the outputs, unsigned, stored minus one in the `gptq` format (not in `gptq_v2`);
  `scales` [G, N]; `g_idx` [K].
* AWQ (GEMM): `qweight` [K, N / pack] packed along the outputs in the order
  `AWQ_PACK_ORDER` (code i of a word is column `AWQ_PACK_ORDER[i]` of its eight); `qzeros`
  [G, N / pack] packed the same way; `scales` [G, N]; unsigned, no offset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pagedserve.quantization.checkpoint_config import IntWeightScheme

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within eight) held by code i of a word


@dataclass(frozen=True, slots=True)
class IntWeights:
    """One projection's integer weights in the one form (module docstring)."""

    codes: torch.Tensor  # [N, K] int8, signed
    scales: torch.Tensor  # [N, G] float32
    zeros: torch.Tensor | None  # [N, G] int8, signed; None: symmetric
    g_idx: torch.Tensor | None  # [K] int32 group of each input; None: k // group_size


def unpack_codes(words: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """The unsigned `bits`-bit codes packed along `dim` of int32 `words`, the first `count` of
    that dimension, as int16 (code i of a word in bits [i*bits, (i+1)*bits)). Pure."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed codes must be int32, got {words.dtype}")
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    moved = words.movedim(dim, -1)
    codes = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, pack]
    codes = codes.reshape(*moved.shape[:-1], moved.shape[-1] * pack)
    if codes.shape[-1] < count:
        raise ValueError(f"{moved.shape[-1]} packed words hold {codes.shape[-1]} codes, fewer than {count}")
    return codes[..., :count].to(torch.int16).movedim(-1, dim)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned `bits`-bit codes [N, K] packed along K into int32 words [N, ceil(K / (32 / bits))]
    (the inverse of `unpack_codes(words, bits, K, dim=1)`). Pure."""
    pack = 32 // bits
    n, k = codes.shape
    padded = torch.zeros((n, -(-k // pack) * pack), dtype=torch.int64, device=codes.device)
    padded[:, :k] = codes.to(torch.int64)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    words = (padded.reshape(n, -1, pack) << shifts).sum(-1)
    # Sums of disjoint bit fields are their OR; the top field may set bit 31: wrap to int32.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _tensor(tensors: Mapping[str, torch.Tensor], name: str, layer: str) -> torch.Tensor:
    tensor = tensors.get(name)
    if tensor is None:
        raise ValueError(f"checkpoint layer {layer!r} has no {name!r} tensor, which its quantization needs")
    return tensor


def _check_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str, layer: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"checkpoint tensor {layer}.{name} has shape {tuple(tensor.shape)}, expected {shape}: "
            "the quantization config does not match the weights"
        )


def num_groups(scheme: IntWeightScheme, in_features: int) -> int:
    """Scale groups per output row. Pure."""
    return 1 if scheme.group_size is None else -(-in_features // scheme.group_size)


def read_int_weights(
    tensors: Mapping[str, torch.Tensor],
    scheme: IntWeightScheme,
    out_features: int,
    in_features: int,
    layer: str,  # the checkpoint's layer name, for errors
    groups: int | None = None,  # scale groups per row; None: `num_groups(scheme, in_features)`
) -> IntWeights:
    """One projection's tensors (names without the layer prefix) in the one form. `groups` is
    larger than the inputs' own for a tensor-parallel shard of the inputs of an activation-ordered
    layer, which keeps the whole scale table. Raises `ValueError` naming the tensor that is
    missing or has the wrong shape. Pure."""
    n, k, bits = out_features, in_features, scheme.bits
    pack = 32 // bits
    groups = num_groups(scheme, k) if groups is None else groups
    offset = 1 << (bits - 1)
    if scheme.layout == "compressed-tensors":
        packed = _tensor(tensors, "weight_packed", layer)
        _check_shape(packed, (n, -(-k // pack)), "weight_packed", layer)
        if "weight_shape" in tensors and tuple(int(v) for v in tensors["weight_shape"].tolist()) != (n, k):
            raise ValueError(
                f"checkpoint tensor {layer}.weight_shape is {tensors['weight_shape'].tolist()}, expected "
                f"{[n, k]}: the config does not match the weights"
            )
        codes = unpack_codes(packed, bits, k, dim=1) - offset
        scales = _tensor(tensors, "weight_scale", layer)
        _check_shape(scales, (n, groups), "weight_scale", layer)
        zeros = None
        if not scheme.symmetric:
            zp = _tensor(tensors, "weight_zero_point", layer)
            _check_shape(zp, (-(-n // pack), groups), "weight_zero_point", layer)
            zeros = unpack_codes(zp, bits, n, dim=0) - offset
        g_idx = _tensor(tensors, "weight_g_idx", layer) if scheme.act_order else None
    elif scheme.layout in ("gptq", "gptq_v2"):
        qweight = _tensor(tensors, "qweight", layer)
        _check_shape(qweight, (-(-k // pack), n), "qweight", layer)
        codes = unpack_codes(qweight, bits, k, dim=0).t() - offset
        qzeros = _tensor(tensors, "qzeros", layer)
        _check_shape(qzeros, (groups, -(-n // pack)), "qzeros", layer)
        stored = unpack_codes(qzeros, bits, n, dim=1).t()
        # The gptq format stores each zero minus one (and wraps 0 - 1 to all ones).
        zeros = ((stored + 1) & ((1 << bits) - 1) if scheme.layout == "gptq" else stored) - offset
        scales = _tensor(tensors, "scales", layer).t()
        _check_shape(scales, (n, groups), "scales.T", layer)
        g_idx = tensors.get("g_idx") if scheme.act_order else None
        if scheme.act_order and g_idx is None:
            raise ValueError(f"checkpoint layer {layer!r} has desc_act=true but no 'g_idx' tensor")
    else:  # awq
        qweight = _tensor(tensors, "qweight", layer)
        _check_shape(qweight, (k, -(-n // pack)), "qweight", layer)
        codes = _awq_columns(unpack_codes(qweight, bits, -(-n // pack) * pack, dim=1), n).t() - offset
        qzeros = _tensor(tensors, "qzeros", layer)
        _check_shape(qzeros, (groups, -(-n // pack)), "qzeros", layer)
        zeros = _awq_columns(unpack_codes(qzeros, bits, -(-n // pack) * pack, dim=1), n).t() - offset
        scales = _tensor(tensors, "scales", layer).t()
        _check_shape(scales, (n, groups), "scales.T", layer)
        g_idx = None
    if g_idx is not None:
        _check_shape(g_idx, (k,), "g_idx", layer)
        g_idx = g_idx.to(torch.int32)
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"checkpoint tensor {layer}.g_idx names groups outside 0..{groups - 1}")
    if zeros is not None and not bool(zeros.any()):
        zeros = None  # symmetric weights written with explicit zeros (GPTQ's sym=true)
    return IntWeights(
        codes.to(torch.int8).contiguous(),
        scales.to(torch.float32).contiguous(),
        None if zeros is None else zeros.to(torch.int8).contiguous(),
        g_idx,
    )


def _awq_columns(codes: torch.Tensor, n: int) -> torch.Tensor:
    """AWQ's codes [rows, words * 8] in packing order, put back in column order: [rows, n]."""
    rows, width = codes.shape
    order = torch.tensor(AWQ_PACK_ORDER, device=codes.device)
    by_word = codes.reshape(rows, width // len(AWQ_PACK_ORDER), len(AWQ_PACK_ORDER))
    columns = torch.empty_like(by_word)
    columns[:, :, order] = by_word
    return columns.reshape(rows, width)[:, :n]
