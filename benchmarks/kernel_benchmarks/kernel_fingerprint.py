"""Without a GPU: fingerprints of the machine code the Triton attention kernels compile to, so a
change meant to leave the kernels' code alone (a refactor of their helpers, say) can be shown to,
and needs no GPU run to keep its timings.

Each variant of the 2D and 3D unified attention kernels that the tuned configs can select (plain,
block-id prefetching, lazy rescaling, a pipelined loop, warp specialisation, window + softcap +
longest-first launch order, an FP8 cache widened by bits, a programmatic-dependent decode launch,
attention sinks (2D only: the 3D kernel leaves them to its reduction))
is compiled by Triton's NVIDIA backend for sm_90 and, with `--amd`, by its AMD backend for gfx942.
The code is the PTX (or AMDGCN) of the kernel body with debug information, source locations and
temporary labels removed: the same fingerprint means the same instructions, so ptxas / the AMD
assembler produce the same binary. Run it before and after the change and compare:

    # at the old revision, then at the new one
    env -u TRITON_INTERPRET python benchmarks/kernel_benchmarks/kernel_fingerprint.py --json before.json
    env -u TRITON_INTERPRET python benchmarks/kernel_benchmarks/kernel_fingerprint.py --compare before.json

Fingerprints depend on the Triton version: compare two runs of one environment only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

POINTERS = {
    "block_table_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "segm_acc_ptr": "*fp32",
    "segm_max_ptr": "*fp32",
    "segm_sum_ptr": "*fp32",
    "sinks_ptr": "*fp32",
}
FLOATS = {"scale_log2", "out_scale", "softcap"}
BASE: dict[str, Any] = dict(
    QUERIES_PER_KV=4,
    BLOCK_M=64,
    BLOCK_Q=16,
    HEAD_SIZE=128,
    HEAD_SIZE_PADDED=128,
    BLOCK_SIZE=16,
    TILE_SIZE=64,
    USE_SOFTCAP=False,
    USE_WINDOW=False,
    DOT_IN_FP32=False,
    NUM_GRID_GROUPS=1,
    KV_CACHE_MODIFIER="",
    PREFETCH_BLOCK_IDS=False,
    LAZY_RESCALE=False,
    LOOP_STAGES=0,
    WARP_SPECIALIZE=False,
    LONGEST_FIRST=False,
    WIDEN_BITS=False,
    DEPENDENT=False,
)
WIDE = {"BLOCK_M": 128, "BLOCK_Q": 32}
# The 2D kernel's sink arguments in a layer without sinks: the backend passes a None pointer, which
# Triton compiles as a constant (the 3D kernel has neither argument).
NO_SINKS_2D: dict[str, Any] = {"USE_SINKS": False, "sinks_ptr": None}
# name -> (constexpr overrides, kv cache pointer type, targets)
VARIANTS: dict[str, tuple[dict[str, Any], str, tuple[str, ...]]] = {
    "plain": ({}, "*bf16", ("sm90", "gfx942")),
    "prefetch": ({"PREFETCH_BLOCK_IDS": True}, "*bf16", ("sm90", "gfx942")),
    "lazy": ({"LAZY_RESCALE": True}, "*bf16", ("sm90",)),
    "loop3": ({**WIDE, "PREFETCH_BLOCK_IDS": True, "LOOP_STAGES": 3}, "*bf16", ("sm90",)),
    "warp_specialize": (
        {**WIDE, "WARP_SPECIALIZE": True, "PREFETCH_BLOCK_IDS": True, "LOOP_STAGES": 2},
        "*bf16",
        ("sm90",),
    ),
    "window_softcap_longest": (
        {"USE_WINDOW": True, "USE_SOFTCAP": True, "LONGEST_FIRST": True, "NUM_GRID_GROUPS": 8},
        "*bf16",
        ("sm90", "gfx942"),
    ),
    "fp8_widen": ({"WIDEN_BITS": True}, "*fp8e4nv", ("sm90",)),
    "sinks": ({"USE_SINKS": True}, "*bf16", ("sm90", "gfx942")),
    "decode_dependent": (
        {"BLOCK_M": 16, "BLOCK_Q": 4, "TILE_SIZE": 32, "DEPENDENT": True, "KV_CACHE_MODIFIER": ".cg"},
        "*bf16",
        ("sm90",),
    ),
}
NUM_SPLITS_3D = 16


def code_of(asm: str, target: str) -> str:
    """The kernel body's instructions: no debug sections, source locations, comments or numbered
    temporary labels (whose numbers move with source lines). Pure."""
    end = "$L__func_end0:" if target == "sm90" else ".Lfunc_end0"
    body = asm[: asm.find(end)] if end in asm else asm
    keep = []
    for line in body.splitlines():
        stripped = line.strip()
        if stripped.startswith((".loc", ".file", "//", ";")) or re.match(
            r"^(\$L__tmp|\.Ltmp)\d+:$", stripped
        ):
            continue
        keep.append(re.sub(r"(\$L__tmp|\.Ltmp)\d+", "TMP", line))
    return "\n".join(keep)


def compile_variant(kernel: Any, constexprs: dict[str, Any], kv_type: str, target: str) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    pointers = {**POINTERS, "kv_ptr": kv_type}
    for index, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = pointers.get(arg, "*bf16")
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "fp32" if arg in FLOATS else "i32"
            if arg.startswith("stride"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    gpu = GPUTarget("cuda", 90, 32) if target == "sm90" else GPUTarget("hip", "gfx942", 64)
    warps = 8 if constexprs["BLOCK_M"] == 128 else 4
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        target=gpu,
        options={"num_warps": warps, "num_stages": 2},
    )
    return code_of(compiled.asm["ptx" if target == "sm90" else "amdgcn"], target)


def fingerprints(amd: bool) -> dict[str, str]:
    from pagedserve_triton.unified_attention import unified_attention_2d_kernel, unified_attention_3d_kernel

    out = {}
    for name, (overrides, kv_type, targets) in VARIANTS.items():
        for target in targets:
            if target == "gfx942" and not amd:
                continue
            for kind, kernel in (("2d", unified_attention_2d_kernel), ("3d", unified_attention_3d_kernel)):
                if kind == "3d" and (overrides.get("WARP_SPECIALIZE") or overrides.get("USE_SINKS")):
                    continue  # no warp specialisation in the split kernel; its sinks are the reduction's
                per_kind = {"NUM_SPLITS": NUM_SPLITS_3D} if kind == "3d" else NO_SINKS_2D
                constexprs = {**BASE, **per_kind, **overrides}
                if constexprs.get("USE_SINKS"):
                    del constexprs["sinks_ptr"]  # a real pointer argument then
                code = compile_variant(kernel, constexprs, kv_type, target)
                out[f"{target}/{kind}/{name}"] = hashlib.sha256(code.encode()).hexdigest()[:16]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--amd", action="store_true", help="also compile for gfx942 (AMD Instinct MI300)")
    parser.add_argument("--json", type=Path, help="write the fingerprints here")
    parser.add_argument("--compare", type=Path, help="fingerprints of another revision to compare with")
    args = parser.parse_args()
    prints = fingerprints(args.amd)
    for key, value in prints.items():
        print(f"{key:40s} {value}")
    if args.json:
        args.json.write_text(json.dumps(prints, indent=1) + "\n")
    if args.compare:
        other = json.loads(args.compare.read_text())
        changed = sorted(k for k in prints.keys() & other.keys() if prints[k] != other[k])
        print(f"{len(changed)} of {len(prints.keys() & other.keys())} variants changed: {changed or 'none'}")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
