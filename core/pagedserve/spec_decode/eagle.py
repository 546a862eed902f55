"""EAGLE and EAGLE-3 draft heads: one decoder layer over the target's hidden states.

EAGLE (Li et al., 2024) feeds its layer fc([embedding of token i + 1; target hidden state at i])
and predicts the target's next hidden state, which the target's own LM head scores. Published
checkpoints hold `fc.weight` ([hidden, 2 * hidden], `fc.bias` in some), `layers.0.*` (a Llama
decoder layer without its input norm) and sometimes `embed_tokens.weight`; the embedding and the
LM head are otherwise the target's.

EAGLE-3 fuses three of the target's layers (low, middle, high: each layer's input residual
stream) through `fc` ([hidden, 3 * hidden]) and runs `midlayer`, whose attention reads
[input_layernorm(embedding); hidden_norm(state)] ([2 * hidden] wide); its own `norm` and
`lm_head` score a draft vocabulary of `draft_vocab_size` tokens, mapped to the target's by `d2t`
(draft id -> target id - draft id). `t2d` (target id -> in the draft vocabulary) is read but only
needed for training. After the first draft the head feeds itself its own pre-norm output, which
is `hidden` wide and so skips `fc`. The target layers it reads are the draft config's
`eagle_aux_hidden_state_layer_ids`, else (2, L // 2, L - 3) of an L-layer target.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from pagedserve.models.decoder import (
    DecoderForCausalLM,
    DecoderLayer,
    DecoderOptions,
    dense_mlp,
    head_size_of,
)
from pagedserve.models.layers import MergedLinear, RMSNorm, RotaryEmbedding, rope_frequencies
from pagedserve.models.spec import ModelSpec
from pagedserve.models.weights import iter_safetensors
from pagedserve.spec_decode.network import DraftNetwork

_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def aux_layer_ids(draft_config: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input an EAGLE-3 head fuses (low, middle, high). Pure."""
    ids = getattr(draft_config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None:
        n = num_target_layers
        ids = (min(2, n - 1), n // 2, max(n - 3, 0))
    ids = tuple(int(i) for i in ids)
    if any(not 0 <= i < num_target_layers for i in ids):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {ids} are not layers of the {num_target_layers}-layer target"
        )
    return ids


class _EagleBase(DraftNetwork):
    """What both heads share: the target's embedding (unless the checkpoint has one), one
    decoder layer, rotary embedding and the fc that fuses the target's states."""

    reads_target_hidden = True

    def __init__(self, config: Any, target: DecoderForCausalLM, fc_inputs: int, fc_bias: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        if hidden != target.spec.hidden_size:
            raise ValueError(
                f"speculative_config.model: the EAGLE head is {hidden} wide and the target "
                f"{target.spec.hidden_size}"
            )
        layer_config = copy.copy(config)
        layer_config.num_hidden_layers = 1
        options = DecoderOptions(False, False, False, False, (None,))
        self.layer = DecoderLayer(layer_config, 0, options, dense_mlp(layer_config, 0, options))
        self.fc = nn.Linear(fc_inputs * hidden, hidden, bias=fc_bias)
        self.rotary_emb = RotaryEmbedding(*rope_frequencies(config))
        self.target = [target]  # a list: the target's modules are not this head's parameters
        self.embed_tokens: nn.Embedding | None = None  # set when the checkpoint has its own
        self.hidden_size = hidden
        self.spec = ModelSpec(
            architecture=type(self).__name__,
            implementation="native",
            num_layers=1,
            num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_size=head_size_of(config),
            hidden_size=hidden,
            vocab_size=target.spec.vocab_size,
            dtype=target.spec.dtype,
            sliding_windows=(None,),
            logit_softcap=None,
            max_position_embeddings=getattr(config, "max_position_embeddings", None),
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self.target[0].model.embed_tokens
        return table(input_ids)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], renames: dict[str, str]) -> None:
        """Copy the checkpoint's tensors in (names after `renames`' prefixes). Raises ValueError
        for an unknown name, a wrong shape or a missing tensor. Mutates the parameters."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            for old, new in renames.items():
                if name.startswith(old):
                    name = new + name[len(old) :]
            if self._load_extra(name, tensor):
                loaded.add(name)
                continue
            if name == "embed_tokens.weight":
                self.embed_tokens = nn.Embedding(*tensor.shape).to(
                    self.fc.weight.device, self.fc.weight.dtype
                )
                self.embed_tokens.weight.data.copy_(tensor)
                continue
            owner, _, param = name.rpartition(".")
            parent, _, proj = owner.rpartition(".")
            if proj in _FUSED:
                fused = self.get_submodule(f"{parent}.{_FUSED[proj]}")
                assert isinstance(fused, MergedLinear)
                fused.load_shard(proj, param, tensor)
                loaded.add(f"{parent}.{_FUSED[proj]}.{param}:{proj}")
                continue
            if name not in params:
                raise ValueError(f"EAGLE checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"EAGLE checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(params[name].shape)}: the config does not match the weights"
                )
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        fused_keys = {
            f"{path}.{p}:{shard}"
            for path, module in self.named_modules()
            if isinstance(module, MergedLinear)
            for shard in module.shard_offsets
            for p in ("weight",)
        }
        plain = {n for n in params if not any(n == k.split(":")[0] for k in fused_keys)}
        missing = sorted((plain | fused_keys) - loaded - self._optional())
        if (
            isinstance(self, Eagle3Head)
            and self.draft_vocab_size != self.spec.vocab_size
            and not self.has_d2t
        ):
            missing.append("d2t")
        if missing:
            raise ValueError(f"EAGLE checkpoint is missing {len(missing)} tensors: {', '.join(missing[:8])}")

    def _load_extra(self, name: str, tensor: torch.Tensor) -> bool:
        return False

    def _optional(self) -> set[str]:
        return set()


class EagleHead(_EagleBase):
    """EAGLE: fc([embedding; target's last hidden state]) -> one layer -> the target's LM head."""

    def __init__(self, config: Any, target: DecoderForCausalLM) -> None:
        super().__init__(config, target, 2, bool(getattr(config, "bias", False)))
        self.layer.input_layernorm = nn.Identity()  # type: ignore[assignment]  # EAGLE's layer 0 has none

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert hidden is not None  # EAGLE always reads a state
        x = self.fc(torch.cat([self.embed(input_ids), hidden.to(self.fc.weight.dtype)], dim=-1))
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)
        q, k, v, residual = self.layer.attention_inputs(x, None, cos, sin)
        out, residual = self.layer.after_attention(self.layer.self_attn.attend(q, k, v), residual)
        state = out + residual
        return state, state

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target[0].compute_logits(hidden).argmax(dim=-1)


class Eagle3Head(_EagleBase):
    """EAGLE-3: three target layers fused by fc, a 2x-wide attention input, its own norm, LM head
    and draft vocabulary (`d2t`)."""

    def __init__(self, config: Any, target: DecoderForCausalLM) -> None:
        super().__init__(config, target, 3, False)
        hidden = config.hidden_size
        attn = self.layer.self_attn
        attn.qkv_proj = MergedLinear(
            2 * hidden, {"q_proj": attn.q_size, "k_proj": attn.kv_size, "v_proj": attn.kv_size}, bias=False
        )
        # The published layout keeps it in the layer: `midlayer.hidden_norm.weight`.
        self.layer.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        # draft id -> target id - draft id (the published `d2t`); zeros: the vocabularies agree
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.has_d2t = False  # set by `load`; a smaller draft vocabulary cannot do without it

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert hidden is not None
        hidden = hidden.to(self.fc.weight.dtype)
        residual = self.fc(hidden) if hidden.shape[-1] != self.hidden_size else hidden
        layer = self.layer
        x = torch.cat(
            [layer.input_layernorm(self.embed(input_ids)), cast(RMSNorm, layer.hidden_norm)(residual)], dim=-1
        )
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        out, residual = layer.after_attention(layer.self_attn.attend(q, k, v), residual)
        state = out + residual
        return self.norm(state), state

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        draft = self.lm_head(hidden).float().argmax(dim=-1)
        return draft + cast(torch.Tensor, self.d2t)[draft]

    def _load_extra(self, name: str, tensor: torch.Tensor) -> bool:
        if name == "d2t":
            if tuple(tensor.shape) != (self.draft_vocab_size,):
                raise ValueError(
                    f"EAGLE-3 d2t has shape {tuple(tensor.shape)}, expected ({self.draft_vocab_size},)"
                )
            cast(torch.Tensor, self.d2t).copy_(tensor.to(torch.int64))
            self.has_d2t = True
            return True
        return name == "t2d"  # target -> draft membership: a training-time map, not needed to draft


def load_eagle_head(
    directory: Path,
    config: Any,
    method: str,
    target: DecoderForCausalLM,
    device: torch.device,
    *,
    dummy: bool = False,  # build it without reading weights (the caller fills random ones)
) -> EagleHead | Eagle3Head:
    """The EAGLE (`method="eagle"`) or EAGLE-3 head in `directory` (safetensors, `config`), on
    `device` in the target's dtype, sharing the target's embedding (and, for EAGLE, its LM
    head). Raises ValueError for a checkpoint of another layout. Slow (reads weights)."""
    head: EagleHead | Eagle3Head = (
        Eagle3Head(config, target) if method == "eagle3" else EagleHead(config, target)
    )
    head.to(device=device, dtype=target.spec.dtype)  # floating tensors only: d2t stays int64
    head.rotary_emb.place(device)
    if not dummy:
        head.load(iter_safetensors(directory), {"midlayer.": "layer.", "layers.0.": "layer."})
    return head.eval()
