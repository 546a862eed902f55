"""The Responses API's stored responses: what `GET /v1/responses/{id}` returns and what
`previous_response_id` continues, in memory, bounded.

An `OrderedDict` in least-recently-used order: storing or reading a response moves it to the
end, and storing past the limit (`serve --max-stored-responses`, default 1,024) drops the least
recently used. Nothing survives a restart, and each API-server process (`--api-server-count`)
keeps its own: a continuation must reach the process that answered its previous turn.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagedserve.server.errors import APIError
from pagedserve.server.responses_items import Message

DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as the client got it
    conversation: tuple[Message, ...]  # every turn so far, this reply included (instructions not)


class ResponseStore:
    """Response id -> `StoredResponse`, the `max_responses` most recently used. Not thread-safe:
    used on the event loop only."""

    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be at least 1, got {max_responses}")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        """Keep `stored` under its response's id, dropping the least recently used past the limit."""
        key = stored.response["id"]
        self._responses[key] = stored
        self._responses.move_to_end(key)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, marked most recently used; None if it was never stored or dropped."""
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def previous(self, response_id: str) -> StoredResponse:
        """The response `previous_response_id` names. Raises a 400 APIError naming the field."""
        stored = self.get(response_id)
        if stored is None:
            raise APIError(
                400,
                f"previous_response_id {response_id!r} is not a stored response: this server keeps "
                f"the {self.max_responses} most recently used responses in memory (--max-stored-"
                "responses), only those created with store=true, and none across restarts; send "
                "the whole conversation as input instead",
                param="previous_response_id",
            )
        return stored
