"""The triton platform plugin: registration through the framework, availability without a GPU,
its tuned-config files, the 2D/3D heuristic, and the in-kernel grid remap (interpreter)."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and the kernels) are imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))

import pytest
import torch

pytest.importorskip("triton")
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedserve.platforms.api import PLUGIN_API_VERSION, AttentionLayerShape, GridOrder
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.registry import PlatformRegistry
from pagedserve.platforms.tuned_configs import (
    TunedConfigError,
    TunedConfigFile,
    TunedConfigs,
    load_tuned_config_file,
)
from pagedserve.worker.graphs.full_cuda_graphs import DecodeGraphBuffers, DecodeGraphIndex
from pagedserve_triton import plugin
from pagedserve_triton.attention import (
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    PLAN_2D,
    SplitPlan,
    TritonUnifiedAttentionBackend,
    choose_split,
)
from pagedserve_triton.launch_params import (
    AttentionLaunchConfig,
    LaunchParams,
    tuned_config_files,
    warp_specialize_supported,
)
from pagedserve_triton.unified_attention import remap_program_id

H100 = "NVIDIA H100 80GB HBM3"
ATTENTION_KERNELS = ("unified_attention_2d", "unified_attention_3d")


# --- registration --------------------------------------------------------------------------------


def test_plugin_registers_cleanly_and_is_unavailable_without_gpu() -> None:
    registry = PlatformRegistry.from_plugins([("triton", plugin)], strict=True)
    platform = registry.get("triton")
    assert platform.info.priority == 10 and platform.info.device_type == "cuda"
    assert platform.attention_backends() == [TritonUnifiedAttentionBackend]
    assert type(platform.cache_ops()).__name__ == "TritonCacheOps"
    assert set(platform.tuned_configs().kernels()) == {
        *ATTENTION_KERNELS,
        "int_weight_gemm",
        "ragged_prefill",
        "reduce_segments",
        "reshape_and_cache",
        "copy_blocks",
        "fused_moe",
        "cascade_prefix",
        "cascade_suffix",
        "merge_attention_states",
    }
    if not torch.cuda.is_available():
        availability = platform.availability
        assert not availability.available
        assert "TRITON_INTERPRET=1 without a GPU" in availability.reason
        assert registry.available() == []


def test_hooks_ignore_other_platforms() -> None:
    assert plugin.PAGEDSERVE_PLUGIN_API == PLUGIN_API_VERSION == "1.16"
    assert plugin.pagedserve_attention_backends(platform="cpu_reference") is None
    assert plugin.pagedserve_cache_ops(platform="cpu_reference") is None
    assert plugin.pagedserve_tuned_config_files(platform="cpu_reference") is None


# --- tuned configs -------------------------------------------------------------------------------


def test_config_files_validate_and_cover_default_and_h100() -> None:
    files = tuned_config_files()
    by_key = {(f.kernel, f.device) for f in map(load_tuned_config_file, files)}
    kernels = {kernel for kernel, _ in by_key}
    assert {(k, "default") for k in kernels} <= by_key
    assert {(k, "h100") for k in kernels} <= by_key


@pytest.mark.parametrize("device_name", ["cpu", H100, "AMD Instinct MI300X"])
def test_every_declared_shape_class_has_valid_params(device_name: str) -> None:
    params = LaunchParams()
    caps = TritonUnifiedAttentionBackend.capabilities
    for kernel in ATTENTION_KERNELS:
        for head_size in caps.head_sizes:
            for block_size in caps.block_sizes:
                for dtype in caps.dtypes:
                    for group in (1, 3, 8):
                        for max_query_len in (1, 4, 16, 17, 2048):
                            cfg = params.attention(
                                kernel,
                                device_name,
                                head_size=head_size,
                                block_size=block_size,
                                num_queries_per_kv=group,
                                dtype=dtype,
                                max_query_len=max_query_len,
                            )
                            assert cfg.tile_size >= 16 and cfg.block_m >= 16
    for head_size in caps.head_sizes:
        assert params.simple("reduce_segments", device_name, head_size=head_size).num_warps >= 1
        assert params.simple("reshape_and_cache", device_name, head_size=head_size).num_warps >= 1
    assert params.simple("copy_blocks", device_name, block_elems=16 * 8 * 128).block >= 16


def test_lookups_are_cached_per_shape_class() -> None:
    params = LaunchParams()
    a = params.attention(
        "unified_attention_2d",
        H100,
        head_size=128,
        block_size=16,
        num_queries_per_kv=4,
        dtype=torch.bfloat16,
        max_query_len=3,
    )
    b = params.attention(
        "unified_attention_2d",
        H100,
        head_size=128,
        block_size=16,
        num_queries_per_kv=4,
        dtype=torch.bfloat16,
        max_query_len=4,
    )  # same power-of-two bucket
    assert a is b


def test_bad_params_are_rejected_with_the_file_context() -> None:
    content = {
        "schema_version": 1,
        "kernel": "unified_attention_2d",
        "device": "default",
        "configs": [{"params": {"num_warps": 3, "num_stages": 2, "TILE_SIZE": 32, "BLOCK_M": 16}}],
    }
    params = LaunchParams(TunedConfigs([(Path("<bad>"), TunedConfigFile.model_validate(content))]))
    with pytest.raises(TunedConfigError, match="num_warps=3 must be one of"):
        params.attention(
            "unified_attention_2d",
            "cpu",
            head_size=64,
            block_size=16,
            num_queries_per_kv=1,
            dtype=torch.float16,
            max_query_len=1,
        )


def _one_entry(params: dict[str, object]) -> LaunchParams:
    content = {
        "schema_version": 1,
        "kernel": "unified_attention_2d",
        "device": "default",
        "configs": [{"params": {"num_warps": 8, "num_stages": 2, "TILE_SIZE": 64, "BLOCK_M": 128, **params}}],
    }
    return LaunchParams(TunedConfigs([(Path("<test>"), TunedConfigFile.model_validate(content))]))


def _lookup(
    params: LaunchParams,
    device: str = "cpu",
    max_query_len: int = 2048,
    kv_cache_dtype: torch.dtype | None = None,
) -> AttentionLaunchConfig:
    """The 2D kernel's params for an 8B layer (head size 128, 4 queries per KV head, bf16)."""
    return params.attention(
        "unified_attention_2d",
        device,
        head_size=128,
        block_size=16,
        num_queries_per_kv=4,
        dtype=torch.bfloat16,
        max_query_len=max_query_len,
        kv_cache_dtype=kv_cache_dtype,
    )


