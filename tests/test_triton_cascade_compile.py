"""The cascade-attention kernels (`pagedserve_triton.cascade_kernels`) compiled without a GPU at an
8B Llama's layer (32 query heads, 8 KV heads, head size 128, bfloat16, blocks of 16) with the
shipped default launch parameters: for an H100 (sm_90) by Triton's NVIDIA backend within its
shared memory, and for MI300 (gfx942) and MI355 (gfx950) by Triton's AMD backend with no register
spills and within their LDS. The compilations run in a child process without TRITON_INTERPRET
(kernels decorated under the interpreter cannot be compiled)."""

from __future__ import annotations

import pytest
from compile_child import run_without_interpreter

pytest.importorskip("triton.backends.nvidia.compiler")
pytest.importorskip("triton.backends.amd.compiler")

H100_SHARED_BYTES = 227 * 1024
LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}

_CHILD = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedserve_rocm.amdgcn import stats_of
from pagedserve_triton.cascade_kernels import (
    cascade_prefix_kernel, cascade_suffix_kernel, merge_states_kernel,
)
from pagedserve_triton.launch_params import LaunchParams
import torch

INT_POINTERS = (
    "prefix_blocks_ptr", "prefix_len_ptr", "block_table_ptr", "query_start_loc_ptr", "seq_lens_ptr",
)
FP32_POINTERS = ("out_ptr", "lse_ptr", "prefix_out_ptr", "prefix_lse_ptr", "suffix_out_ptr", "suffix_lse_ptr")
FLOATS = ("scale", "softcap")

def build(kernel, constexprs, out_is_fp32=True):
    signature, attrs = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            if arg in INT_POINTERS:
                signature[arg] = "*i32"
            elif arg in FP32_POINTERS and not (arg == "out_ptr" and not out_is_fp32):
                signature[arg] = "*fp32"
            else:
                signature[arg] = "*bf16"
            attrs[(index,)] = [["tt.divisibility", 16]]
            if arg != "kv_cache_ptr":  # as a real launch: a cache is > 2 GiB
                attrs[(index,)].append(["tt.pointer_range", 32])
        elif arg in FLOATS:
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if arg.startswith("stride"):  # a launch specialises the 16-divisible strides
                attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)

params = LaunchParams()
results = {}
shape = dict(head_size=128, block_size=16, num_queries_per_kv=4, dtype=torch.bfloat16)
for name, kernel, lookup, max_query_len in (
    ("prefix", cascade_prefix_kernel, "cascade_prefix", 256),
    ("suffix_decode", cascade_suffix_kernel, "cascade_suffix", 1),
    ("suffix_chunk", cascade_suffix_kernel, "cascade_suffix", 512),
):
    config = params.attention(lookup, "default", max_query_len=max_query_len, **shape)
    for softcap in (False, True):
        constexprs = dict(QUERIES_PER_KV=4, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16,
                          TILE_SIZE=config.tile_size, BLOCK_M=config.block_m, USE_SOFTCAP=softcap,
                          DOT_IN_FP32=False)
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        key = f"{name}{'_softcap' if softcap else ''}"
        source = build(kernel, constexprs)
        sm90 = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        results[key] = {"sm90_shared": sm90.metadata.shared}
        for arch in ("gfx942", "gfx950"):
            amd = triton.compile(source, target=GPUTarget("hip", arch, 64), options=options)
            stats = stats_of(amd.asm["amdgcn"], arch, amd.metadata.shared)
            results[key][arch] = [amd.metadata.shared, stats.vgpr_spills, stats.sgpr_spills]
merge = params.simple("merge_attention_states", "default", head_size=128)
constexprs = dict(HEAD_SIZE=128, HEAD_PAD=128, HEADS_PAD=32)
source = build(merge_states_kernel, constexprs, out_is_fp32=False)
sm90 = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": merge.num_warps})
results["merge"] = {"sm90_shared": sm90.metadata.shared}
for arch in ("gfx942", "gfx950"):
    amd = triton.compile(source, target=GPUTarget("hip", arch, 64), options={"num_warps": merge.num_warps})
    stats = stats_of(amd.asm["amdgcn"], arch, amd.metadata.shared)
    results["merge"][arch] = [amd.metadata.shared, stats.vgpr_spills, stats.sgpr_spills]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = run_without_interpreter(_CHILD)
    return results


KERNELS = [
    *(f"{k}{s}" for k in ("prefix", "suffix_decode", "suffix_chunk") for s in ("", "_softcap")),
    "merge",
]


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_fits_an_h100(compiled: dict[str, dict[str, object]], kernel: str) -> None:
    shared = compiled[kernel]["sm90_shared"]
    assert isinstance(shared, int) and shared <= H100_SHARED_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_amd_without_spills(compiled: dict[str, dict[str, object]], kernel: str, arch: str) -> None:
    lds, vgpr_spills, sgpr_spills = compiled[kernel][arch]  # type: ignore[misc]
    assert (vgpr_spills, sgpr_spills) == (0, 0)
    assert lds <= LDS_BYTES[arch]
