"""The cuda platform without a GPU: availability reasons, the kernel-selection heuristic, the
wrappers' layout contracts (checked before any CUDA call), tuned configs, argument packing, and
NVRTC compilation of every kernel family when libnvrtc is installed (skipped otherwise)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import struct
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pagedserve.platforms.api import PLUGIN_API_VERSION, AttentionLayerShape, UnsupportedCase
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.tuned_configs import TunedConfigError, TunedConfigs
from pagedserve_cuda import compiler, launcher, plugin
from pagedserve_cuda.attention import CudaPagedAttentionBackend
from pagedserve_cuda.cache_ops import CudaCacheOps, contiguous_runs, copy_unit
from pagedserve_cuda.compiler import CudaCompileError, CudaToolError, KernelSource
from pagedserve_cuda.launcher import CudaKernel
from pagedserve_cuda.paged_attention import check_decode_layout, decode_source, decode_variant
from pagedserve_cuda.selection import (
    BatchShape,
    DecodeTuning,
    DeviceProps,
    LaunchShape,
    explain,
    heads_per_cta,
    shared_bytes,
    thread_layout,
)
from pagedserve_cuda.tuning import decode_tuning, tuned_config_files

H100 = DeviceProps("NVIDIA H100 80GB HBM3", 132, (9, 0))
TUNING = DecodeTuning(
    num_threads=128, partition_size=512, min_partition_size=128, ctas_per_sm=2, v1_max_seq_len=4096
)
BF16 = torch.bfloat16


def _llama(num_seqs: int, ctx: int, **changes: object) -> BatchShape:
    fields: dict[str, object] = dict(
        num_seqs=num_seqs, max_query_len=1, max_seq_len=ctx, num_q_heads=32, num_kv_heads=8,
        head_size=128, dtype=BF16, block_size=16,
    )  # fmt: skip
    fields.update(changes)
    return BatchShape(**fields)  # type: ignore[arg-type]


# --- availability ------------------------------------------------------------------------------


def test_unavailable_without_a_gpu_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = plugin.availability()
    assert not result.available and "no NVIDIA GPU" in result.reason


def test_unavailable_on_rocm_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2")
    result = plugin.availability()
    assert not result.available and "ROCm" in result.reason


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=0: "NVIDIA Test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _=0: capability)


def test_unavailable_below_sm80(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, (7, 5))
    result = plugin.availability()
    assert not result.available and "sm_75" in result.reason and "sm_80" in result.reason


def test_unavailable_without_nvrtc_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, (9, 0))

    def missing() -> tuple[int, int]:
        raise CudaToolError(f"cuda-python cannot be imported (ImportError: no); {compiler.INSTALL_HINT}")

    monkeypatch.setattr(plugin, "nvrtc_version", missing)
    result = plugin.availability()
    assert not result.available and "pip install 'pagedserve[cuda]'" in result.reason


def test_load_nvrtc_without_cuda_python_raises_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_module(name: str) -> types.ModuleType:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(compiler.importlib, "import_module", no_module)
    with pytest.raises(CudaToolError, match=r"pip install 'pagedserve\[cuda\]'"):
        compiler.load_nvrtc()


def test_available_on_sm90_with_the_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    _fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(plugin, "nvrtc_version", lambda: (13, 0))
    result = plugin.availability()
    assert result.available and "sm_90" in result.reason and "NVRTC 13.0" in result.reason


def test_platform_outranks_triton_and_lists_both_config_sets() -> None:
    (info,) = plugin.pagedserve_platforms()
    assert info.name == "cuda" and info.priority > 10 and info.device_type == "cuda"
    files = plugin.pagedserve_tuned_config_files("cuda")
    assert files is not None
    kernels = TunedConfigs.from_files(files).kernels()
    assert "cuda_paged_attention" in kernels and "unified_attention_2d" in kernels
    assert plugin.pagedserve_tuned_config_files("triton") is None


# --- explain -------------------------------------------------------------------------------------


def test_prefill_and_mixed_batches_go_to_triton() -> None:
    choice = explain(_llama(4, 512, max_query_len=37), H100, TUNING)
    assert choice.kernel == "triton" and choice.launch is None and "max_query_len=37" in choice.reason


def test_unsupported_dtype_and_head_size_go_to_triton() -> None:
    assert explain(_llama(4, 512, dtype=torch.float64), H100, TUNING).kernel == "triton"
    assert explain(_llama(4, 512, head_size=264), H100, TUNING).kernel == "triton"
    old = DeviceProps("Tesla T4", 40, (7, 5))
    assert "sm_75" in explain(_llama(4, 512), old, TUNING).reason


def test_many_sequences_use_v1() -> None:
    choice = explain(_llama(64, 2048), H100, TUNING)
    assert choice.kernel == "cuda_v1" and choice.launch is not None
    assert choice.launch.partition_size is None and choice.launch.heads_per_cta == 4


def test_few_long_sequences_use_v2_with_partitions_that_fill_the_gpu() -> None:
    choice = explain(_llama(1, 8192), H100, TUNING)
    assert choice.kernel == "cuda_v2" and choice.launch is not None
    size, parts = choice.launch.partition_size, choice.launch.num_partitions
    assert size is not None and parts == -(-8192 // size)
    # 8 CTAs per partition; partitions halve until 2 CTAs per SM or the 128-token floor.
    assert 8 * parts >= 2 * 132 or size == TUNING.min_partition_size


def test_long_contexts_use_v2_even_with_many_ctas() -> None:
    choice = explain(_llama(256, 8192), H100, TUNING)
    assert choice.kernel == "cuda_v2" and "longer than 4096" in choice.reason


def test_short_contexts_and_windows_use_v1() -> None:
    assert explain(_llama(1, 100), H100, TUNING).kernel == "cuda_v1"
    windowed = explain(_llama(1, 8192, sliding_window=64), H100, TUNING)
    assert windowed.kernel == "cuda_v1" and "64 tokens" in windowed.reason


def test_gqa_groups_and_thread_counts_fit_the_hardware() -> None:
    assert [heads_per_cta(q) for q in (1, 3, 4, 8, 12, 16)] == [1, 3, 4, 8, 6, 8]
    wide = DecodeTuning(256, 512, 128, 2, 4096)
    choice = explain(
        _llama(512, 512, num_q_heads=64, num_kv_heads=8, head_size=256, dtype=torch.float32), H100, wide
    )
    assert choice.launch is not None
    assert shared_bytes(choice.launch.num_threads, 8, 256) <= 48 * 1024 and choice.launch.num_threads == 128


def test_thread_layout_covers_every_declared_head_size() -> None:
    for dtype in (torch.float16, BF16, torch.float32):
        for head in CudaPagedAttentionBackend.capabilities.head_sizes:
            tg, rows = thread_layout(head, dtype, 4)
            vecs = head // (16 // dtype.itemsize)
            assert tg & (tg - 1) == 0 and vecs % tg == 0 and tg <= 32 and rows >= 1


def test_describe_names_the_kernel_and_the_grid() -> None:
    text = explain(_llama(1, 8192), H100, TUNING).describe()
    assert text.startswith("cuda_v2 (4 heads/CTA, 128 threads") and "partitions of" in text


# --- layout contracts (no CUDA call) -------------------------------------------------------------

V1 = LaunchShape(
    heads_per_cta=4, num_threads=128, threads_per_token=16, rows=8, partition_size=None, num_partitions=1
)


def _decode_inputs(dtype: torch.dtype = BF16) -> dict[str, torch.Tensor]:
    query = torch.zeros(3, 32, 128, dtype=dtype)
    return {
        "out": torch.zeros_like(query),
        "query": query,
        "kv_cache": torch.zeros(2, 10, 16, 8, 128, dtype=dtype),
        "block_table": torch.zeros(3, 4, dtype=torch.int32),
        "seq_lens": torch.ones(3, dtype=torch.int32),
        "query_start_loc": torch.arange(4, dtype=torch.int32),
    }


def _check(inputs: dict[str, torch.Tensor], launch: LaunchShape = V1, num_seqs: int = 3) -> None:
    check_decode_layout(
        inputs["out"], inputs["query"], inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"],
        inputs["query_start_loc"], num_seqs, launch,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.update(query=t["query"][0]), "query must be"),
        (lambda t: t.update(kv_cache=t["kv_cache"][0]), "NHD"),
        (lambda t: t.update(kv_cache=t["kv_cache"].half()), "kv_cache dtype"),
        (lambda t: t.update(query=t["query"].double(), out=t["out"].double()), "dtype torch.float64"),
        (lambda t: t.update(kv_cache=torch.zeros(2, 10, 16, 8, 64, dtype=BF16)), "head_size differs"),
        (lambda t: t.update(kv_cache=torch.zeros(2, 10, 16, 5, 128, dtype=BF16)), "not a multiple"),
        (lambda t: t.update(query=torch.zeros(3, 32, 129, dtype=BF16)[..., 1:]), "16-byte aligned"),
        (lambda t: t.update(query=torch.zeros(3, 128, 32, dtype=BF16).transpose(1, 2)), "unit-stride"),
        (lambda t: t.update(block_table=t["block_table"].long()), "block_table must be int32"),
        (lambda t: t.update(block_table=t["block_table"].t()), "block_table must be"),
        (lambda t: t.update(seq_lens=t["seq_lens"][:2]), "seq_lens must be"),
        (lambda t: t.update(query_start_loc=t["query_start_loc"][:3]), "query_start_loc must be"),
        (lambda t: t.update(out=t["out"][:2]), "out must be"),
        (lambda t: None, "on one CUDA device"),
    ],
)
def test_decode_wrapper_rejects_bad_layouts_before_cuda(change: object, message: str) -> None:
    inputs = _decode_inputs()
    assert callable(change)
    change(inputs)
    with pytest.raises(ValueError, match=message):
        _check(inputs)


def test_decode_wrapper_rejects_a_launch_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match="heads_per_cta=3"):
        _check(_decode_inputs(), LaunchShape(3, 128, 16, 8, None, 1))
    with pytest.raises(ValueError, match="thread_layout"):
        _check(_decode_inputs(), LaunchShape(4, 128, 8, 8, None, 1))
    with pytest.raises(ValueError, match="num_threads=100"):
        _check(_decode_inputs(), LaunchShape(4, 100, 16, 8, None, 1))
    with pytest.raises(ValueError, match="num_seqs=0"):
        _check(_decode_inputs(), num_seqs=0)


def test_backend_refuses_undeclared_cases_with_unsupported_case() -> None:
    backend = CudaPagedAttentionBackend()
    inputs = _decode_inputs(torch.float64)
    from pagedserve.platforms.attention_metadata import AttentionMetadata

    meta = AttentionMetadata.build([1, 1, 1], [1, 1, 1], inputs["block_table"], 16)
    with pytest.raises(UnsupportedCase, match="float64"):
        backend.forward(inputs["query"], inputs["kv_cache"], meta, scale=1.0)
    with pytest.raises(ValueError, match="kernel='v3'"):
        CudaPagedAttentionBackend(kernel="v3")  # type: ignore[arg-type]


def test_cache_ops_reject_bad_layouts_before_cuda() -> None:
    ops = CudaCacheOps()
    cache = torch.zeros(2, 8, 16, 2, 64, dtype=torch.float16)
    key = torch.zeros(4, 2, 64, dtype=torch.float16)
    slots = torch.arange(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="NHD"):
        ops.reshape_and_cache(key, key, cache[0], slots)
    with pytest.raises(ValueError, match="contiguous within and between blocks"):
        ops.reshape_and_cache(key, key, cache[:, ::2], slots)
    with pytest.raises(ValueError, match="key must be"):
        ops.reshape_and_cache(key[:, :1], key, cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be 1-D int64"):
        ops.reshape_and_cache(key, key, cache, slots.int())
    with pytest.raises(ValueError, match="need a CUDA device"):
        ops.reshape_and_cache(key, key, cache, slots)
    with pytest.raises(ValueError, match=r"source block ids must lie in \[0, 8\)"):
        ops.copy_blocks([cache], torch.tensor([[8, 1]]))
    with pytest.raises(ValueError, match="block_mapping must be"):
        ops.copy_blocks([cache], torch.tensor([[1, 2]], dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_caches\\[1\\]"):
        ops.copy_blocks([cache, cache.float()], torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        ops.swap_blocks(cache, cache.clone(), torch.tensor([[1, 2]]))


def test_copy_unit_and_contiguous_runs() -> None:
    assert copy_unit(256, 32, 4096) == 16 and copy_unit(160, 8) == 8 and copy_unit(6, 2) == 2
    with pytest.raises(ValueError, match="2-byte aligned"):
        copy_unit(3)
    mapping = torch.tensor([[4, 10], [5, 11], [6, 12], [9, 2], [1, 3]])
    assert contiguous_runs(mapping) == [(4, 10, 3), (9, 2, 1), (1, 3, 1)]


# --- tuned configs ---------------------------------------------------------------------------------


def test_decode_tuning_per_device() -> None:
    configs = TunedConfigs.from_files(tuned_config_files())
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"):
        tuning = decode_tuning(configs, name, head_size=128, dtype=BF16)
        assert tuning.num_threads % 32 == 0 and tuning.min_partition_size <= tuning.partition_size


def test_decode_tuning_rejects_bad_values(tmp_path: Path) -> None:
    bad = tmp_path / "cuda_paged_attention-default.json"
    params = (
        '{"num_threads": 100, "partition_size": 512, "min_partition_size": 128, '
        '"ctas_per_sm": 2, "v1_max_seq_len": 1}'
    )
    bad.write_text(f'{{"schema_version": 1, "kernel": "cuda_paged_attention", "device": "default", '
                   f'"configs": [{{"match": {{}}, "params": {params}}}]}}')  # fmt: skip
    with pytest.raises(TunedConfigError, match="num_threads"):
        decode_tuning(TunedConfigs.from_files([bad]), "NVIDIA H100", head_size=128, dtype=BF16)


# --- argument packing ------------------------------------------------------------------------------


def test_kernel_launch_packs_every_argument_into_its_slot() -> None:
    seen: list[list[bytes]] = []

    def fake_launch(func: object, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int,
                    stream: int, params: int, extra: int) -> tuple[int]:  # fmt: skip
        ptrs = (ctypes.c_void_p * 4).from_address(params)
        seen.append([ctypes.string_at(p or 0, 8) for p in ptrs])
        return (0,)

    driver = types.SimpleNamespace(
        cuLaunchKernel=fake_launch, CUresult=types.SimpleNamespace(CUDA_SUCCESS=0), cuGetErrorName=None
    )
    kernel = CudaKernel(driver, object(), "k", "pqif")  # type: ignore[arg-type]
    kernel.launch((1, 1, 1), 32, 0, 0, 0xDEADBEEF, -5, 7, 1.5)
    kernel.launch((1, 1, 1), 32, 0, 0, 1, 2, 3, 4.0)
    first, second = seen
    assert struct.unpack("<Q", first[0])[0] == 0xDEADBEEF and struct.unpack("<q", first[1])[0] == -5
    assert struct.unpack("<i", first[2][:4])[0] == 7 and struct.unpack("<f", first[3][:4])[0] == 1.5
    assert struct.unpack("<f", second[3][:4])[0] == 4.0
    with pytest.raises(ValueError, match="unknown argument kinds"):
        CudaKernel(driver, object(), "k", "pz")  # type: ignore[arg-type]


def test_threads_launching_one_kernel_each_pass_their_own_arguments() -> None:
    # The start-up sweep launches from several threads; one kernel's parameter block is shared.
    mismatches: list[tuple[int, int]] = []

    def fake_launch(func: object, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int,
                    stream: int, params: int, extra: int) -> tuple[int]:  # fmt: skip
        slot = ctypes.c_void_p.from_address(params).value or 0
        before = struct.unpack("<q", ctypes.string_at(slot, 8))[0]
        time.sleep(0.0005)  # the driver reading the block; another thread may run meanwhile
        after = struct.unpack("<q", ctypes.string_at(slot, 8))[0]
        if before != after or before != gx:
            mismatches.append((gx, after))
        return (0,)

    driver = types.SimpleNamespace(
        cuLaunchKernel=fake_launch, CUresult=types.SimpleNamespace(CUDA_SUCCESS=0), cuGetErrorName=None
    )
    kernel = CudaKernel(driver, object(), "k", "q")  # type: ignore[arg-type]

    def launch_many(first: int) -> None:
        for value in range(first, first + 40):
            kernel.launch((value, 1, 1), 32, 0, 0, value)  # the grid says which argument it passed

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(launch_many, (1, 1001, 2001, 3001)))
    assert mismatches == []


def test_the_loader_compiles_different_modules_at_once_and_one_module_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    both_compiling = threading.Barrier(2, timeout=10)  # broken unless two compiles overlap
    compiled: list[KernelSource] = []

    def fake_cubin(source: KernelSource, arch: str) -> bytes:
        compiled.append(source)
        if source.file != "same.cu":
            both_compiling.wait()
        return b"cubin"

    driver = types.SimpleNamespace(
        cuModuleLoadData=lambda cubin: (0, object()),
        cuModuleGetFunction=lambda module, name: (0, object()),
        cuLaunchKernel=None,
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
    )
    monkeypatch.setattr(launcher, "cached_cubin", fake_cubin)
    monkeypatch.setattr(launcher, "device_arch", lambda device: "sm_90")
    monkeypatch.setattr(launcher, "load_driver", lambda: driver)
    monkeypatch.setattr(launcher, "_make_primary_context_current", lambda driver, index: None)
    monkeypatch.setattr(launcher.torch.cuda, "device", lambda index: contextlib.nullcontext())
    loader = launcher.KernelLoader()
    device = torch.device("cuda", 0)
    sources = [KernelSource("a.cu", ()), KernelSource("b.cu", ())] + [KernelSource("same.cu", ())] * 4
    with ThreadPoolExecutor(6) as pool:
        kernels = list(pool.map(lambda src: loader.kernel(src, "f", "p", device), sources))
    assert sorted(s.file for s in compiled) == ["a.cu", "b.cu", "same.cu"]
    assert len({id(k) for k in kernels[2:]}) == 1  # one module, one function object for "same.cu"


# --- NVRTC -------------------------------------------------------------------------------------------


def _nvrtc_or_skip() -> None:
    try:
        compiler.nvrtc_version()
    except CudaToolError as e:
        pytest.skip(f"NVRTC is not installed here: {e}")


def test_cache_key_covers_source_options_arch_and_version() -> None:
    base = compiler.cache_key("src", ["-DA=1"], "sm_90", (13, 0))
    assert len({
        base,
        compiler.cache_key("src2", ["-DA=1"], "sm_90", (13, 0)),
        compiler.cache_key("src", ["-DA=2"], "sm_90", (13, 0)),
        compiler.cache_key("src", ["-DA=1"], "sm_80", (13, 0)),
        compiler.cache_key("src", ["-DA=1"], "sm_90", (12, 8)),
    }) == 5  # fmt: skip


def test_cache_dir_honours_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(compiler.CACHE_ENV, str(tmp_path / "c"))
    assert compiler.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(compiler.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compiler.cache_dir() == tmp_path / "pagedserve" / "cuda"


# Every dtype, v1 and v2, a padded head size (80) and the largest (256): the code paths that differ.
KERNEL_FAMILIES = [
    (torch.float16, 128, 4, None),
    (BF16, 128, 4, 512),
    (torch.float32, 80, 3, None),
    (BF16, 256, 8, 512),
]


@pytest.mark.parametrize(("dtype", "head", "qpk", "partition"), KERNEL_FAMILIES)
def test_attention_kernels_compile_to_cubin(
    dtype: torch.dtype, head: int, qpk: int, partition: int | None
) -> None:
    _nvrtc_or_skip()
    heads = heads_per_cta(qpk)
    tg, rows = thread_layout(head, dtype, heads)
    source = decode_source(dtype, head, 16, LaunchShape(heads, 128, tg, rows, partition, 1))
    cubin = compiler.compile_to_cubin(source.text(), source.file, source.options("sm_90"))
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("unit", [16, 2])
def test_cache_kernels_compile_to_cubin(unit: int) -> None:
    _nvrtc_or_skip()
    source = KernelSource("cache_ops.cu", (("UNIT_BYTES", unit),), with_common=False)
    assert compiler.compile_to_cubin(source.text(), source.file, source.options("sm_80"))[:4] == b"\x7fELF"


def test_cubins_are_cached_on_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _nvrtc_or_skip()
    monkeypatch.setenv(compiler.CACHE_ENV, str(tmp_path))
    source = KernelSource("cache_ops.cu", (("UNIT_BYTES", 4),), with_common=False)
    first = compiler.cached_cubin(source, "sm_80")
    assert [p.suffix for p in tmp_path.iterdir()] == [".cubin"]

    def no_compiler(*args: object) -> bytes:
        raise AssertionError("a cached cubin must not be compiled again")

    monkeypatch.setattr(compiler, "compile_to_cubin", no_compiler)
    assert compiler.cached_cubin(source, "sm_80") == first


def test_compile_errors_carry_the_nvrtc_log() -> None:
    _nvrtc_or_skip()
    with pytest.raises(CudaCompileError, match=r"(?s)broken\.cu.*undefined_name"):
        compiler.compile_to_cubin(
            'extern "C" __global__ void k() { undefined_name(); }', "broken.cu", ["--gpu-architecture=sm_80"]
        )


# --- pagedserve platforms --explain ------------------------------------------------------------------


def test_cli_explain_reports_the_cuda_choice(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedserve.cli import main as cli_main

    # Without --device the H100 is assumed; its measured table sends decode to Triton.
    assert cli_main.main(["platforms", "--explain", "--platform", "cuda", "--batch", "1x1x8192"]) == 0
    text = capsys.readouterr().out
    assert "cuda/cuda_paged" in text and "route decode batches to the Triton kernel" in text
    # A GPU without a table of its own gets the default one, which uses the CUDA kernels.
    a100 = ["--device", "NVIDIA A100-SXM4-80GB:108:8.0"]
    assert cli_main.main(["platforms", "--explain", "--platform", "cuda", "--batch", "1x1x8192", *a100]) == 0
    text = capsys.readouterr().out
    assert "cuda_v2" in text and "partitions of" in text
    args = ["platforms", "--explain", "--platform", "cuda", "--batch", "256x1x1024", "--device", "X:100:9.0"]
    assert cli_main.main(args) == 0
    assert "cuda_v1" in capsys.readouterr().out
    assert cli_main.main(["platforms", "--explain", "--platform", "cuda", "--batch", "8x33x512"]) == 0
    assert "triton: max_query_len=33" in capsys.readouterr().out


def test_cli_explain_rejects_malformed_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedserve.cli import main as cli_main

    assert cli_main.main(["platforms", "--explain", "--batch", "4x1"]) == 2
    assert "SEQSxQUERYxCTX" in capsys.readouterr().err
    assert cli_main.main(["platforms", "--explain", "--heads", "32-8"]) == 2
    assert cli_main.main(["platforms", "--explain", "--device", "H100"]) == 2
    assert "NAME:SMS:MAJOR.MINOR" in capsys.readouterr().err


def test_tuned_configs_can_route_decode_to_triton() -> None:
    tuning = DecodeTuning(128, 512, 128, 2, 4096, decode_kernels="triton")
    choice = explain(_llama(64, 2048), H100, tuning)
    assert choice.kernel == "triton" and "route decode batches to the Triton kernel" in choice.reason


# --- the plan key of full decode graphs ---------------------------------------------------------

CUDA0 = torch.device("cuda", 0)
LLAMA_LAYER = AttentionLayerShape(32, 8, 128, 16, BF16, BF16, CUDA0)
BUCKETS = (256, 512, 1024, 2048, 4096)


@pytest.fixture
def fake_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda:0 answers as an H100: the kernel choice is host-only, so no GPU is needed."""
    props = types.SimpleNamespace(name=H100.name, multi_processor_count=132, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _=0: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=0: H100.name)