def test_loop_variant_params_default_to_the_plain_loop() -> None:
    cfg = _lookup(_one_entry({}))
    assert (cfg.prefetch_block_ids, cfg.lazy_rescale, cfg.loop_stages, cfg.warp_specialize) == (
        False,
        False,
        0,
        False,
    )
    plain = {
        "PREFETCH_BLOCK_IDS": False,
        "LAZY_RESCALE": False,
        "LOOP_STAGES": 0,
        "WARP_SPECIALIZE": False,
        "LONGEST_FIRST": False,
    }
    assert cfg.variant_constexprs(warp_specialize_supported=True) == plain
    # The shipped files keep today's loop for every class unless they name a variant.
    shipped = _lookup(LaunchParams())
    assert shipped.variant_constexprs(warp_specialize_supported=False)["LOOP_STAGES"] == 0


def test_loop_variant_params_are_read_and_resolved() -> None:
    every = {
        "PREFETCH_BLOCK_IDS": True,
        "LAZY_RESCALE": True,
        "LOOP_STAGES": 3,
        "WARP_SPECIALIZE": True,
        "LONGEST_FIRST": True,
    }
    cfg = _lookup(_one_entry(every))
    assert (cfg.prefetch_block_ids, cfg.lazy_rescale, cfg.loop_stages, cfg.warp_specialize) == (
        True,
        True,
        3,
        True,
    )
    assert cfg.longest_first
    assert cfg.variant_constexprs(warp_specialize_supported=True) == every
    # Off NVIDIA sm_90+ the flag is dropped and the loop keeps its own depth.
    assert cfg.variant_constexprs(warp_specialize_supported=False)["WARP_SPECIALIZE"] is False
    # Warp specialisation alone gets a tl.range loop at the kernel's num_stages (2 here).
    alone = _lookup(_one_entry({"WARP_SPECIALIZE": True}))
    assert alone.variant_constexprs(warp_specialize_supported=True) == {
        "PREFETCH_BLOCK_IDS": False,
        "LAZY_RESCALE": False,
        "LOOP_STAGES": 2,
        "WARP_SPECIALIZE": True,
        "LONGEST_FIRST": False,
    }
    assert alone.variant_constexprs(warp_specialize_supported=False)["LOOP_STAGES"] == 0


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"PREFETCH_BLOCK_IDS": 1}, "'PREFETCH_BLOCK_IDS' must be true or false"),
        ({"LAZY_RESCALE": "yes"}, "'LAZY_RESCALE' must be true or false"),
        ({"WARP_SPECIALIZE": 0}, "'WARP_SPECIALIZE' must be true or false"),
        ({"LONGEST_FIRST": "true"}, "'LONGEST_FIRST' must be true or false"),
        ({"LOOP_STAGES": True}, "'LOOP_STAGES' must be an integer"),
        ({"LOOP_STAGES": -1}, "'LOOP_STAGES' must be >= 0"),
    ],
)
def test_bad_loop_variant_params_are_rejected(params: dict[str, object], message: str) -> None:
    with pytest.raises(TunedConfigError, match=message):
        _lookup(_one_entry(params))


