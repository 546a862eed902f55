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
