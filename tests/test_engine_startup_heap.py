"""The start-up heap freeze: an engine's long-lived objects leave Python's full collections once it
is ready, and the next engine's start-up releases what an engine dropped before it left behind."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from models_harness import save_checkpoint, tiny_hf_model
from transformers import LlamaConfig

import pagedserve.engine.setup as engine_setup
from pagedserve import LLM, SamplingParams
from pagedserve.worker.startup.startup_heap import freeze_startup_heap


@pytest.fixture(autouse=True)
def _unfrozen_afterwards() -> Iterator[None]:
    yield
    gc.unfreeze()  # leave the collector as the other tests of this process expect it


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_cycles_are_released_by_the_next_freeze() -> None:
    node = _Node()
    alive = weakref.ref(node)
    frozen = freeze_startup_heap()
    # Frozen objects still die by reference count, so the count may have fallen since.
    assert 0 < gc.get_freeze_count() <= frozen.objects and frozen.collect_s >= 0
    del node
    gc.collect()
    assert alive() is not None  # frozen: a full collection does not look at it
    freeze_startup_heap()  # what the next engine's start-up does first: unfreeze and collect
    assert alive() is None


def test_frozen_objects_are_not_walked_by_a_full_collection() -> None:
    keep = [[i] for i in range(50_000)]  # tracked containers, like a model's modules and graphs
    gc.collect()
    walked_before = _objects_walked()
    freeze_startup_heap()
    walked_after = _objects_walked()
    assert walked_before - walked_after >= len(keep)


def _objects_walked() -> int:
    """Objects the collector's generations hold (what a full collection walks)."""
    return sum(len(gc.get_objects(generation)) for generation in range(3))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return save_checkpoint(tiny_hf_model(config, seed=1), tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("freeze", [True, False])
def test_the_engine_freezes_after_start_up_unless_told_not_to(
    checkpoint: Path, freeze: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(engine_setup, "freeze_startup_heap", lambda: calls.append(1))
    llm = LLM(
        str(checkpoint),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=32,
        freeze_startup_heap=freeze,
    )
    assert calls == ([1] if freeze else [])
    params = SamplingParams(max_tokens=2, detokenize=False)
    assert llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids


def test_frozen_objects_are_finalized_when_the_interpreter_exits() -> None:
    """A frozen garbage cycle is still finalized by the collection the interpreter runs while it
    shuts down (extension modules that count their objects report them as leaked otherwise)."""
    script = (
        "import gc\n"
        "from pagedserve.worker.startup.startup_heap import freeze_startup_heap\n"
        "class Node:\n"
        "    def __init__(self):\n"
        "        self.me = self\n"
        "    def __del__(self):\n"
        "        print('finalized', flush=True)\n"
        "node = Node()\n"
        "freeze_startup_heap()\n"
        "freeze_startup_heap()  # a second engine of the process registers nothing twice\n"
        "del node\n"
        "gc.collect()\n"
        "print('exiting', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["exiting", "finalized"]