def test_warp_specialization_is_never_asked_off_nvidia() -> None:
    assert warp_specialize_supported(torch.device("cpu")) is False


# --- 2D / 3D heuristic ---------------------------------------------------------------------------


def test_heuristic_keeps_2d_when_the_grid_is_full() -> None:
    # 256 decodes x 8 KV heads = 2048 tiles on 132 SMs.
    assert choose_split(256, 1, 8192, 8, 132) == PLAN_2D
    # A long prefill: query blocks give the parallelism, and partials would be huge.
    assert choose_split(1, 4096, 4096, 8, 132, block_q=4) == PLAN_2D


def test_heuristic_splits_small_batches_of_long_decodes() -> None:
    plan = choose_split(1, 1, 8192, 8, 132)
    assert plan.kind == "3d" and plan.num_splits >= 2 and plan.num_splits & (plan.num_splits - 1) == 0
    # Two programs per SM: 8 tiles -> 33 splits wanted -> rounded up to 64 (== MAX_SPLITS).
    assert plan == SplitPlan("3d", 64)
    # A shorter context caps the splits at MIN_KEYS_PER_SPLIT keys each: 1024 / 64 = 16.
    assert choose_split(1, 1, 1024, 8, 132) == SplitPlan("3d", 16)
    # ... rounded up to a power of two: 576 keys are 9 chunks -> 16 splits (the last ones short or empty).
    assert choose_split(1, 1, 576, 8, 132) == SplitPlan("3d", 16)
    # Speculative queries of a small batch are still split.
    assert choose_split(4, 3, 4096, 8, 132, block_q=4).kind == "3d"


def test_heuristic_respects_length_and_split_caps() -> None:
    # Too short to split: fewer than two chunks of MIN_KEYS_PER_SPLIT keys.
    assert choose_split(1, 1, 2 * MIN_KEYS_PER_SPLIT - 1, 8, 132) == PLAN_2D
    # Two whole chunks split in two; 3 chunks of keys -> rounded up to 4 splits.
    assert choose_split(1, 1, 2 * MIN_KEYS_PER_SPLIT, 8, 132) == SplitPlan("3d", 2)
    assert choose_split(1, 1, 3 * MIN_KEYS_PER_SPLIT, 8, 132) == SplitPlan("3d", 4)
    # A 3D tile longer than MIN_KEYS_PER_SPLIT sets the chunk instead: 1024 / 128 = 8.
    assert choose_split(1, 1, 1024, 8, 132, tile_size=128) == SplitPlan("3d", 8)
    # A single KV head on a huge GPU asks for many splits; capped at MAX_SPLITS.
    assert choose_split(1, 1, 1 << 20, 1, 10_000).num_splits == MAX_SPLITS
    assert choose_split(0, 1, 8192, 8, 132) == PLAN_2D


def test_heuristic_splits_fall_as_the_batch_grows() -> None:
    splits = [choose_split(b, 1, 8192, 8, 132).num_splits for b in (1, 2, 4, 8, 16, 17)]
    assert splits == sorted(splits, reverse=True) and splits[-1] == 1


# --- the plan key of full decode graphs ---------------------------------------------------------

CUDA0 = torch.device("cuda", 0)
LLAMA_8B = AttentionLayerShape(32, 8, 128, 16, torch.bfloat16, torch.bfloat16, CUDA0)
BUCKETS = (256, 512, 1024, 2048, 4096)


