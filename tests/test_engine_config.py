"""The engine's configuration is resolved once, before any worker starts: the defaults that depend
on the model or the platform, the rules between options, and the rules that turn a device's
measured memory into KV blocks, with concrete numbers. Nothing here loads a model."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import pytest
import torch
from config_support import CPU, GPU, resolved

from pagedserve import LLM
from pagedserve.config import PreemptionMode, SchedulerConfig, SchedulingPolicy
from pagedserve.config.engine_config import resolve_dtype
from pagedserve.worker.step_runner import WorkerReport

GIB = 2**30


# ----------------------------------------------------------------------------- the scheduler's limits
@pytest.mark.parametrize(
    ("trained", "expected"),
    [(None, 8192), (2048, 2048), (131072, 8192)],
)
def test_max_model_len_defaults_to_the_trained_context_at_most_8192(
    trained: int | None, expected: int
) -> None:
    assert resolved(trained_context_len=trained).scheduler.max_model_len == expected


def test_a_max_model_len_past_the_trained_context_is_kept_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedserve.config.engine_config"):
        config = resolved(trained_context_len=2048, max_model_len=4096)
    assert config.scheduler.max_model_len == 4096
    assert "longer than the model's trained context (2048)" in caplog.text


def test_the_step_budget_defaults_to_8192_and_holds_every_running_request() -> None:
    assert resolved().scheduler.max_num_batched_tokens == 8192
    assert resolved(max_num_seqs=10_000).scheduler.max_num_batched_tokens == 10_000
    assert resolved(max_num_batched_tokens=64, max_num_seqs=8).scheduler.max_num_batched_tokens == 64


def test_without_chunked_prefill_the_budget_holds_the_longest_prompt() -> None:
    config = resolved(max_num_batched_tokens=64, max_model_len=512, enable_chunked_prefill=False)
    assert config.scheduler.max_num_batched_tokens == 512
    # The cache's bounds come from the same resolved max_model_len.
    assert (config.cache.min_blocks, config.cache.max_useful_blocks) == (512 // 16, 256 * 512 // 16)


def test_a_budget_below_max_num_seqs_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens \(8\) must be at least max_num_seqs \(16\)"
    ):
        resolved(max_num_batched_tokens=8, max_num_seqs=16)


def test_the_budget_is_refused_before_any_rank_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedserve.processes.tensor_parallel.launch as launch

    def no_ranks(*args: object) -> None:
        raise AssertionError("a rank was started for an engine whose options cannot hold")

    monkeypatch.setattr(launch, "start_executor", no_ranks)
    with pytest.raises(ValueError, match="must be at least max_num_seqs"):
        LLM(platform="cpu_reference", tensor_parallel_size=2, max_num_batched_tokens=8, max_num_seqs=16)


def test_scheduling_options_reach_the_scheduler_config() -> None:
    config = resolved(
        offline=True,
        num_speculative_tokens=3,
        preemption_mode="swap",
        cuda_graph_max_tokens=96,
        enable_lora=True,
        max_loras=2,
    )
    scheduler = config.scheduler
    assert scheduler.policy is SchedulingPolicy.MAKESPAN  # "auto" offline
    assert resolved(offline=False).scheduler.policy is SchedulingPolicy.FCFS  # "auto" in a server
    assert (scheduler.num_speculative_tokens, scheduler.preemption_mode) == (3, PreemptionMode.SWAP)
    assert (scheduler.widest_decoding_step, scheduler.max_loras) == (96, 2)
    assert resolved().scheduler.max_loras is None


def test_asynchronous_scheduling_is_on_for_accelerators_unless_asked_otherwise() -> None:
    assert not resolved(platform=CPU).scheduler.async_scheduling
    assert resolved(platform=GPU).scheduler.async_scheduling
    assert resolved(platform=CPU, async_scheduling=True).scheduler.async_scheduling
    assert not resolved(platform=GPU, async_scheduling=False).scheduler.async_scheduling


def test_ranks_report_measurements_not_the_limits_resolved_before_them() -> None:
    """The step budget and max_model_len are the driver's: a rank never sends them back up."""
    reported = {f.name for f in dataclasses.fields(WorkerReport)}
    assert not reported & {f.name for f in dataclasses.fields(SchedulerConfig)}