def _capture_metadata(num_reqs: int, max_seq_len: int) -> AttentionMetadata:
    """The host fields a full decode graph of `num_reqs` requests is captured with."""
    table = torch.zeros((num_reqs, 1), dtype=torch.int32)
    md = AttentionMetadata.build([1] * num_reqs, [1] * num_reqs, table, 16)
    return dataclasses.replace(md, max_seq_len=max_seq_len)  # a bound, as in a capture


def test_plugin_declares_the_current_api() -> None:
    assert plugin.PAGEDSERVE_PLUGIN_API == PLUGIN_API_VERSION


@pytest.mark.usefixtures("fake_h100")
def test_full_graph_key_is_the_decode_kernel_and_its_launch() -> None:
    backend = CudaPagedAttentionBackend(tuning=TUNING)
    keys = {b: backend.full_graph_key(_capture_metadata(1, b), LLAMA_LAYER) for b in BUCKETS}
    for bucket, key in keys.items():
        choice = explain(_llama(1, bucket), H100, TUNING)
        assert key == (choice.kernel, choice.launch)
    # One sequence: v2 with a partition count that follows the bound, so every bucket differs.
    assert [k[1].num_partitions for k in keys.values()] == [2, 4, 8, 16, 32]  # type: ignore[union-attr]
    # 64 sequences fill the GPU with v1 up to v1_max_seq_len: one key at every bucket.
    assert {backend.full_graph_key(_capture_metadata(64, b), LLAMA_LAYER) for b in BUCKETS} == {
        ("cuda_v1", explain(_llama(64, 4096), H100, TUNING).launch)
    }
    # A sliding window bounds the span: bounds past the window plan alike.
    windowed = AttentionLayerShape(32, 8, 128, 16, BF16, BF16, CUDA0, sliding_window=1024)
    assert len({backend.full_graph_key(_capture_metadata(1, b), windowed) for b in (1024, 2048, 4096)}) == 1