@pytest.fixture
def fake_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda:0 answers as an H100 (its name picks the tuned configs, its SMs the split counts):
    the plan is host-only, so no GPU is needed."""
    props = types.SimpleNamespace(name=H100, multi_processor_count=132, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _=0: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=0: H100)


def _capture_metadata(num_reqs: int, max_seq_len: int) -> AttentionMetadata:
    """The host fields a full decode graph of `num_reqs` requests is captured with."""
    return DecodeGraphBuffers(num_reqs, 4, torch.device("cpu")).metadata(num_reqs, max_seq_len)


def _plan_of(backend: TritonUnifiedAttentionBackend, num_reqs: int, max_seq_len: int) -> SplitPlan:
    layer = LLAMA_8B
    return backend.plan(
        _capture_metadata(num_reqs, max_seq_len), num_q_heads=layer.num_q_heads,
        num_kv_heads=layer.num_kv_heads, head_size=layer.head_size, block_size=layer.block_size,
        dtype=layer.dtype, device=layer.device,
    )  # fmt: skip


@pytest.mark.usefixtures("fake_h100")
def test_full_graph_key_is_the_plan_forward_makes() -> None:
    backend = TritonUnifiedAttentionBackend()
    keys = {b: backend.full_graph_key(_capture_metadata(1, b), LLAMA_8B) for b in BUCKETS}
    assert keys == {b: _plan_of(backend, 1, b) for b in BUCKETS}
    # One request of 600 tokens plans 16 splits (10 chunks of 64 keys, rounded up); planned for
    # 4096 it would launch 64.
    assert backend.full_graph_key(_capture_metadata(1, 600), LLAMA_8B) == SplitPlan("3d", 16)
    assert keys[4096] == SplitPlan("3d", 64)
    splits = [keys[b].num_splits for b in BUCKETS]
    assert splits == sorted(splits) and len(set(splits)) == len(BUCKETS)
    # 64 decodes x 8 KV heads fill the GPU: the 2D kernel at every length.
    assert {backend.full_graph_key(_capture_metadata(64, b), LLAMA_8B) for b in BUCKETS} == {PLAN_2D}
    # A forced split count ignores the lengths.
    forced = TritonUnifiedAttentionBackend(num_splits=4)
    assert {forced.full_graph_key(_capture_metadata(1, b), LLAMA_8B) for b in BUCKETS} == {SplitPlan("3d", 4)}


@pytest.mark.usefixtures("fake_h100")
def test_full_graphs_of_small_batches_split_by_bucket_and_large_ones_do_not() -> None:
    backend = TritonUnifiedAttentionBackend()
    index = DecodeGraphIndex(
        (1, 2, 16, 64),
        BUCKETS,
        lambda size, bucket: backend.full_graph_key(_capture_metadata(size, bucket), LLAMA_8B),
        max_model_len=4096,
    )
    per_size = {size: sorted(b for s, b in index.graphs if s == size) for size in index.sizes}
    assert per_size[1] == list(BUCKETS)  # 4, 8, 16, 32, 64 splits
    assert per_size[64] == [4096]  # 2D everywhere: today's single graph
    assert index.graph_for(1, 600) == (1, 1024)
    # Every graph is the plan of the bucket it serves: grouping never changes a plan.
    for size in index.sizes:
        for bucket in BUCKETS:
            captured = index.graph_for(size, bucket)[1]
            assert _plan_of(backend, size, captured) == _plan_of(backend, size, bucket)


# --- grid remap (interpreter) --------------------------------------------------------------------


@triton.jit
def _remap_probe(out_ptr, num_programs, NUM_GROUPS: tl.constexpr):  # type: ignore[no-untyped-def]
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, remap_program_id(pid, num_programs, NUM_GROUPS))


@pytest.mark.skipif(not isinstance(_remap_probe, InterpretedFunction), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("num_groups", [1, 3, 8])
@pytest.mark.parametrize("num_programs", [1, 5, 8, 37])
def test_kernel_remap_matches_grid_order(num_groups: int, num_programs: int) -> None:
    out = torch.full((num_programs,), -1, dtype=torch.int32)
    _remap_probe[(num_programs,)](out, num_programs, NUM_GROUPS=num_groups)
    order = GridOrder(name="probe", num_groups=num_groups)
    assert out.tolist() == [order.remap(pid, num_programs) for pid in range(num_programs)]
    assert sorted(out.tolist()) == list(range(num_programs))  # a permutation of the tiles


def test_plugin_without_triton_is_unavailable_not_broken() -> None:
    """A machine without triton discovers the platform and is told why it cannot run (the plugin
    module and the launch-parameter module it imports must not import triton)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import importlib.util\n"
        "importlib.util.find_spec = (lambda f: lambda name, *a: None if name == 'triton' else f(name, *a))"
        "(importlib.util.find_spec)\n"
        "from pagedserve_triton import plugin\n"
        "assert plugin.pagedserve_attention_backends('triton') is None\n"
        "assert plugin.pagedserve_cache_ops('triton') is None\n"
        "print(plugin._availability().reason)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "triton cannot be imported" in done.stdout


def test_an_fp8_cache_gets_its_own_decode_config_on_the_h100() -> None:
    """The cache's dtype is a shape key: FP8-cache decodes on an H100 take the entry swept with an
    FP8 cache, bf16 caches keep theirs, and a device without an FP8 entry falls back to the
    decode entry of the model's dtype."""
    params = LaunchParams()

    def decode(device: str, kv: torch.dtype | None) -> AttentionLaunchConfig:
        return _lookup(params, device, max_query_len=1, kv_cache_dtype=kv)

    fp8, bf16 = decode(H100, torch.float8_e4m3fn), decode(H100, torch.bfloat16)
    assert (fp8.tile_size, fp8.num_stages, fp8.prefetch_block_ids) == (32, 3, True)
    assert (bf16.tile_size, bf16.num_stages, bf16.prefetch_block_ids) == (64, 2, False)
    assert decode(H100, None) == bf16  # no cache dtype given: the cache holds the model's dtype
    assert decode("cpu", torch.float8_e4m3fn) == decode("cpu", torch.bfloat16)
