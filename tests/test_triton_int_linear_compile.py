"""The integer-weight GEMM (`pagedserve_triton.int_linear`) compiled without a GPU at the tiles its
launch rule picks, for decode and prefill steps, 4- and 8-bit codes, groups aligned with the K
step and gathered, with and without zero points: for an H100 (sm_90) with no local memory in the
cubin, and for an MI300X (gfx942) and an MI355X (gfx950) with no register spills. The compilations
run in a child process without TRITON_INTERPRET."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from compile_child import run_without_interpreter

pytest.importorskip("triton.backends.nvidia.compiler")
pytest.importorskip("triton.backends.amd.compiler")

# (rows, bits, group size, zero points): groups of 128 (K steps of 64) and of 32 (K steps of 32).
# With the default files' tiles (every target), and with the H100 file's (sm_90 only) at its
# decode and 64-row classes, narrow and wide outputs (longer steps there dequantize first).
H100 = "NVIDIA H100 80GB HBM3"
CASES = [
    (m, bits, group, zeros, 4096, "default")
    for m in (1, 256)
    for bits in (4, 8)
    for group in (128, 32)
    for zeros in (False, True)
] + [
    (m, bits, group, zeros, n, H100)
    for m in (1, 64)
    for bits in (4, 8)
    for group in (128, 32)
    for zeros in (False, True)
    for n in (6144, 28672)
]
LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}

_CHILD = """
import json, pathlib, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedserve_rocm.amdgcn import stats_of
from pagedserve_triton import int_linear as il

TARGETS = {"sm90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64),
           "gfx950": GPUTarget("hip", "gfx950", 64)}
out_dir = pathlib.Path(tempfile.mkdtemp())
results = {}

def record(key, target, compiled):
    if target == "sm90":
        cubin = out_dir / f"{len(results)}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        results[key] = {"shared": compiled.metadata.shared, "cubin": str(cubin)}
    else:
        stats = stats_of(compiled.asm["amdgcn"], target, compiled.metadata.shared)
        results[key] = {"shared": compiled.metadata.shared, "vgpr_spills": stats.vgpr_spills,
                        "sgpr_spills": stats.sgpr_spills}

for m, bits, group, zeros, n, device in json.loads(sys.argv[1]):
    tiles = il.choose_tiles(m, group, n, 4096, bits, device)
    constexprs = dict(SPLIT=tiles.split_k > 1, BITS=bits, HAS_ZEROS=zeros, HAS_BIAS=False,
                      GROUP_ALIGNED=group % tiles.block_k == 0, EVEN=True,
                      BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                      WEIGHT_MAJOR=tiles.weight_major,
                      DOT_IN_FP32=False, ROUND_BF16=False)
    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "scale_ptr": "*fp32", "zero_ptr": "*i8",
                "bias_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32"}
    signature, attrs = {}, {}
    for index, arg in enumerate(il.int_weight_gemm_kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = pointers[arg]
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "i32"
            if arg.startswith("stride") or arg in ("N", "K", "k_per_split"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    for target, gpu in TARGETS.items() if device == "default" else [("sm90", TARGETS["sm90"])]:
        compiled = triton.compile(ASTSource(fn=il.int_weight_gemm_kernel, signature=signature,
                                            constexprs=constexprs, attrs=attrs), target=gpu,
                                  options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
        record(f"{m}/{bits}/{group}/{zeros}/{n}/{device}/{target}", target, compiled)
dequant_sig = {"w_ptr": "*i32", "scale_ptr": "*fp32", "zero_ptr": "*i8", "out_ptr": "*bf16", "N": "i32",
               "K": "i32", "stride_wn": "i32", "stride_sn": "i32", "group_size": "i32", "BITS": "constexpr",
               "HAS_ZEROS": "constexpr", "GROUP_ALIGNED": "constexpr", "EVEN": "constexpr",
               "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "ROUND_BF16": "constexpr"}
dequant_consts = dict(BITS=4, HAS_ZEROS=True, GROUP_ALIGNED=True, EVEN=True, BLOCK_N=64, BLOCK_K=128,
                      ROUND_BF16=False)
for target, gpu in TARGETS.items():  # the dense weight of long steps
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(il.dequantize_int_weight_kernel.arg_names)
             if a.endswith("_ptr") or a.startswith("stride") or a in ("N", "K")}
    compiled = triton.compile(ASTSource(fn=il.dequantize_int_weight_kernel, signature=dequant_sig,
                                        constexprs=dequant_consts, attrs=attrs), target=gpu,
                              options={"num_warps": 4, "num_stages": 1})
    record(f"dequantize/{target}", target, compiled)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = run_without_interpreter(_CHILD, json.dumps(CASES))
    return results


def test_compiles_for_h100_without_local_memory(compiled: dict[str, dict[str, object]]) -> None:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip(f"no cuobjdump at {tool}")
    keys = [key for key in compiled if key.endswith("/sm90")]
    assert len(keys) == len(CASES) + 1  # and the dequantize kernel
    for key in keys:
        text = subprocess.run(
            [str(tool), "-res-usage", str(compiled[key]["cubin"])], capture_output=True, text=True, check=True
        ).stdout
        usage = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", text)}
        assert usage["STACK"] == 0 and usage["LOCAL"] == 0, (key, usage)


@pytest.mark.parametrize("target", ["gfx942", "gfx950"])
def test_compiles_for_amd_without_spills(compiled: dict[str, dict[str, object]], target: str) -> None:
    keys = [key for key in compiled if key.endswith(f"/{target}")]
    assert len(keys) == sum(case[-1] == "default" for case in CASES) + 1  # and the dequantize kernel
    for key in keys:
        result = compiled[key]
        shared = result["shared"]
        assert isinstance(shared, int) and shared <= LDS_BYTES[target], (key, result)
        assert result["vgpr_spills"] == 0 and result["sgpr_spills"] == 0, (key, result)
