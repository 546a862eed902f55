"""The V1 scheduler with concrete numbers: token budget, chunked prefill, prefix hits,
preemption and resumption, n > 1 forks, speculative drafts, stop rules, admission errors."""

from __future__ import annotations

import pytest
from config_support import resolved

from pagedserve.config import PreemptionMode
from pagedserve.scheduler.admission import RequestRejected
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.scheduler.request import Request, RequestStatus, StopCriteria
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.types import RequestId

BS = 16


def make(
    num_blocks: int = 200,
    budget: int = 1024,
    max_seqs: int = 16,
    max_model_len: int = 1024,
    num_swap_blocks: int = 0,
    **options: object,
) -> Scheduler:
    """A scheduler of `num_blocks` blocks configured as `LLM(...)` with these options would be."""
    config = resolved(
        block_size=BS,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=max_model_len,
        **options,
    )
    return Scheduler(config.scheduler, config.cache, num_blocks, num_swap_blocks)


def req(name: str, prompt: list[int], max_tokens: int = 8, **stop: object) -> Request:
    return Request(RequestId(name), prompt, StopCriteria(max_tokens=max_tokens, **stop))  # type: ignore[arg-type]


def rid(name: str) -> RequestId:
    return RequestId(name)


def sample_all(s: Scheduler, out: SchedulerOutput, token: int = 5) -> dict[RequestId, list[int]]:
    """One token for every request whose scheduled chunk reached the end of its known tokens."""
    sampled = {}
    for r in out.num_scheduled_tokens:
        request = s.get_request(r)
        if request is not None and request.num_computed_tokens >= request.num_tokens:
            sampled[r] = [token]
    return sampled


def step(s: Scheduler, token: int = 5) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, sample_all(s, out, token))
    return out


def test_three_800_token_prompts_share_a_1024_token_budget() -> None:
    s = make()
    for i, name in enumerate("abc"):
        s.add_request(req(name, [1000 * (i + 1) + t for t in range(800)]))
    out = step(s)
    # No prefill phase: a gets its whole prompt, b the rest of the budget as a chunk, c nothing.
    assert out.num_scheduled_tokens == {rid("a"): 800, rid("b"): 224}
    assert out.total_num_scheduled_tokens == 1024
    assert [len(n.block_ids) for n in out.scheduled_new_reqs] == [50, 14]
    out = step(s)
    # a decodes (1), b finishes its prompt (576), c starts with what is left (447).
    assert out.num_scheduled_tokens == {rid("a"): 1, rid("b"): 576, rid("c"): 447}
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["a", "b"]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["c"]
    cached_a, cached_b = out.scheduled_cached_reqs
    assert cached_a.new_token_ids == [5] and cached_a.num_computed_tokens == 800
    # Position 800 starts a 51st block: blocks come on demand, one decode at a time.
    assert len(cached_a.new_block_ids) == 1 and cached_a.replaced_block_ids is None
    assert cached_b.new_token_ids == [] and len(cached_b.new_block_ids) == 50 - 14
    out = step(s)
    assert out.num_scheduled_tokens == {rid("a"): 1, rid("b"): 1, rid("c"): 353}
    assert s.stats().kv_cache.num_blocks_in_use == 51 + 51 + 50


def test_chunked_prefill_off_makes_a_prompt_wait_for_a_whole_budget() -> None:
    s = make(budget=1024, enable_chunked_prefill=False)
    s.add_request(req("a", list(range(800))))
    s.add_request(req("b", list(range(5000, 5800))))
    out = step(s)
    assert out.num_scheduled_tokens == {rid("a"): 800}
    out = step(s)
    assert out.num_scheduled_tokens == {rid("a"): 1, rid("b"): 800}


def test_max_num_seqs_caps_running_requests() -> None:
    s = make(max_seqs=2, budget=64)
    for i in range(3):
        s.add_request(req(f"r{i}", [100 * i + t for t in range(4)]))
    out = step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert s.stats().num_running == 2 and s.stats().num_waiting == 1


