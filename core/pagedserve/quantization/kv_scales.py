"""The FP8 KV-cache scales a quantized checkpoint stores (compressed-tensors `kv_cache_scheme`).

llm-compressor calibrates one scale for the keys and one for the values of each attention layer
(amax / 448 over its calibration data) and writes them as `self_attn.k_scale` and
`self_attn.v_scale` (older versions: `self_attn.k_proj.output_scale`, `v_proj.output_scale`). They
mean what `KVCacheScales` means: a stored key `s` is `s * k_scale`. Each attention layer gets a
`CheckpointKVScales` part that reads them (the names are renamed onto it), and an engine with an
FP8 cache (`kv_cache_dtype="fp8"`) quantizes and reads each layer's cache with its scales instead
of the default 1.0; with a cache in the model's dtype they are read and not used.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from pagedserve.platforms.api import KVCacheScales
from pagedserve.platforms.kv_cache_dtype import DEFAULT_KV_SCALES

logger = logging.getLogger(__name__)

# The checkpoint's names -> the part's, as fragments of `DecoderForCausalLM.checkpoint_renames`.
RENAMES = (
    (".self_attn.k_scale", ".self_attn.kv_cache_scales.k_scale"),
    (".self_attn.v_scale", ".self_attn.kv_cache_scales.v_scale"),
    (".self_attn.k_proj.output_scale", ".self_attn.kv_cache_scales.k_scale"),
    (".self_attn.v_proj.output_scale", ".self_attn.kv_cache_scales.v_scale"),
)
_FIELDS = ("k_scale", "v_scale")


class CheckpointKVScales(nn.Module):
    """One attention layer's stored KV-cache scales (a `models.decoder.CheckpointPart`)."""

    k_scale: torch.Tensor  # [1] float32
    v_scale: torch.Tensor  # [1] float32

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32, device=device))
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32, device=device))

    @torch.no_grad()
    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str | None:
        """Read "k_scale" or "v_scale"; returns the key filled, None for other names. Raises
        `ValueError` for a scale that is not one positive finite number."""
        if name not in _FIELDS:
            return None
        value = float(tensor.reshape(-1)[0]) if tensor.numel() == 1 else math.nan
        if not (math.isfinite(value) and value > 0):
            shown = tensor.flatten()[:4].tolist()
            raise ValueError(
                f"checkpoint KV-cache scale {name} has {tensor.numel()} values {shown}: one positive, "
                "finite scale per tensor is read"
            )
        getattr(self, name).fill_(value)
        return name

    def missing_checkpoint_keys(self, loaded: set[str]) -> list[str]:
        """Both scales, once each. Pure."""
        return [field for field in _FIELDS if field not in loaded]

    def scales(self) -> KVCacheScales:
        """The scales as the attention layers take them (a host copy)."""
        return KVCacheScales(float(self.k_scale), float(self.v_scale))


def place_kv_scale_readers(model: Any) -> int:
    """Give every attention layer of the native decoder `model` a `CheckpointKVScales` and point
    the checkpoint's scale names at it; returns the layers. Mutates `model`."""
    layers = list(model.model.layers)
    device = model.model.embed_tokens.weight.device
    for layer in layers:
        layer.self_attn.kv_cache_scales = CheckpointKVScales(device)
    model.checkpoint_renames = (*type(model).checkpoint_renames, *RENAMES)
    return len(layers)


def checkpoint_kv_scales(model: nn.Module) -> list[KVCacheScales] | None:
    """Each layer's stored KV-cache scales (layer order), or None when the checkpoint has none.
    Pure."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return None
    parts = [getattr(layer.self_attn, "kv_cache_scales", None) for layer in layers]
    found = [p for p in parts if isinstance(p, CheckpointKVScales)]
    if not found or len(found) != len(parts):
        return None
    return [p.scales() for p in found]


def kv_scales_for_cache(model: nn.Module, num_layers: int, fp8_cache: bool) -> list[KVCacheScales] | None:
    """The scales an engine's cache runs with: None for a cache in the model's dtype; for an FP8
    cache the checkpoint's, or `DEFAULT_KV_SCALES` (1.0) for every layer. Logs which."""
    stored = checkpoint_kv_scales(model)
    if not fp8_cache:
        if stored is not None:
            logger.info(
                "the checkpoint stores FP8 KV-cache scales; they apply to an FP8 cache "
                "(kv_cache_dtype='fp8'), not to this one in the model's dtype"
            )
        return None
    if stored is not None:
        logger.info("FP8 KV cache with the checkpoint's scales (%d layers)", len(stored))
        return stored
    return [DEFAULT_KV_SCALES] * num_layers
