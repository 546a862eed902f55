"""The bit-moving e4m3fn -> bfloat16 widening (`pagedserve_triton.fp8_widen`) compiled for an H100
(sm_90) by Triton's NVIDIA backend, without a GPU: the weight-streaming GEMM with FP8 weights and
the unified attention kernels with an FP8 cache assemble with it, and the GEMM's machine code then
widens on the integer and half-precision units (no F2F/F2FP conversion instructions in its
loop) where
Triton's own conversion takes 1.5 per weight. Values are checked on a GPU by
`test_fp8_gpu.py`. The compilations run in one child process (see `compile_child`)."""

from __future__ import annotations

import os

import pytest
from compile_child import SM90_COMPILE, run_without_interpreter

nvidia = pytest.importorskip("triton.backends.nvidia.compiler")

_NVDISASM = os.path.join(os.path.dirname(os.path.dirname(nvidia.__file__)), "nvidia", "bin", "nvdisasm")

_CHILD = (
    SM90_COMPILE
    + """
import collections, json, re, subprocess, sys, tempfile
from pagedserve_triton.skinny_gemm import skinny_gemm_kernel
from pagedserve_triton.unified_attention import unified_attention_2d_kernel, unified_attention_3d_kernel

NVDISASM = sys.argv[1]


def opcodes(compiled):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout
    counts = collections.Counter()
    for line in sass.splitlines():
        found = re.search(r"/\\*[0-9a-f]+\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z][A-Z0-9_]*)", line)
        if found:
            counts[found.group(1)] += 1
    return dict(counts)


results = {}
gemm_pointers = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16",
                 "partial_ptr": "*fp32", "counter_ptr": "*i32"}
for bits in (False, True):
    constexprs = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, EVEN_K=True, HAS_SCALE=True,
                      HAS_BIAS=False, DOT_IN_FP32=False, WIDEN_BITS=bits, WEIGHT_MAJOR=False,
                      DEPENDENT=False, GATED=False)
    compiled = sm90_compile(
        skinny_gemm_kernel, constexprs, gemm_pointers, 4, 3, divisible=("K", "k_per_split")
    )
    results[f"gemm_bits={bits}"] = opcodes(compiled)
attention_pointers = {"kv_ptr": "*fp8e4nv", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                      "query_start_loc_ptr": "*i32", "segm_acc_ptr": "*fp32", "segm_max_ptr": "*fp32",
                      "segm_sum_ptr": "*fp32"}
# A layer without attention sinks passes a None sinks pointer: a constant to Triton.
for name, kernel, extra in (("attention_2d", unified_attention_2d_kernel,
                             {"DEPENDENT": False, "USE_SINKS": False, "sinks_ptr": None}),
                            ("attention_3d", unified_attention_3d_kernel,
                             {"NUM_SPLITS": 8, "DEPENDENT": False})):
    constexprs = dict(
        QUERIES_PER_KV=4, BLOCK_M=16, BLOCK_Q=4, HEAD_SIZE=128, HEAD_SIZE_PADDED=128, BLOCK_SIZE=16,
        TILE_SIZE=32, USE_SOFTCAP=False, USE_WINDOW=False, DOT_IN_FP32=False, NUM_GRID_GROUPS=1,
        KV_CACHE_MODIFIER="", PREFETCH_BLOCK_IDS=False, LAZY_RESCALE=False, LOOP_STAGES=0,
        WARP_SPECIALIZE=False, LONGEST_FIRST=False, WIDEN_BITS=True, **extra,
    )
    floats = ("scale_log2", "out_scale", "softcap")
    compiled = sm90_compile(kernel, constexprs, attention_pointers, 4, 2, floats=floats)
    results[name] = opcodes(compiled)
print(json.dumps(results))
"""
)


@pytest.fixture(scope="module")
def opcodes() -> dict[str, dict[str, int]]:
    if not os.path.exists(_NVDISASM):
        pytest.skip(f"Triton's NVIDIA backend ships no nvdisasm at {_NVDISASM}")
    result: dict[str, dict[str, int]] = run_without_interpreter(_CHILD, _NVDISASM)
    return result


def _conversions(counts: dict[str, int]) -> int:
    return counts.get("F2F", 0) + counts.get("F2FP", 0)


def test_gemm_widens_fp8_weights_without_conversion_instructions(opcodes: dict[str, dict[str, int]]) -> None:
    plain, bits = opcodes["gemm_bits=False"], opcodes["gemm_bits=True"]
    # 32 x 256 weights per iteration over 128 threads: 64 values, 1.5 conversions each; what is
    # left with the bit path is the epilogue's float32 -> bfloat16 output cast.
    assert _conversions(plain) - _conversions(bits) >= 96
    assert _conversions(bits) <= 4
    assert bits.get("HMUL2", 0) + bits.get("HFMA2", 0) >= 32  # the multiply by 2**120, two values each
    assert bits["HMMA"] == plain["HMMA"]  # the same tensor-core work


@pytest.mark.parametrize("kernel", ["attention_2d", "attention_3d"])
def test_attention_compiles_with_bit_widened_fp8_cache(
    kernel: str, opcodes: dict[str, dict[str, int]]
) -> None:
    counts = opcodes[kernel]
    assert counts.get("HMMA", 0) > 0
    assert counts.get("HMUL2", 0) + counts.get("HFMA2", 0) > 0
