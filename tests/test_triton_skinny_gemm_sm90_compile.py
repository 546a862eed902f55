"""The weight-streaming GEMM compiled for an H100 (sm_90) by Triton's NVIDIA backend, without a GPU:
the engine's bf16 and FP8 launch parameters at the 8B shapes (FP8 also at 32 and 128 rows, FP8
activations on the FP8 tensor cores' warpgroup instructions, nothing widened) compile within an
H100's shared memory, keep their loads pipelined (cp.async), and the split-K launches meet through
one device-scope acquire-release ticket per column block, after a block-wide barrier, reading the
other splits' partials from L2; launched as programmatic dependents they wait before touching
memory. The compilations run in one child process without
TRITON_INTERPRET (kernels decorated under the interpreter cannot be compiled)."""

from __future__ import annotations

import json

import pytest
from compile_child import SM90_COMPILE, run_without_interpreter

pytest.importorskip("triton.backends.nvidia.compiler")

H100_SHARED_BYTES = 227 * 1024

# (name, N, K, weight dtype, rows): the 8B Llama layer's products at one row, and FP8 weights at
# 32 and 128 rows, where the activations arrive as FP8 codes for the FP8 tensor cores
CASES = [
    ("bf16_o", 4096, 4096, "bf16", 1),
    ("bf16_qkv", 6144, 4096, "bf16", 1),
    ("fp8_o", 4096, 4096, "fp8", 1),
    ("fp8_down", 4096, 14336, "fp8", 1),
    ("fp8_qkv_32rows", 6144, 4096, "fp8", 32),
    ("fp8_gate_up_128rows", 28672, 4096, "fp8", 128),
    ("fp8_down_128rows", 4096, 14336, "fp8", 128),
    # SiLU-and-multiply in the epilogue of a gated MLP's gate/up product
    ("bf16_gate_up_gated", 28672, 4096, "bf16", 1),
    ("fp8_gate_up_gated", 28672, 4096, "fp8", 1),
    ("fp8_gate_up_64rows_gated", 28672, 4096, "fp8", 64),
]