# ----------------------------------------------------------------------------- the model
def test_auto_dtype_is_the_platforms_and_an_unsupported_one_is_refused() -> None:
    assert resolved(platform=CPU).model.dtype == torch.float32
    assert resolved(platform=GPU).model.dtype == torch.bfloat16
    assert resolved(platform=CPU, quantization="gguf").model.dtype == torch.bfloat16  # packed int4 kernels
    assert resolve_dtype("float16", CPU) == torch.float16
    with pytest.raises(ValueError, match=r"dtype 'float64' is not supported by platform 'test_gpu'"):
        resolved(platform=GPU, dtype="float64")


def test_lora_gets_slots_for_the_widest_forward() -> None:
    assert resolved().lora is None
    lora = resolved(enable_lora=True, max_loras=3, max_lora_rank=8, max_num_batched_tokens=512).lora
    assert lora is not None
    assert (lora.max_loras, lora.max_lora_rank) == (3, 8)
    assert lora.max_tokens == 2048  # the CUDA-graph ceiling is wider than the step budget


# ----------------------------------------------------------------------------- the KV cache's size
def test_gpu_blocks_are_the_memory_share_left_after_the_model_and_its_largest_step() -> None:
    cache = resolved(gpu_memory_utilization=0.5).cache
    # 0.5 * 80 GiB - 20 GiB in use - 4 GiB of activations = 16 GiB, in 2 MiB blocks.
    blocks = cache.blocks_in_gpu(
        total_bytes=80 * GIB, in_use_bytes=20 * GIB, peak_activation_bytes=4 * GIB, block_bytes=2 * 2**20
    )
    assert blocks == 16 * 512
    with pytest.raises(ValueError, match=r"no GPU memory left .* gpu_memory_utilization=0.5"):
        cache.blocks_in_gpu(
            total_bytes=80 * GIB, in_use_bytes=39 * GIB, peak_activation_bytes=GIB, block_bytes=1
        )


def test_cpu_blocks_take_the_budget_up_to_half_the_memory_and_what_can_be_used() -> None:
    cache = resolved(cpu_kv_cache_gib=1.0, max_num_seqs=2, max_model_len=64, block_size=16).cache
    assert cache.max_useful_blocks == 2 * 4
    assert cache.blocks_on_host(available_bytes=64 * GIB, block_bytes=2**20) == 8  # capped by use
    roomy = resolved(cpu_kv_cache_gib=1.0).cache
    assert roomy.blocks_on_host(available_bytes=64 * GIB, block_bytes=2**20) == 1024  # the budget
    assert roomy.blocks_on_host(available_bytes=GIB, block_bytes=2**20) == 512  # half the memory
    assert roomy.blocks_on_host(available_bytes=0, block_bytes=2**20) == 1  # never none


def test_every_device_holds_the_fewest_blocks_any_found_room_for() -> None:
    cache = resolved(max_model_len=64, block_size=16).cache
    assert cache.agreed_blocks([40, 12, 30]) == 12
    with pytest.raises(ValueError, match=r"only 3 KV blocks fit in memory but one request .* needs 4"):
        cache.agreed_blocks([40, 3])
    exact = resolved(max_model_len=64, block_size=16, num_kv_blocks=2).cache
    assert exact.agreed_blocks([2, 2]) == 2  # asked for exactly: taken as it is


def test_the_swap_pool_holds_swap_space_gib_in_blocks() -> None:
    assert resolved(swap_space_gib=0.5).cache.swap_blocks(2**20) == 512
    assert resolved().cache.swap_blocks(2**20) == 0


# ----------------------------------------------------------------------------- import weight
def test_the_options_import_without_torch() -> None:
    """`pagedserve serve` builds its flags from `EngineArgs` and starts its engine core before
    the API process imports torch (`processes.engine_core.early_core`): the config face must stay light."""
    script = "import sys, pagedserve.cli.serve, pagedserve.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
