"""Programmatic dependent launches (NVIDIA sm_90+) of the plugin's Triton kernels.

Why. A decode step of a small batch is hundreds of short kernels in a row; between two of them the
GPU drains the first (its last programs finish, its writes are flushed) before it sets up the
second's grid, about a microsecond each time with nothing running. A programmatic dependent
launch lets the second kernel's grid be set up while the first drains: its programs wait on the
device (`griddepcontrol.wait`) for the first to finish before they touch memory, and the first
lets it launch (`griddepcontrol.launch_dependents`) once its own loads are issued. CUDA graphs
keep the dependency when they capture such launches.

A kernel launched this way must wait before its first memory access and may let the next one
launch only after that wait: then every kernel of the chain starts its memory work after all
earlier kernels have finished, whichever of them were launched this way.
"""

from __future__ import annotations

import torch

from pagedserve_triton.interpreter import INTERPRETED


def programmatic_launch_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be programmatic dependent launches: an NVIDIA GPU of compute
    capability 9.0 or newer, outside Triton's interpreter."""
    if INTERPRETED or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(dependent: bool, device: torch.device) -> dict[str, bool]:
    """The Triton launch keywords of a launch that is a programmatic dependent one exactly when
    `dependent`. Raises ValueError when `device` has no programmatic dependent launch."""
    if not dependent:
        return {}
    if not programmatic_launch_supported(device):
        raise ValueError(f"{device} has no programmatic dependent launch (NVIDIA sm_90+ only)")
    return {"launch_pdl": True}
