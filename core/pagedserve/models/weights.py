"""Checkpoint readers (safetensors directories, GGUF files) and random "dummy" weights.

Both readers yield `(transformers parameter name, tensor)` pairs, so a model's `load_weights`
sees the same names whichever format the weights came from.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's shard files: those the index names, else every `*.safetensors`.
    Raises `FileNotFoundError` when there are none or the index names a missing shard."""
    index_path = directory / SAFETENSORS_INDEX
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} names shards that are not in {directory}: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {directory}; pagedserve reads safetensors or GGUF checkpoints "
            "(convert a PyTorch .bin checkpoint with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of a (possibly sharded) safetensors checkpoint, one shard open at a time."""
    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)


def iter_gguf(gguf_path: Path, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield a GGUF file's tensors dequantized to float32 under transformers parameter names,
    one at a time.

    transformers' GGUF support does the name mapping (through a transformers model of this
    config, built on the meta device here: no memory, no init) and its tensor processor undoes
    llama.cpp's q/k row permutation for Llama-family files. The metadata comes from the
    per-process cache (`gguf_reads`) and the tensor table from transformers' struct-based header
    reader, so loading the weights does not parse the file's metadata again."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize
    from transformers import AutoModelForCausalLM
    from transformers.integrations.gguf import GgufHeader, load_gguf_state_dict
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from pagedserve.models.gguf_reads import gguf_metadata, shared_gguf_reads

    with torch.device("meta"):
        name_source = AutoModelForCausalLM.from_config(config)
    header = GgufHeader.from_file(str(gguf_path))
    # The processor sees the config as transformers read it from this file, as it would inside
    # transformers' own loader (head counts for the q/k un-permutation).
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(
        config=gguf_metadata(gguf_path)["config"]
    )
    with shared_gguf_reads():
        mapped = get_gguf_hf_weights_map(name_source, TensorProcessor())  # the base one only maps names
        tensor_key_mapping = get_gguf_hf_weights_map(name_source, processor)
    # transformers drops GGUF tensors its model has no parameter for (q/k/v biases of a llama
    # file, whose metadata cannot say attention_bias; llama 3.1's rope_freqs). Serving without
    # them would be a different model, so name them instead.
    unmapped = sorted({info.name for info in header.tensors} - set(mapped))
    if unmapped:
        raise ValueError(
            f"{gguf_path} holds tensors that the {config.model_type!r} config read from its metadata "
            f"has no place for: {unmapped[:6]}; transformers (and so pagedserve) cannot load this "
            "file faithfully"
        )
    stored = load_gguf_state_dict(header)  # memory-mapped, nothing read yet
    # Processors of merged expert tensors write into parsed_parameters["tensors"] themselves.
    parsed_parameters: dict[str, Any] = {"tensors": {}}
    for info in header.tensors:
        # Rows of raw bytes, whatever the type: gguf's dequantize views float rows and decodes
        # block rows (the last dimension is then bytes per row).
        rows = stored[info.name].data.reshape(*info.shape[:-1], -1)
        weights = dequantize(rows, GGMLQuantizationType(info.ggml_type))
        result = processor.process(
            weights=weights,
            name=info.name,
            tensor_key_mapping=tensor_key_mapping,
            parsed_parameters=parsed_parameters,
        )
        if result.name not in tensor_key_mapping:
            continue
        # A copy: `weights` may still be a view of the read-only memory map.
        yield tensor_key_mapping[result.name], torch.from_numpy(np.copy(result.weights))
    tensors: dict[str, torch.Tensor] = parsed_parameters["tensors"]
    yield from tensors.items()


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Give every parameter deterministic random values: norm weights ~1, biases ~0, other
    weights N(0, 0.02). Good for benchmarks (right shapes, finite, non-degenerate activations),
    meaningless as a model. Mutates the parameters."""
    for name, param in model.named_parameters():
        generator = torch.Generator(device=param.device).manual_seed(seed + _stable_hash(name))
        noise = torch.randn(param.shape, generator=generator, device=param.device, dtype=torch.float32)
        if name.endswith(".bias"):
            value = noise * 0.02
        elif param.dim() == 1:  # norm scales
            value = 1.0 + noise * 0.02
        else:
            value = noise * 0.02
        param.copy_(value)


def _stable_hash(name: str) -> int:
    """A per-parameter seed offset that, unlike `hash()`, is the same in every process."""
    value = 0
    for byte in name.encode():
        value = (value * 131 + byte) % (2**31)
    return value
