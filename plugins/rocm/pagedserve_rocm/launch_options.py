"""Launch options that exist on one Triton backend only, and the rule that keeps them off the other.

`kernel[grid](..., waves_per_eu=2)` on Triton's CUDA backend raises (an unknown keyword), and an
NVIDIA option such as `maxnreg` means nothing to the AMD compiler. The rocm tables may hold AMD
options; they are passed only when the launch targets AMD (HIP), and stripped (named in
`--explain`) when the same tables run through the CUDA backend or the interpreter. NVIDIA-only
options are refused in the rocm tables outright, and stripped from any launch that targets AMD.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

LaunchBackend = Literal["hip", "cuda", "interpreter"]

AMD_ONLY_OPTIONS = frozenset({"waves_per_eu", "matrix_instr_nonkdim", "kpack", "schedule_hint"})
"""Options of Triton's AMD backend (`HIPOptions`) that its CUDA backend does not have."""

NVIDIA_ONLY_OPTIONS = frozenset({"maxnreg", "launch_pdl", "min_shared_mem", "ptx_options"})
"""Options of Triton's CUDA backend (`CUDAOptions`) that its AMD backend does not have."""

_FOREIGN: dict[LaunchBackend, frozenset[str]] = {
    "hip": NVIDIA_ONLY_OPTIONS,
    "cuda": AMD_ONLY_OPTIONS,
    "interpreter": AMD_ONLY_OPTIONS | NVIDIA_ONLY_OPTIONS,  # the interpreter compiles nothing
}


def options_for(options: Mapping[str, int], backend: LaunchBackend) -> tuple[dict[str, int], tuple[str, ...]]:
    """(the options `backend` may receive, the names stripped because only the other backend has
    them, sorted). Pure."""
    foreign = _FOREIGN[backend]
    kept = {name: value for name, value in options.items() if name not in foreign}
    return kept, tuple(sorted(name for name in options if name in foreign))