_CHILD = (
    SM90_COMPILE
    + """
import json, re, sys
import torch
from pagedserve_triton.linear_op import activation_dtype, choose_config
from pagedserve_triton.skinny_gemm import row_block, skinny_gemm_kernel as kernel

H100_BUDGET = 227 * 1024 - 8 * 1024
results = {}
for name, n, k, wdt, rows in json.loads(sys.argv[1]):
    weight = torch.bfloat16 if wdt == "bf16" else torch.float8_e4m3fn
    x_dtype = activation_dtype(weight, rows, torch.bfloat16)
    config = choose_config(n, k, weight, x_dtype, rows, H100_BUDGET)
    for split in sorted({1, max(2, config.split_k)}):
        constexprs = dict(
            BLOCK_M=row_block(rows), BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split,
            EVEN_K=True, HAS_SCALE=wdt == "fp8", HAS_X_SCALE=x_dtype != torch.bfloat16, HAS_BIAS=False,
            DOT_IN_FP32=False, WIDEN_BITS=wdt == "fp8", WEIGHT_MAJOR=config.weight_major,
            DEPENDENT=False, GATED=name.endswith("_gated"),
        )
        types = {"w_ptr": "*bf16" if wdt == "bf16" else "*fp8e4nv", "scale_ptr": "*fp32",
                 "x_ptr": "*bf16" if x_dtype == torch.bfloat16 else "*fp8e4nv", "x_scale_ptr": "*fp32",
                 "partial_ptr": "*fp32", "counter_ptr": "*i32"}
        key = f"{name}_split{split}"
        try:
            compiled = sm90_compile(
                kernel, constexprs, types, config.num_warps, config.num_stages,
                divisible=("N", "K", "k_per_split"),
            )
        except Exception as e:
            results[key] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            continue
        ptx = compiled.asm["ptx"]
        atomics = re.findall(r"atom\\.[\\w.]*", ptx)
        first_atomic = ptx.find("atom.")
        results[key] = {
            "error": None,
            "shared": compiled.metadata.shared,
            "cp_async": len(re.findall(r"cp\\.async", ptx)),
            "atomics": atomics,
            # the partial tile's stores, then a block-wide barrier, then the ticket
            "barrier_before_atomic": first_atomic > 0
            and ptx.rfind("st.global", 0, first_atomic) < ptx.rfind("bar.sync", 0, first_atomic),
            "l2_loads": len(re.findall(r"ld\\.global\\.cg", ptx)),
            "fp8_codes": x_dtype != torch.bfloat16,
            "fp8_wgmma": len(re.findall(r"wgmma\\.mma_async[\\w.]*\\.e4m3\\.e4m3", ptx)),
            "fp8_conversions": len(re.findall(r"cvt\\.[\\w.]*e4m3", ptx)),
        }
# programmatic dependent launches: the plain one-pass launch of each case again with DEPENDENT
for name, n, k, wdt, rows in json.loads(sys.argv[1]):
    weight = torch.bfloat16 if wdt == "bf16" else torch.float8_e4m3fn
    x_dtype = activation_dtype(weight, rows, torch.bfloat16)
    config = choose_config(n, k, weight, x_dtype, rows, H100_BUDGET)
    constexprs = dict(
        BLOCK_M=row_block(rows), BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        EVEN_K=True, HAS_SCALE=wdt == "fp8", HAS_X_SCALE=x_dtype != torch.bfloat16, HAS_BIAS=False,
        DOT_IN_FP32=False, WIDEN_BITS=wdt == "fp8", WEIGHT_MAJOR=config.weight_major, DEPENDENT=True,
        GATED=name.endswith("_gated"),
    )
    types = {"w_ptr": "*bf16" if wdt == "bf16" else "*fp8e4nv", "scale_ptr": "*fp32",
             "x_ptr": "*bf16" if x_dtype == torch.bfloat16 else "*fp8e4nv", "x_scale_ptr": "*fp32",
             "partial_ptr": "*fp32", "counter_ptr": "*i32"}
    ptx = sm90_compile(
        kernel, constexprs, types, config.num_warps, config.num_stages, divisible=("N", "K", "k_per_split"),
    ).asm["ptx"]
    memory = r"\\b(?:cp\\.async\\.c[ag]|ld\\.global|st\\.global|atom)\\."
    accesses = [m.start() for m in re.finditer(memory, ptx)]
    loads = [m.start() for m in re.finditer(r"\\bcp\\.async\\.c[ag]\\.", ptx)]
    results[f"{name}_dependent"] = {
        "waits": [m.start() for m in re.finditer(r"griddepcontrol\\.wait", ptx)],
        "launches": [m.start() for m in re.finditer(r"griddepcontrol\\.launch_dependents", ptx)],
        "first_access": min(accesses),
        "last_load": max(loads),
    }
print(json.dumps(results))
"""
)


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = run_without_interpreter(_CHILD, json.dumps(CASES))
    return results


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_compiles_pipelined_within_shared_memory(name: str, compiled: dict[str, dict[str, object]]) -> None:
    launches = {key: value for key, value in compiled.items() if key.startswith(name + "_split")}
    assert len(launches) == 2  # one K pass and split K
    for key, result in launches.items():
        assert result["error"] is None, (key, result["error"])
        shared = result["shared"]
        assert isinstance(shared, int) and 0 < shared <= H100_SHARED_BYTES, key
        cp_async = result["cp_async"]
        assert isinstance(cp_async, int) and cp_async > 0, key  # weight loads stream into shared memory


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_split_k_meets_through_an_acquire_release_ticket(
    name: str, compiled: dict[str, dict[str, object]]
) -> None:
    one_pass = compiled[f"{name}_split1"]
    assert one_pass["atomics"] == [] and one_pass["l2_loads"] == 0
    split = next(
        value
        for key, value in compiled.items()
        if key.startswith(name + "_split") and key != f"{name}_split1"
    )
    atomics = split["atomics"]
    assert isinstance(atomics, list) and len(atomics) == 1
    assert ".gpu" in atomics[0] and ".acq_rel" in atomics[0] and ".add" in atomics[0]
    assert split["barrier_before_atomic"] is True
    l2_loads = split["l2_loads"]
    assert isinstance(l2_loads, int) and l2_loads > 0


@pytest.mark.parametrize("name", [case[0] for case in CASES if case[3] == "fp8" and case[4] > 16])
def test_fp8_codes_run_on_the_fp8_warpgroup_mma_without_widening(
    name: str, compiled: dict[str, dict[str, object]]
) -> None:
    """Past 16 rows FP8 codes meet FP8 weights in `wgmma ... e4m3.e4m3` (weight-major, so even 32
    rows qualify) with no FP8 conversion anywhere in the kernel."""
    for key, result in compiled.items():
        if key.startswith(name + "_split"):
            assert result["fp8_codes"] is True, key
            fp8_wgmma = result["fp8_wgmma"]
            assert isinstance(fp8_wgmma, int) and fp8_wgmma > 0, key
            assert result["fp8_conversions"] == 0, key


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_dependent_launches_wait_before_any_memory_access(
    name: str, compiled: dict[str, dict[str, object]]
) -> None:
    """Launched as a programmatic dependent, the kernel waits for the previous kernel before its
    first global memory access and lets the next one launch after its last weight load."""
    result = compiled[f"{name}_dependent"]
    waits, launches = result["waits"], result["launches"]
    assert isinstance(waits, list) and isinstance(launches, list)
    assert len(waits) == 1 and len(launches) == 1
    first_access, last_load = result["first_access"], result["last_load"]
    assert isinstance(first_access, int) and isinstance(last_load, int)
    assert waits[0] < first_access
    assert launches[0] > last_load
