"""The two ways `AsyncLLMEngine` refuses or fails a request: the request is wrong
(`InvalidRequest`, a 400), or the engine core is gone (`EngineDeadError`, a 503)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; the server must be restarted."""


class InvalidRequest(ValueError):
    """A request the engine refuses before running it; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
