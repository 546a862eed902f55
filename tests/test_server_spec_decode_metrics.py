"""Speculative decoding's counters in /metrics, under pagedserve's names and vLLM's, and on the
wire between the engine core and the API process (summed over data-parallel replicas)."""

from __future__ import annotations

from pagedserve.processes.engine_core.serialization import CoreStats, MessageType, decode, encode_outputs
from pagedserve.server.metrics import ServerMetrics
from pagedserve.spec_decode.metrics import SpecDecodeCounts, SpecDecodeStats


def test_counts_per_step_and_position() -> None:
    stats = SpecDecodeStats()
    # a: 3 drafts, 2 accepted (then the bonus); b: 2 drafts, none accepted; c: no drafts.
    drafted, accepted = stats.observe({"a": [1, 2, 3], "b": [4, 5]}, {"a": [1, 2, 9], "b": [7], "c": [8]})
    assert (drafted, accepted) == (5, 2)
    stats.observe({"a": [1]}, {"a": [1, 6]})
    assert stats.snapshot() == SpecDecodeCounts(3, 6, 3, (2, 1, 0))
    assert stats.snapshot().acceptance_rate == 0.5


def test_metrics_show_vllm_names() -> None:
    stats = CoreStats(1, 0, 0, 64, 4, 0, 0, SpecDecodeCounts(3, 6, 3, (2, 1, 0)))
    text = ServerMetrics(lambda: stats).exposition("m").decode()
    assert "pagedserve_spec_decode_num_drafts_total 3.0" in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 6.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 3.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text


def test_counts_cross_the_wire_and_add_up() -> None:
    stats = CoreStats(1, 2, 3, 64, 10, 100, 40, SpecDecodeCounts(3, 6, 3, (2, 1)))
    message = decode(encode_outputs([], stats))
    assert message.kind is MessageType.OUTPUTS and message.stats == stats
    total = CoreStats.total([stats, CoreStats(0, 0, 0, 32, 0, 0, 0, SpecDecodeCounts(1, 4, 4, (1, 1, 1, 1)))])
    assert total.spec_decode == SpecDecodeCounts(4, 10, 7, (3, 2, 1, 1))
    assert total.num_kv_blocks == 96
