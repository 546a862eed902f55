"""Test-session setup that must happen before any test module is imported."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels can only run in Triton's interpreter, and triton.jit reads the
# variable when a kernel module is imported: set it before collection imports any test module, so
# the order in which pytest-xdist workers collect files cannot decide whether kernels interpret.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
