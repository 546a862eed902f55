"""Asynchronous scheduling on cpu_reference: the same outputs as synchronous steps, and the host
really schedules step N+1 before it reads step N's samples.

Every case runs the same requests through an engine with `async_scheduling=True` and one with
`False` and compares everything a user sees: token ids, text, finish reasons, logprobs. The cases
are those where scheduling ahead of the samples could go wrong: EOS and max_tokens reached while
the next step already computes a token, stop strings found by the front end one step late, n > 1
forks, seeded sampling and penalties (which read the pending token's position and id), n-gram
drafts (synchronous fallback), preemption under a tiny KV pool, and aborts.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from transformers import LlamaConfig

from pagedserve import LLM, SamplingParams
from pagedserve.outputs import RequestOutput
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.worker.async_output import ModelRunnerOutput
from pagedserve.worker.model_runner import ModelRunner

VOCAB = 96


def _config(vocab: int = VOCAB) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=3,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tiny_hf_model(_config(), seed=11), tmp_path_factory.mktemp("llama"))


PROMPTS = random_prompts(VOCAB, [5, 17, 30, 3, 9, 22], seed=3)
PROMPTS.append([*PROMPTS[2][:12], 5, 6, 7])  # shares a 12-token prefix with PROMPTS[2]


def _llm(path: Path, async_scheduling: bool, **engine: Any) -> LLM:
    options: dict[str, Any] = {"max_model_len": 64, "block_size": 4, **engine}
    return LLM(
        str(path), skip_tokenizer_init=True, dtype="float32", async_scheduling=async_scheduling, **options
    )


def _seen(outputs: list[RequestOutput]) -> list[list[tuple[object, ...]]]:
    """What a user sees of each request: per sample, token ids, finish reason, text and logprobs
    (ids and ranks; values rounded to 4 decimals: a step's batch may hold other rows in the two
    modes, e.g. a request whose EOS is not known yet, and CPU GEMMs round differently per batch
    size)."""
    return [
        [
            (
                c.index,
                c.token_ids,
                c.finish_reason,
                c.stop_reason,
                c.text,
                [{t: (round(lp.logprob, 4), lp.rank) for t, lp in pos.items()} for pos in c.logprobs or []],
            )
            for c in out.outputs
        ]
        for out in outputs
    ]


def _both(
    path: Path, params: SamplingParams | list[SamplingParams], prompts: Any = None, **engine: Any
) -> Any:
    """Generate with asynchronous scheduling off and on; return both results and the async LLM."""
    results = []
    llm = None
    for on in (False, True):
        llm = _llm(path, on, **engine)
        assert (llm.engine.core.pipeline is not None) is on
        results.append(_seen(llm.generate(prompts or PROMPTS, params, use_tqdm=False)))
    return results[0], results[1], llm


def test_greedy_identical_with_eos_max_tokens_and_chunked_prefill(checkpoint: Path) -> None:
    # Varied max_tokens: requests finish by length in different steps while the next step already
    # computes a token for them; EOS (id 3) may end some too. Chunks of 8 tokens split prompts.
    params = [SamplingParams(temperature=0, max_tokens=m, detokenize=False) for m in (1, 2, 5, 12, 3, 20, 7)]
    sync, async_, llm = _both(checkpoint, params, max_num_batched_tokens=8, max_num_seqs=4)
    assert sync == async_
    assert not llm.engine.core.has_unfinished_requests()
    assert llm.engine.core.scheduler.kv.stats().num_blocks_in_use == 0


def test_seeded_sampling_penalties_logprobs_and_n_identical(checkpoint: Path) -> None:
    # Seeds count outputs before the sampled position and penalties read the token history: both
    # must see the output that was still pending on the device when the step was prepared.
    params = SamplingParams(
        n=3,
        temperature=0.9,
        seed=5,
        max_tokens=10,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        min_tokens=4,
        ignore_eos=True,  # same batches in both modes: random samples compare bit for bit
        logprobs=2,
        detokenize=False,
    )
    sync, async_, _ = _both(checkpoint, params)
    assert sync == async_
    assert all(len(out) == 3 for out in async_)


def test_ngram_drafts_fall_back_to_synchronous_steps(checkpoint: Path) -> None:
    # Repetitive prompts so that drafts exist and some are accepted.
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, PROMPTS[1]]
    params = SamplingParams(temperature=0, max_tokens=12, detokenize=False)
    sync, async_, llm = _both(checkpoint, params, prompts, num_speculative_tokens=3)
    assert sync == async_
    assert llm.engine.core.pipeline is not None and llm.engine.core.pipeline.needs_sync()


def test_preemption_under_a_tiny_kv_pool_identical(checkpoint: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    sync, async_, llm = _both(checkpoint, params, num_kv_blocks=14, max_num_seqs=4)
    assert sync == async_
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_swap_preemption_identical(checkpoint: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    sync, async_, llm = _both(
        checkpoint, params, num_kv_blocks=14, max_num_seqs=4, preemption_mode="swap", swap_space_gib=0.001
    )
    assert sync == async_
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_abort_in_flight_frees_everything_and_leaves_others_unchanged(checkpoint: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
    reference = _seen(_llm(checkpoint, False).generate(PROMPTS[:3], params, use_tqdm=False))
    engine = _llm(checkpoint, True).engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, params)
    finals: dict[str, RequestOutput] = {}
    aborted = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
        # Abort request 1 while a step computing its next token is in flight.
        if aborted is None and "1" in finals and len(finals["1"].outputs[0].token_ids) >= 3:
            assert engine.core.pipeline is not None and engine.core.pipeline.busy
            aborted = engine.abort_request("1")
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    assert reference[1][0][1][: len(aborted.outputs[0].token_ids)] == aborted.outputs[0].token_ids
    assert _seen([finals["0"], finals["2"]]) == [reference[0], reference[2]]
    assert engine.core.scheduler.kv.stats().num_blocks_in_use == 0


# ---- stop strings need a tokenizer: a tiny model over SmolLM2's vocabulary -------------------


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    from pagedserve.models.loader import default_model_source

    source = default_model_source()
    tokenizer = AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
    path = save_checkpoint(tiny_hf_model(_config(len(tokenizer)), seed=2), tmp_path_factory.mktemp("text"))
    tokenizer.save_pretrained(path)
    return path


def test_stop_strings_identical(text_checkpoint: Path) -> None:
    prompts = ["The capital of France is", "Once upon a time", "def f(x):"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = LLM(str(text_checkpoint), dtype="float32", max_model_len=64, async_scheduling=False).generate(
        prompts, greedy, use_tqdm=False
    )
    # A stop string from the middle of each request's text: found by the front end while the
    # engine already computes the next token.
    stops = [out.outputs[0].text[len(out.outputs[0].text) // 2 :][:3] for out in full]
    assert all(stops)
    params = [
        SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop=[s], include_stop_str_in_output=i == 0
        )
        for i, s in enumerate(stops)
    ]
    results = [
        _seen(
            LLM(str(text_checkpoint), dtype="float32", max_model_len=64, async_scheduling=on).generate(
                prompts, params, use_tqdm=False
            )
        )
        for on in (False, True)
    ]
    assert results[0] == results[1]
    assert all(sample[0][2] == "stop" for sample in results[1])


# ---- the host schedules ahead: a slow device on a worker thread ------------------------------


class _SlowPending:
    def __init__(self, future: Future[ModelRunnerOutput], step: int, log: list[tuple[str, int]]) -> None:
        self.future, self.step, self.log = future, step, log

    def result(self) -> ModelRunnerOutput:
        self.log.append(("read", self.step))
        return self.future.result()


class SlowDevice:
    """The model runner behind a one-thread executor that sleeps before each step: `launch`
    returns at once, and the "device" finishes the step later, in launch order."""

    def __init__(self, runner: ModelRunner, delay_s: float, log: list[tuple[str, int]]) -> None:
        self.runner, self.delay_s, self.log = runner, delay_s, log
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.futures: list[Future[ModelRunnerOutput]] = []
        self.lock = threading.Lock()

    def launch(self, so: SchedulerOutput) -> _SlowPending:
        step = len(self.futures)
        self.log.append(("launch", step))
        future = self.pool.submit(self._run, so)
        self.futures.append(future)
        return _SlowPending(future, step, self.log)

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(self.delay_s)
        return self.runner.launch(so).result()


def test_host_schedules_step_n_plus_1_before_reading_step_n(checkpoint: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, detokenize=False)
    reference = _seen(_llm(checkpoint, False).generate(PROMPTS[:4], params, use_tqdm=False))
    llm = _llm(checkpoint, True)
    core = llm.engine.core
    assert core.pipeline is not None
    log: list[tuple[str, int]] = []
    device = SlowDevice(core.runner, 0.05, log)
    core.pipeline.runner = device  # type: ignore[assignment]
    busy_when_scheduled: list[bool] = []
    schedule = core.scheduler.schedule

    def schedule_and_record() -> SchedulerOutput:
        # Was the previous step still running on the "device" while this one was scheduled?
        busy_when_scheduled.append(bool(device.futures) and not device.futures[-1].done())
        log.append(("schedule", len(device.futures)))
        return schedule()

    core.scheduler.schedule = schedule_and_record  # type: ignore[method-assign]
    assert _seen(llm.generate(PROMPTS[:4], params, use_tqdm=False)) == reference
    num_steps = len(device.futures)
    assert num_steps > 3
    for n in range(num_steps - 1):
        assert log.index(("schedule", n + 1)) < log.index(("read", n)), log
    assert all(busy_when_scheduled[1:]), busy_when_scheduled


def test_engine_args_default_is_off_on_cpu(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), skip_tokenizer_init=True, dtype="float32", max_model_len=64)
    assert llm.engine.core.pipeline is None
