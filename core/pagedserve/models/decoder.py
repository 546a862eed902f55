"""The Llama-style decoder shared by the native models (Llama, Mistral, Qwen2, Qwen3).

These architectures differ only in a handful of switches: biases on the q/k/v projections
(Qwen2), per-head RMSNorm on queries and keys (Qwen3), and which layers use a sliding window
(Mistral, Qwen2/3 with `use_sliding_window`). `DecoderOptions` holds the switches; each
architecture's file derives them from its transformers config, so the numerics live once, here.

Parameter names follow the transformers checkpoints except for the two fusions (`qkv_proj`,
`gate_up_proj`), which `load_weights` fills from the separate checkpoint tensors.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.attention.layer import PagedAttention
from pagedserve.distributed.layers import VocabParallelLogits
from pagedserve.models.fp8 import Fp8Linear, scaled_linear
from pagedserve.models.layers import (
    GatedMLP,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    rope_frequencies,
)
from pagedserve.models.packed_int4 import PackedInt4Linear, RecoveredCodes, pack_linear_layers
from pagedserve.models.spec import ModelSpec, PagedCausalLM, RegionCompiler
from pagedserve.platforms.api import LinearKernel


@dataclass(frozen=True, slots=True)
class DecoderOptions:
    """The architecture switches of the shared decoder."""

    qkv_bias: bool  # biases on q/k/v projections (Qwen2; Llama's attention_bias)
    o_bias: bool  # bias on the output projection (Llama's attention_bias)
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over head_size on q and k before rotary (Qwen3)
    sliding_windows: tuple[int | None, ...]  # layer_idx -> window; None: full attention
    attention_sinks: bool = False  # a learned sink logit per query head in every softmax (gpt-oss)


def head_size_of(config: Any) -> int:
    """transformers configs give head_dim explicitly (Qwen3) or imply hidden_size / num_heads."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def layer_sliding_windows(config: Any) -> tuple[int | None, ...]:
    """Per-layer window from `layer_types` (Qwen2/3, Gemma-style configs) or one `sliding_window`
    for all layers (Mistral). A config without either attends fully everywhere."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(
                f"layer_types {unknown} are not attention layers pagedserve can run "
                "(supported: full_attention, sliding_attention)"
            )
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return (window,) * config.num_hidden_layers


class DecoderAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, options: DecoderOptions) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_size = head_size_of(config)
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
            bias=options.qkv_bias,
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=options.o_bias)
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps) if options.qk_norm else None
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps) if options.qk_norm else None
        self.attn = PagedAttention(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            scale=self.head_size**-0.5,
            sliding_window=options.sliding_windows[layer_idx],
        )
        # [num_heads] logits (gpt-oss), in the model dtype like the checkpoint; attention takes float32.
        self.sinks = (
            nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
            if options.attention_sinks
            else None
        )

    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, q_size]
        k: torch.Tensor,  # [num_tokens, kv_size]
        v: torch.Tensor,  # [num_tokens, kv_size]
    ) -> torch.Tensor:  # [num_tokens, q_size]
        """The paged attention of this layer (with its sinks, if it has them). Mutates the KV cache."""
        if self.sinks is None:
            return self.attn(q, k, v)
        return self.attn(q, k, v, sinks=self.sinks.float())

    def qkv(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, 1, head_size]
        sin: torch.Tensor,  # [num_tokens, 1, head_size]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [n, q_size], k [n, kv_size], v [n, kv_size]
        """The attention's inputs: projected, normed (Qwen3) and rotated. Does not mutate its inputs."""
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        if self.q_norm is None or self.k_norm is None:
            # q and k sit side by side in the fused output: rotate them in one call (half the
            # elementwise ops per layer, which decode on a CPU pays for one by one), written back
            # into that output so that q, k and v stay views of one buffer. Compiled, that is one
            # kernel for the whole buffer; a rotated q and k of their own become two buffers the
            # attention operator reads, each written by its own kernel.
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, -1)
            qk.copy_(apply_rotary(qk, cos, sin))
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rotary(self.q_norm(q.view(num_tokens, self.num_heads, self.head_size)), cos, sin)
            k = apply_rotary(self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_size)), cos, sin)
        return q.reshape(num_tokens, self.q_size), k.reshape(num_tokens, self.kv_size), v