def test_repeated_prompt_hits_prefix_cache_in_whole_blocks() -> None:
    s = make()
    prompt = list(range(300, 364))  # 64 tokens: 4 full blocks
    s.add_request(req("a", prompt, max_tokens=1))
    step(s)
    assert not s.has_unfinished_requests()
    s.add_request(req("b", prompt, max_tokens=1))
    out = s.schedule()
    (new,) = out.scheduled_new_reqs
    # 3 blocks (48 tokens) reused; the last block is recomputed so its last token yields logits.
    assert new.num_computed_tokens == 48 and out.num_scheduled_tokens == {rid("b"): 16}
    (update,) = s.update_from_output(out, {rid("b"): [1]})
    assert update.num_cached_tokens == 48  # reported to the client as cached prompt tokens
    kv = s.stats().kv_cache.counters
    assert (kv.prefix_hits_tokens, kv.prefix_hits_blocks) == (48, 3)


def test_prefix_caching_off_never_hits() -> None:
    s = make(enable_prefix_caching=False)
    prompt = list(range(64))
    for name in "ab":
        s.add_request(req(name, prompt, max_tokens=1))
        out = step(s)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert s.stats().kv_cache.num_cached_blocks == 0


def test_lru_eviction_keeps_most_recently_finished_prefix() -> None:
    # 4 blocks: each 33-token prompt (max_tokens 1) fills 3 blocks, 2 of them cacheable.
    s = make(num_blocks=4, budget=64, max_model_len=64)
    old, new = [10_000 + t for t in range(33)], [20_000 + t for t in range(33)]
    s.add_request(req("old", old, max_tokens=1))
    step(s)
    s.add_request(req("new", new, max_tokens=1))
    step(s)  # takes the free block first, then evicts the LRU end: old's tail, then old's head
    s.add_request(req("again-new", new, max_tokens=1))
    out = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32  # new's 2 full blocks survived
    s.add_request(req("again-old", old, max_tokens=1))
    out = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # old's were evicted


def test_latest_arrival_is_preempted_and_resumes_with_its_outputs() -> None:
    # 6 blocks. a and b each prefill 40 tokens (3 blocks); decoding to token 48 needs a 4th block.
    s = make(num_blocks=6, budget=128, max_model_len=96, enable_prefix_caching=False)
    s.add_request(req("a", list(range(40)), max_tokens=20))
    s.add_request(req("b", list(range(100, 140)), max_tokens=20))
    step(s, token=7)
    for _ in range(8):  # tokens 41..48: the 9th output lands at position 48 -> 4th block
        out = step(s, token=7)
        assert not out.preempted_req_ids
    out = step(s, token=7)
    # a (earliest arrival) needs a block; none free, so b (latest arrival) is preempted.
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {rid("a"): 1}
    b = s.get_request(rid("b"))
    assert b is not None and b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert len(b.output_token_ids) == 9 and s.stats().num_preemptions == 1
    while (a := s.get_request(rid("a"))) is not None:
        out = step(s, token=7)
        assert "b" not in out.num_scheduled_tokens or a is None
    # a finished (20 outputs) and freed its blocks; b is re-prefilled with its 9 outputs kept.
    out = s.schedule()
    (resumed,) = out.scheduled_new_reqs
    assert resumed.req_id == "b" and resumed.resumed_from_preemption
    assert resumed.all_token_ids == [*range(100, 140), *[7] * 9]
    assert out.num_scheduled_tokens == {rid("b"): 49} and resumed.num_computed_tokens == 0


def test_priority_decides_the_victim_before_arrival() -> None:
    s = make(num_blocks=6, budget=128, max_model_len=96, enable_prefix_caching=False)
    urgent = Request(RequestId("late-urgent"), list(range(40)), StopCriteria(max_tokens=20), priority=0)
    relaxed = Request(
        RequestId("early-relaxed"), list(range(50, 90)), StopCriteria(max_tokens=20), priority=5
    )
    s.add_request(relaxed)
    s.add_request(urgent)
    preempted: set[str] = set()
    for _ in range(10):
        preempted |= step(s).preempted_req_ids
    assert preempted == {"early-relaxed"}


