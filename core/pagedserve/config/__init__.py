"""Engine configuration: `EngineArgs`, the flat options users give, and the frozen config of each
concern it resolves to, once, before any worker starts (`engine_config.resolve_engine_config`).

This face imports no torch (the CLI builds its flags from `EngineArgs` before anything heavy
loads); `engine_config`, which resolves against a platform, is imported from its module.
"""

from pagedserve.config.cache import CacheConfig
from pagedserve.config.engine_args import EngineArgs
from pagedserve.config.forward import ForwardConfig
from pagedserve.config.lora import LoRAConfig
from pagedserve.config.model import ModelConfig
from pagedserve.config.parallel import ParallelConfig
from pagedserve.config.scheduler import PreemptionMode, SchedulerConfig, SchedulingPolicy

__all__ = [
    "CacheConfig",
    "EngineArgs",
    "ForwardConfig",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "PreemptionMode",
    "SchedulerConfig",
    "SchedulingPolicy",
]
