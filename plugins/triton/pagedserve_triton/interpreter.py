"""Whether this process runs the plugin's Triton kernels in Triton's interpreter (`TRITON_INTERPRET=1`).

`triton.jit` reads the variable when a kernel is decorated, i.e. when a kernel module is imported,
so this is read once, at import, like the kernels' own mode."""

from __future__ import annotations

import os

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
