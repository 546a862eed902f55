"""Two contracts of the server with clients written for other servers, through a real
`pagedserve serve` process (a tiny random Llama with SmolLM2's tokenizer):

* /v1/completions with `echo` and `logprobs` returns the prompt's logprobs before the completion's,
  as OpenAI's legacy completions API and vLLM do, streamed or not, with `text_offset` indexing the
  choice's text;
* /metrics exports vLLM's metric names and labels next to the `pagedserve_` ones, with the same
  values, so dashboards written for vLLM work unchanged.

One server serves the whole module; the fixture stops it and its engine core.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_support import ServerProcess, build_tiny_model, start_server
from transformers import AutoTokenizer, LlamaForCausalLM

from pagedserve.processes.engine_core.serialization import CoreStats
from pagedserve.server.metrics import ServerMetrics

MODEL_NAME = "tiny-contract"
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
# 40 tokens: two full KV blocks, so a second identical request would hit the prefix cache.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat. " * 2
MULTIBYTE_PROMPT = "café naïve 日本語 🙂 ok"  # characters split over several byte-level tokens
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        model_dir,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-kv-blocks",
        "256",
        "--block-size",
        str(BLOCK_SIZE),
        name=MODEL_NAME,
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[Any, LlamaForCausalLM]:
    """The tokenizer and the Hugging Face model the server loaded, to score prompts independently."""
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(model_dir), model


def _complete(server: ServerProcess, **body: Any) -> dict[str, Any]:
    payload = {"model": server.model_name, "temperature": 0, "ignore_eos": True, **body}
    r = httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _stream(server: ServerProcess, **body: Any) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed completion, `[DONE]` checked and dropped."""
    payload = {"model": server.model_name, "temperature": 0, "ignore_eos": True, "stream": True, **body}
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=payload, timeout=60) as r:
        assert r.status_code == 200, r.read().decode()
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    for item in data[:-1]:
        chunk = json.loads(item)
        assert "error" not in chunk, chunk
        chunks.append(chunk)
    return chunks


def _check_offsets(text: str, logprobs: dict[str, Any]) -> None:
    """`text_offset` rises, stays inside the text, and places every token whose text is whole
    (not a piece of a character split over tokens) exactly where the text shows it."""
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets)
    assert all(0 <= o <= len(text) for o in offsets)
    for token, offset in zip(logprobs["tokens"], offsets, strict=True):
        if "\ufffd" not in token:
            assert text[offset : offset + len(token)] == token, (token, offset, text)


def _prompt_reference(
    reference: tuple[Any, LlamaForCausalLM], ids: list[int], top_n: int
) -> tuple[list[float], list[list[float]]]:
    """Hugging Face's logprob of prompt tokens 1.. given the tokens before each, and the top-N
    logprobs at each of those positions."""
    _, model = reference
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[:-1]
    chosen = rows.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    return chosen, rows.topk(top_n, dim=-1).values.tolist()


# ---- echo + logprobs ---------------------------------------------------------------------------------


