"""Drive a pagedserve model through a whole greedy generation, the way the model runner will.

Each step schedules, per request, either its next prompt chunk (chunked prefill) or its one
decode token; all requests' tokens form one flattened batch. The KV cache uses a shuffled block
table, so a bug that assumes contiguous blocks shows up. The attention backend and cache ops are
the cpu_reference plugin's, the oracle every platform is compared against.

Also builds tiny random transformers models and saves them as safetensors checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.models.spec import PagedCausalLM
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps


@torch.no_grad()
def paged_greedy(
    model: PagedCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    block_size: int = 4,
    prefill_chunk: int | None = None,  # None: whole prompts in the first step
    seed: int = 0,
) -> list[list[int]]:
    """Greedy-generate `max_new_tokens` per prompt; returns each request's new token ids."""
    spec = model.spec
    num_reqs = len(prompts)
    max_len = max(len(p) for p in prompts) + max_new_tokens
    blocks_per_req = -(-max_len // block_size)
    num_blocks = num_reqs * blocks_per_req
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    block_table = order.view(num_reqs, blocks_per_req).to(torch.int32)
    # NaN-filled: a read of a slot nobody wrote poisons the output instead of passing silently.
    kv_caches = [
        torch.full(spec.kv_cache_shape(num_blocks, block_size), float("nan"), dtype=spec.dtype)
        for _ in range(spec.num_layers)
    ]
    backend, cache_ops = ReferenceAttentionBackend(), ReferenceCacheOps()
    tokens = [list(p) for p in prompts]  # req -> all token ids so far
    computed = [0] * num_reqs  # req -> tokens whose K/V are cached
    generated: list[list[int]] = [[] for _ in prompts]
    while any(len(g) < max_new_tokens for g in generated):
        active = [i for i in range(num_reqs) if len(generated[i]) < max_new_tokens]
        query_lens: list[int] = []
        seq_lens: list[int] = []
        ids: list[int] = []
        positions: list[int] = []
        for i in active:
            remaining = len(tokens[i]) - computed[i]
            n = remaining if prefill_chunk is None else min(remaining, prefill_chunk)
            ids.extend(tokens[i][computed[i] : computed[i] + n])
            positions.extend(range(computed[i], computed[i] + n))
            query_lens.append(n)
            seq_lens.append(computed[i] + n)
        metadata = AttentionMetadata.build(query_lens, seq_lens, block_table[active], block_size)
        ctx = ForwardContext(metadata=metadata, kv_caches=kv_caches, backend=backend, cache_ops=cache_ops)
        with forward_context(ctx):
            hidden = model(torch.tensor(ids), torch.tensor(positions))
        last_rows = metadata.query_start_loc[1:].long() - 1
        next_ids = model.compute_logits(hidden[last_rows]).argmax(-1).tolist()
        for slot, i in enumerate(active):
            computed[i] = seq_lens[slot]
            if computed[i] == len(tokens[i]):  # the prompt is done: this row's logits sample
                tokens[i].append(next_ids[slot])
                generated[i].append(next_ids[slot])
    return generated


@torch.no_grad()
def hf_greedy(hf_model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy `generate` (of a causal LM; `Any` because transformers' types
    leave `generate` off `PreTrainedModel`), one prompt at a time (no padding to reason about).
    Stops early at the config's EOS token, if it has one."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        seq = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
        out.append(seq[0, len(prompt) :].tolist())
    return out


@torch.no_grad()
def hf_argmax_tokens(hf_model: Any, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """transformers' forward on each prompt, its argmax token appended `steps` times (no EOS
    check, like `ignore_eos`), one prompt at a time; returns the new tokens."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=hf_model.device)
        for _ in range(steps):
            ids = torch.cat([ids, hf_model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        out.append(ids[0, len(prompt) :].tolist())
    return out


# Shared by the model tests: a 2-layer decoder small enough for exact comparisons in seconds.
# Large initializer_range: random tiny models then have peaked logits, so greedy choices are not
# decided by float rounding. No EOS, so every generation runs its full length.
TINY_DECODER: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def tiny_hf_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """A random transformers causal LM for `config`, in float32 eval mode, with the eager attention."""
    torch.manual_seed(seed)
    model: Any = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    # transformers initializes norm weights to one and biases to zero; perturb them so that a
    # norm or bias loaded into the wrong place changes the output.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def save_tiny_llama(directory: Path, vocab_size: int, seed: int) -> Path:
    """A random two-layer Llama (hidden 64, 4 query / 2 KV heads of 16) saved in `directory`: the
    smallest model the engine-routing tests run end to end."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    return save_checkpoint(tiny_hf_model(config, seed=seed), directory)


def save_checkpoint(model: PreTrainedModel, directory: Path, max_shard_size: str | None = None) -> Path:
    """`save_pretrained` as safetensors (sharded when `max_shard_size` is given); returns `directory`."""
    if max_shard_size is None:
        model.save_pretrained(directory)
    else:
        model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def random_prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def paged_prefill_logits(
    model: PagedCausalLM, prompts: list[list[int]], *, block_size: int = 4
) -> torch.Tensor:
    """Logits [sum of prompt lengths, vocab] for every prompt position, all prompts in one step."""
    spec = model.spec
    lens = [len(p) for p in prompts]
    blocks_per_req = -(-max(lens) // block_size)
    num_blocks = len(prompts) * blocks_per_req
    block_table = torch.arange(num_blocks, dtype=torch.int32).view(len(prompts), blocks_per_req)
    kv_caches = [
        torch.zeros(spec.kv_cache_shape(num_blocks, block_size), dtype=spec.dtype)
        for _ in range(spec.num_layers)
    ]
    metadata = AttentionMetadata.build(lens, lens, block_table, block_size)
    ctx = ForwardContext(metadata, kv_caches, ReferenceAttentionBackend(), ReferenceCacheOps())
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    with forward_context(ctx):
        return model.compute_logits(model(ids, positions))


@torch.no_grad()
def hf_prefill_logits(hf_model: PreTrainedModel, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' logits for every prompt position, prompts run one at a time, concatenated."""
    return torch.cat([hf_model(torch.tensor([p])).logits[0].float() for p in prompts])


def write_tiny_gguf(hf_model: PreTrainedModel, path: Path, arch: str, quantized: bool = False) -> Path:
    """Write `hf_model`'s weights as a GGUF file, laid out the way llama.cpp's converter does
    (GGUF tensor names; for "llama", q/k rows permuted to llama.cpp's rotary layout), with the
    config metadata transformers reads back. F32, or with `quantized` the SmolLM2 file's mix:
    Q8_0 embedding/head, Q4_1 projections, F32 norms. Returns `path`."""
    import gguf
    from gguf.quants import quantize

    config: Any = hf_model.config
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    for hf_name, tensor in hf_model.state_dict().items():
        if config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue  # tied GGUFs store only token_embd
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        assert gguf_name is not None, hf_name
        data = tensor.detach().float().numpy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            # llama.cpp interleaves each head's two rotary halves; transformers' reader undoes it.
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:])
            data = data.swapaxes(1, 2).reshape(tensor.shape)
        if quantized and data.ndim == 2:
            kind = gguf.GGMLQuantizationType
            qtype = kind.Q8_0 if base.endswith(("embed_tokens", "lm_head")) else kind.Q4_1
            writer.add_tensor(f"{gguf_name}.{suffix}", quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(f"{gguf_name}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