class DecoderLayer(nn.Module):
    """One decoder layer. It carries the residual stream apart from the sublayers' outputs so that
    each residual add happens right before the norm that reads it (one fused kernel, compiled),
    and so that everything between two attention calls is one method of one layer
    (`DecoderRegions`)."""

    def __init__(self, config: Any, layer_idx: int, options: DecoderOptions, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_idx, options)
        self.mlp = mlp  # the feed-forward part: a dense `GatedMLP` or a `SparseMoE`, [n, hidden] -> same
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def attention_inputs(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]: the previous sublayer's output
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None in the first layer
        cos: torch.Tensor,  # [num_tokens, 1, head_size]
        sin: torch.Tensor,  # [num_tokens, 1, head_size]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k, v, residual
        """The residual add, the input norm and the attention's q, k, v. Does not mutate its inputs."""
        residual = hidden_states if residual is None else residual + hidden_states
        q, k, v = self.self_attn.qkv(self.input_layernorm(residual), cos, sin)
        return q, k, v, residual

    def after_attention(
        self,
        attention: torch.Tensor,  # [num_tokens, q_size]: the attention's output
        residual: torch.Tensor,  # [num_tokens, hidden_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the MLP's output, residual
        """The output projection, the residual add, the post-attention norm and the MLP. Does not
        mutate its inputs."""
        residual = residual + self.self_attn.o_proj(attention)
        return self.mlp(self.post_attention_layernorm(residual)), residual


def embed(
    model: DecoderModel,
    input_ids: torch.Tensor,  # [num_tokens]
    positions: torch.Tensor,  # [num_tokens]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # hidden [n, hidden], cos, sin [n, 1, head_size]
    """The token embeddings and the step's one cos/sin table, shared by every layer. Pure."""
    hidden_states = model.embed_tokens(input_ids)
    cos, sin = model.rotary_emb.cos_sin(positions, hidden_states.dtype)
    return hidden_states, cos, sin


def final_norm(
    model: DecoderModel,
    hidden_states: torch.Tensor,  # [num_tokens, hidden_size]: the last sublayer's output
    residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None for a model without layers
) -> torch.Tensor:  # [num_tokens, hidden_size]
    """The last residual add and the final norm. Pure."""
    return model.norm(hidden_states if residual is None else residual + hidden_states)


@dataclass(frozen=True, slots=True)
class DecoderRegions:
    """The decoder forward between its attention calls, as functions of the module they read.

    Every layer runs the same two functions, so a compiler that takes the module as an argument
    (`torch.compile` inlines its parameters as inputs) traces and builds each once for the whole
    stack, instead of once per layer inside one whole-model graph: `regional_forward`. Attention
    runs between them as it does eagerly."""

    embed: Callable[
        [DecoderModel, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ]
    attention_inputs: Callable[
        [DecoderLayer, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor],
        tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ]
    after_attention: Callable[[DecoderLayer, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    final_norm: Callable[[DecoderModel, torch.Tensor, torch.Tensor | None], torch.Tensor]

    def map(self, transform: Callable[[Callable[..., Any]], Callable[..., Any]]) -> DecoderRegions:
        """Every region passed through `transform` (a compiler). Pure."""
        return DecoderRegions(*(transform(getattr(self, f.name)) for f in fields(self)))


# (config, layer_idx, options) -> the layer's feed-forward part
FeedForwardFactory = Callable[[Any, int, DecoderOptions], nn.Module]


def dense_mlp(config: Any, layer_idx: int, options: DecoderOptions) -> nn.Module:
    """The dense gated MLP of `config.intermediate_size` (every layer of the dense models)."""
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, options.mlp_bias)


@runtime_checkable
class CheckpointPart(Protocol):
    """A part whose parameters are not one checkpoint tensor each (stacked experts): it places
    the tensors under its name itself. Names and keys are relative to the part."""

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str | None:
        """Write the tensor, return the key it filled; None: not this part's (load it plainly)."""

    def missing_checkpoint_keys(self, loaded: set[str]) -> list[str]:
        """The keys still to fill, given those filled so far."""


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm: the checkpoints' `model.` prefix."""

    def __init__(self, config: Any, options: DecoderOptions, feed_forward: FeedForwardFactory) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, options, feed_forward(config, i, options))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(*rope_frequencies(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.forward_with(EAGER_REGIONS, input_ids, positions)

    def forward_with(
        self, regions: DecoderRegions, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The forward with its attention-free stretches run by `regions`. Mutates the KV caches."""
        hidden_states, cos, sin = regions.embed(self, input_ids, positions)
        residual = None
        for layer in cast("Iterable[DecoderLayer]", self.layers):
            q, k, v, residual = regions.attention_inputs(layer, hidden_states, residual, cos, sin)
            hidden_states, residual = regions.after_attention(
                layer, layer.self_attn.attend(q, k, v), residual
            )
        return regions.final_norm(self, hidden_states, residual)


EAGER_REGIONS = DecoderRegions(embed, DecoderLayer.attention_inputs, DecoderLayer.after_attention, final_norm)


# checkpoint projection name -> fused module it lives in (the shard name is the projection name)
_FUSED_PROJECTIONS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
# Tensors some checkpoints carry that hold nothing a forward needs (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class DecoderForCausalLM(PagedCausalLM):
    """Base class of the native models. Subclasses set `architecture` and `options_from_config`,
    and a model whose layers are not all dense MLPs its `feed_forward` part per layer."""

    architecture: ClassVar[str]
    # (checkpoint name fragment, this model's) pairs applied to every checkpoint tensor name, for
    # checkpoints that call a part otherwise (Mixtral's `block_sparse_moe` is our `mlp`).
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        options = self.options_from_config(config)
        if len(options.sliding_windows) != config.num_hidden_layers:
            raise ValueError(
                f"config has {len(options.sliding_windows)} layer_types for {config.num_hidden_layers} layers"
            )
        self.config = config
        self.model = DecoderModel(config, options, type(self).feed_forward)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied models have no lm_head module at all: a Parameter shared by two modules does not
        # stay shared through `to_empty` (which materializes the meta-built model), whereas
        # compute_logits reading the embedding matrix directly cannot come apart. After loading,
        # `quantize_head_fp8` makes it an `Fp8Linear`, tied or not (a tied one is an FP8 copy).
        self.lm_head: nn.Linear | Fp8Linear | None = (
            None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # Set by `pack_quantized_weights`: the head as packed 4-bit codes (CPU decode).
        self.packed_head: PackedInt4Linear | None = None
        self.head_kernel: LinearKernel | None = None  # set by `platform_linear.route_linear_layers`
        # Set by `models.tensor_parallel.shard_model`: the head holds one rank's vocabulary rows.
        self.vocab_parallel: VocabParallelLogits | None = None
        self.spec = ModelSpec(
            architecture=self.architecture,
            implementation="native",
            num_layers=config.num_hidden_layers,
            num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_size=head_size_of(config),
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            dtype=dtype,
            sliding_windows=options.sliding_windows,
            logit_softcap=None,
            max_position_embeddings=getattr(config, "max_position_embeddings", None),
            attention_sinks=options.attention_sinks,
        )

    @classmethod
    @abstractmethod
    def options_from_config(cls, config: Any) -> DecoderOptions:
        """The architecture switches this model class reads from its config. Does not mutate."""

    @classmethod
    def feed_forward(cls, config: Any, layer_idx: int, options: DecoderOptions) -> nn.Module:
        """Layer `layer_idx`'s feed-forward part (built on the meta device). Dense by default."""
        return dense_mlp(config, layer_idx, options)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden_size]. Mutates the KV caches."""
        return self.model(input_ids, positions)

    def regional_forward(
        self, compile_region: RegionCompiler
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The forward with each of its attention-free stretches (`DecoderRegions`) compiled once
        by `compile_region` and shared by every layer. Does not mutate."""
        return functools.partial(self.model.forward_with, EAGER_REGIONS.map(compile_region))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_selected, hidden_size] -> [num_selected, vocab_size] float32. Does not mutate."""
        if self.packed_head is not None:
            return self.packed_head(hidden_states).float()
        if isinstance(self.lm_head, Fp8Linear):  # `quantize_head_fp8`: codes and per-row scales
            codes, scale = self.lm_head.weight, self.lm_head.weight_scale
            if self.head_kernel is not None:  # routed only when it takes FP8 (`platform_linear`)
                logits = self.head_kernel.op(hidden_states, codes, scale.reshape(-1), None)
            else:
                logits = scaled_linear(hidden_states, codes, scale, None)
        else:
            head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            if self.head_kernel is not None:  # the platform's GEMM (`platform_linear`)
                logits = self.head_kernel.op(hidden_states, head, None, None)
            else:
                logits = F.linear(hidden_states, head)
        if self.vocab_parallel is not None:
            logits = self.vocab_parallel.gather(logits)
        return logits.float()

    @torch.no_grad()
    def quantize_head_fp8(self) -> None:
        """Make the LM head FP8 per vocabulary row (`quantize_lm_head`): an `Fp8Linear` in the
        format of the decoder's FP8 layers (`float8_e4m3fn` codes [vocab, hidden], one float32
        scale `amax(row) / 448` per row). Untied, it replaces the `lm_head` linear, whose weight
        is dropped (the head's bytes halve from bfloat16). Tied, the embedding stays in the model's
        dtype for the lookup and `lm_head` becomes an FP8 copy of the shared matrix: vocab x hidden
        bytes of codes plus vocab x 4 bytes of scales on top of the embedding (27 MiB for
        SmolLM2-135M, 0.5 GiB for a 128K x 4096 vocabulary). Call after the weights are loaded.
        Raises `ValueError` for a packed 4-bit or vocabulary-parallel head. Mutates `lm_head`."""
        if self.packed_head is not None:
            raise ValueError(
                "quantize_lm_head=True cannot quantize a head kept as packed 4-bit codes "
                "(quantization='gguf'); use quantization='fp8' on a dense checkpoint"
            )
        if self.vocab_parallel is not None:
            raise ValueError(
                "quantize_lm_head=True cannot quantize a head sharded over tensor-parallel ranks; "
                "use tensor_parallel_size=1"
            )
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_head = Fp8Linear(head.data, None)

    @torch.no_grad()
    def pack_quantized_weights(self, recovered: dict[str, RecoveredCodes]) -> int:
        """Swap in packed 4-bit layers for the projections (and the head) whose checkpoint
        tensors `recovered` holds exact codes of (see `packed_int4`). Call after
        `load_weights`; returns the number of layers packed. Mutates the model."""
        head_name = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        packed = pack_linear_layers(self.model, recovered, prefix="model.")
        head_codes = recovered.get(head_name)
        if head_codes is not None:
            head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self.packed_head = PackedInt4Linear(head_codes, head.data, None)
            packed += 1
        return packed

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named checkpoint tensors into this model (casting to its dtype).

        Raises `ValueError` for an unknown tensor name, a shape mismatch, or a parameter the
        checkpoint never provided. Mutates the parameters."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        parts = {path: m for path, m in modules.items() if isinstance(m, CheckpointPart)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            for fragment, ours in self.checkpoint_renames:
                name = name.replace(fragment, ours)
            part_key = _load_into_part(parts, name, tensor)
            if part_key is not None:
                loaded.add(part_key)
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                # Some tied checkpoints still store the head; it equals the embedding by definition.
                continue
            module_path, _, param_name = name.rpartition(".")
            owner, _, proj = module_path.rpartition(".")
            if proj in _FUSED_PROJECTIONS:
                fused_name = f"{owner}.{_FUSED_PROJECTIONS[proj]}"
                fused = modules.get(fused_name)
                if isinstance(fused, CheckpointPart):  # a quantized stacked layer places its own rows
                    key = fused.load_checkpoint_tensor(f"{proj}.{param_name}", tensor)
                    if key is None:
                        raise ValueError(f"checkpoint tensor {name!r} has no place in {fused_name}")
                    loaded.add(f"{fused_name}.{key}")
                    continue
                if not isinstance(fused, MergedLinear):
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                fused.load_shard(proj, param_name, tensor)
                loaded.add(f"{fused_name}.{param_name}:{proj}")
                continue
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}: "
                    "the checkpoint is not of this architecture, or its config is wrong"
                )
            param = params[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(param.shape)}: the config does not match the weights"
                )
            param.copy_(tensor)
            loaded.add(name)
        missing = [n for n in self._expected_weight_keys() if n not in loaded]
        for path, part in parts.items():
            mine = {key.removeprefix(f"{path}.") for key in loaded if key.startswith(f"{path}.")}
            missing += [f"{path}.{key}" for key in part.missing_checkpoint_keys(mine)]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")
        self._relayout_for_cpu()

    @torch.no_grad()
    def _relayout_for_cpu(self) -> None:
        """On the CPU in float32, store every projection matrix (and the embedding, which is the
        tied head) input-major: `weight` keeps its [out, in] shape but its transpose is the
        contiguous one. Why: MKL's float32 GEMM streams an [in, out] matrix about twice as fast
        as an [out, in] one at decode's few rows (the tied head: 12 ms -> 6 ms per token here), and
        is no slower at prefill's many; bfloat16 goes through oneDNN, which prefers [out, in],
        so it is left alone. Values are unchanged. Mutates the parameters' storage."""
        for module in self.modules():
            weight = getattr(module, "weight", None)
            if (
                isinstance(module, nn.Linear | nn.Embedding)
                and isinstance(weight, nn.Parameter)
                and weight.device.type == "cpu"
                and weight.dtype == torch.float32
            ):
                weight.data = weight.data.t().contiguous().t()

    def _expected_weight_keys(self) -> list[str]:
        """Every key `load_weights` must see once: plain parameter names, and fused ones as
        `param:shard` per checkpoint projection (a `CheckpointPart`'s own tensors aside)."""
        keys: list[str] = []
        for name, _ in self.named_parameters():
            module = self.get_submodule(name.rpartition(".")[0])
            if isinstance(module, CheckpointPart):
                continue  # the part's own stacked tensors: `missing_checkpoint_keys` counts them
            if isinstance(module, MergedLinear):
                keys.extend(f"{name}:{shard}" for shard in module.shard_offsets)
            else:
                keys.append(name)
        return keys


def _load_into_part(parts: dict[str, CheckpointPart], name: str, tensor: torch.Tensor) -> str | None:
    """Hand checkpoint tensor `name` to the `CheckpointPart` whose path it starts with, if one
    takes it; returns the filled key prefixed with the part's path, or None. Mutates the part."""
    path = name
    while "." in path:
        path = path.rpartition(".")[0]
        part = parts.get(path)
        if part is not None:
            key = part.load_checkpoint_tensor(name[len(path) + 1 :], tensor)
            return None if key is None else f"{path}.{key}"
    return None