def test_swap_mode_moves_blocks_out_and_back_in() -> None:
    s = make(
        num_blocks=6,
        budget=128,
        max_model_len=96,
        enable_prefix_caching=False,
        num_swap_blocks=8,
        preemption_mode=PreemptionMode.SWAP,
    )
    s.add_request(req("a", list(range(40)), max_tokens=12))
    s.add_request(req("b", list(range(100, 140)), max_tokens=20))
    outs = [step(s, token=7) for _ in range(10)]
    swapped_out = [o for o in outs if o.blocks_to_swap_out]
    assert len(swapped_out) == 1 and swapped_out[0].preempted_req_ids == {"b"}
    assert len(swapped_out[0].blocks_to_swap_out) == 3
    b = s.get_request(rid("b"))
    assert b is not None and (b.num_computed_tokens, b.num_tokens) == (48, 49)  # swap keeps the KV
    while s.get_request(rid("a")) is not None:
        step(s, token=7)
    out = s.schedule()
    (resumed,) = out.scheduled_new_reqs
    assert resumed.resumed_from_preemption and resumed.num_computed_tokens == 48
    assert [cpu for cpu, _ in out.blocks_to_swap_in] == [cpu for _, cpu in swapped_out[0].blocks_to_swap_out]
    # The 3 swapped-in blocks, then a fresh one for position 48.
    assert resumed.block_ids[:3] == [dev for _, dev in out.blocks_to_swap_in] and len(resumed.block_ids) == 4
    assert out.num_scheduled_tokens == {rid("b"): 1}


def test_fork_shares_prompt_blocks_then_copies_on_write() -> None:
    s = make()
    prompt = list(range(20))  # block 0 full, block 1 holds 4 tokens
    s.add_request(req("p", prompt))
    s.add_request(req("c", prompt), fork_of=rid("p"))
    out = s.schedule()
    # The child waits: the parent's prompt is not computed before this step.
    assert out.num_scheduled_tokens == {rid("p"): 20}
    s.update_from_output(out, {rid("p"): [5]})
    parent_row = s.kv.block_ids(rid("p"))
    out = s.schedule()
    (child,) = out.scheduled_new_reqs
    # The child shares block 0 (ref 2) and recomputes prompt token 19 in a private copy of block 1.
    assert child.num_computed_tokens == 19 and out.num_scheduled_tokens[rid("c")] == 1
    assert out.blocks_to_copy == [(parent_row[1], child.block_ids[1])]
    assert child.block_ids[0] == parent_row[0] and child.block_ids[1] != parent_row[1]
    blocks = s.kv.blocks(rid("p"))
    assert [b.ref_cnt for b in blocks] == [2, 1]
    s.update_from_output(out, {rid("p"): [6], rid("c"): [9]})
    child_req = s.get_request(rid("c"))
    assert child_req is not None and child_req.output_token_ids == [9]
    s.abort_requests([rid("p")])
    assert [b.ref_cnt for b in s.kv.blocks(rid("c"))] == [1, 1]


def test_fork_of_a_finished_parent_starts_from_the_prefix_cache() -> None:
    s = make()
    prompt = list(range(40))
    s.add_request(req("p", prompt, max_tokens=1))
    s.add_request(req("c", prompt), fork_of=rid("p"))
    step(s)  # p prefills and finishes (max_tokens 1); c had to wait
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32 and out.blocks_to_copy == []


def test_speculative_drafts_are_scheduled_and_rejected_ones_rolled_back() -> None:
    s = make(num_speculative_tokens=4)
    s.add_request(req("a", list(range(14)), max_tokens=20))
    step(s)  # prefill: 14 computed, 15 known
    a = s.get_request(rid("a"))
    assert a is not None
    a.spec_token_ids = [50, 51, 52, 53]
    out = s.schedule()
    assert out.num_scheduled_tokens == {rid("a"): 5}
    assert out.scheduled_spec_decode_tokens == {rid("a"): [50, 51, 52, 53]}
    assert len(s.kv.blocks(rid("a"))) == 2  # positions 14..18 cross into block 1
    # One draft accepted + a bonus token: 3 drafts rejected.
    updates = s.update_from_output(out, {rid("a"): [50, 60]})
    assert updates[0].new_token_ids == [50, 60]
    assert a.num_computed_tokens == 16 and a.num_tokens == 17 and a.spec_token_ids == []
    assert len(s.kv.blocks(rid("a"))) == 1  # block 1 held only rejected drafts
    out = s.schedule()
    (cached,) = out.scheduled_cached_reqs
    assert cached.num_computed_tokens == 16 and cached.new_token_ids == [50, 60]
    # The row lost a block, then gains one: the worker gets the whole row, not an append.
    assert out.num_scheduled_tokens == {rid("a"): 1} and cached.new_block_ids == []
    assert cached.replaced_block_ids == s.kv.block_ids(rid("a")) and len(cached.replaced_block_ids) == 2


