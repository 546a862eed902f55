"""The scheduler run one step ahead of the samples (asynchronous scheduling), with concrete
numbers: output placeholders, the last output not scheduled again, a request preempted while its
token is in flight, a finish between schedule and update, and the in-flight KV bookkeeping."""

from __future__ import annotations

import pytest
from config_support import resolved

from pagedserve.scheduler.request import Request, RequestStatus, StopCriteria
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.types import RequestId

BS = 4


def make(num_blocks: int = 64) -> Scheduler:
    config = resolved(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=64, block_size=BS)
    return Scheduler(config.scheduler, config.cache, num_blocks)


def req(name: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(RequestId(name), list(range(10, 10 + prompt_len)), StopCriteria(max_tokens=max_tokens))


def test_decode_scheduled_ahead_gets_its_placeholder_and_the_last_output_is_not_rescheduled() -> None:
    s = make()
    r = req("a", 5, max_tokens=3)
    s.add_request(r)
    step1 = s.schedule()
    assert step1.num_scheduled_tokens == {"a": 5} and r.num_output_placeholders == 1
    step2 = s.schedule()  # before step 1's token is known: computes it (position 5)
    assert step2.num_scheduled_tokens == {"a": 1}
    assert r.num_computed_tokens == 6 and r.num_output_placeholders == 2
    [update] = s.update_from_output(step1, {RequestId("a"): [50]})
    assert update.new_token_ids == [50] and update.status is RequestStatus.RUNNING
    assert r.all_token_ids[-1] == 50 and r.num_output_placeholders == 1
    step3 = s.schedule()
    assert step3.num_scheduled_tokens == {"a": 1}
    # The worker learns token 50 from the diff one step late, as new_token_ids.
    assert step3.scheduled_cached_reqs[0].new_token_ids == [50]
    s.update_from_output(step2, {RequestId("a"): [51]})
    step4 = s.schedule()  # outputs 2 + 1 pending == max_tokens: nothing left to compute
    assert step4.num_scheduled_tokens == {}
    [last] = s.update_from_output(step3, {RequestId("a"): [52]})
    assert last.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == [50, 51, 52]
    assert s.update_from_output(step4, {}) == []
    assert not s.has_unfinished_requests() and s.kv.stats().num_blocks_in_use == 0


def test_request_preempted_while_its_token_is_in_flight_keeps_the_token() -> None:
    s = make(num_blocks=3)
    a, b = req("a", 4, max_tokens=8), req("b", 4, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    step1 = s.schedule()  # both prompts fill one block each
    assert step1.num_scheduled_tokens == {"a": 4, "b": 4}
    step2 = s.schedule()  # a needs a second block, the last free one; b then has none
    assert step2.preempted_req_ids == {"b"} and b.status is RequestStatus.PREEMPTED
    updates = s.update_from_output(step1, {RequestId("a"): [60], RequestId("b"): [70]})
    assert {u.req_id: u.new_token_ids for u in updates} == {"a": [60], "b": [70]}
    assert b.all_token_ids[-1] == 70 and b.num_output_placeholders == 0
    s.update_from_output(step2, {RequestId("a"): [61]})
    s.abort_requests([RequestId("a")])
    step3 = s.schedule()  # b resumes with its token, re-prefilled with the prompt
    [resumed] = step3.scheduled_new_reqs
    assert resumed.req_id == "b" and resumed.all_token_ids == [*b.prompt_token_ids, 70]


def test_finished_between_schedule_and_update_drops_the_token_of_the_step_ahead() -> None:
    s = make()
    r = req("a", 5, max_tokens=8)
    s.add_request(r)
    step1 = s.schedule()
    step2 = s.schedule()
    s.update_from_output(step1, {RequestId("a"): [50]})
    s.finish_requests([RequestId("a")], RequestStatus.FINISHED_STOPPED)  # a stop string, found late
    assert s.update_from_output(step2, {RequestId("a"): [51]}) == []
    assert r.output_token_ids == [50]
    assert s.schedule().finished_req_ids == {"a"}


def test_update_keeps_the_later_step_in_flight_for_the_kv_cache() -> None:
    s = make()
    s.add_request(req("a", 5, max_tokens=8))
    step1 = s.schedule()
    step2 = s.schedule()
    s.update_from_output(step1, {RequestId("a"): [50]})
    assert dict(s.kv.in_flight) == {"a": 1}  # step 2 still writes position 5
    s.update_from_output(step2, {RequestId("a"): [51]})
    assert dict(s.kv.in_flight) == {}


def test_outputs_out_of_scheduling_order_are_refused() -> None:
    s = make()
    s.add_request(req("a", 5, max_tokens=8))
    s.schedule()
    step2 = s.schedule()
    with pytest.raises(ValueError, match="oldest scheduled"):
        s.update_from_output(step2, {})
