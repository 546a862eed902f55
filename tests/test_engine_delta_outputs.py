"""Delta outputs: per step, the front end's work and what it hands on follow the step's new tokens,
not the sequences' lengths. The engine core sends new token ids only (the wire message of a step
does not grow as the sequences do); a delta request's outputs hold only what is new (what the
server streams), and merged they are exactly the cumulative outputs, stop strings, logprobs, n > 1,
multi-token steps and aborts included."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import ClassVar

from prometheus_client.parser import text_string_to_metric_families
from server_support import build_tiny_model

from pagedserve.config import EngineArgs
from pagedserve.engine.output_processor import OutputProcessor, merge_deltas
from pagedserve.engine.protocol import EngineCoreOutput
from pagedserve.outputs import Logprob, RequestOutput
from pagedserve.processes.engine_core import serialization as wire
from pagedserve.processes.engine_core.serialization import CoreStats
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.async_engine import AsyncLLMEngine
from pagedserve.types import RequestId


class LetterTokenizer:
    """Token i decodes to PIECES[i % len(PIECES)]."""

    PIECES: ClassVar[list[str]] = ["a", "b", "c", " S", "TOP", "d", "e"]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.PIECES[t % len(self.PIECES)] for t in token_ids)


def _step_outputs(step: int, seq_ids: list[RequestId], per_step: int) -> list[EngineCoreOutput]:
    """Each sequence gains `per_step` tokens (several: speculative decoding), with logprobs."""
    outs = []
    for k, seq in enumerate(seq_ids):
        tokens = [(step * 3 + k + j) % 7 for j in range(per_step)]
        logprobs = [{t: Logprob(-0.25 * (j + 1), 1)} for j, t in enumerate(tokens)]
        outs.append(EngineCoreOutput(seq, tokens, None, None, logprobs))
    return outs


def _timeless(out: RequestOutput) -> RequestOutput:
    """`out` without its wall-clock milestones (two processors never share those)."""
    return dataclasses.replace(out, metrics=None)


def test_delta_outputs_hold_only_the_step_and_merge_into_the_cumulative_ones() -> None:
    stop_at = SamplingParams(max_tokens=400, n=2, logprobs=0, stop=[" STOP"])
    plain = SamplingParams(max_tokens=400, logprobs=0)
    cumulative = OutputProcessor(LetterTokenizer(), eos_token_id=None, max_model_len=1000)
    delta = OutputProcessor(LetterTokenizer(), eos_token_id=None, max_model_len=1000)
    seqs: dict[bool, list[RequestId]] = {}
    for is_delta, processor in ((False, cumulative), (True, delta)):
        ids = processor.add_request("stops", None, [1, 2, 3], stop_at, delta=is_delta)
        ids += processor.add_request("runs", None, [1, 2, 3], plain, delta=is_delta)
        ids += processor.add_request("aborted", None, [4], plain, delta=is_delta)
        seqs[is_delta] = ids
    assert seqs[False] == seqs[True]
    seq_ids = seqs[True]
    latest: dict[str, RequestOutput] = {}
    pieces: dict[str, list[RequestOutput]] = {}
    for step in range(120):
        outputs = _step_outputs(step, seq_ids, per_step=2)
        whole, stop_whole = cumulative.process(outputs)
        parts, stop_parts = delta.process(outputs)
        assert stop_whole == stop_parts
        for out in whole:
            latest[out.request_id] = out
        for out in parts:
            pieces.setdefault(out.request_id, []).append(out)
            # However long the sequence has grown, an output holds this step's tokens at most.
            assert all(len(s.token_ids) <= 2 for s in out.outputs)
            assert all(s.logprobs is not None and len(s.logprobs) == len(s.token_ids) for s in out.outputs)
        # The processors agree at every step, not only at the end.
        for request_id, out in latest.items():
            assert _timeless(merge_deltas(pieces[request_id])) == _timeless(out)
        seq_ids = [s for s in seq_ids if s not in stop_parts and delta.has_request(s.split("#")[0])]
        if step == 30:
            final_whole, final_part = cumulative.abort("aborted"), delta.abort("aborted")
            assert final_whole is not None and final_part is not None
            latest["aborted"] = final_whole
            pieces["aborted"].append(final_part)
            seq_ids = [s for s in seq_ids if s != "aborted"]
    assert latest["stops"].finished and latest["stops"].outputs[0].stop_reason == " STOP"
    assert len(latest["runs"].outputs[0].token_ids) == 240
    assert latest["aborted"].outputs[0].finish_reason == "abort"
    for request_id, out in latest.items():
        assert _timeless(merge_deltas(pieces[request_id])) == _timeless(out)


def test_a_delta_never_shows_text_a_stop_string_may_cut() -> None:
    processor = OutputProcessor(LetterTokenizer(), eos_token_id=None, max_model_len=100)
    (held,) = processor.add_request("held", None, [1], SamplingParams(stop=[" STOP"]), delta=True)
    (missed,) = processor.add_request("missed", None, [1], SamplingParams(stop=[" STOP"]), delta=True)
    texts: dict[str, list[str]] = {"held": [], "missed": []}
    for new in ([0, 3], [4, 5]):  # "a", " S" (may begin " STOP"), then "TOP" (it does), "d"
        outputs, to_stop = processor.process(
            [
                EngineCoreOutput(held, new, None),
                EngineCoreOutput(missed, [0, 3] if new[0] == 0 else [5], None),
            ]
        )
        for out in outputs:
            texts[out.request_id].append(out.outputs[0].text)
    assert texts["held"] == ["a", ""] and to_stop == [held]
    assert texts["missed"] == ["a", " Sd"]  # " S" went out once "d" ruled " STOP" out


def test_a_steps_wire_message_does_not_grow_with_the_sequences(tmp_path: Path) -> None:
    """What crosses from the engine core to the front end each step: new token ids only."""
    from pagedserve.engine.llm_engine import LLMEngine

    model = build_tiny_model(tmp_path / "tiny")
    engine = LLMEngine(EngineArgs(model=str(model), max_model_len=256, block_size=16, max_num_seqs=8))
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
    for i in range(8):
        engine.add_request(f"r{i}", f"story {i}", params)
    stats = CoreStats.from_scheduler(engine.core.scheduler.stats())
    sizes = []
    for _ in range(150):
        outputs = engine.core.step()
        if len(outputs) == 8 and all(len(o.new_token_ids) == 1 for o in outputs):
            sizes.append(len(wire.encode_outputs(outputs, stats)))
    assert len(sizes) > 100
    # Token ids vary in how many bytes they take, nothing else in the message grows.
    assert max(sizes[-20:]) <= max(sizes[:20]) + 8 * 2


def test_generate_with_delta_yields_what_is_new_and_merges_what_waited(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    args = EngineArgs(model=str(model), max_model_len=128, block_size=16, max_num_seqs=8)

    async def main() -> None:
        engine = await AsyncLLMEngine.launch(args)
        try:
            params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, n=2, logprobs=1)
            whole = [o async for o in engine.generate("story 3", params, "whole")]
            parts = [o async for o in engine.generate("story 3", params, "parts", delta=True)]
            # A slow consumer: the outputs that waited meanwhile come as one.
            slow: list[RequestOutput] = []
            async for out in engine.generate("story 3", params, "slow", delta=True):
                slow.append(out)
                if len(slow) == 1:
                    await asyncio.sleep(1.0)
        finally:
            await engine.shutdown()
        # Each part holds only tokens no earlier part held: per sample they add up to the 12
        # generated (cumulative outputs would repeat them). How many parts a consumer gets
        # depends on whether it keeps up with the engine; a loaded host may merge two steps.
        assert len(parts) > 1
        for index in range(params.n):
            assert sum(len(s.token_ids) for o in parts for s in o.outputs if s.index == index) == 12
        for merged in (merge_deltas(parts), merge_deltas(slow)):
            assert merged.finished
            for a, b in zip(merged.outputs, whole[-1].outputs, strict=True):
                assert (a.text, a.token_ids, a.logprobs, a.finish_reason) == (
                    b.text,
                    b.token_ids,
                    b.logprobs,
                    b.finish_reason,
                )
                assert a.cumulative_logprob == b.cumulative_logprob
        assert len(slow) < len(parts)
        families = text_string_to_metric_families(engine.metrics.exposition("m").decode())
        generated = next(f for f in families if f.name == "pagedserve_generation_tokens")
        assert [s.value for s in generated.samples if s.name.endswith("_total")] == [3 * 2 * 12]

    asyncio.run(main())