def test_decode_variant_is_the_nvrtc_module_not_the_partition_count() -> None:
    """v2's partition count and size are run-time arguments: its launches of one shape class
    share one module, which the warm-up therefore compiles once (`compile_key`)."""
    launches = {explain(_llama(n, ctx), H100, TUNING).launch for n in (1, 8, 64) for ctx in BUCKETS}
    assert all(launch is not None for launch in launches)
    v2 = {launch for launch in launches if launch is not None and launch.partition_size is not None}
    assert len({(launch.partition_size, launch.num_partitions) for launch in v2}) > 1
    assert len({decode_variant(decode_source(BF16, 128, 16, launch), CUDA0) for launch in v2}) == 1
    every = {decode_variant(decode_source(BF16, 128, 16, launch), CUDA0) for launch in launches if launch}
    assert len(every) == 2  # v1 and v2
    fp8 = decode_variant(decode_source(BF16, 128, 16, next(iter(v2)), torch.float8_e4m3fn), CUDA0)
    assert fp8 not in every


def test_compile_key_off_cuda_is_the_triton_backends() -> None:
    from pagedserve_triton.attention import TritonUnifiedAttentionBackend

    query, cache = torch.zeros(2, 32, 128, dtype=BF16), torch.zeros(2, 4, 16, 8, 128, dtype=BF16)
    md = AttentionMetadata.build([1, 1], [20, 3], torch.zeros((2, 2), dtype=torch.int32), 16)
    key = CudaPagedAttentionBackend(tuning=TUNING).compile_key(query, cache, md, scale=0.1)
    triton = TritonUnifiedAttentionBackend(tuned_configs=TunedConfigs.from_files(tuned_config_files()))
    assert key is not None and key == triton.compile_key(query, cache, md, scale=0.1)

    class Other(CudaPagedAttentionBackend):
        def forward(self, *args: object, **kwargs: object) -> torch.Tensor:  # type: ignore[override]
            return super().forward(*args, **kwargs)  # type: ignore[arg-type]

    assert Other(tuning=TUNING).compile_key(query, cache, md, scale=0.1) is None


