"""The LoRA shrink and expand kernels (`pagedserve_triton.lora_kernel`) compiled without a GPU, at
an 8B Llama's shapes and the launch plans of a decode step and a prefill step: for an H100 (sm_90)
by Triton's NVIDIA backend, within its shared memory; and for an MI300 (gfx942) by Triton's AMD
backend, with no register spills. The compilations run in a child process without
TRITON_INTERPRET (kernels decorated under the interpreter cannot be compiled)."""

from __future__ import annotations

import json

import pytest
from compile_child import run_without_interpreter

pytest.importorskip("triton.backends.nvidia.compiler")
pytest.importorskip("triton.backends.amd.compiler")

H100_SHARED_BYTES = 227 * 1024
MI300_LDS_BYTES = 64 * 1024

# (name, rows, input features, output features, stacked rank width, slots): the 8B layers'
# widest shrink (down_proj's K) and widest expand (gate_up's N), decode- and prefill-sized.
SHAPES = [
    ("decode_qkv", 64, 4096, 6144, 48, 8),
    ("decode_down", 64, 14336, 4096, 16, 8),
    ("decode_gate_up", 64, 4096, 28672, 32, 8),
    ("prefill_gate_up", 2048, 4096, 28672, 32, 8),
    ("prefill_down", 2048, 14336, 4096, 16, 4),
]

_CHILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedserve_rocm.amdgcn import stats_of
from pagedserve_triton.lora_kernel import lora_expand_kernel, lora_shrink_kernel, plan_launch

POINTERS = {"order_ptr": "*i32", "starts_ptr": "*i32", "part_ptr": "*fp32", "t_ptr": "*fp32",
            "counter_ptr": "*i32"}

def build(kernel, constexprs):
    signature, attrs = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = POINTERS.get(arg, "*bf16")
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "i32"
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)

results = {}
for name, m, k, n, r, s in json.loads(sys.argv[1]):
    plan = plan_launch(m, k, n, r, s)
    kernels = {
        "shrink": (lora_shrink_kernel, plan.shrink_warps, dict(SPLIT_K=plan.split_k, BLOCK_M=plan.block_m,
                    BLOCK_K=plan.block_k, BLOCK_R=plan.block_r, DOT_IN_FP32=False)),
        "expand": (lora_expand_kernel, plan.expand_warps, dict(BLOCK_M=plan.block_m,
                    BLOCK_N=plan.block_n, BLOCK_R=plan.block_r, DOT_IN_FP32=False)),
    }
    for which, (kernel, warps, constexprs) in kernels.items():
        sm90 = triton.compile(build(kernel, constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
        amd = triton.compile(build(kernel, constexprs), target=GPUTarget("hip", "gfx942", 64),
                             options={"num_warps": warps})
        stats = stats_of(amd.asm["amdgcn"], "gfx942", amd.metadata.shared)
        results[f"{name}/{which}"] = {
            "sm90_shared": sm90.metadata.shared,
            "gfx942_lds": amd.metadata.shared,
            "vgpr_spills": stats.vgpr_spills,
            "sgpr_spills": stats.sgpr_spills,
        }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, int]]:
    results: dict[str, dict[str, int]] = run_without_interpreter(_CHILD, json.dumps(SHAPES))
    return results


@pytest.mark.parametrize("name", [f"{s[0]}/{k}" for s in SHAPES for k in ("shrink", "expand")])
def test_lora_kernels_compile_for_h100_and_mi300(name: str, compiled: dict[str, dict[str, int]]) -> None:
    result = compiled[name]
    assert 0 <= result["sm90_shared"] <= H100_SHARED_BYTES
    assert 0 <= result["gfx942_lds"] <= MI300_LDS_BYTES
    assert result["vgpr_spills"] == 0 and result["sgpr_spills"] == 0, result
