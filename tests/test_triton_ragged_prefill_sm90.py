"""The Hopper whole-prompt prefill kernel (`pagedserve_triton.ragged_prefill_sm90`) on a CPU
machine: it compiles for sm_90a with the installed Triton and fits its launch points without
spilling, and it is chosen only where it runs. Gluon has no interpreter, so its numerics are
checked on the GPU (`test_triton_gpu.py`).

The compilation runs in a child process (this file run as a script): the test session sets
`TRITON_INTERPRET=1`, under which Triton's own library functions cannot be compiled."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

NUM_TOKENS, Q_HEADS, KV_HEADS = 256, 8, 2
_SMEM_PER_SM = 228 * 1024  # shared memory of one sm_90 SM; the driver reserves 1 KiB per block
_REGS_PER_SM = 64 * 1024
POINTS = [(128, 64, 2), (128, 64, 3), (64, 64, 2)]  # (head_size, BLOCK_N, stages)


def _compile_points(out_dir: Path) -> dict[str, dict[str, object]]:
    """Compile every point for sm_90a; write each cubin to `out_dir`. Runs in the child."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from pagedserve_triton import ragged_prefill_sm90 as sm90

    fn = sm90.ragged_prefill_sm90_kernel
    names = list(fn.arg_names)
    result: dict[str, dict[str, object]] = {}
    for head_size, block_n, stages in POINTS:
        q = torch.empty(NUM_TOKENS, Q_HEADS, head_size, dtype=torch.bfloat16)
        kv = torch.empty(NUM_TOKENS, KV_HEADS, head_size, dtype=torch.bfloat16)
        descriptors = {
            "q_desc": sm90._descriptor(q, NUM_TOKENS, sm90.BLOCK_M),
            "k_desc": sm90._descriptor(kv, NUM_TOKENS, block_n),
            "v_desc": sm90._descriptor(kv, NUM_TOKENS, block_n),
        }
        runtime = {
            "out_ptr": "*bf16",
            "stride_out_token": "i32",
            "stride_out_head": "i32",
            "tile_request_ptr": "*i32",
            "tile_index_ptr": "*i32",
            "query_start_loc_ptr": "*i32",
            "scale_log2": "fp32",
        }
        constexprs = {
            "NUM_Q_HEADS": Q_HEADS,
            "QUERIES_PER_KV": Q_HEADS // KV_HEADS,
            "HEAD_SIZE": head_size,
            "BLOCK_M": sm90.BLOCK_M,
            "BLOCK_N": block_n,
            "STAGES": stages,
            "num_warps": sm90.NUM_WARPS,
        }
        signature = {
            n: mangle_type(descriptors[n]) if n in descriptors else runtime.get(n, "constexpr") for n in names
        }
        positions = {(names.index(n),): v for n, v in constexprs.items()}
        source = GluonASTSource(fn, signature, constexprs=positions)
        target = GPUTarget("cuda", 90, 32)
        kernel = triton.compile(source, target=target, options={"num_warps": sm90.NUM_WARPS})
        key = f"{head_size}-{block_n}-{stages}"
        cubin = out_dir / f"{key}.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        result[key] = {"ptx": kernel.asm["ptx"], "shared": kernel.metadata.shared, "cubin": str(cubin)}
    return result


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    pytest.importorskip("triton.experimental.gluon")
    out_dir = tmp_path_factory.mktemp("sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out_dir / "cache")
    done = subprocess.run(
        [sys.executable, __file__, str(out_dir)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out_dir / "compiled.json").read_text())


def _resource_usage(cubin: str) -> dict[str, int]:
    """REG, STACK and LOCAL of the cubin's kernel, from the cuobjdump that ships with Triton."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip(f"no cuobjdump at {tool}")
    text = subprocess.run([str(tool), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", text)}


@pytest.mark.parametrize("point", [f"{h}-{n}-{s}" for h, n, s in POINTS])
def test_compiles_for_sm90_without_spills(compiled: dict[str, dict[str, object]], point: str) -> None:
    kernel = compiled[point]
    ptx = str(kernel["ptx"])
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx  # warpgroup products, TMA loads
    usage = _resource_usage(str(kernel["cubin"]))
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0, usage
    # Two programs per SM, so that one's softmax runs beside the other's products.
    shared = int(str(kernel["shared"]))
    assert 2 * (shared + 1024) <= _SMEM_PER_SM, shared
    assert 2 * 128 * usage["REG"] <= _REGS_PER_SM, usage


def test_runs_only_where_it_compiles() -> None:
    pytest.importorskip("triton.experimental.gluon")
    from pagedserve_triton import ragged_prefill_sm90 as sm90

    q = torch.empty(64, 8, 128, dtype=torch.bfloat16)
    assert not sm90.device_supported(torch.device("cpu"))
    assert not sm90.supports(q, has_context=False)  # a CPU tensor


if __name__ == "__main__":
    target = Path(sys.argv[1])
    (target / "compiled.json").write_text(json.dumps(_compile_points(target)))
