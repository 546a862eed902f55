"""Serve any decoder-only transformers model on pagedserve's paged attention.

transformers models call attention through `AttentionInterface`: each attention module computes
q/k/v (rotary included) and hands them to the function registered under the config's
`_attn_implementation`. We register `"pagedserve"`, which routes them into `paged_attention`, and
run the transformers decoder on the whole flattened batch as one row of `[1, num_tokens]` with
`position_ids` carrying each token's position inside its own request. Masks are never built:
transformers skips mask creation for attention functions it has no mask function for, and the
paged backend derives causality and windows from the attention metadata.

What a fallback model looks like to the KV cache (layers, heads, windows, softcap) is read from
the model itself by a one-token probe forward, so the spec cannot disagree with what the model
will actually ask of the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.attention.layer import paged_attention
from pagedserve.models.decoder import layer_sliding_windows
from pagedserve.models.spec import ModelSpec, PagedCausalLM
from pagedserve.platforms.api import AttentionBackend, AttentionCapabilities, CacheOps, KVCacheScales
from pagedserve.platforms.attention_metadata import AttentionMetadata

ATTN_IMPLEMENTATION = "pagedserve"


def _transformers_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_q_heads, num_tokens, head_size]
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_size]
    value: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_size]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # ([1, num_tokens, num_q_heads, head_size], no weights)
    """The `AttentionInterface` entry transformers calls. Mutates the layer's KV cache."""
    if query.shape[0] != 1:
        raise RuntimeError(
            "pagedserve attention got a batch of "
            f"{query.shape[0]} rows: the fallback runs the flattened batch as one row"
        )
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{type(module).__name__} uses attention sinks, which pagedserve does not support")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__} is not causal; pagedserve serves decoder-only models")
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int):
        raise ValueError(
            f"{type(module).__name__} has no integer `layer_idx`, so its KV cache cannot be found"
        )
    # The backend and cache ops take [num_tokens, heads, head_size] with heads contiguous.
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    out = paged_attention(
        layer_idx,
        q,
        k,
        v,
        scale=scaling if scaling is not None else q.shape[-1] ** -0.5,
        sliding_window=sliding_window,
        logit_softcap=softcap,
    )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _transformers_attention)


