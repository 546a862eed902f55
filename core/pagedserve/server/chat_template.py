"""Rendering a conversation with a chat template, off the event loop and within a time budget.

A chat template is a Jinja program: the model's own is trusted, a request's is not (the server
refuses those unless started with `--trust-request-chat-template`). Either way it runs in a
thread of its own, so the event loop keeps answering, and it is stopped when it runs past its
budget: an exception is raised inside the thread (Jinja templates are compiled to Python, which
checks for such exceptions between bytecodes), so a template that loops for minutes does not hold
a thread for minutes. Rendering only reads the tokenizer's template and special tokens, so it may
run beside the tokenizer thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Callable
from typing import Any


class TemplateTimeout(Exception):
    """A chat template ran past its time budget."""


async def render_within(render: Callable[[], str], timeout_s: float) -> str:
    """`render()` in a thread of its own; raises TemplateTimeout after `timeout_s` seconds (the
    thread is stopped), or what `render` raised."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str] = loop.create_future()
    lock = threading.Lock()
    state = {"finished": False}

    def deliver(value: str | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            assert value is not None
            future.set_result(value)

    def run() -> None:
        try:
            value: str | None = None
            error: BaseException | None = None
            try:
                value = render()
            except TemplateTimeout:
                raise
            except BaseException as exc:  # reported to the awaiting request, not to the thread
                error = exc
            with lock:
                state["finished"] = True
            loop.call_soon_threadsafe(deliver, value, error)
        except TemplateTimeout:
            # Stopped (possibly just as it finished): the request has already been answered.
            pass

    thread = threading.Thread(target=run, name="pagedserve-chat-template", daemon=True)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except TimeoutError:
        with lock:
            if not state["finished"] and thread.ident is not None:
                _raise_in(thread.ident, TemplateTimeout)
        raise TemplateTimeout(f"the chat template took more than {timeout_s:g} s to render") from None


def _raise_in(thread_id: int, exc_type: type[BaseException]) -> None:
    """Raise `exc_type` in the thread `thread_id` at its next Python bytecode."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc_type))


def render_messages(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    chat_template: str | None,
) -> Callable[[], str]:
    """The call that renders `messages` with the tokenizer's template (or `chat_template`)."""

    def render() -> str:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
        )
        assert isinstance(text, str)
        return text

    return render
