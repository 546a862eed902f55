"""The 2D unified attention kernel's variants compiled for an H100 (sm_90) by
Triton's NVIDIA backend, without a GPU: each variant the tuned configs can select must compile at
the H100 prefill shape (32 query / 8 KV heads, head 128, bfloat16, block 16) and its launch points
of `benchmarks/kernel_benchmarks/attention.py --variants`, within an H100's shared memory. The
compilations run in one child process without TRITON_INTERPRET (kernels decorated under the
interpreter cannot be compiled)."""

from __future__ import annotations

import json

import pytest
from compile_child import SM90_COMPILE, run_without_interpreter

pytest.importorskip("triton.backends.nvidia.compiler")

H100_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block may use on sm_90

# (name, BLOCK_M, TILE_SIZE, num_warps, num_stages, variant params)
VARIANTS = [
    ("plain", 64, 64, 4, 2, {}),
    ("prefetch", 64, 64, 4, 3, {"PREFETCH_BLOCK_IDS": True}),
    ("prefetch_tile128_3stages", 64, 128, 4, 3, {"PREFETCH_BLOCK_IDS": True}),
    ("lazy", 64, 64, 4, 2, {"LAZY_RESCALE": True}),
    ("prefetch_loop3", 128, 64, 8, 2, {"PREFETCH_BLOCK_IDS": True, "LOOP_STAGES": 3}),
    ("warp_specialize_prefetch", 128, 64, 8, 2, {"WARP_SPECIALIZE": True, "PREFETCH_BLOCK_IDS": True}),
    (
        "prefetch_lazy_longest_first",
        128,
        128,
        8,
        2,
        {"PREFETCH_BLOCK_IDS": True, "LAZY_RESCALE": True, "LONGEST_FIRST": True},
    ),
]

_CHILD = (
    SM90_COMPILE
    + """
import json, sys
from pagedserve_triton.launch_params import AttentionLaunchConfig
from pagedserve_triton.unified_attention import unified_attention_2d_kernel as kernel

POINTERS = {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32"}
FLOATS = {"scale_log2", "out_scale", "softcap"}
results = {}
for name, block_m, tile, warps, stages, params in json.loads(sys.argv[1]):
    config = AttentionLaunchConfig(
        num_warps=warps, num_stages=stages, tile_size=tile, block_m=block_m,
        prefetch_block_ids=params.get("PREFETCH_BLOCK_IDS", False),
        lazy_rescale=params.get("LAZY_RESCALE", False),
        loop_stages=params.get("LOOP_STAGES", 0),
        warp_specialize=params.get("WARP_SPECIALIZE", False),
        longest_first=params.get("LONGEST_FIRST", False),
    )
    constexprs = dict(
        QUERIES_PER_KV=4, BLOCK_M=block_m, BLOCK_Q=block_m // 4, HEAD_SIZE=128, HEAD_SIZE_PADDED=128,
        BLOCK_SIZE=16, TILE_SIZE=tile, USE_SOFTCAP=False, USE_WINDOW=False, DOT_IN_FP32=False,
        NUM_GRID_GROUPS=1, KV_CACHE_MODIFIER="", WIDEN_BITS=False, DEPENDENT=False,
        USE_SINKS=False, sinks_ptr=None,  # a layer without sinks: a None pointer is a constant
        **config.variant_constexprs(warp_specialize_supported=True),
    )
    try:
        compiled = sm90_compile(kernel, constexprs, POINTERS, warps, stages, floats=FLOATS)
        results[name] = {"shared": compiled.metadata.shared, "error": None}
    except Exception as e:
        results[name] = {"shared": None, "error": f"{type(e).__name__}: {str(e)[:400]}"}
print(json.dumps(results))
"""
)


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = run_without_interpreter(_CHILD, json.dumps(VARIANTS))
    return results


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS])
def test_variant_compiles_for_sm90_within_shared_memory(
    name: str, compiled: dict[str, dict[str, object]]
) -> None:
    result = compiled[name]
    assert result["error"] is None, result["error"]
    shared = result["shared"]
    assert isinstance(shared, int) and 0 < shared <= H100_SHARED_BYTES


# The decode kernels as a one-request decode step launches them: programmatic dependent launches.
_DECODE_CHILD = (
    SM90_COMPILE
    + """
import json
from pagedserve_triton.unified_attention import (
    reduce_segments_kernel, unified_attention_2d_kernel, unified_attention_3d_kernel,
)

POINTERS = {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
            "segm_acc_ptr": "*fp32", "segm_max_ptr": "*fp32", "segm_sum_ptr": "*fp32"}
FLOATS = {"scale_log2", "out_scale", "softcap"}
common = dict(
    QUERIES_PER_KV=4, BLOCK_M=16, BLOCK_Q=4, HEAD_SIZE=128, HEAD_SIZE_PADDED=128, BLOCK_SIZE=16,
    TILE_SIZE=32, USE_SOFTCAP=False, USE_WINDOW=False, DOT_IN_FP32=False, NUM_GRID_GROUPS=1,
    KV_CACHE_MODIFIER="", PREFETCH_BLOCK_IDS=False, LAZY_RESCALE=False, LOOP_STAGES=0,
    WARP_SPECIALIZE=False, LONGEST_FIRST=False, WIDEN_BITS=False,
)
no_sinks = {"USE_SINKS": False, "sinks_ptr": None}  # a layer without sinks: a None pointer is a constant
launches = {
    "2d_dependent": (unified_attention_2d_kernel, {**common, **no_sinks, "DEPENDENT": True}),
    "3d_plain": (unified_attention_3d_kernel, {**common, "NUM_SPLITS": 16, "DEPENDENT": False}),
    "3d_dependent": (unified_attention_3d_kernel, {**common, "NUM_SPLITS": 16, "DEPENDENT": True}),
    "reduce_dependent": (reduce_segments_kernel,
                         {"HEAD_SIZE": 128, "HEAD_SIZE_PADDED": 128, "NUM_SPLITS": 16, "DEPENDENT": True,
                          **no_sinks}),
}
results = {}
for name, (kernel, constexprs) in launches.items():
    ptx = sm90_compile(kernel, constexprs, POINTERS, 4, 2, floats=FLOATS).asm["ptx"]
    results[name] = {
        "wait": ptx.count("griddepcontrol.wait"),
        "launch_dependents": ptx.count("griddepcontrol.launch_dependents"),
    }
print(json.dumps(results))
"""
)


@pytest.fixture(scope="module")
def decode_ptx() -> dict[str, dict[str, int]]:
    results: dict[str, dict[str, int]] = run_without_interpreter(_DECODE_CHILD)
    return results


def test_dependent_decode_kernels_wait_and_release_on_the_device(
    decode_ptx: dict[str, dict[str, int]],
) -> None:
    for name in ("2d_dependent", "3d_dependent", "reduce_dependent"):
        assert decode_ptx[name]["wait"] >= 1 and decode_ptx[name]["launch_dependents"] >= 1, name
    assert decode_ptx["3d_plain"]["wait"] == decode_ptx["3d_plain"]["launch_dependents"] == 0