def check_fallback_supported(config: Any) -> None:
    """Raise `ValueError` saying why transformers cannot serve `config` through pagedserve."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"model_type={model_type!r} is an encoder-decoder; pagedserve serves decoder-only models"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"model_type={model_type!r} has no native pagedserve implementation and transformers "
            "has no causal-LM class for it; it cannot be served"
        )
    cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(
            f"transformers' {cls.__name__} does not route attention through AttentionInterface, "
            "so pagedserve's paged attention cannot be plugged into it"
        )
    layer_sliding_windows(config)  # raises for recurrent / linear-attention layers


@dataclass(frozen=True, slots=True)
class _LayerCall:
    """What one attention layer asked of the backend during the probe forward."""

    layer_idx: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    sliding_window: int | None
    logit_softcap: float | None


def _layer_of(probe_cache: torch.Tensor) -> int:
    """Each probe "cache" is a 1-element tensor holding its own layer index."""
    return int(probe_cache.reshape(-1)[0])


class _Probe(AttentionBackend, CacheOps):
    """Backend and cache ops for the probe forward: records what each layer asks for, stores
    nothing, and returns zeros (the probe's output is thrown away)."""

    name: ClassVar[str] = "fallback-probe"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        head_sizes=frozenset(), dtypes=frozenset(), block_sizes=frozenset()
    )

    def __init__(self) -> None:
        self.kv_heads: dict[int, int] = {}  # layer_idx -> num_kv_heads of the written keys
        self.calls: list[_LayerCall] = []  # in call order

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVCacheScales | None = None,
    ) -> None:
        """Records the key's head count (mutates `self.kv_heads`, never the cache)."""
        self.kv_heads[_layer_of(kv_cache)] = key.shape[1]

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: torch.Tensor | None = None,
        kv_scales: KVCacheScales | None = None,
        new_key: torch.Tensor | None = None,
        new_value: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,  # never passed: attention_sinks is not declared
    ) -> torch.Tensor:
        """Appends to `self.calls`; returns zeros shaped like `query`."""
        layer_idx = _layer_of(kv_cache)
        self.calls.append(
            _LayerCall(
                layer_idx=layer_idx,
                num_q_heads=query.shape[1],
                num_kv_heads=self.kv_heads[layer_idx],
                head_size=query.shape[2],
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        )
        return torch.zeros_like(query) if out is None else out.zero_()

    def copy_blocks(self, kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
        raise RuntimeError("the fallback probe never copies blocks")

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
        raise RuntimeError("the fallback probe never swaps blocks")


def _probe_layers(hf_model: PreTrainedModel, num_layers: int, device: torch.device) -> list[_LayerCall]:
    """Run one token through `hf_model` and return what each attention layer asked for.
    Does not mutate the model."""
    probe = _Probe()
    metadata = AttentionMetadata.build([1], [1], torch.zeros((1, 1), dtype=torch.int32), 1, device)
    caches = [torch.full((1,), i, dtype=torch.int64, device=device) for i in range(num_layers)]
    ids = torch.zeros((1, 1), dtype=torch.int64, device=device)
    with torch.no_grad(), forward_context(ForwardContext(metadata, caches, probe, probe)):
        hf_model.base_model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)
    return probe.calls


def _spec_from_probe(hf_model: PreTrainedModel, dtype: torch.dtype, device: torch.device) -> ModelSpec:
    config = hf_model.config
    num_layers = int(config.num_hidden_layers)
    calls = _probe_layers(hf_model, num_layers, device)
    if sorted(c.layer_idx for c in calls) != list(range(num_layers)):
        raise ValueError(
            f"{type(hf_model).__name__}: attention was called for layers {[c.layer_idx for c in calls]}, "
            f"expected each of 0..{num_layers - 1} once; hybrid or shared-cache models are not supported"
        )
    for what in ("num_q_heads", "num_kv_heads", "head_size", "logit_softcap"):
        values = {getattr(c, what) for c in calls}
        if len(values) != 1:
            raise ValueError(
                f"{type(hf_model).__name__}: layers differ in {what} ({sorted(map(str, values))}); "
                "pagedserve needs one KV-cache geometry for all layers"
            )
    first = min(calls, key=lambda c: c.layer_idx)
    by_layer = {c.layer_idx: c for c in calls}
    return ModelSpec(
        architecture=type(hf_model).__name__,
        implementation="transformers",
        num_layers=num_layers,
        num_q_heads=first.num_q_heads,
        num_kv_heads=first.num_kv_heads,
        head_size=first.head_size,
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        dtype=dtype,
        sliding_windows=tuple(by_layer[i].sliding_window for i in range(num_layers)),
        logit_softcap=first.logit_softcap,
        max_position_embeddings=getattr(config, "max_position_embeddings", None),
    )


class TransformersCausalLM(PagedCausalLM):
    """A transformers causal LM whose attention runs on pagedserve's paged KV cache."""

    def __init__(self, hf_model: PreTrainedModel, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if hf_model.get_output_embeddings() is None:
            raise ValueError(f"{type(hf_model).__name__} has no output embedding (lm_head) for logits")
        self.hf_model = hf_model.eval()
        self.spec = _spec_from_probe(hf_model, dtype, device)
        config = hf_model.config
        # Post-head logit transforms some architectures apply inside their own forward.
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)  # Gemma 2
        self.logit_multiplier = float(getattr(config, "logit_scale", 1.0) or 1.0)  # Cohere
        self.logit_divisor = float(getattr(config, "logits_scaling", 1.0) or 1.0)  # Granite

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden_size]. Mutates the KV caches."""
        out = self.hf_model.base_model(
            input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False
        )
        hidden: torch.Tensor = out.last_hidden_state[0]
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_selected, hidden_size] -> [num_selected, vocab_size] float32. Does not mutate."""
        head = self.hf_model.get_output_embeddings()
        logits: torch.Tensor = head(hidden_states)
        if self.logit_multiplier != 1.0:
            logits = logits * self.logit_multiplier
        if self.logit_divisor != 1.0:
            logits = logits / self.logit_divisor
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits.float()


def build_fallback_model(
    config: Any,
    *,
    directory: Path,
    gguf_file: str | None,
    load_weights: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> TransformersCausalLM:
    """Build the transformers model for `config`, with checkpoint weights from `directory` (and
    `gguf_file`) when `load_weights`, or with transformers' random init otherwise."""
    check_fallback_supported(config)
    hf_model: Any
    if load_weights:
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(directory), gguf_file=gguf_file, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype
        )
        hf_model = hf_model.to(device)
    else:
        with torch.device(device):
            hf_model = AutoModelForCausalLM.from_config(
                config, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype
            )
    return TransformersCausalLM(hf_model, dtype, device)
