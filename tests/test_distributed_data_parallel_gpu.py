"""Data parallelism on GPUs: two replicas, each its own engine-core process on its own GPU, give the
greedy tokens one engine gives on the triton platform in float32 (and, with four GPUs, two
replicas of tensor_parallel_size=2 do too), with the GPU defaults (compiled forward, CUDA graphs,
asynchronous scheduling).

Skipped without two CUDA GPUs. Run this file in its own pytest process (the interpreter test files
set TRITON_INTERPRET=1, which would put the Triton kernels on the CPU).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from models_harness import save_checkpoint, tiny_hf_model
from test_distributed_engine import GREEDY, PROMPTS
from test_distributed_gpu import CONFIGS

from pagedserve import LLM
from pagedserve.processes.data_parallel.offline_client import DataParallelCores
from pagedserve.processes.data_parallel.placement import visible_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
    ),
]

ENGINE: dict[str, object] = dict(
    platform="triton", skip_tokenizer_init=True, dtype="float32", block_size=16, max_model_len=64
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The tensor-parallel GPU tests' tiny Llama: head size 32, the smallest triton takes.
    return save_checkpoint(tiny_hf_model(CONFIGS["llama"](), seed=0), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    llm = LLM(str(checkpoint), **ENGINE)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


def _replica_gpus(pid: int) -> str | None:
    """CUDA_VISIBLE_DEVICES in the environment a process started with (Linux /proc)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    value = entries.get(b"CUDA_VISIBLE_DEVICES")
    return value.decode() if value is not None else None


@pytest.mark.parametrize("tp", [1, 2])
def test_dp2_equals_one_engine_on_gpus(checkpoint: Path, expected: list[list[int]], tp: int) -> None:
    gpus = visible_gpus()
    if len(gpus) < 2 * tp:
        pytest.skip(f"needs {2 * tp} CUDA GPUs")
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    llm = LLM(str(checkpoint), data_parallel_size=2, tensor_parallel_size=tp, **ENGINE)
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # set for the replicas' start only
    engine = llm.engine
    assert isinstance(engine.client, DataParallelCores)
    try:
        pids = [pid for pid in engine.client.replica_pids if pid is not None]
        assert [_replica_gpus(pid) for pid in pids] == [",".join(gpus[i * tp : (i + 1) * tp]) for i in (0, 1)]
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == expected
        assert all(n > 0 for n in engine.client.balancer.placed)
    finally:
        engine.shutdown()
