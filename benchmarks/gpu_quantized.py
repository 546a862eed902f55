"""On a GPU: what quantized checkpoints buy, Llama-3.1-8B shapes (or `--shape 70b`), random weights
written as real checkpoints that the engine loads as it loads released ones.

Each variant's checkpoint is written first (`write_checkpoint`: random tensors drawn on the GPU
layer by layer, sharded safetensors files of at most 5 GB with a `model.safetensors.index.json`,
a `config.json` of `gpu_latency.llama_config`, no tokenizer), in the formats the loader reads
(`core/pagedserve/quantization/`):

  * `bf16`: bfloat16 weights, N(0, 0.02) as the dummy loader draws them;
  * `gptq_w4a16`: GPTQ 4-bit, groups of 128, symmetric, no activation order (`qweight`,
    `qzeros`, float16 `scales`, `g_idx`); embeddings, norms and LM head bfloat16;
  * `ct_w4a16`: compressed-tensors `pack-quantized` W4A16, groups of 128, symmetric
    (`weight_packed`, bfloat16 `weight_scale`, `weight_shape`), the same codes and scales as
    `gptq_w4a16` packed the other way; the LM head in `ignore`;
  * `ct_fp8`: compressed-tensors `float-quantized` FP8_DYNAMIC: `bf16`'s weights quantized per
    output channel (amax / 448), dynamic per-token FP8 activations;
  * `fp8_load_time`: the `bf16` checkpoint served with `quantization="fp8"` (no checkpoint of
    its own), which should match `ct_fp8` (the same codes and scales).

At 8B the checkpoints hold 16.1 GB (bf16), 5.7 GB (each W4A16) and 9.1 GB (FP8) of tensors.

Random 4-bit codes are uniform over -8..7 with scales of about 0.02 / 4.6, so the dequantized
weights have the bf16 variant's spread and activations stay finite. For each variant one engine is
built (`--platform`, the KV pool sized at `--gpu-memory-utilization`) and measured:

  * load: seconds of the engine's weight loading (its "model loaded in" start-up log record:
    reading the shards, repacking the codes, `quantization="fp8"`'s quantization), with the
    checkpoint's pages dropped from the page cache first (`posix_fadvise(DONTNEED)`; `--no-evict`
    keeps them); the whole build (`build_s`: load, compile, kernel warm-up, graph capture);
    `--load-twice`: `bf16` built once more from the page cache, warm;
  * memory: the loaded model's bytes on the GPU, and the KV tokens that fit beside it;
  * single stream: one `--prompt-len` prompt, `--output-len` tokens out, TTFT and TPOT from the
    wall times at which the engine hands out each token (`gpu_async_scheduling.single_stream`);
  * throughput (with `--workload FILE`): every request of the workload at once, each run to its
    `output_len` (`pagedserve bench throughput`'s loop), after `--warmup-requests` requests.

The report (stdout, and `--json FILE` with every number, the device, torch and triton versions and
the checkpoint sizes) gives the ratios the targets use: W4A16 TPOT / bf16 TPOT, W4A16 and FP8
throughput / bf16 throughput, `ct_fp8` / `fp8_load_time` TPOT and throughput. A variant that fails
to load or run is reported with its error; the others still run (the exit status is then 1).

    python benchmarks/gpu_quantized.py --platform triton --load-twice \\
        --workload benchmarks/workloads/sharegpt_like_1000.json --json quantized_triton.json
    python benchmarks/gpu_quantized.py --platform cuda \\
        --workload benchmarks/workloads/sharegpt_like_1000.json --json quantized_cuda.json

Checkpoints go to a temporary directory, each removed after its last variant; `--dir DIR` keeps
them there and reuses them on the next run, so variants can be split over calls on one machine and
reported together:

    python benchmarks/gpu_quantized.py --dir /tmp/ckpt --variants bf16,fp8_load_time,ct_fp8 \\
        --load-twice --workload benchmarks/workloads/sharegpt_like_1000.json --json fp8.json
    python benchmarks/gpu_quantized.py --dir /tmp/ckpt --variants gptq_w4a16,ct_w4a16 \\
        --workload benchmarks/workloads/sharegpt_like_1000.json --json w4a16.json
    python benchmarks/gpu_quantized.py --merge fp8.json w4a16.json --json quantized.json

70B shapes on one 80 GB GPU: only the W4A16 variants fit (about 40 GB of weights):

    python benchmarks/gpu_quantized.py --shape 70b --variants gptq_w4a16,ct_w4a16 --json q70b.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_async_scheduling import single_stream  # type: ignore[import-not-found, unused-ignore]
from gpu_latency import (  # type: ignore[import-not-found, unused-ignore]
    LLAMA_SHAPES,
    bench_engine_args,
    llama_config,
)

from pagedserve import LLMEngine
from pagedserve.bench.datasets import fit_vocab, load_workload
from pagedserve.bench.throughput import run_throughput
from pagedserve.config import EngineArgs
from pagedserve.models.fp8 import Fp8Linear, quantize_rows
from pagedserve.quantization.int_linear import IntWeightLinear
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger("gpu_quantized")

FORMATS = ("bf16", "gptq_w4a16", "ct_w4a16", "ct_fp8")  # checkpoints written


@dataclass(frozen=True)
class Variant:
    checkpoint: str  # one of FORMATS
    engine: dict[str, Any] = field(default_factory=dict)  # EngineArgs changes


VARIANTS: dict[str, Variant] = {
    "bf16": Variant("bf16"),
    "gptq_w4a16": Variant("gptq_w4a16"),
    "ct_w4a16": Variant("ct_w4a16"),
    "ct_fp8": Variant("ct_fp8"),
    "fp8_load_time": Variant("bf16", {"quantization": "fp8"}),
}

GROUP_SIZE = 128
SHARD_BYTES = 5 * 10**9  # transformers' default "5GB" shards
WEIGHT_STD = 0.02  # the dummy loader's N(0, 0.02)
INT4_CODE_STD = math.sqrt((16**2 - 1) / 12)  # codes uniform over -8..7
INT4_SCALE = WEIGHT_STD / INT4_CODE_STD  # about 0.0043: dequantized weights of bf16's spread
GPTQ_SYMMETRIC_ZEROS = 0x77777777  # eight zero points of 8, stored minus one (the gptq format)
MARKER = "pagedserve_bench_checkpoint.json"  # written last: the checkpoint is complete
# Every file `write_checkpoint` writes, finished or not.
_WRITTEN = re.compile(
    r"part-\d+\.safetensors|model-\d+-of-\d+\.safetensors|model\.safetensors\.index\.json|config\.json|"
    + re.escape(MARKER)
)
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


# --- checkpoints ------------------------------------------------------------------------------


def checkpoint_format(variant: str) -> str:
    """The checkpoint a variant (or a format name) loads: one of FORMATS."""
    if variant in FORMATS:
        return variant
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
    return VARIANTS[variant].checkpoint


def projection_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each projection of a decoder layer."""
    hidden, inter = int(config.hidden_size), int(config.intermediate_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(config.num_key_value_heads or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def _generator(name: str, device: torch.device, seed: int) -> torch.Generator | None:
    """A generator of its own per tensor name, so that every format draws the same values for the
    same name (None on the meta device, which draws nothing)."""
    if device.type == "meta":
        return None
    return torch.Generator(device=device).manual_seed(seed * 2**32 + zlib.crc32(name.encode()))


def _normal(name: str, shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    noise = torch.randn(shape, generator=_generator(name, device, seed), device=device)
    return (noise * WEIGHT_STD).to(torch.bfloat16)


def _norm(name: str, size: int, device: torch.device, seed: int) -> torch.Tensor:
    noise = torch.randn((size,), generator=_generator(name, device, seed), device=device)
    return (1.0 + noise * WEIGHT_STD).to(torch.bfloat16)


def _int4(
    name: str, n: int, k: int, group_size: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 4-bit codes of an [n, k] weight as int32 words [n, k / 8] (code i of a word in bits
    4i..4i+3, unsigned, the code minus 8 being the signed value) and bfloat16 scales
    [n, ceil(k / group_size)] near `INT4_SCALE`, every one exact in float16 too."""
    if n % 8 or k % 8:
        raise ValueError(f"{name}: 4-bit packing needs both dimensions divisible by 8, got [{n}, {k}]")
    gen = _generator(f"{name}.int4", device, seed)
    words = torch.randint(-(2**31), 2**31, (n, k // 8), generator=gen, dtype=torch.int32, device=device)
    groups = -(-k // group_size)
    spread = torch.rand((n, groups), generator=gen, device=device)
    return words, (INT4_SCALE * (0.75 + 0.5 * spread)).to(torch.bfloat16)


def projection_tensors(
    fmt: str, name: str, n: int, k: int, device: torch.device, seed: int, group_size: int = GROUP_SIZE
) -> dict[str, torch.Tensor]:
    """One projection's checkpoint tensors, named without the layer prefix."""
    if fmt == "bf16":
        return {"weight": _normal(f"{name}.weight", (n, k), device, seed)}
    if fmt == "ct_fp8":  # bf16's weight, quantized as `quantization="fp8"` quantizes it
        codes, scales = quantize_rows(_normal(f"{name}.weight", (n, k), device, seed))
        return {"weight": codes, "weight_scale": scales}  # [n, k] float8_e4m3fn, [n, 1] float32
    words, scales = _int4(name, n, k, group_size, device, seed)
    if fmt == "ct_w4a16":  # packed along the inputs: [n, k / 8]; scales [n, groups]
        return {
            "weight_packed": words,
            "weight_scale": scales,
            "weight_shape": torch.tensor([n, k], dtype=torch.int64, device=device),
        }
    if fmt == "gptq_w4a16":  # the same words transposed: [k / 8, n]; scales [groups, n] float16
        groups = scales.shape[1]
        return {
            "qweight": words.t().contiguous(),
            "qzeros": torch.full((groups, n // 8), GPTQ_SYMMETRIC_ZEROS, dtype=torch.int32, device=device),
            "scales": scales.t().to(torch.float16).contiguous(),
            "g_idx": (torch.arange(k, device=device) // group_size).to(torch.int32),
        }
    raise ValueError(f"unknown checkpoint format {fmt!r} (known: {', '.join(FORMATS)})")


def tensor_groups(
    fmt: str, config: LlamaConfig, device: torch.device, seed: int = 0, group_size: int = GROUP_SIZE
) -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint's tensors under transformers' Llama names, drawn on `device` one group at a
    time: the embeddings, each decoder layer, the final norm with the LM head."""
    hidden, vocab = config.hidden_size, config.vocab_size
    yield {"model.embed_tokens.weight": _normal("model.embed_tokens.weight", (vocab, hidden), device, seed)}
    shapes = projection_shapes(config)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        group = {
            f"{prefix}.{norm}.weight": _norm(f"{prefix}.{norm}.weight", hidden, device, seed)
            for norm in ("input_layernorm", "post_attention_layernorm")
        }
        for proj in PROJECTIONS:
            n, k = shapes[proj]
            parts = projection_tensors(fmt, f"{prefix}.{proj}", n, k, device, seed, group_size)
            group |= {f"{prefix}.{proj}.{part}": t for part, t in parts.items()}
        yield group
    yield {
        "model.norm.weight": _norm("model.norm.weight", hidden, device, seed),
        "lm_head.weight": _normal("lm_head.weight", (vocab, hidden), device, seed),
    }


def checkpoint_bytes(variant: str, config: LlamaConfig, group_size: int = GROUP_SIZE) -> int:
    """The tensor bytes of a variant's checkpoint, counted without drawing anything."""
    meta = torch.device("meta")
    groups = tensor_groups(checkpoint_format(variant), config, meta, group_size=group_size)
    return sum(t.nbytes for group in groups for t in group.values())


def quantization_config(fmt: str, group_size: int = GROUP_SIZE) -> dict[str, Any] | None:
    """The `quantization_config` of a format's config.json (None: a dense checkpoint)."""
    if fmt == "bf16":
        return None
    if fmt == "gptq_w4a16":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "sym": True,
            "desc_act": False,
            "checkpoint_format": "gptq",
            "lm_head": False,
            "damp_percent": 0.01,
            "true_sequential": True,
            "static_groups": False,
        }
    if fmt == "ct_w4a16":
        weights: dict[str, Any] = {
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "strategy": "group",
            "group_size": group_size,
            "dynamic": False,
            "actorder": None,
            "observer": "minmax",
        }
        activations: dict[str, Any] | None = None
        ct_format = "pack-quantized"
    elif fmt == "ct_fp8":  # llm-compressor's FP8_DYNAMIC scheme
        weights = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "channel",
            "group_size": None,
            "dynamic": False,
            "observer": "minmax",
        }
        activations = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "token",
            "dynamic": True,
        }
        ct_format = "float-quantized"
    else:
        raise ValueError(f"unknown checkpoint format {fmt!r} (known: {', '.join(FORMATS)})")
    group = {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": activations,
        "output_activations": None,
        "format": ct_format,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": ct_format,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    format: str
    bytes: int  # tensor bytes (the index's total_size)
    disk_bytes: int  # of every file of the directory
    files: int  # safetensors shards
    write_s: float | None  # None: an earlier run's checkpoint, reused
    reused: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "format": self.format,
            "bytes": self.bytes,
            "disk_bytes": self.disk_bytes,
            "files": self.files,
            "write_s": self.write_s,
            "reused": self.reused,
        }


def _marker(fmt: str, config: LlamaConfig, group_size: int, seed: int) -> dict[str, Any]:
    config_json: dict[str, Any] = json.loads(config.to_json_string(use_diff=False))
    return {"format": fmt, "group_size": group_size, "seed": seed, "config": config_json}


def write_checkpoint(
    variant: str,
    config: LlamaConfig,
    directory: str | Path,
    device: str | torch.device | None = None,  # None: the GPU if there is one, else the CPU
    *,
    group_size: int = GROUP_SIZE,
    shard_bytes: int = SHARD_BYTES,
    seed: int = 0,
) -> Checkpoint:
    """Write the checkpoint `variant` loads (`checkpoint_format`) into `directory`: safetensors
    shards of at most `shard_bytes` (a group of `tensor_groups` larger than that gets one of its
    own), `model.safetensors.index.json`, `config.json` with its `quantization_config`. A complete
    checkpoint of the same format, config, group size and seed already there is reused, any other
    one this function wrote (or began) is replaced; a directory holding anything else is refused."""
    fmt = checkpoint_format(variant)
    path = Path(directory)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    marker = _marker(fmt, config, group_size, seed)
    if (path / MARKER).is_file():
        written = json.loads((path / MARKER).read_text())
        if {k: v for k, v in written.items() if k in marker} == marker:
            return Checkpoint(path, fmt, written["bytes"], _disk_bytes(path), written["files"], None, True)
    if path.exists():
        foreign = [p.name for p in path.iterdir() if not _WRITTEN.fullmatch(p.name)]
        if foreign:
            raise ValueError(
                f"{path} holds files that are not a checkpoint of this benchmark ({', '.join(foreign[:3])}): "
                "use another --dir"
            )
        shutil.rmtree(path)  # another format's or shape's, or one whose writing was cut short
    path.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    parts: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        part = path / f"part-{len(parts) + 1:05d}.safetensors"
        save_file(shard, str(part), metadata={"format": "pt"})
        parts.append((part, list(shard)))
        shard.clear()

    with torch.no_grad():
        for group in tensor_groups(fmt, config, dev, seed, group_size):
            group_bytes = sum(t.nbytes for t in group.values())
            if shard and size + group_bytes > shard_bytes:
                flush()
                size = 0
            shard.update((name, t.to("cpu").contiguous()) for name, t in group.items())
            size += group_bytes
            total += group_bytes
            del group
        flush()
    weight_map: dict[str, str] = {}
    for i, (part, names) in enumerate(parts, 1):
        final = path / f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        part.rename(final)
        weight_map |= dict.fromkeys(names, final.name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config_json: dict[str, Any] = json.loads(config.to_json_string(use_diff=False))
    quant = quantization_config(fmt, group_size)
    if quant is not None:
        config_json["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config_json, indent=2))
    write_s = time.perf_counter() - start
    (path / MARKER).write_text(json.dumps(marker | {"bytes": total, "files": len(parts), "write_s": write_s}))
    return Checkpoint(path, fmt, total, _disk_bytes(path), len(parts), write_s, reused=False)


def _disk_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.iterdir())


def evict_page_cache(directory: Path) -> str:
    """Write the checkpoint's files back and drop their pages from the page cache, so the next load
    reads them from the disk; what happened, in words."""
    try:
        for file in sorted(directory.iterdir()):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except (OSError, AttributeError) as exc:  # AttributeError: no posix_fadvise on this OS
        return f"not evicted ({type(exc).__name__}: {exc})"
    return "evicted"


def filesystem_of(path: Path) -> str | None:
    """The file-system type holding `path` (/proc/mounts' longest mount point above it): on
    tmpfs the checkpoint lives in memory and eviction does nothing."""
    try:
        mounts = [line.split()[:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    resolved = str(path.resolve())
    best, kind = "", None
    for _, point, fs in (m for m in mounts if len(m) == 3):
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fs
    return kind


# --- engines ----------------------------------------------------------------------------------


class _LoadRecord(logging.Handler):
    """Keeps the seconds of the start-up's "model loaded in %.1f s" log record."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("model loaded in") or not isinstance(record.args, tuple):
            return
        seconds = record.args[0] if record.args else None
        if isinstance(seconds, int | float):
            self.seconds = float(seconds)


@contextlib.contextmanager
def logged_load_seconds() -> Iterator[_LoadRecord]:
    """The weight-loading seconds the engine's start-up logs while the block runs (None if it logs
    none)."""
    source = logging.getLogger("pagedserve.worker.startup.device_model")
    handler = _LoadRecord()
    level = source.level
    if not source.isEnabledFor(logging.INFO):
        source.setLevel(logging.INFO)
    source.addHandler(handler)
    try:
        yield handler
    finally:
        source.removeHandler(handler)
        source.setLevel(level)


def engine_args(variant: str, checkpoint: str | Path, platform: str, **options: Any) -> EngineArgs:
    """The variant's engine over its checkpoint: `gpu_latency.bench_engine_args` reading the
    checkpoint's weights, with the variant's changes; `options` overrides."""
    fields: dict[str, Any] = {"load_format": "safetensors"} | VARIANTS[variant].engine | options
    args: EngineArgs = bench_engine_args(str(checkpoint), platform, **fields)
    return args


def _linear_layers(engine: LLMEngine) -> dict[str, int]:
    """The decoder's quantized linear layers by what runs them."""
    loaded = engine.setup.loaded
    counts: dict[str, int] = {}
    if loaded is None:
        return counts
    for module in loaded.model.modules():
        if isinstance(module, IntWeightLinear):
            runs_on = module.kernel.name if module.kernel else "core dequantize + matmul"
            name = f"int{module.scheme.bits}: {runs_on}"
        elif isinstance(module, Fp8Linear):
            name = f"fp8: {module.kernel.name if module.kernel else 'torch._scaled_mm'}"
        else:
            continue
        counts[name] = counts.get(name, 0) + 1
    return counts


def _model_bytes(engine: LLMEngine) -> int | None:
    loaded = engine.setup.loaded
    if loaded is None:
        return None
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def build_engine(
    variant: str, checkpoint: str | Path, platform: str, **options: Any
) -> tuple[LLMEngine, dict[str, Any]]:
    """Build the variant's engine; with what its start-up cost and what it holds."""
    with logged_load_seconds() as load:
        start = time.perf_counter()
        engine = LLMEngine(engine_args(variant, checkpoint, platform, **options))
        build_s = time.perf_counter() - start
    out: dict[str, Any] = {"load_s": load.seconds, "build_s": build_s}
    runner = engine.core.runner
    times = runner.startup_times if isinstance(runner, ModelRunner) else None
    if times is not None:
        out["startup"] = {
            "compile_s": times.compile_s,
            "attention_kernels_s": times.kernels_s,
            "capture_s": times.capture_s,
        }
    blocks = engine.setup.num_kv_blocks
    out |= {
        "kv_blocks": blocks,
        "kv_tokens": blocks * engine.args.block_size,
        "model_bytes": _model_bytes(engine),
        "linear_layers": _linear_layers(engine),
        "backend": engine.setup.backend.name,
    }
    return engine, out


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(args: argparse.Namespace, variant: str, checkpoint: Checkpoint, out: dict[str, Any]) -> None:
    """Build the variant's engine from the (evicted) checkpoint and measure it into `out` (which
    keeps what was measured if a step fails); the engine is freed after."""
    out["page_cache"] = "kept (--no-evict)" if args.no_evict else evict_page_cache(checkpoint.path)
    engine, built = build_engine(
        variant, checkpoint.path, args.platform, gpu_memory_utilization=args.gpu_memory_utilization
    )
    out |= built
    print(json.dumps(out), flush=True)
    out["single_stream"] = single_stream(engine, args.prompt_len, args.output_len)
    print(json.dumps(out["single_stream"]), flush=True)
    if args.workload:
        requests = fit_vocab(load_workload(args.workload), engine.vocab_size, wrap=True)
        if args.warmup_requests:
            run_throughput(engine, requests[: args.warmup_requests])
        out["throughput"] = run_throughput(engine, requests).to_dict()
        print(json.dumps(out["throughput"]), flush=True)
    del engine
    _free()
    if args.load_twice and variant == "bf16":  # again, its pages now in the page cache
        engine, warm = build_engine(
            variant, checkpoint.path, args.platform, gpu_memory_utilization=args.gpu_memory_utilization
        )
        del engine
        _free()
        out["warm_load"] = {key: warm[key] for key in ("load_s", "build_s", "startup") if key in warm}
        print(json.dumps(out["warm_load"]), flush=True)


# --- report -----------------------------------------------------------------------------------


def _get(results: dict[str, Any], variant: str, *path: str) -> float | None:
    value: Any = results.get(variant)
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, int | float) else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(variants: dict[str, Any]) -> dict[str, Any]:
    """The ratios the targets use, from the variants' results (None where one side is missing)."""
    tpot = ("single_stream", "tpot_median_ms")
    tput = ("throughput", "output_tokens_per_s")
    others = [v for v in VARIANTS if v != "bf16" and v in variants]
    out: dict[str, Any] = {
        name: {v: _div(_get(variants, v, *key), _get(variants, "bf16", *key)) for v in others}
        for name, key in (
            ("tpot_vs_bf16", tpot),
            ("throughput_vs_bf16", tput),
            ("load_s_vs_bf16", ("load_s",)),
            ("checkpoint_bytes_vs_bf16", ("checkpoint_bytes",)),
        )
    }
    out["ct_fp8_vs_fp8_load_time"] = {
        "tpot": _div(_get(variants, "ct_fp8", *tpot), _get(variants, "fp8_load_time", *tpot)),
        "throughput": _div(_get(variants, "ct_fp8", *tput), _get(variants, "fp8_load_time", *tput)),
    }
    return out


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(results: dict[str, Any]) -> str:
    """The report: one row per variant, then the ratios."""
    variants: dict[str, Any] = results.get("variants", {})
    r = ratios(variants)
    lines = [
        f"{results.get('device', '?')}, torch {results.get('torch', '?')}, "
        f"triton {results.get('triton', '?')}, platform {(results.get('args') or {}).get('platform', '?')}",
        "",
        "| variant | checkpoint GB | load s | warm load s | build s | model GiB | KV tokens | TTFT ms "
        "| TPOT ms | TPOT vs bf16 | out tok/s | tok/s vs bf16 | linear layers |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        v = variants.get(name)
        if v is None:
            continue
        gb = _get(variants, name, "checkpoint_bytes")
        if "error" in v:
            lines.append(
                f"| {name} | {_fmt(None if gb is None else gb / 1e9, '.2f')} | failed: {v['error'][:300]} |"
            )
            continue
        model = _get(variants, name, "model_bytes")
        layers = ", ".join(f"{count} {what}" for what, count in v.get("linear_layers", {}).items())
        cells = [
            name,
            _fmt(None if gb is None else gb / 1e9, ".2f"),
            _fmt(_get(variants, name, "load_s"), ".1f"),
            _fmt(_get(variants, name, "warm_load", "load_s"), ".1f"),
            _fmt(_get(variants, name, "build_s"), ".1f"),
            _fmt(None if model is None else model / 2**30, ".2f"),
            _fmt(_get(variants, name, "kv_tokens"), ".0f"),
            _fmt(_get(variants, name, "single_stream", "ttft_ms"), ".1f"),
            _fmt(_get(variants, name, "single_stream", "tpot_median_ms"), ".2f"),
            _fmt(r["tpot_vs_bf16"].get(name), ".3f", "x"),
            _fmt(_get(variants, name, "throughput", "output_tokens_per_s"), ".0f"),
            _fmt(r["throughput_vs_bf16"].get(name), ".3f", "x"),
            layers or "bf16",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    both = r["ct_fp8_vs_fp8_load_time"]
    lines += [
        "",
        f"ct_fp8 / fp8_load_time: TPOT {_fmt(both['tpot'], '.3f', 'x')}, "
        f"throughput {_fmt(both['throughput'], '.3f', 'x')}",
    ]
    return "\n".join(lines)


def merge(files: list[str]) -> dict[str, Any]:
    """One report of several runs' JSON files (later files' variants replace earlier ones')."""
    merged: dict[str, Any] = {"merged_from": files, "variants": {}, "checkpoints": {}}
    devices, platforms = [], []
    for file in files:
        run = json.loads(Path(file).read_text())
        devices.append(run.get("device"))
        platforms.append((run.get("args") or {}).get("platform"))
        for key in ("device", "torch", "triton", "revision", "args", "checkpoint_filesystem"):
            if key in run:
                merged.setdefault(key, run[key])
        merged["variants"] |= run.get("variants", {})
        merged["checkpoints"] |= run.get("checkpoints", {})
    if len(set(devices)) > 1:
        merged["device"] = " / ".join(str(d) for d in devices) + " (different devices: ratios not comparable)"
    if len(set(platforms)) > 1:  # the table names one platform: say they differ
        merged["args"] = {"platform": " / ".join(str(p) for p in platforms) + " (different platforms)"}
    merged["ratios"] = ratios(merged["variants"])
    return merged


# --- command line -----------------------------------------------------------------------------


def variant_list(text: str) -> list[str]:
    """`--variants`: comma-separated names of VARIANTS."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)} (comma-separated)"
        )
    if not names:
        raise argparse.ArgumentTypeError(f"no variant given; choose from {', '.join(VARIANTS)}")
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--platform", default="triton", help="triton (default) or cuda")
    parser.add_argument("--shape", default="8b", choices=list(LLAMA_SHAPES), help="Llama-3.1 shapes")
    parser.add_argument(
        "--variants",
        type=variant_list,
        default=list(VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS)}",
    )
    parser.add_argument(
        "--dir", help="keep the checkpoints here and reuse them (default: a temporary directory)"
    )
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--workload", help="workload JSON of the throughput run (none: no throughput)")
    parser.add_argument("--warmup-requests", type=int, default=16)
    parser.add_argument("--load-twice", action="store_true", help="build bf16 twice: the second load is warm")
    parser.add_argument("--no-evict", action="store_true", help="leave the checkpoints in the page cache")
    parser.add_argument("--write-device", help="where random tensors are drawn (default: cuda, else cpu)")
    parser.add_argument("--group-size", type=int, default=GROUP_SIZE, help="4-bit scale groups")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here (after every variant)")
    parser.add_argument(
        "--merge", nargs="+", metavar="FILE", help="only report these runs' --json files together"
    )
    return parser


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _revision() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def disk_peak_bytes(variants: list[str], sizes: dict[str, int], keep: bool) -> int:
    """The most checkpoint bytes on the disk at once while `variants` run in order: all of them
    when kept, else each from its first variant to its last. Pure."""
    formats = [checkpoint_format(v) for v in variants]
    if keep:
        return sum(sizes[fmt] for fmt in set(formats))
    last = {fmt: i for i, fmt in enumerate(formats)}
    return max(
        (sum(sizes[fmt] for fmt in set(formats[: i + 1]) if last[fmt] >= i) for i in range(len(formats))),
        default=0,
    )


def _preflight(args: argparse.Namespace, config: LlamaConfig, root: Path, keep: bool) -> dict[str, int]:
    """Each needed checkpoint's bytes; refuses (SystemExit) variants whose weights cannot fit the
    GPU's share, and checkpoints that cannot fit the disk."""
    formats = dict.fromkeys(checkpoint_format(v) for v in args.variants)
    sizes = {fmt: checkpoint_bytes(fmt, config, args.group_size) for fmt in formats}
    budget = torch.cuda.get_device_properties(0).total_memory * args.gpu_memory_utilization
    too_big = {v: sizes[checkpoint_format(v)] for v in args.variants if sizes[checkpoint_format(v)] > budget}
    if too_big:
        shown = ", ".join(f"{v} {size / 1e9:.1f} GB" for v, size in too_big.items())
        raise SystemExit(
            f"the {args.shape} weights of {shown} do not fit {args.gpu_memory_utilization} of this GPU "
            f"({budget / 1e9:.1f} GB): leave them out of --variants"
        )
    present = {fmt for fmt in sizes if (root / f"{args.shape}-{fmt}" / MARKER).is_file()}
    to_write = {fmt: 0 if fmt in present else size for fmt, size in sizes.items()}
    need = disk_peak_bytes(args.variants, to_write, keep)
    free = shutil.disk_usage(root).free
    if need * 1.02 > free:
        raise SystemExit(
            f"the checkpoints to write need {need / 1e9:.1f} GB at once, but {root} has "
            f"{free / 1e9:.1f} GB free: use another --dir, fewer --variants, or no --dir (each "
            "checkpoint is then removed after its last variant)"
        )
    return sizes


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit(
            "gpu_quantized.py measures on a CUDA GPU and none is visible (its tests run the writers on CPUs)"
        )
    config = llama_config(args.shape)
    keep = args.dir is not None
    root = Path(args.dir) if keep else Path(tempfile.mkdtemp(prefix="pagedserve-quantized-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "revision": _revision(),
        "args": vars(args),
        "config": json.loads(config.to_json_string(use_diff=False)),
        "checkpoint_filesystem": filesystem_of(root),
        "checkpoints": {},
        "variants": {},
    }
    failed = False
    try:
        sizes = _preflight(args, config, root, keep)
        results["checkpoint_sizes_bytes"] = sizes
        last_use = {checkpoint_format(v): i for i, v in enumerate(args.variants)}
        for i, name in enumerate(args.variants):
            fmt = checkpoint_format(name)
            out: dict[str, Any] = {"checkpoint": fmt, "checkpoint_bytes": sizes[fmt]}
            results["variants"][name] = out
            try:
                checkpoint = write_checkpoint(
                    fmt, config, root / f"{args.shape}-{fmt}", args.write_device,
                    group_size=args.group_size, seed=args.seed,
                )  # fmt: skip
                results["checkpoints"].setdefault(fmt, checkpoint.to_dict())  # the first: its write_s
                logger.info("%s: checkpoint %s, %.2f GB in %d files", name, checkpoint.path,
                            checkpoint.bytes / 1e9, checkpoint.files)  # fmt: skip
                _free()
                measure(args, name, checkpoint, out)
            except Exception as exc:  # a refused or failing variant is a result; the others still run
                traceback.print_exc()
                failed = True
                out["error"] = f"{type(exc).__name__}: {exc}"
            _free()  # after the except block: its traceback no longer holds the engine
            if not keep and last_use[fmt] == i:
                shutil.rmtree(root / f"{args.shape}-{fmt}", ignore_errors=True)
            results["ratios"] = ratios(results["variants"])
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results, indent=2))
    print(markdown_table(results))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.merge:
        results = merge(args.merge)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        print(json.dumps(results["ratios"], indent=2))
        print(markdown_table(results))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
