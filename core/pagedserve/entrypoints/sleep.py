"""`LLM.sleep(level)` / `LLM.wake_up(tags)`: vLLM's sleep mode, for a process that must lend the
device's memory to something else for a while (an RLHF trainer's step, say) and come back.

Level 1 offloads the weights to host memory and frees the KV cache; level 2 frees both (waking
reads the checkpoint again). `wake_up(tags=["weights"])` then `wake_up(tags=["kv_cache"])` wakes
the parts one at a time, as vLLM's does. The engine must be built with `enable_sleep_mode=True`
(as vLLM requires) and idle when it goes to sleep; generation and pooling are refused until both
parts are awake. The runner's side is `worker.sleep_mode`. One device only: tensor and data
parallel engines are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.sleep_mode import SleepingRunner, SleepLevel, put_to_sleep, wake_kv_cache, wake_weights
from pagedserve.worker.startup.device_model import load_device_model

WAKE_TAGS = ("weights", "kv_cache")


class SleepMode:
    """The sleep state of one `LLM`'s engine. Not thread-safe; `sleep` and `wake_up` mutate."""

    def __init__(self, engine: Any, enabled: bool) -> None:
        self._engine = engine
        self._enabled = enabled
        self._sleeping: SleepingRunner | None = None
        self._asleep: set[str] = set()  # which of WAKE_TAGS are asleep

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def check_awake(self, method: str) -> None:
        """Raise ValueError when part of the engine is asleep."""
        if self._asleep:
            raise ValueError(
                f"{method}: the engine is asleep ({', '.join(sorted(self._asleep))}): call wake_up() first"
            )

    def sleep(self, level: int) -> None:
        """Put the engine to sleep (see the module). Raises ValueError when sleep mode is off,
        the engine is busy or already asleep, or cannot sleep (several devices)."""
        runner = self._runner("sleep")
        if level not in (1, 2):
            raise ValueError(
                f"level must be 1 (weights offloaded to host memory) or 2 (weights freed), got {level!r}"
            )
        if self._asleep:
            raise ValueError("the engine is already asleep: call wake_up() first")
        engine: LLMEngine = self._engine
        if engine.has_unfinished_requests():
            raise ValueError(
                "sleep: requests are still running (added through llm_engine): finish or abort them"
            )
        if level == 2 and engine.setup.lora is not None:
            raise ValueError(
                "sleep(level=2) reloads the checkpoint on waking, which LoRA's wrapped layers do not "
                "match: use level=1"
            )
        engine.reset_prefix_cache()  # the cached prefixes' KV is about to be freed
        lvl: SleepLevel = 1 if level == 1 else 2
        self._sleeping = put_to_sleep(runner, lvl)
        self._asleep = set(WAKE_TAGS)

    def wake_up(self, tags: Sequence[str] | None) -> None:
        """Wake the parts `tags` names (None: both). Raises ValueError for an unknown tag, or
        when nothing sleeps."""
        runner = self._runner("wake_up")
        wanted = list(WAKE_TAGS) if tags is None else list(tags)
        unknown = [t for t in wanted if t not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"wake_up tags must be among {list(WAKE_TAGS)}, got {unknown}")
        if self._sleeping is None:
            raise ValueError("wake_up: the engine is not asleep")
        if "weights" in wanted and "weights" in self._asleep:
            wake_weights(runner, self._sleeping, self._reload)
            self._asleep.discard("weights")
        if "kv_cache" in wanted and "kv_cache" in self._asleep:
            wake_kv_cache(runner, self._sleeping)
            self._asleep.discard("kv_cache")
        if not self._asleep:
            self._sleeping = None

    def _runner(self, method: str) -> ModelRunner:
        if not self._enabled:
            raise ValueError(
                f"{method}: sleep mode is off: build the LLM with enable_sleep_mode=True (as vLLM requires)"
            )
        engine = self._engine
        runner = engine.core.runner if engine.in_process else None
        if not isinstance(runner, ModelRunner):
            raise ValueError(
                f"{method}: sleep mode runs on one device; tensor_parallel_size > 1 and "
                "data_parallel_size > 1 engines cannot sleep"
            )
        return runner

    def _reload(self) -> Any:
        """The model loaded again from its checkpoint, as the runner was built (level 2)."""
        engine: LLMEngine = self._engine
        config = engine.setup.config
        runner = engine.core.runner
        assert isinstance(runner, ModelRunner)
        dm = load_device_model(
            config.model, config.cache, config.forward, engine.setup.platform, runner.device
        )
        return dm.loaded.model