@pytest.mark.usefixtures("fake_h100")
def test_full_graph_key_of_decode_routed_to_triton_is_the_triton_plan() -> None:
    # Imported here, not at collection: the Triton test files set TRITON_INTERPRET=1 before triton
    # is first imported, and a worker may collect this file first.
    from pagedserve_triton.attention import PLAN_2D, SplitPlan, TritonUnifiedAttentionBackend

    routed = DecodeTuning(128, 512, 128, 2, 4096, decode_kernels="triton")  # as the H100 table says
    backend = CudaPagedAttentionBackend(tuning=routed)
    triton = TritonUnifiedAttentionBackend(tuned_configs=TunedConfigs.from_files(tuned_config_files()))
    for bucket in BUCKETS:
        md = _capture_metadata(1, bucket)
        assert backend.full_graph_key(md, LLAMA_LAYER) == ("triton", triton.full_graph_key(md, LLAMA_LAYER))
    assert backend.full_graph_key(_capture_metadata(1, 600), LLAMA_LAYER) == ("triton", SplitPlan("3d", 16))
    # Off CUDA `forward` always runs Triton (one interpreter "SM": the 2D kernel).
    forced = CudaPagedAttentionBackend(tuning=TUNING)
    on_cpu = AttentionLayerShape(32, 8, 128, 16, BF16, BF16, torch.device("cpu"))
    assert forced.full_graph_key(_capture_metadata(1, 4096), on_cpu) == ("triton", PLAN_2D)


def test_backend_checks_each_layout_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.platforms.attention_metadata import AttentionMetadata
    from pagedserve_cuda import attention

    checks: list[int] = []
    launches: list[int] = []
    monkeypatch.setattr(attention, "check_decode_layout", lambda *args: checks.append(1))
    monkeypatch.setattr(attention, "launch_decode", lambda *args, **kwargs: launches.append(1))
    backend = CudaPagedAttentionBackend()
    inputs = _decode_inputs()
    meta = AttentionMetadata.build([1, 1, 1], [1, 1, 1], inputs["block_table"], 16)
    for _ in range(3):  # three layers of one step: same layout
        backend.run_decode(
            V1, inputs["out"], inputs["query"], torch.zeros_like(inputs["kv_cache"]), meta,
            scale=1.0, sliding_window=None, logit_softcap=None,
        )  # fmt: skip
    assert (len(checks), len(launches)) == (1, 3)
    strided = torch.zeros(3, 32, 256, dtype=BF16)[..., :128]  # a new layout is checked again
    backend.run_decode(
        V1,
        inputs["out"],
        strided,
        inputs["kv_cache"],
        meta,
        scale=1.0,
        sliding_window=None,
        logit_softcap=None,
    )
    assert len(checks) == 2
