"""The start-up attention sweep on several threads (`worker/startup/attention_sweep.py`): the same calls as on
one thread, really at once, only for a backend that declares `concurrent_batches`; and the whole
sweep on a thread of its own beside the forward's compilation (`SweepInBackground`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable
from typing import Any, ClassVar

import pytest
import torch

from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.startup.attention_sweep import (
    DEFAULT_MAX_THREADS,
    AttentionWarmup,
    SweepInBackground,
    WarmupBatch,
    attention_warmup_threads,
    thread_on,
    warm_up_attention,
)
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps

HQ, HKV, D, BLOCK_SIZE = 4, 2, 8, 4
SPEC = ModelSpec(
    architecture="LlamaForCausalLM", implementation="native", num_layers=1, num_q_heads=HQ,
    num_kv_heads=HKV, head_size=D, hidden_size=HQ * D, vocab_size=32, dtype=torch.float32,
    sliding_windows=(None, 3), logit_softcap=None, max_position_embeddings=64,
)  # fmt: skip
CACHE = torch.zeros(2, 8, BLOCK_SIZE, HKV, D)
# One variant per context length: every batch below brings one (twice, in another layout: no).
BATCHES = [WarmupBatch((1,), (s,)) for s in range(1, 13)]


class Recording(ReferenceAttentionBackend):
    """Names one variant per (context length, window) and records, launching nothing, which
    calls ran on which thread; `meet` makes the first two calls on pool threads wait for each other."""

    concurrent_batches: ClassVar[bool] = True

    def __init__(self, meet: threading.Barrier | None = None, fail_at: int | None = None) -> None:
        super().__init__()
        self.meet = meet
        self.fail_at = fail_at
        self.lock = threading.Lock()
        self.ran: list[tuple[int, int | None]] = []  # (context length, window)
        self.threads: set[int] = set()
        self.met = 0

    def compile_key(  # type: ignore[override]
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, **kw: Any
    ) -> frozenset[Hashable]:
        return frozenset({(metadata.max_seq_len, kw["sliding_window"])})

    def forward(  # type: ignore[override]
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, **kw: Any
    ) -> torch.Tensor:
        if metadata.max_seq_len == self.fail_at:
            raise RuntimeError(f"variant {self.fail_at} does not compile")
        with self.lock:
            self.ran.append((metadata.max_seq_len, kw["sliding_window"]))
            pooled = threading.current_thread() is not threading.main_thread()
            self.threads.add(threading.get_ident())
            wait = self.meet is not None and pooled and self.met < 2
            self.met += wait
        if wait:
            assert self.meet is not None
            self.meet.wait()  # BrokenBarrierError unless a second call runs meanwhile
        return query


def test_threads_run_the_calls_one_thread_runs_and_run_them_at_once() -> None:
    alone = Recording()
    one = warm_up_attention(alone, ReferenceCacheOps(), CACHE, SPEC, BATCHES)
    pooled = Recording(meet=threading.Barrier(2, timeout=10))
    many = warm_up_attention(pooled, ReferenceCacheOps(), CACHE, SPEC, BATCHES, threads=3)
    assert sorted(pooled.ran, key=str) == sorted(alone.ran, key=str)
    assert len(alone.ran) == 2 * len(BATCHES)  # both layouts of every batch: each a new variant
    assert (many.num_calls, many.num_launched, many.num_variants) == (
        one.num_calls,
        one.num_launched,
        one.num_variants,
    )
    assert len(alone.threads) == 1 and len(pooled.threads) > 1
    # The layouts of one batch share its metadata, so they stay on one thread, in order.
    for context in range(1, 13):
        windows = [w for s, w in pooled.ran if s == context]
        assert windows == [w for s, w in alone.ran if s == context] and len(windows) == 2


def test_a_failure_on_a_thread_reaches_the_caller() -> None:
    with pytest.raises(RuntimeError, match="variant 7 does not compile"):
        warm_up_attention(Recording(fail_at=7), ReferenceCacheOps(), CACHE, SPEC, BATCHES, threads=4)


def test_threads_need_a_backend_that_declares_concurrent_batches(caplog: pytest.LogCaptureFixture) -> None:
    plain = ReferenceAttentionBackend()
    with pytest.raises(ValueError, match="does not declare concurrent_batches"):
        warm_up_attention(plain, ReferenceCacheOps(), CACHE, SPEC, BATCHES, threads=2)
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.startup.attention_sweep"):
        assert attention_warmup_threads(4, plain, cpu_count=32) == 1
    assert "attention_warmup_threads=4 has no effect" in caplog.text
    assert attention_warmup_threads(None, plain, cpu_count=32) == 1


def test_the_thread_count_defaults_to_half_the_cpus_up_to_a_cap() -> None:
    backend = Recording()
    assert attention_warmup_threads(None, backend, cpu_count=64) == DEFAULT_MAX_THREADS
    assert attention_warmup_threads(None, backend, cpu_count=6) == 3
    assert attention_warmup_threads(None, backend, cpu_count=1) == 1
    assert attention_warmup_threads(None, backend, cpu_count=None) == 1
    assert attention_warmup_threads(5, backend, cpu_count=2) == 5
    with pytest.raises(ValueError, match="must be >= 1"):
        attention_warmup_threads(0, backend, cpu_count=8)


def _report() -> AttentionWarmup:
    return AttentionWarmup(num_calls=1, num_launched=1, num_variants=1)


def test_a_sweep_in_the_background_runs_while_the_caller_works() -> None:
    started = threading.Event()
    release = threading.Event()

    def sweep() -> AttentionWarmup:
        started.set()
        assert release.wait(10)  # held until the caller has done its own work
        time.sleep(0.05)  # still running when the caller asks for it
        return _report()

    background = SweepInBackground(sweep, torch.device("cpu"))
    background.start()
    assert started.wait(10)  # it runs before `finish` is called
    time.sleep(0.1)  # the caller's own work ("the compile")
    release.set()
    result, waited_s, beside_s = background.finish()
    assert result == _report()
    assert 0.04 < waited_s < 1.0 and beside_s >= 0.09


def test_a_sweep_not_started_runs_on_the_caller_and_failures_surface() -> None:
    caller = threading.get_ident()
    ran_on: list[int] = []

    def sweep() -> AttentionWarmup:
        ran_on.append(threading.get_ident())
        return _report()

    result, waited_s, beside_s = SweepInBackground(sweep, torch.device("cpu")).finish()
    assert (result, ran_on, beside_s) == (_report(), [caller], 0.0) and waited_s >= 0.0

    def broken() -> AttentionWarmup:
        raise RuntimeError("no compiler")

    background = SweepInBackground(broken, torch.device("cpu"))
    background.start()
    with pytest.raises(RuntimeError, match="no compiler"):
        background.finish()
    with pytest.raises(RuntimeError, match="started already"):
        background.start()


def test_pool_threads_go_to_the_callers_device_even_when_it_is_named_without_an_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # the caller's, under tensor parallelism
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    thread_on(torch.device("cuda"))()
    thread_on(torch.device("cuda", 1))()
    thread_on(torch.device("cpu"))()
    assert chosen == [3, 1]
