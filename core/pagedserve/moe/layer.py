"""`SparseMoE`: a mixture-of-experts feed-forward block, declared by its sizes and routing, run by
the platform's fused MoE op (`MoEKernel`).

The block holds its experts stacked (`w13` [E, 2I, H] with each expert's gate rows above its up
rows, `w2` [E, H, I]), the layout every `MoEKernel` takes, so a step passes the tensors as they
are. Checkpoints store one matrix per expert and projection (`experts.{e}.gate_proj.weight`, or
Mixtral's `w1`/`w3`/`w2`); `load_checkpoint_tensor` writes each into its slice, and also takes
the stacked layout transformers keeps in memory (`experts.gate_up_proj`, `experts.down_proj`).

gpt-oss stores its experts stacked and transposed, gate and up interleaved column by column
(`experts.gate_up_proj` [E, H, 2I], `experts.down_proj` [E, I, H], with biases), bfloat16 or
MXFP4 (`*_blocks` / `*_scales`, dequantized here); `ExpertNames.layout` says which a checkpoint
uses.

Under tensor parallelism (`shard`) every rank holds a slice of each expert's intermediate
dimension (and of the shared expert's): its partial sums of the routed and shared experts are
added up over the ranks with one all-reduce per layer. Per-expert tensors arrive already sliced
(`distributed.sharding` reads only the rank's rows); stacked ones arrive whole, one layer at a
time, and the block keeps its slice.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

from pagedserve.distributed.group import TensorParallelGroup
from pagedserve.models.fp8 import quantize_rows
from pagedserve.models.layers import GatedMLP
from pagedserve.models.mxfp4 import dequantize_mxfp4
from pagedserve.moe.reference import REFERENCE_MOE_KERNEL
from pagedserve.platforms.api import ExpertWeights, MoEKernel, MoERouting


class RouterLinear(nn.Linear):
    """The router's [E, H] projection. A class of its own so that weight quantization and
    platform GEMM routing leave it alone: its logits choose the experts, and it is a few
    hundredths of the layer's bytes."""


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """What a checkpoint calls each expert's three projections (`experts.{e}.NAME.weight`)."""

    gate: str  # rows [0, I) of w13
    up: str  # rows [I, 2I) of w13
    down: str  # w2
    # "per_expert": `experts.{e}.NAME.weight` (or transformers' stacked [E, 2I, H] / [E, H, I]);
    # "gpt_oss": stacked, transposed, gate/up interleaved, with biases, bfloat16 or MXFP4.
    layout: Literal["per_expert", "gpt_oss"] = "per_expert"


QWEN_EXPERT_NAMES = ExpertNames(gate="gate_proj", up="up_proj", down="down_proj")
MIXTRAL_EXPERT_NAMES = ExpertNames(gate="w1", up="w3", down="w2")
GPT_OSS_EXPERT_NAMES = ExpertNames(gate="gate_up_proj", up="gate_up_proj", down="down_proj", layout="gpt_oss")

_PER_EXPERT = re.compile(r"experts\.(\d+)\.(\w+)\.(weight|bias)")
_PER_EXPERT_ANY = re.compile(r"experts\.(\d+)\.(\w+)\.(\w+)")


class QuantizedExpertReader(Protocol):
    """What reads one expert projection's quantized checkpoint tensors (`IntWeightLinear` does)."""

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str | None: ...

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor: ...


# (in_features, out rows, the checkpoint's name of the projection) -> a fresh reader
ExpertReaderFactory = Callable[[int, int, str], QuantizedExpertReader]