def test_drafts_are_cut_to_the_remaining_max_tokens() -> None:
    s = make(num_speculative_tokens=4)
    s.add_request(req("a", list(range(10)), max_tokens=3))
    step(s)
    a = s.get_request(rid("a"))
    assert a is not None
    a.spec_token_ids = [1, 2, 3, 4]
    out = s.schedule()
    # 1 output exists, 2 more allowed: the pending token + 1 draft.
    assert out.scheduled_spec_decode_tokens == {rid("a"): [1]}
    with pytest.raises(ValueError, match=r"at most drafts \+ 1"):
        s.update_from_output(out, {rid("a"): [1, 2, 3]})


def test_stop_rules_eos_min_tokens_stop_ids_and_length() -> None:
    s = make()
    s.add_request(req("eos", list(range(5)), eos_token_ids=frozenset({2})))
    s.add_request(req("min", list(range(5)), min_tokens=2, eos_token_ids=frozenset({2})))
    s.add_request(req("ign", list(range(5)), max_tokens=2, ignore_eos=True, eos_token_ids=frozenset({2})))
    s.add_request(req("stop", list(range(5)), stop_token_ids=frozenset({2}), ignore_eos=True))
    out = s.schedule()
    ups = {u.req_id: u for u in s.update_from_output(out, {r: [2] for r in out.num_scheduled_tokens})}
    assert ups[rid("eos")].status is RequestStatus.FINISHED_STOPPED and ups[rid("eos")].stop_token_id == 2
    assert ups[rid("stop")].status is RequestStatus.FINISHED_STOPPED
    assert ups[rid("min")].status is RequestStatus.RUNNING and ups[rid("ign")].status is RequestStatus.RUNNING
    out = s.schedule()
    assert out.finished_req_ids == {"eos", "stop"}
    ups = {u.req_id: u for u in s.update_from_output(out, {r: [2] for r in out.num_scheduled_tokens})}
    assert ups[rid("min")].status is RequestStatus.FINISHED_STOPPED
    assert ups[rid("ign")].status is RequestStatus.FINISHED_LENGTH
    assert not s.has_unfinished_requests() and s.stats().kv_cache.num_blocks_in_use == 0


def test_accepted_tokens_past_a_stop_are_dropped() -> None:
    s = make()
    s.add_request(req("a", list(range(5)), max_tokens=10, eos_token_ids=frozenset({0})))
    step(s)
    a = s.get_request(rid("a"))
    assert a is not None
    a.spec_token_ids = [3, 0, 4]
    out = s.schedule()
    (up,) = s.update_from_output(out, {rid("a"): [3, 0, 4, 8]})
    assert up.new_token_ids == [3, 0] and up.status is RequestStatus.FINISHED_STOPPED
    assert a.output_token_ids == [5, 3, 0]


def test_abort_and_finish_free_everything_at_any_moment() -> None:
    s = make()
    s.add_request(req("run", list(range(40))))
    s.add_request(req("wait", list(range(100, 140))))
    s.add_request(req("mid", list(range(200, 1000)), max_tokens=8))
    out = s.schedule()  # run, wait in full; mid gets a chunk
    s.abort_requests([rid("mid")])
    s.update_from_output(out, sample_all(s, out))
    s.finish_requests([rid("run")], RequestStatus.FINISHED_STOPPED)
    s.abort_requests([rid("wait"), rid("never-existed")])
    assert not s.has_unfinished_requests()
    assert s.stats().kv_cache.num_blocks_in_use == 0
    out = s.schedule()
    assert out.finished_req_ids == {"run", "wait", "mid"} and out.total_num_scheduled_tokens == 0
    with pytest.raises(ValueError, match="FINISHED_"):
        s.finish_requests([rid("x")], RequestStatus.RUNNING)


