"""The makespan policy: admission by most outputs left, the spread step budget, every running
request still served each step, whole runs through the scheduler, and the engine's choice of
policy; with concrete numbers."""

from __future__ import annotations

import random
from pathlib import Path

import pydantic
import pytest
from models_harness import hf_greedy, random_prompts, save_checkpoint, tiny_hf_model
from test_engine_greedy import CONFIGS
from test_scheduler_policy import make, req, sample_all, step

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineArgs, SchedulingPolicy
from pagedserve.config.engine_config import scheduling_policy
from pagedserve.scheduler import makespan
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.scheduler import Scheduler

MAKESPAN = SchedulingPolicy.MAKESPAN


def _admitted(s: Scheduler) -> list[str]:
    return [n.req_id for n in step(s).scheduled_new_reqs]


@pytest.mark.parametrize(
    ("policy", "order"),
    [(SchedulingPolicy.FCFS, ["a", "b", "c", "d"]), (MAKESPAN, ["b", "d", "c", "a"])],
)
def test_admission_order(policy: SchedulingPolicy, order: list[str]) -> None:
    s = make(scheduling_policy=policy.value)
    for name, max_tokens in [("a", 5), ("b", 50), ("c", 20), ("d", 50)]:
        s.add_request(req(name, [1, 2, 3], max_tokens=max_tokens))
    assert _admitted(s) == order  # ties (b, d) keep arrival order


def test_admission_key_puts_preempted_requests_first() -> None:
    fresh = req("fresh", [1], max_tokens=100)
    preempted = req("preempted", [1], max_tokens=3)
    preempted.status = RequestStatus.PREEMPTED
    started = req("started", [1], max_tokens=100)
    started.output_token_ids.extend([7] * 60)  # 40 left
    queue = sorted([started, fresh, preempted], key=makespan.admission_key)
    assert [r.id for r in queue] == ["preempted", "fresh", "started"]


def _running(name: str, prompt_len: int, max_tokens: int, outputs: int) -> Request:
    r = req(name, [1] * prompt_len, max_tokens=max_tokens)
    r.output_token_ids.extend([2] * outputs)
    r.all_token_ids.extend([2] * outputs)
    r.num_computed_tokens = prompt_len + outputs - 1  # decoding: the last sample is uncomputed
    r.status = RequestStatus.RUNNING
    return r


def _waiting(n: int, prompt_len: int, max_tokens: int) -> list[Request]:
    return [req(f"w{i}", [1] * prompt_len, max_tokens=max_tokens) for i in range(n)]


def _budget(requests: list[Request], *, widest: int = 512, per_running: int = 1) -> int:
    running = sum(r.status is RequestStatus.RUNNING for r in requests)
    return makespan.step_token_budget(
        requests, num_running=running, tokens_per_running=per_running, widest_spread=widest, max_budget=8192
    )


def test_budget_spreads_waiting_prompts_over_the_running_horizon() -> None:
    # The running request samples 900 more; the waiting ones 10 each: a horizon of 890 steps for
    # 100 x 1,000 prompt tokens -> twice 100,000 / 890 = 225 (rounded up) beside its one token.
    requests = [_running("long", 16, 1000, 100), *_waiting(100, 1000, 10)]
    assert _budget(requests) == 1 + 225


def test_budget_never_below_the_running_tokens_plus_the_minimum_prompt_share() -> None:
    # 4 x 100 prompt tokens over 890 steps is under one token a step: the floor applies.
    requests = [_running(f"r{i}", 16, 1000, 100) for i in range(3)] + _waiting(4, 100, 10)
    assert _budget(requests) == 3 + makespan.MIN_PROMPT_TOKENS
    # With 4 draft tokens a running request may take 5 tokens.
    assert _budget(requests, per_running=5) == 15 + makespan.MIN_PROMPT_TOKENS


def test_budget_is_whole_when_thin_steps_cannot_carry_the_prompts() -> None:
    requests = [_running("long", 16, 1000, 100), *_waiting(100, 1000, 10)]
    assert _budget(requests, widest=200) == 8192  # the spread (226) is wider than allowed


def test_budget_is_whole_when_the_waiting_requests_set_the_end() -> None:
    # Every request has as many outputs left as the running one: no horizon to spread over.
    requests = [_running("r", 16, 110, 10), *_waiting(8, 100, 100)]
    assert _budget(requests) == 8192


