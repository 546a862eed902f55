"""`LoRAManager`: the adapters of one engine, their `max_loras` slots, and the per-step token slots.

Policy. Adapters are read (and checked against the model) when a request naming them arrives,
and kept in host memory by `lora_int_id`. A running request's adapter sits in one of `max_loras`
device slots; a new adapter takes a free slot or the least recently used one that no request in
the batch uses. The scheduler never runs requests of more than `max_loras` distinct adapters at
once (`Scheduler._schedule_waiting`): a request whose adapter would be one too many waits until
a slot frees up, so a slot is always found here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from pagedserve.lora.adapter import LoRAAdapter, load_adapter
from pagedserve.lora.layers import NO_SLOT, LoRALinear, LoRAMapping, SlotShape
from pagedserve.lora.reference import MASKED_LORA_KERNEL
from pagedserve.lora.request import LoRARequest
from pagedserve.models.decoder import DecoderForCausalLM, DecoderLayer
from pagedserve.models.layers import GatedMLP
from pagedserve.platforms.api import LoRAKernel


class LoRAManager:
    """Wraps the linear layers of `model` and fills their slots. Not thread-safe."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_loras: int,
        max_rank: int,
        max_tokens: int,
        kernel: LoRAKernel | None = None,  # the platform's; None: the core's torch formulation
    ) -> None:
        if not isinstance(model, DecoderForCausalLM):
            raise ValueError(
                f"enable_lora=True needs one of pagedserve's native decoders (Llama, Mistral, Qwen2, "
                f"Qwen3); {type(model).__name__} runs through the transformers fallback, which has no "
                "LoRA support: drop enable_lora"
            )
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.kernel = kernel or MASKED_LORA_KERNEL
        weight = model.model.embed_tokens.weight
        shape = SlotShape(max_loras, max_rank, weight.device, weight.dtype)
        self.mapping = LoRAMapping(max_loras, max_tokens, weight.device)
        op = self.kernel.op

        def wrap(owner: nn.Module, attr: str, in_features: int, shards: dict[str, int]) -> LoRALinear:
            """Replace `owner.attr` by a `LoRALinear` around it. Mutates `owner`."""
            layer = LoRALinear(getattr(owner, attr), in_features, shards, shape, self.mapping, op)
            setattr(owner, attr, layer)
            return layer

        # layer index -> checkpoint projection -> the wrapped layer holding it
        self.targets: list[dict[str, LoRALinear]] = []
        for layer in cast("Iterable[DecoderLayer]", model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(mlp, GatedMLP):
                raise ValueError(
                    f"LoRA adapters on {type(mlp).__name__} feed-forward layers (mixtures of experts) are "
                    "not supported; serve this model with enable_lora=False"
                )
            hidden = attn.qkv_proj.in_features
            q, kv = attn.q_size, attn.kv_size
            qkv = wrap(attn, "qkv_proj", hidden, {"q_proj": q, "k_proj": kv, "v_proj": kv})
            o = wrap(attn, "o_proj", q, {"o_proj": hidden})
            inter = mlp.intermediate_size
            gate_up = wrap(mlp, "gate_up_proj", hidden, {"gate_proj": inter, "up_proj": inter})
            down = wrap(mlp, "down_proj", inter, {"down_proj": hidden})
            # The fused platform operators read the base weights directly and would skip the
            # deltas: LoRA runs the plain gate/up, activation, down path.
            mlp.silu_gate = mlp.gated_down = None
            self.targets.append(
                {"q_proj": qkv, "k_proj": qkv, "v_proj": qkv, "o_proj": o, "gate_proj": gate_up}
                | {"up_proj": gate_up, "down_proj": down}
            )
        self._adapters: dict[int, tuple[LoRARequest, LoRAAdapter]] = {}  # lora_int_id -> loaded
        self._slot_ids: list[int | None] = [None] * max_loras  # slot -> lora_int_id
        self._slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self._last_use: list[int] = [0] * max_loras
        self._clock = itertools.count(1)

    # ---- adapters ------------------------------------------------------------------------------
    def check(self, request: LoRARequest) -> None:
        """Read `request`'s adapter (once per lora_int_id) and check it fits this model. Raises
        ValueError naming the problem; a lora_int_id already used for another path is refused."""
        known = self._adapters.get(request.lora_int_id)
        if known is not None:
            if known[0].lora_path != request.lora_path:
                raise ValueError(
                    f"lora_int_id={request.lora_int_id} already names adapter {known[0].lora_path!r}, "
                    f"not {request.lora_path!r}: give each adapter its own lora_int_id"
                )
            return
        adapter = load_adapter(request.lora_path, self.max_rank)
        for (layer, proj), pair in adapter.weights.items():
            if layer >= len(self.targets):
                raise ValueError(
                    f"LoRA adapter {request.lora_path}: it has weights for layer {layer}, the model only "
                    f"{len(self.targets)} layers: it was trained for another model"
                )
            target = self.targets[layer][proj]
            expected = (target.shards[proj], target.in_features)
            if (pair.b.shape[0], pair.a.shape[1]) != expected:
                raise ValueError(
                    f"LoRA adapter {request.lora_path}: layer {layer} {proj} maps {pair.a.shape[1]} -> "
                    f"{pair.b.shape[0]} features, the model's {expected[1]} -> {expected[0]}: it was "
                    "trained for another model"
                )
        self._adapters[request.lora_int_id] = (request, adapter)

    def acquire(self, request: LoRARequest, in_use: Iterable[int]) -> int:
        """The slot holding `request`'s adapter, loading it into a free slot or the least recently
        used one no adapter of `in_use` (lora_int_ids of the batch's rows) holds. Raises
        RuntimeError when every slot is in use (the scheduler prevents it). Mutates the slots."""
        self.check(request)
        lora_id = request.lora_int_id
        slot = self._slot_of.get(lora_id)
        if slot is None:
            busy = set(in_use)
            free = [s for s, held in enumerate(self._slot_ids) if held is None or held not in busy]
            if not free:
                raise RuntimeError(
                    f"all {self.max_loras} LoRA slots are used by running requests; the scheduler "
                    "should have held this request back"
                )
            slot = min(free, key=self._last_use.__getitem__)
            evicted = self._slot_ids[slot]
            if evicted is not None:
                del self._slot_of[evicted]
            self._load(slot, self._adapters[lora_id][1])
            self._slot_ids[slot] = lora_id
            self._slot_of[lora_id] = slot
        self._last_use[slot] = next(self._clock)
        return slot

    def slot_of(self, lora_int_id: int) -> int:
        """The slot of a loaded adapter; NO_SLOT for 0 (no adapter). Pure."""
        return NO_SLOT if lora_int_id == 0 else self._slot_of[lora_int_id]

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer, targets in enumerate(self.targets):
            pieces: dict[LoRALinear, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
            for proj, target in targets.items():
                pair = adapter.weights.get((layer, proj))
                entry = pieces.setdefault(target, {})
                if pair is not None:
                    entry[proj] = (pair.a, adapter.scaling * pair.b)
            for target, shard_pieces in pieces.items():
                target.set_slot(slot, shard_pieces)
