"""Token ids beside the text of generation responses (vLLM's `return_token_ids`).

A client asks for them with `"return_token_ids": true`; a server without a tokenizer
(`--skip-tokenizer-init`) always sends them, since its text is empty and they are all the client
gets. The fields are vLLM's, where vLLM puts them:

- `/v1/completions`: each choice has `prompt_token_ids` (its prompt's) and `token_ids` (what it
  generated). Streamed, a choice's first chunk has `prompt_token_ids` and every chunk the
  `token_ids` it adds.
- `/v1/chat/completions`: `prompt_token_ids` (the rendered conversation) is a field of the
  response, `token_ids` of each choice. Streamed, the stream's first chunk has
  `prompt_token_ids` and every chunk's choice the `token_ids` it adds.

A streamed chunk holds back nothing: ids generated while a renderer sends no chunk (a tool call
not complete yet) ride on the choice's next chunk, so the concatenated `token_ids` of a choice
are exactly its generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


def wants_token_ids(return_token_ids: bool, has_tokenizer: bool) -> bool:
    """Whether a response carries token ids: asked for, or the server has no text to give."""
    return return_token_ids or not has_tokenizer


@dataclass(slots=True)
class StreamedTokenIds:
    """Puts token ids into a stream's events as they go out. Mutable: one per stream."""

    prompts: list[list[int]]  # prompt index -> its token ids (as the engine runs it)
    # "choice": each choice's first chunk holds its prompt's ids (completions); "response": the
    # stream's first event holds them at the top level (chat).
    prompt_placement: Literal["choice", "response"]
    pending: dict[int, list[int]] = field(default_factory=dict)  # choice index -> ids not sent yet
    opened: set[int] = field(default_factory=set)  # choice indices whose prompt ids went out
    first_event_sent: bool = False

    def add(self, index: int, token_ids: list[int]) -> None:
        """Generated ids of choice `index` to send with its next chunk."""
        self.pending.setdefault(index, []).extend(token_ids)

    def stamp(self, event: dict[str, Any], prompt_index: int, *, with_generated: bool) -> None:
        """Fill the token-id fields of `event` (one chunk holding one choice) in place.
        `with_generated`: the chunk is the last of its delta, so the ids waiting go with it."""
        (choice,) = event["choices"]
        index = choice["index"]
        if self.prompt_placement == "response" and not self.first_event_sent:
            event["prompt_token_ids"] = self.prompts[prompt_index]
        elif self.prompt_placement == "choice" and index not in self.opened:
            choice["prompt_token_ids"] = self.prompts[prompt_index]
        self.first_event_sent = True
        self.opened.add(index)
        if with_generated:
            choice["token_ids"] = self.pending.pop(index, [])
