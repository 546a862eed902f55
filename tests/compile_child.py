"""Triton compilations for a GPU target from the CPU test suite, in a child process.

Kernels decorated while TRITON_INTERPRET=1 is set (as tests/conftest.py sets it without a GPU)
cannot be compiled, so the compile tests run their script in a fresh interpreter without it and
read back the JSON the script prints last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_without_interpreter(script: str, *args: str, timeout: float = 600) -> Any:
    """`python -c script *args` without TRITON_INTERPRET; returns the JSON of its last stdout line.
    Fails the calling test with the child's stderr when it exits non-zero."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# Prepended to a child script that compiles for an H100: the one way those scripts describe a
# kernel's launch to `triton.compile`.
SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def sm90_compile(kernel, constexprs, pointers, warps, stages, floats=(), divisible=()):
    # `kernel` for sm_90 as a launch specialises it: pointers of the given types (default *bf16),
    # 16-byte aligned; `floats` fp32 and the other scalars i32; strides and `divisible` multiples
    # of 16.
    signature, attrs = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = pointers.get(arg, "*bf16")
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "fp32" if arg in floats else "i32"
            if arg.startswith("stride") or arg in divisible:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
"""
