"""The fused MoE kernels (`pagedserve_triton.moe_kernel`, `moe_routing`) compiled without a GPU at
the launch configs the tuned-config lookup returns for three models' expert shapes, at decode and
prefill sizes: for an H100 (sm_90) by Triton's NVIDIA backend, with no local memory (spills) in
the cubin and within its shared memory; and for an MI300 (gfx942) and an MI355X (gfx950), looking
up the "default" file, by Triton's AMD backend, with no register spills and within their LDS. The
compilations run in a child process without TRITON_INTERPRET (kernels decorated under the
interpreter cannot be compiled)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from compile_child import run_without_interpreter

pytest.importorskip("triton.backends.nvidia.compiler")
pytest.importorskip("triton.backends.amd.compiler")

H100 = "NVIDIA H100 80GB HBM3"
MI300 = "AMD Instinct MI300X"
MI355 = "AMD Instinct MI355X"
AMD_TARGETS = ("gfx942", "gfx950")
H100_SHARED_BYTES = 227 * 1024
AMD_LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}

# (model, experts, top_k, hidden, intermediate of one expert)
MODELS = [
    ("qwen3_30b_a3b", 128, 8, 2048, 768),
    ("gpt_oss_20b", 32, 4, 2880, 2880),
    ("mixtral_8x7b", 8, 2, 4096, 14336),
]
TOKENS = [1, 64, 512, 4096]  # two decode steps, two prefills
# bfloat16 experts everywhere; FP8 experts where Qwen3 is served quantized (the NVIDIA path,
# whose bit-moving widening is inline PTX).
CASES = [(*model, tokens, "bfloat16") for model in MODELS for tokens in TOKENS] + [
    (*MODELS[0], tokens, "float8_e4m3fn") for tokens in (1, 4096)
]

_CHILD = """
import dataclasses, json, sys, tempfile, pathlib
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedserve_rocm.amdgcn import stats_of
from pagedserve_triton import moe_kernel as mk, moe_routing as mr

H100, MI300, MI355 = sys.argv[2], sys.argv[3], sys.argv[4]
out_dir = pathlib.Path(tempfile.mkdtemp())
TARGETS = {"sm90": (H100, GPUTarget("cuda", 90, 32)), "gfx942": (MI300, GPUTarget("hip", "gfx942", 64)),
           "gfx950": (MI355, GPUTarget("hip", "gfx950", 64))}

def source(kernel, constexprs, pointers, ints, floats=()):
    # As a launch specialises the kernel: every pointer 16-byte aligned (fresh or aligned buffers),
    # integers divisible by 16 marked so (`ints`: the launch's values) unless the kernel says not
    # to specialise on them.
    unspecialized = {kernel.arg_names[a] if isinstance(a, int) else a for a in kernel.do_not_specialize}
    signature, attrs = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = pointers.get(arg, "*i32")
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "fp32" if arg in floats else "i32"
            if arg not in floats and arg not in unspecialized and ints[arg] % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)