def test_aborting_a_waiting_request_drops_it_from_the_queue() -> None:
    s = make(max_seqs=1, budget=16)
    s.add_request(req("a", list(range(4))))
    s.add_request(req("b", list(range(4))))
    s.abort_requests([rid("b")])
    assert step(s).num_scheduled_tokens == {rid("a"): 4}
    assert len(s.waiting) == 0 or all(r.is_finished for r in s.waiting)


def test_requests_that_can_never_fit_are_rejected_at_admission() -> None:
    s = make(num_blocks=4, max_model_len=100, budget=128)
    with pytest.raises(RequestRejected, match=r"exceeds max_model_len \(100\)"):
        s.add_request(req("long", list(range(90)), max_tokens=20))
    with pytest.raises(RequestRejected, match=r"needs up to 5 KV blocks .* the whole cache has 4"):
        s.add_request(req("big", list(range(60)), max_tokens=10))
    with pytest.raises(RequestRejected, match="token id -3 outside"):
        s.add_request(req("neg", [1, -3]))
    with pytest.raises(RequestRejected, match="empty prompt"):
        s.add_request(req("empty", []))
    s.add_request(req("ok", list(range(10))))
    with pytest.raises(RequestRejected, match="already in use"):
        s.add_request(req("ok", list(range(10))))
    with pytest.raises(RequestRejected, match="fork_of='nope'"):
        s.add_request(req("child", list(range(10))), fork_of=rid("nope"))
    with pytest.raises(RequestRejected, match="prompt or cache salt differs"):
        s.add_request(req("child", list(range(11))), fork_of=rid("ok"))
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        StopCriteria(max_tokens=0)
    with pytest.raises(ValueError, match="swap pool"):
        make(preemption_mode=PreemptionMode.SWAP)


def test_sampled_token_for_an_unfinished_prompt_chunk_is_an_error() -> None:
    s = make(budget=32, max_seqs=2)
    s.add_request(req("a", list(range(100))))
    out = s.schedule()
    with pytest.raises(ValueError, match="chunk that ended inside its known tokens"):
        s.update_from_output(out, {rid("a"): [1]})


def test_missing_sample_for_a_finished_chunk_is_an_error() -> None:
    s = make()
    s.add_request(req("a", list(range(10))))
    out = s.schedule()
    with pytest.raises(ValueError, match="got no sampled token"):
        s.update_from_output(out, {})


def test_drafts_are_cut_to_num_speculative_tokens() -> None:
    s = make(num_speculative_tokens=2)
    s.add_request(req("a", list(range(10)), max_tokens=20))
    step(s)
    a = s.get_request(rid("a"))
    assert a is not None
    a.spec_token_ids = [1, 2, 3, 4]
    assert s.schedule().scheduled_spec_decode_tokens == {rid("a"): [1, 2]}


def test_a_request_blocked_at_the_head_is_counted_once_as_a_prefix_query() -> None:
    s = make(num_blocks=6, budget=256, max_model_len=96)
    s.add_request(req("big", list(range(80)), max_tokens=8))  # 5 blocks + 1 to decode
    s.add_request(req("next", list(range(200, 240)), max_tokens=8))  # 3 blocks: must wait
    for _ in range(3):
        step(s)
    assert s.stats().kv_cache.counters.prefix_queries_tokens == 80


def test_a_block_filled_by_decoding_is_shared_with_a_request_arriving_next_step() -> None:
    s = make()
    s.add_request(req("a", list(range(10)), max_tokens=50))
    step(s, token=100)  # prefill: 10 computed, 11 known
    for _ in range(6):
        step(s, token=100)  # decodes positions 10..15: block 0 is now full and computed
    a = s.get_request(rid("a"))
    assert a is not None and a.num_computed_tokens == 16
    s.add_request(req("b", [*a.all_token_ids[:16], 999]))
    out = s.schedule()
    # a's decode needs block 1, which indexes block 0 first; b, admitted after it, hits it.
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 16
    assert new.block_ids[0] == s.kv.block_ids(rid("a"))[0]