def test_echo_logprobs_cover_prompt_then_completion(
    server: ServerProcess, reference: tuple[Any, LlamaForCausalLM]
) -> None:
    tokenizer, _ = reference
    ids = tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 2 * BLOCK_SIZE
    out = _complete(server, prompt=LONG_PROMPT, max_tokens=4, logprobs=2, echo=True)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    n = len(ids)
    assert out["usage"]["prompt_tokens"] == n
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 4
    assert len(lp["text_offset"]) == n + 4
    # The prompt's part: the first token has no context, so no logprob and no alternatives.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"][:n]) == LONG_PROMPT
    assert choice["text"].startswith(LONG_PROMPT)
    want, want_top = _prompt_reference(reference, ids, 2)
    for got, expected in zip(lp["token_logprobs"][1:n], want, strict=True):
        assert got == pytest.approx(expected, abs=TOLERANCE)
    for got_top, expected_top in zip(lp["top_logprobs"][1:n], want_top, strict=True):
        assert sorted(got_top.values(), reverse=True) == pytest.approx(expected_top, abs=TOLERANCE)
    # The completion's part is what the same request without echo returns, offsets shifted by
    # the echoed prompt.
    plain = _complete(server, prompt=LONG_PROMPT, max_tokens=4, logprobs=2)["choices"][0]
    assert choice["text"] == LONG_PROMPT + plain["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert lp[key][n:] == plain["logprobs"][key]
    assert lp["text_offset"][n:] == [o + len(LONG_PROMPT) for o in plain["logprobs"]["text_offset"]]
    assert lp["text_offset"][:n] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    _check_offsets(choice["text"], lp)


def test_echo_logprobs_whole_when_prompt_is_cached(server: ServerProcess) -> None:
    """The prefix cache holds KV, not logits: a repeated prompt must still get every logprob."""
    first = _complete(server, prompt=LONG_PROMPT, max_tokens=2, logprobs=1, echo=True)
    second = _complete(server, prompt=LONG_PROMPT, max_tokens=2, logprobs=1, echo=True)
    assert first["choices"][0]["logprobs"] == second["choices"][0]["logprobs"]
    assert all(v is not None for v in second["choices"][0]["logprobs"]["token_logprobs"][1:])


@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_offsets_with_characters_split_over_tokens(
    server: ServerProcess, reference: tuple[Any, LlamaForCausalLM], as_ids: bool
) -> None:
    tokenizer, _ = reference
    ids = tokenizer.encode(MULTIBYTE_PROMPT)
    prompt: str | list[int] = ids if as_ids else MULTIBYTE_PROMPT
    out = _complete(server, prompt=prompt, max_tokens=3, logprobs=0, echo=True)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(MULTIBYTE_PROMPT)
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])
    assert all(t == {} for t in lp["top_logprobs"][1:])  # logprobs=0: the chosen token only
    # Each token starts where the text its predecessors decode to ends, counting whole characters
    # only: the pieces of a character split over tokens all start where its first piece does.
    whole = [i for i in range(len(ids) + 1) if not tokenizer.decode(ids[:i]).endswith("\ufffd")]
    expected = [len(tokenizer.decode(ids[: max(j for j in whole if j <= i)])) for i in range(len(ids))]
    assert expected != [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]  # pieces are there
    assert lp["text_offset"][: len(ids)] == expected
    assert lp["text_offset"][len(ids)] == len(MULTIBYTE_PROMPT)
    _check_offsets(choice["text"], lp)