def launches(device, model, e, k, h, i, tokens, wdtype):
    # Every kernel a call of these shapes launches, with the constexprs `fused_moe_forward` passes.
    weight = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}[wdtype]
    config = mk.moe_config(device, num_experts=e, hidden_size=h, intermediate_size=i, top_k=k,
                           dtype=torch.bfloat16, weight_dtype=weight, tokens=tokens)
    plan = mk.plan_launch(config, tokens, e, h, i, k)
    tiles = mr.routing_tiles(e, k)
    num_chunks = -(-tokens // tiles.block_t)
    fused = num_chunks == 1
    w_ty = "*fp8e4nv" if wdtype == "float8_e4m3fn" else "*bf16"
    fp8 = wdtype == "float8_e4m3fn"
    route_warps = mr.ROUTE_WARPS if device == H100 else mr.ROUTE_WARPS_AMD  # as `route_warps` picks
    yield ("route", mr.moe_route_kernel, route_warps, 1, dict(
        TOP_K=k, K_PAD=tiles.k_pad, SOFTMAX_FIRST=True, RENORMALIZE=True, BLOCK_T=tiles.route_block_t(tokens),
        BLOCK_E=tiles.block_e, FUSED=fused, BLOCK_M=config.block_m if fused else 16, BLOCK_B=tiles.block_b),
        {"logits_ptr": "*fp32", "weights_ptr": "*fp32"},
        dict(M=tokens, E=e, stride_lm=e, max_blocks=plan.max_blocks), ())
    if not fused:
        yield "scan", mr.moe_scan_kernel, 4, 1, dict(BLOCK_M=config.block_m, BLOCK_E=tiles.block_e,
            BLOCK_C=tiles.block_c, BLOCK_B=tiles.block_b), {}, dict(num_chunks=num_chunks, E=e,
            max_blocks=plan.max_blocks), ()
        yield "scatter", mr.moe_scatter_kernel, 4, 1, dict(TOP_K=k, BLOCK_T=tiles.block_t,
            BLOCK_S=mr.SCATTER_BLOCK), {}, dict(num_pairs=tokens * k, E=e), ()
    gemm_ptrs = {"a_ptr": "*bf16", "w_ptr": w_ty, "scale_ptr": "*fp32", "bias_ptr": "*bf16"}
    pairs = tokens * k
    for name, tiles_, gated, split, n, kk, ints in (
        ("gate_up", config.gate_up, True, 1, i, h, dict(stride_am=h, stride_we=2 * i * h, stride_wn=h,
         stride_se=2 * i, stride_be=2 * i, stride_os=0, stride_om=i, k_per_split=h)),
        ("down", config.down, False, plan.split_k, h, i, dict(stride_am=i, stride_we=h * i, stride_wn=i,
         stride_se=h, stride_be=h, stride_os=pairs * h, stride_om=h, k_per_split=plan.k_per_split)),
    ):
        widen = fp8 and device == H100
        even = kk % tiles_.block_k == 0 and (split == 1 or split * plan.k_per_split == kk)
        gpt_oss = model == "gpt_oss_20b"
        constexprs = dict(TOP_K=k, BLOCK_M=config.block_m, BLOCK_N=tiles_.block_n, BLOCK_K=tiles_.block_k,
                          EVEN_K=even, GATED=gated, SWIGLU=gpt_oss, HAS_SCALE=fp8,
                          HAS_BIAS=gpt_oss, DOT_IN_FP32=False, ROUND_BF16=False, WIDEN_BITS=widen,
                          WEIGHT_MAJOR=config.weight_major)
        out = "*fp32" if split > 1 else "*bf16"
        yield name, mk.moe_gemm_kernel, tiles_.num_warps, tiles_.num_stages, constexprs, \
            {**gemm_ptrs, "out_ptr": out}, dict(N=n, K=kk, **ints), ("swiglu_limit",)
    block_t, block_h = mk.combine_tiles(h)
    yield "combine", mk.moe_combine_kernel, 4, 1, dict(TOP_K=k, SPLIT_K=plan.split_k, BLOCK_T=block_t,
        BLOCK_H=block_h, ROUND_BF16=False), {"y_ptr": "*fp32" if plan.split_k > 1 else "*bf16",
        "weights_ptr": "*fp32", "out_ptr": "*bf16"}, dict(M=tokens, H=h, stride_ys=pairs * h, stride_yp=h,
        stride_om=h), ()

results, seen = {}, {}
for model, e, k, h, i, tokens, wdtype in json.loads(sys.argv[1]):
    for target, (device, gpu) in TARGETS.items():
        for launch in launches(device, model, e, k, h, i, tokens, wdtype):
            name, kernel, warps, stages, constexprs, pointers, ints, floats = launch
            key = f"{model}/{tokens}/{wdtype}/{name}/{target}"
            divisible = sorted((arg, value % 16 == 0) for arg, value in ints.items())
            spec = json.dumps([name, target, warps, stages, sorted(constexprs.items()),
                               sorted(pointers.items()), divisible])
            if spec in seen:
                results[key] = seen[spec]
                continue
            compiled = triton.compile(source(kernel, constexprs, pointers, ints, floats), target=gpu,
                                      options={"num_warps": warps, "num_stages": stages})
            if target == "sm90":
                cubin = out_dir / f"{len(seen)}.cubin"
                cubin.write_bytes(compiled.asm["cubin"])
                found = {"shared": compiled.metadata.shared, "cubin": str(cubin)}
            else:
                stats = stats_of(compiled.asm["amdgcn"], target, compiled.metadata.shared)
                found = {"shared": compiled.metadata.shared, "vgpr_spills": stats.vgpr_spills,
                         "sgpr_spills": stats.sgpr_spills}
            found["config"] = {n: v for n, v in constexprs.items() if n.startswith("BLOCK") or n == "FUSED"}
            found["warps"], found["stages"] = warps, stages
            seen[spec] = results[key] = found
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = run_without_interpreter(
        _CHILD, json.dumps(CASES), H100, MI300, MI355
    )
    return results


def _resource_usage(cubin: str) -> dict[str, int]:
    """REG, STACK and LOCAL of the cubin's kernel, from the cuobjdump that ships with Triton."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip(f"no cuobjdump at {tool}")
    text = subprocess.run([str(tool), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", text)}


def _keys(compiled: dict[str, dict[str, object]], target: str) -> list[str]:
    return sorted(key for key in compiled if key.endswith(f"/{target}"))


def test_every_model_and_size_compiled_each_kernel(compiled: dict[str, dict[str, object]]) -> None:
    for model, *_ in MODELS:
        for tokens in TOKENS:
            for target in ("sm90", *AMD_TARGETS):
                names = {
                    k.split("/")[3] for k in compiled if k.startswith(f"{model}/{tokens}/") and target in k
                }
                assert {"route", "gate_up", "down", "combine"} <= names, (model, tokens, target, names)
    # Steps of one routing chunk route in one launch; prefills launch the scan and scatter too.
    assert not any(k.startswith("qwen3_30b_a3b/1/") and ("/scan/" in k or "/scatter/" in k) for k in compiled)
    assert any("/scan/" in key for key in compiled) and any("/scatter/" in key for key in compiled)


def test_kernels_compile_for_h100_without_spills(compiled: dict[str, dict[str, object]]) -> None:
    for key in _keys(compiled, "sm90"):
        result = compiled[key]
        shared = result["shared"]
        assert isinstance(shared, int) and 0 <= shared <= H100_SHARED_BYTES, (key, result)
        usage = _resource_usage(str(result["cubin"]))
        assert usage["STACK"] == 0 and usage["LOCAL"] == 0, (key, result, usage)


@pytest.mark.parametrize("target", AMD_TARGETS)
def test_kernels_compile_for_amd_without_spills(compiled: dict[str, dict[str, object]], target: str) -> None:
    keys = _keys(compiled, target)
    assert any("/route/" in key for key in keys)
    for key in keys:
        result = compiled[key]
        shared = result["shared"]
        assert isinstance(shared, int) and 0 <= shared <= AMD_LDS_BYTES[target], (key, result)
        assert result["vgpr_spills"] == 0 and result["sgpr_spills"] == 0, (key, result)
