"""The API process's first-use work, done before the server reports ready.

Why. Right after `pagedserve serve` reported ready, a client sending requests one at a time saw
the first one take several times the others' time to first token (on a 2-CPU host with a tiny
model: 35 to 60 ms against 14 ms for a streamed token-id prompt, 100 ms against 13 ms for a text
prompt). The difference was work each process does once, on first use:

- the vocabulary scan that bounds a text prompt's size (`InputProcessor.max_text_bytes`): 60 ms
  for SmolLM2's 49,152 tokens, more for a larger vocabulary;
- the chat template's compilation (Jinja, 7 ms) and the tokenizer's first encode (1.5 ms);
- the modules anyio imports when Starlette opens the task group of the first streamed response
  (12 ms);
- starting the tokenizer thread.

How. `warm_up_tokenizer` runs on the tokenizer thread while the engine core loads the model
(`AsyncLLMEngine.launch`), so it adds nothing to start-up; `warm_up_streaming` streams a response
in memory before the port is served. The engine core warms up its own step (`EngineCore.warm_up`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Message
from transformers import PreTrainedTokenizerBase

from pagedserve.engine.input_processor import longest_token_bytes

logger = logging.getLogger(__name__)

_SAMPLE_TEXT = "Hello, world!"
_SAMPLE_CONVERSATION = [{"role": "user", "content": _SAMPLE_TEXT}]


def warm_up_tokenizer(tokenizer: PreTrainedTokenizerBase) -> int:
    """Do the tokenizer's first-use work: encode a text and render the model's chat template (Jinja
    compiles it on first use and caches the result). Returns `longest_token_bytes(tokenizer)` for
    the `InputProcessor`. CPU-bound (~0.1 s); run it on the thread that later tokenizes."""
    tokenizer.encode(_SAMPLE_TEXT)
    if tokenizer.chat_template is not None:
        try:
            tokenizer.apply_chat_template(_SAMPLE_CONVERSATION, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template may refuse this conversation; requests will tell
            logger.info("rendering the chat template at start-up failed: %s: %s", type(exc).__name__, exc)
    return longest_token_bytes(tokenizer)


async def warm_up_streaming() -> None:
    """Stream a one-chunk response through Starlette in memory, as uvicorn's HTTP/1.1 protocols
    call it (ASGI spec 2.3: the response also listens for a disconnect in a task group), so the
    modules the first streamed response needs are imported now. Call on the serving event loop."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: [DONE]\n\n"

    async def receive() -> Message:
        await asyncio.Event().wait()  # the client stays: cancelled once the stream has ended
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        pass

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "GET"}
    await StreamingResponse(chunks(), media_type="text/event-stream")(scope, receive, send)