def _run(s: Scheduler) -> list[int]:
    """Step until every request finishes; the tokens of each step. Checks that every running
    request got at least one token in every step (no decode starves behind a prompt chunk)."""
    widths = []
    while s.has_unfinished_requests():
        running_before = {r.id for r in s.running if r.status is RequestStatus.RUNNING}
        out = s.schedule()
        assert running_before <= set(out.num_scheduled_tokens) | out.preempted_req_ids
        widths.append(out.total_num_scheduled_tokens)
        s.update_from_output(out, sample_all(s, out))
    return widths


def _workload(s: Scheduler, seed: int) -> dict[str, int]:
    """40 requests of mixed prompt and output lengths; the last to arrive runs much longer."""
    rng = random.Random(seed)
    lengths = {f"q{i}": (rng.randint(4, 120), rng.randint(2, 60)) for i in range(39)}
    lengths["long"] = (30, 200)
    for name, (prompt_len, max_tokens) in lengths.items():
        s.add_request(req(name, [rng.randint(1, 90) for _ in range(prompt_len)], max_tokens=max_tokens))
    return {name: max_tokens for name, (_, max_tokens) in lengths.items()}


@pytest.mark.parametrize("seed", [0, 1])
def test_whole_run_finishes_on_the_critical_path(seed: int) -> None:
    runs = {}
    for policy in SchedulingPolicy:
        # cuda_graph_max_tokens: the widest step a spread of prompt work asks for while requests decode.
        s = make(
            num_blocks=2000, budget=512, max_seqs=32, scheduling_policy=policy.value, cuda_graph_max_tokens=96
        )
        _workload(s, seed)
        runs[policy] = _run(s)
    # The 200-output request samples once per step: makespan starts it in the first step, first
    # come, first served only when seats free up.
    assert len(runs[MAKESPAN]) == 200
    assert len(runs[SchedulingPolicy.FCFS]) > 210
    assert sum(runs[MAKESPAN]) == sum(runs[SchedulingPolicy.FCFS])  # the same work either way


def test_whole_run_with_preemption_and_drafts_delivers_every_output() -> None:
    s = make(num_blocks=60, budget=256, max_seqs=16, scheduling_policy="makespan", num_speculative_tokens=2)
    expected = _workload(s, seed=3)
    produced: dict[str, int] = {}
    while s.has_unfinished_requests():
        running_before = {r.id for r in s.running if r.status is RequestStatus.RUNNING}
        out = s.schedule()
        assert running_before <= set(out.num_scheduled_tokens) | out.preempted_req_ids
        for update in s.update_from_output(out, sample_all(s, out)):
            produced[update.req_id] = produced.get(update.req_id, 0) + len(update.new_token_ids)
    assert s.num_preemptions > 0
    assert produced == expected


def test_the_engine_picks_makespan_offline_and_fcfs_for_the_server() -> None:
    assert scheduling_policy("auto", offline=True) is MAKESPAN
    assert scheduling_policy("auto", offline=False) is SchedulingPolicy.FCFS
    assert scheduling_policy("fcfs", offline=True) is SchedulingPolicy.FCFS
    assert scheduling_policy("makespan", offline=False) is MAKESPAN
    with pytest.raises(pydantic.ValidationError, match="scheduling_policy"):
        EngineArgs(scheduling_policy="shortest")  # type: ignore[arg-type]


def test_llm_greedy_tokens_under_makespan_equal_hf(tmp_path: Path) -> None:
    config = CONFIGS["llama"]()  # vocabulary 96
    hf = tiny_hf_model(config, seed=5)
    path = save_checkpoint(hf, tmp_path / "llama")
    prompts = random_prompts(96, [5, 17, 30, 3, 22, 9], seed=11)
    max_new = [3, 24, 7, 16, 2, 11]  # different lengths: makespan reorders and spreads
    expected = [tokens[:n] for tokens, n in zip(hf_greedy(hf, prompts, max(max_new)), max_new, strict=True)]
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=4,
        max_model_len=64,
        num_kv_blocks=12,  # small enough to preempt
        max_num_seqs=4,
    )
    assert llm.engine.core.scheduler.config.policy is MAKESPAN
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in max_new]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.core.scheduler.num_preemptions > 0
