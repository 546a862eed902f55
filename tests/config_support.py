"""Engine configurations for tests, resolved as the engine resolves them: what `LLM(**options)` asks
for on a CPU platform, without a model to load (so the scheduler's tests build their configs from
the same defaults and rules as the engine)."""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.config import EngineArgs
from pagedserve.config.engine_config import EngineConfig, resolve_engine_config
from pagedserve.platforms.api import Availability, PlatformInfo

CPU = PlatformInfo(
    name="test_cpu",
    priority=0,
    device_type="cpu",
    supported_dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16),
    is_available=lambda: Availability(True, "a test's platform"),
)
GPU = PlatformInfo(
    name="test_gpu",
    priority=0,
    device_type="cuda",
    supported_dtypes=(torch.float32, torch.bfloat16, torch.float16),
    is_available=lambda: Availability(True, "a test's platform"),
)


def resolved(
    *,
    trained_context_len: int | None = None,
    offline: bool = False,
    platform: PlatformInfo = CPU,
    **options: Any,
) -> EngineConfig:
    """The configuration `EngineArgs(**options)` resolves to on `platform`, for a model trained on
    `trained_context_len` tokens (None: its config names no length)."""
    return resolve_engine_config(
        EngineArgs(**options), platform=platform, trained_context_len=trained_context_len, offline=offline
    )