def test_echo_logprobs_for_each_prompt_and_sample(server: ServerProcess) -> None:
    prompts = ["Hello, my name is", LONG_PROMPT]
    out = _complete(server, prompt=prompts, max_tokens=3, n=2, logprobs=1, echo=True, temperature=1.0, seed=1)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == 4
    per_prompt = {}
    for choice in choices:
        prompt = prompts[choice["index"] // 2]
        lp = choice["logprobs"]
        n = len(lp["tokens"]) - 3
        assert "".join(lp["tokens"][:n]) == prompt
        assert lp["token_logprobs"][0] is None
        assert all(v is not None for v in lp["token_logprobs"][1:])
        _check_offsets(choice["text"], lp)
        part = {key: lp[key][:n] for key in lp}
        # The samples of one prompt share its prompt logprobs (a forked sample included).
        assert per_prompt.setdefault(prompt, part) == part


def test_echo_logprobs_streamed_match_non_streamed(server: ServerProcess) -> None:
    body: dict[str, Any] = {"prompt": LONG_PROMPT, "max_tokens": 5, "logprobs": 2, "echo": True}
    whole = _complete(server, **body)["choices"][0]
    chunks = _stream(server, **body)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    opening = choices[0]
    assert opening["text"] == LONG_PROMPT
    assert opening["logprobs"] is not None
    assert opening["logprobs"]["token_logprobs"][0] is None
    n = len(opening["logprobs"]["tokens"])
    assert {key: whole["logprobs"][key][:n] for key in whole["logprobs"]} == opening["logprobs"]
    joined: dict[str, list[Any]] = {key: [] for key in whole["logprobs"]}
    for choice in choices:
        for key in joined:
            joined[key] += (choice["logprobs"] or {}).get(key, [])
    assert joined == whole["logprobs"]
    assert "".join(c["text"] for c in choices) == whole["text"]


def test_echo_and_logprobs_apart_are_unchanged(server: ServerProcess) -> None:
    echo_only = _complete(server, prompt="Hello, my name is", max_tokens=2, echo=True)["choices"][0]
    assert echo_only["logprobs"] is None
    assert echo_only["text"].startswith("Hello, my name is")
    logprobs_only = _complete(server, prompt="Hello, my name is", max_tokens=2, logprobs=1)["choices"][0]
    assert len(logprobs_only["logprobs"]["tokens"]) == 2
    assert logprobs_only["logprobs"]["text_offset"][0] == 0
    streamed = [
        c["choices"][0] for c in _stream(server, prompt="Hello", max_tokens=2, logprobs=1) if c["choices"]
    ]
    assert sum(len(c["logprobs"]["tokens"]) for c in streamed if c["logprobs"]) == 2


# ---- vLLM's metric names ---------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(server: ServerProcess) -> tuple[Samples, dict[str, str]]:
    """(sample name and sorted labels -> value, metric family name -> type) of one /metrics."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def _vllm(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted({"model_name": MODEL_NAME, **labels}.items()))


def _own(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def _wait_idle(server: ServerProcess, timeout_s: float = 20.0) -> Samples:
    deadline = time.monotonic() + timeout_s
    while True:
        samples, _ = _scrape(server)
        busy = samples.get(_vllm("vllm:num_requests_running"), 1) + samples.get(
            _vllm("vllm:num_requests_waiting"), 1
        )
        if busy == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


# vLLM family name -> the pagedserve family whose values it repeats.
SAME_VALUES = {
    "vllm:num_requests_running": "pagedserve_num_requests_running",
    "vllm:num_requests_waiting": "pagedserve_num_requests_waiting",
    "vllm:kv_cache_usage_perc": "pagedserve_kv_cache_usage_ratio",
    "vllm:gpu_cache_usage_perc": "pagedserve_kv_cache_usage_ratio",
    "vllm:prefix_cache_queries_total": "pagedserve_prefix_cache_queries_tokens_total",
    "vllm:prefix_cache_hits_total": "pagedserve_prefix_cache_hits_tokens_total",
    "vllm:num_preemptions_total": "pagedserve_num_preemptions_total",
    "vllm:prompt_tokens_total": "pagedserve_prompt_tokens_total",
    "vllm:generation_tokens_total": "pagedserve_generation_tokens_total",
    "vllm:time_to_first_token_seconds_count": "pagedserve_time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count": "pagedserve_inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_count": "pagedserve_inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count": "pagedserve_e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum": "pagedserve_e2e_request_latency_seconds_sum",
    "vllm:request_prompt_tokens_sum": "pagedserve_request_prompt_tokens_sum",
    "vllm:request_generation_tokens_sum": "pagedserve_request_generation_tokens_sum",
}

HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
)


def test_vllm_metric_names_labels_and_values(server: ServerProcess) -> None:
    _complete(server, prompt="Hello, my name is", max_tokens=3)  # something in every histogram
    samples, types = _scrape(server)
    for vllm_name, own_name in SAME_VALUES.items():
        assert _vllm(vllm_name) in samples, vllm_name
        assert samples[_vllm(vllm_name)] == samples[_own(own_name)], vllm_name
    for name in HISTOGRAMS:
        assert types[name] == "histogram", name
        assert _vllm(f"{name}_bucket", le="+Inf") in samples, name
    assert types["vllm:prompt_tokens"] == "counter"
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    assert 0.0 <= samples[_vllm("vllm:kv_cache_usage_perc")] <= 1.0
    for reason in ("stop", "length", "abort"):
        vllm_key = _vllm("vllm:request_success_total", finished_reason=reason)
        assert samples[vllm_key] == samples[_own("pagedserve_requests_total", finish_reason=reason)]
    vllm_names = {name for name, _ in samples if name.startswith("vllm:")}
    assert not any(name.startswith("pagedserve") for name in vllm_names)
    # Every vLLM series carries the served model's name, and only vLLM's labels.
    for (name, labels), _ in samples.items():
        if name.startswith("vllm:"):
            keys = {k for k, _ in labels}
            assert dict(labels)["model_name"] == MODEL_NAME, name
            assert keys <= {"model_name", "finished_reason", "le"}, (name, keys)


def test_vllm_metrics_count_a_request(server: ServerProcess) -> None:
    before = _wait_idle(server)
    out = _complete(server, prompt="Once upon a time", max_tokens=5)
    prompt_tokens = out["usage"]["prompt_tokens"]
    after = _wait_idle(server)

    def grew(name: str, **labels: str) -> float:
        return after[_vllm(name, **labels)] - before.get(_vllm(name, **labels), 0.0)

    assert grew("vllm:prompt_tokens_total") == prompt_tokens
    assert grew("vllm:generation_tokens_total") == 5
    assert grew("vllm:request_success_total", finished_reason="length") == 1
    assert grew("vllm:time_to_first_token_seconds_count") == 1
    assert grew("vllm:e2e_request_latency_seconds_count") == 1
    assert grew("vllm:inter_token_latency_seconds_count") >= 1
    assert grew("vllm:request_prompt_tokens_count") == 1
    assert grew("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert grew("vllm:request_generation_tokens_sum") == 5
    assert after[_vllm("vllm:kv_cache_usage_perc")] == 0.0
    assert after[_vllm("vllm:num_requests_running")] == 0


def test_vllm_prefix_cache_counters(server: ServerProcess) -> None:
    prompt = "A prompt long enough to fill whole KV blocks of sixteen tokens each, twice over. " * 2
    _complete(server, prompt=prompt, max_tokens=1)
    before = _wait_idle(server)
    _complete(server, prompt=prompt, max_tokens=1)
    after = _wait_idle(server)
    hits = after[_vllm("vllm:prefix_cache_hits_total")] - before[_vllm("vllm:prefix_cache_hits_total")]
    queries = (
        after[_vllm("vllm:prefix_cache_queries_total")] - before[_vllm("vllm:prefix_cache_queries_total")]
    )
    assert hits >= 2 * BLOCK_SIZE
    assert queries >= hits


def test_vllm_abort_counted(server: ServerProcess) -> None:
    before = _wait_idle(server)
    body = {
        "model": server.model_name,
        "prompt": "abc " * 20,
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # leave after the first chunk: the server must abort the request
    key = _vllm("vllm:request_success_total", finished_reason="abort")
    deadline = time.monotonic() + 20
    while _scrape(server)[0][key] < before[key] + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _scrape(server)[0][key] == before[key] + 1


def test_vllm_request_success_leaves_out_engine_errors() -> None:
    """A request failed by a dead engine is no vLLM success; pagedserve still counts it."""
    stats = CoreStats(
        num_running=0,
        num_waiting=0,
        num_preemptions=0,
        num_kv_blocks=8,
        num_kv_blocks_in_use=2,
        prefix_queries_tokens=0,
        prefix_hits_tokens=0,
    )
    metrics = ServerMetrics(lambda: stats)
    metrics.on_added("a", 3)
    metrics.on_failed("a")
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition("m").decode())}
    own = {
        s.labels["finish_reason"]: s.value
        for s in families["pagedserve_requests"].samples
        if s.name.endswith("_total")
    }
    vllm = {
        s.labels["finished_reason"]: s.value
        for s in families["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    assert own["error"] == 1
    assert set(vllm) == {"stop", "length", "abort"} and not any(vllm.values())
    assert families["vllm:kv_cache_usage_perc"].samples[0].value == 0.25
    assert families["vllm:kv_cache_usage_perc"].samples[0].labels == {"model_name": "m"}
