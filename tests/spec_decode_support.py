"""Tiny checkpoints for the speculative-decoding tests: a target, a draft model, and EAGLE and
EAGLE-3 heads with random weights in the published checkpoint layouts (`fc.weight`, `layers.0.*`;
`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from models_harness import save_checkpoint, tiny_hf_model
from safetensors.torch import save_file
from transformers import LlamaConfig

from pagedserve import LLM

VOCAB = 96
HIDDEN = 64
HEADS, KV_HEADS, HEAD_DIM, FFN = 4, 2, 16, 96


def tiny_llama_config(num_layers: int = 4) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


def save_target(directory: Path, seed: int = 0, num_layers: int = 4) -> Path:
    """A random 4-layer Llama (EAGLE-3 taps layers 2, 2 and 1 of it)."""
    return save_checkpoint(tiny_hf_model(tiny_llama_config(num_layers), seed=seed), directory)


def _layer(prefix: str, gen: torch.Generator, q_in: int) -> dict[str, torch.Tensor]:
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    return {
        f"{prefix}self_attn.q_proj.weight": w(HEADS * HEAD_DIM, q_in),
        f"{prefix}self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, q_in),
        f"{prefix}self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, q_in),
        f"{prefix}self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}mlp.gate_proj.weight": w(FFN, HIDDEN),
        f"{prefix}mlp.up_proj.weight": w(FFN, HIDDEN),
        f"{prefix}mlp.down_proj.weight": w(HIDDEN, FFN),
        f"{prefix}post_attention_layernorm.weight": 1 + w(HIDDEN) * 0.5,
    }


def _config(directory: Path, architecture: str, **extra: Any) -> None:
    config = tiny_llama_config(1).to_dict()
    config.update(architectures=[architecture], **extra)
    (directory / "config.json").write_text(json.dumps(config))


def save_eagle(directory: Path, seed: int = 5) -> Path:
    """An EAGLE head: fc over [embedding; hidden], one layer without its input norm."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "fc.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * 0.2,
        **_layer("layers.0.", gen, HIDDEN),
    }
    save_file(tensors, str(directory / "model.safetensors"))
    _config(directory, "EagleLlamaForCausalLM")
    return directory


def save_eagle3(directory: Path, seed: int = 6, draft_vocab: int = 64) -> Path:
    """An EAGLE-3 head: fc over three target layers, midlayer with a 2x-wide attention input, its
    own norm and a `draft_vocab`-token LM head mapped to the target's ids by d2t."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    kept = torch.sort(torch.randperm(VOCAB, generator=gen)[:draft_vocab]).values  # target ids drafted
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[kept] = True
    tensors = {
        "fc.weight": torch.randn(HIDDEN, 3 * HIDDEN, generator=gen) * 0.2,
        **_layer("midlayer.", gen, 2 * HIDDEN),
        "midlayer.input_layernorm.weight": torch.ones(HIDDEN),
        "midlayer.hidden_norm.weight": torch.ones(HIDDEN),
        "norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": torch.randn(draft_vocab, HIDDEN, generator=gen) * 0.2,
        "d2t": kept - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    save_file(tensors, str(directory / "model.safetensors"))
    _config(directory, "Eagle3LlamaForCausalLM", draft_vocab_size=draft_vocab)
    return directory


def spec_llm(
    target: Path, speculative_config: dict[str, Any] | None, fixed_k: bool = True, **engine: Any
) -> LLM:
    """An engine on `target` with `speculative_config`; `fixed_k`: draft k tokens every step (the
    cost model off), so that the tests score drafts whatever the CPU's timings say."""
    options: dict[str, Any] = dict(
        skip_tokenizer_init=True, dtype="float32", num_kv_blocks=96, max_model_len=192
    )
    options.update(engine)
    llm = LLM(str(target), speculative_config=speculative_config, **options)
    proposer = llm.engine.core.proposer
    if fixed_k and proposer is not None and hasattr(proposer, "cost_model"):
        proposer.cost_model = None
    return llm