class SparseMoE(nn.Module):
    """out = sum over the token's top-k experts of weight * expert(x), plus an optional shared
    expert scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,  # of one expert
        routing: MoERouting,
        names: ExpertNames,
        *,
        shared_expert: GatedMLP | None = None,
        shared_expert_gate: bool = False,
        router_bias: bool = False,
        expert_bias: bool = False,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size  # this rank's share under tensor parallelism
        self.routing = routing
        self.names = names
        self.gate = RouterLinear(hidden_size, num_experts, bias=router_bias)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if expert_bias else None
        self.tp_rank, self.tp_world_size = 0, 1  # set by `shard`
        # MXFP4 blocks or scales waiting for their other half: checkpoint name stem -> tensor.
        self._pending_mxfp4: dict[str, torch.Tensor] = {}
        # Set by `quantize_fp8`: per-output-channel scales of FP8 `w13` / `w2`.
        self.w13_scale: torch.Tensor | None = None  # [E, 2I] float32
        self.w2_scale: torch.Tensor | None = None  # [E, H] float32
        self.shared_expert = shared_expert
        self.shared_expert_gate = RouterLinear(hidden_size, 1, bias=False) if shared_expert_gate else None
        self.kernel: MoEKernel = REFERENCE_MOE_KERNEL  # the platform's, set by `route_moe_layers`
        # Set by `quantization.apply.place_quantized_layers` when the checkpoint's experts hold
        # integer codes: each projection is read by its own reader and written dequantized.
        self.expert_reader: ExpertReaderFactory | None = None
        self._readers: dict[tuple[int, str], QuantizedExpertReader] = {}  # (expert, projection)
        self.group: TensorParallelGroup | None = None  # set by `shard`: sums the ranks' partials

    def experts(self) -> ExpertWeights:
        """The stacked expert tensors as the `MoEKernel` contract takes them. Pure."""
        return ExpertWeights(self.w13, self.w2, self.w13_scale, self.w2_scale, self.w13_bias, self.w2_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden]. Does not mutate `x`."""
        rows = x.reshape(-1, self.hidden_size)
        logits = self.gate(rows)
        if not self.kernel.logits_in_model_dtype:
            logits = logits.float()
        out = self.kernel.op(rows, logits, self.experts(), self.routing)
        if self.shared_expert is not None:
            shared = self.shared_expert(rows)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(rows)) * shared
            out = out + shared
        if self.group is not None:
            # One sum over the ranks for the routed and shared experts together: each rank's
            # part is linear in its slice of the intermediate dimension.
            out = self.group.all_reduce(out)
        return out.reshape(x.shape)

    @torch.no_grad()
    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str | None:
        """Write checkpoint tensor `name` (relative to this block) into the stacked experts and
        return the key it fills, or None when it is not an expert tensor (the router and the
        shared expert load as ordinary parameters). Raises `ValueError` for a shape that does not
        fit. Mutates the expert parameters."""
        if self.names.layout == "gpt_oss":
            return self._load_gpt_oss(name, tensor)
        if self.expert_reader is not None:
            quantized = _PER_EXPERT_ANY.fullmatch(name)
            if quantized is not None and quantized.group(3) != "bias":
                return self._load_quantized(
                    int(quantized.group(1)), quantized.group(2), quantized.group(3), tensor
                )
        match = _PER_EXPERT.fullmatch(name)
        if match is not None:
            return self._load_expert(int(match.group(1)), match.group(2), match.group(3), tensor, name)
        if name == "experts.gate_up_proj":  # transformers' in-memory stacked layout [E, 2I, H]
            gate, up = self._local(tensor, 1, halves=True)
            self._copy(self.w13, torch.cat((gate, up), dim=1), "w13:all", name)
            return "w13:all"
        if name == "experts.down_proj":  # [E, H, I]
            return self._copy(self.w2, self._local(tensor, 2)[0], "w2:all", name)
        return None

    def _load_expert(self, expert: int, proj: str, kind: str, tensor: torch.Tensor, name: str) -> str:
        """A dense `experts.{expert}.{proj}.{kind}` into its slice of `w13` / `w2`."""
        if kind == "bias" or expert >= self.num_experts:
            raise ValueError(f"checkpoint tensor experts.{expert}.{proj}.{kind} has no place in this model")
        inter = self.intermediate_size
        if proj == self.names.gate:
            return self._copy(self.w13[expert, :inter], tensor, f"w13:{expert}:gate", name)
        if proj == self.names.up:
            return self._copy(self.w13[expert, inter:], tensor, f"w13:{expert}:up", name)
        if proj == self.names.down:
            return self._copy(self.w2[expert], tensor, f"w2:{expert}", name)
        raise ValueError(f"checkpoint tensor {name!r}: experts have no projection {proj!r}")

    def _load_quantized(self, expert: int, proj: str, field: str, tensor: torch.Tensor) -> str:
        """One quantized tensor of expert `expert`'s projection `proj`; once the projection's
        tensors are all here, its weight dequantized to the experts' dtype is written like a dense
        one. Returns the key filled."""
        assert self.expert_reader is not None
        where = f"experts.{expert}.{proj}"
        if expert >= self.num_experts or proj not in (self.names.gate, self.names.up, self.names.down):
            raise ValueError(f"checkpoint tensor {where}.{field} has no place in this model")
        reader = self._readers.get((expert, proj))
        if reader is None:
            down = proj == self.names.down
            in_features = self.intermediate_size if down else self.hidden_size
            rows = self.hidden_size if down else self.intermediate_size
            reader = self._readers[(expert, proj)] = self.expert_reader(in_features, rows, where)
        key = reader.load_checkpoint_tensor(field, tensor)
        if key != "weight":
            return f"{where}:{key}"
        del self._readers[(expert, proj)]
        return self._load_expert(
            expert, proj, "weight", reader.dequantized(self.w13.dtype), f"{where}.weight"
        )

    def _load_gpt_oss(self, name: str, tensor: torch.Tensor) -> str | None:
        """gpt-oss's stacked experts: [E, H, 2I] gate/up interleaved along the last dimension,
        [E, I, H] down, their biases, or the MXFP4 blocks and scales of the two matrices (rows
        are output channels there: [E, 2I, H] interleaved by row, and [E, H, I])."""
        stem, _, suffix = name.rpartition("_")
        if suffix in ("blocks", "scales") and stem in ("experts.gate_up_proj", "experts.down_proj"):
            other = self._pending_mxfp4.pop(f"{stem}_{'scales' if suffix == 'blocks' else 'blocks'}", None)
            if other is None:
                self._pending_mxfp4[name] = tensor
                return f"{stem}:{suffix}"  # the key of this half; the matrix follows with its other half
            blocks, scales = (tensor, other) if suffix == "blocks" else (other, tensor)
            matrix = dequantize_mxfp4(blocks, scales, self.w13.dtype)
            if stem == "experts.gate_up_proj":  # [E, 2I, H], gate and up rows interleaved
                self._write_w13(matrix[:, 0::2], matrix[:, 1::2], name)
                return "w13:all"
            return self._copy(self.w2, self._local(matrix, 2)[0], "w2:all", name)
        if name == "experts.gate_up_proj":  # [E, H, 2I]
            self._write_w13(tensor[:, :, 0::2].transpose(1, 2), tensor[:, :, 1::2].transpose(1, 2), name)
            return "w13:all"
        if name == "experts.down_proj":  # [E, I, H]
            return self._copy(self.w2, self._local(tensor.transpose(1, 2), 2)[0], "w2:all", name)
        if name == "experts.gate_up_proj_bias" and self.w13_bias is not None:  # [E, 2I] interleaved
            gate, up = self._local(tensor[:, 0::2], 1)[0], self._local(tensor[:, 1::2], 1)[0]
            return self._copy(self.w13_bias, torch.cat((gate, up), dim=1), "w13_bias:all", name)
        if name == "experts.down_proj_bias" and self.w2_bias is not None:  # [E, H]
            # The ranks' outputs are summed: the bias joins on one rank only.
            return self._copy(
                self.w2_bias, tensor if self.tp_rank == 0 else torch.zeros_like(tensor), "w2_bias:all", name
            )
        return None

    def _write_w13(self, gate: torch.Tensor, up: torch.Tensor, name: str) -> None:
        """Whole gate and up matrices [E, I, H] into this rank's w13. Mutates `w13`."""
        gate, up = self._local(gate, 1)[0], self._local(up, 1)[0]
        self._copy(self.w13, torch.cat((gate, up), dim=1), "w13:all", name)

    def _local(self, tensor: torch.Tensor, dim: int, *, halves: bool = False) -> tuple[torch.Tensor, ...]:
        """This rank's slice of a whole tensor along the intermediate dimension `dim` (of each
        half, for a stacked [gate | up]). Pure."""
        parts = tensor.chunk(2, dim=dim) if halves else (tensor,)
        out = []
        for part in parts:
            local = part.shape[dim] // self.tp_world_size
            out.append(part.narrow(dim, self.tp_rank * local, local))
        return tuple(out)

    def missing_checkpoint_keys(self, loaded: set[str]) -> list[str]:
        """The expert keys `load_checkpoint_tensor` has not returned yet (of those in `loaded`);
        a stacked tensor fills every expert's. Pure."""
        if self.names.layout == "gpt_oss":
            wanted = ["w13:all", "w2:all"]
            if self.w13_bias is not None:
                wanted += ["w13_bias:all", "w2_bias:all"]
            return [key for key in wanted if key not in loaded]
        missing = []
        for e in range(self.num_experts):
            if "w13:all" not in loaded:
                missing += [k for k in (f"w13:{e}:gate", f"w13:{e}:up") if k not in loaded]
            if "w2:all" not in loaded and f"w2:{e}" not in loaded:
                missing.append(f"w2:{e}")
        return missing

    @staticmethod
    def _copy(target: torch.Tensor, tensor: torch.Tensor, key: str, name: str) -> str:
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(target.shape)}: the config does not match the weights"
            )
        target.copy_(tensor)
        return key

    def shard(self, rank: int, world_size: int, group: TensorParallelGroup) -> None:
        """Give a meta-built block rank `rank`'s shapes: 1/world_size of every expert's (and the
        shared expert's) intermediate dimension, the router replicated. Mutates this block."""
        inter = self.intermediate_size // world_size
        self.intermediate_size = inter
        self.tp_rank, self.tp_world_size = rank, world_size
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * inter, self.hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, inter))
        if self.w13_bias is not None:
            self.w13_bias = nn.Parameter(torch.empty(self.num_experts, 2 * inter))
        if self.shared_expert is not None:
            shared = self.shared_expert
            shared_inter = shared.intermediate_size // world_size
            self.shared_expert = GatedMLP(self.hidden_size, shared_inter, shared.hidden_act, bias=False)
        self.group = group

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Make the experts FP8 (`float8_e4m3fn`) with one float32 scale per expert and output
        channel, the format of the decoder's FP8 linear layers. Mutates `w13` / `w2`."""
        for attr in ("w13", "w2"):
            weight = getattr(self, attr)
            codes, scales = quantize_rows(weight.data.reshape(-1, weight.shape[-1]))
            setattr(self, attr, nn.Parameter(codes.reshape(weight.shape), requires_grad=False))
            setattr(self, f"{attr}_scale", scales.reshape(weight.shape[:-1]))


def route_moe_layers(model: nn.Module, kernel: MoEKernel | None) -> tuple[int, str]:
    """Run every `SparseMoE` in `model` on `kernel` where it computes the block (its activation,
    its weight dtype), else on the core's torch formulation. Returns how many blocks took the
    platform's kernel and the name of what runs the others ("" when none). Mutates the blocks."""
    routed, fallback = 0, ""
    for module in model.modules():
        if not isinstance(module, SparseMoE):
            continue
        takes = (
            kernel is not None
            and module.routing.activation in kernel.activations
            and (module.w13.dtype == module.gate.weight.dtype or module.w13.dtype in kernel.weight_dtypes)
        )
        if takes:
            assert kernel is not None
            module.kernel = kernel
            routed += 1
        else:
            module.kernel = REFERENCE_MOE_KERNEL
            fallback = REFERENCE_MOE_KERNEL.name
    return routed, fallback
