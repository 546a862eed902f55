"""The residual stream entering chosen layers of the target, recorded during its forward (for
EAGLE-3, which fuses a low, a middle and a high layer's).

`TappedTarget` is the target model as the model runner sees it: the same forward, logits and
spec, run through `DecoderModel.forward_with` with regions that keep each chosen layer's input
(its `attention_inputs`' residual, which is exactly what enters that layer). Nothing about the
model changes, so a runner with a tapped target gives the same tokens."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.models.decoder import EAGER_REGIONS, DecoderForCausalLM, DecoderLayer, DecoderRegions
from pagedserve.models.spec import PagedCausalLM, RegionCompiler


class TappedTarget(PagedCausalLM):
    """The target, keeping the inputs of `layer_ids` of its latest forward (`latest()`)."""

    def __init__(self, target: DecoderForCausalLM, layer_ids: tuple[int, ...]) -> None:
        super().__init__()
        self.target = target
        self.spec = target.spec
        self.layer_ids = layer_ids
        # layer (by identity) -> the slots its input fills; a layer may be chosen twice (small targets)
        self._slot_of: dict[int, list[int]] = {}
        for n, i in enumerate(layer_ids):
            self._slot_of.setdefault(id(target.model.layers[i]), []).append(n)
        self._seen: list[torch.Tensor | None] = [None] * len(layer_ids)

    def _tap(self, attention_inputs: Callable[..., Any]) -> Callable[..., Any]:
        def tapped(layer: DecoderLayer, *args: Any) -> Any:
            q, k, v, residual = attention_inputs(layer, *args)
            for slot in self._slot_of.get(id(layer), ()):
                self._seen[slot] = residual
            return q, k, v, residual

        return tapped

    def _regions(self, base: DecoderRegions) -> DecoderRegions:
        return DecoderRegions(
            base.embed, self._tap(base.attention_inputs), base.after_attention, base.final_norm
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.target.model.forward_with(self._regions(EAGER_REGIONS), input_ids, positions)

    def regional_forward(
        self, compile_region: RegionCompiler
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return functools.partial(
            self.target.model.forward_with, self._regions(EAGER_REGIONS.map(compile_region))
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden_states)

    def latest(self) -> torch.Tensor:
        """[num_tokens, len(layer_ids) * hidden] the chosen layers' inputs of the latest forward,
        side by side in `layer_ids` order. Raises RuntimeError before any forward. Pure."""
        seen = self._seen
        if any(s is None for s in seen):
            raise RuntimeError("the tapped target has not run a forward yet")
        return torch.cat([s for s in seen if s is not None], dim=-1)
