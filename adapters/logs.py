"""Structured logs for nodes: JSON lines for machines, aligned text for people (spec/design.md §6).

Every record may carry structured fields: ``log.info("vote", extra={"fields": {"window": 3}})``. The
engine's `Log` effects arrive the same way (logger ``peerloom.engine``, message = the event name).

`setup_logging(fmt="auto")` writes JSON lines when the stream is not a terminal (files, pipes, journald,
log shippers) and readable text when it is. One JSON object per line::

    {"t": 1763690000.123, "level": "info", "logger": "peerloom.engine", "node": "validator-1",
     "event": "vote", "window": 3, "round": 0, "step": "prevote"}
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

import attrs

_HANDLER_NAME = "peerloom-structured"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: t (unix seconds), level, logger, node, event (the message), fields."""

    def __init__(self, node: str | None = None) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"t": round(record.created, 3), "level": record.levelname.lower(),
                                "logger": record.name}
        if self.node is not None:
            line["node"] = self.node
        line["event"] = record.getMessage()
        for key, value in _fields(record).items():
            line.setdefault(key, value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """``HH:MM:SS level  logger  event  key=value ...`` for a person at a terminal."""

    def __init__(self, node: str | None = None) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        who = f"{self.node} " if self.node else ""
        text = f"{clock} {record.levelname.lower():<7} {who}{record.name:<18} {record.getMessage()}"
        text = f"{text}  {fields}" if fields else text
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(fmt: str = "auto", level: str = "info", *, name: str | None = None,
                  stream: TextIO | None = None) -> logging.Handler:
    """Send ``peerloom.*`` logs to `stream` (stderr) as JSON lines or text; replaces an earlier setup.

    `fmt`: ``auto`` (JSON unless `stream` is a TTY), ``json`` or ``text``. ValueError for anything else.
    """
    stream = stream if stream is not None else sys.stderr
    if fmt == "auto":
        fmt = "text" if stream.isatty() else "json"
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be auto, json or text, got {fmt!r}")
    handler = logging.StreamHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter(name) if fmt == "json" else TextFormatter(name))
    logger = logging.getLogger("peerloom")
    for old in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    return handler


@attrs.define
class _Budget:
    start: float
    logged: int = 0
    suppressed: int = 0


class LineLimiter:
    """At most `burst` log lines of one kind per `interval_s` seconds; the rest are counted, and each count
    comes back once from `summaries` as one line's worth (spec/transport.md §14: a flood of
    rejections from fresh identities must not become a flood of log lines and disk).

    A kind is a short string (``"reject/decode-non-canonical"``); at most `max_kinds` are tracked, and any
    further one counts under ``"other"``. Times are the caller's (any clock that does not go back).
    """

    def __init__(self, *, burst: int = 20, interval_s: float = 10.0, max_kinds: int = 256) -> None:
        if burst < 0 or interval_s <= 0 or max_kinds < 1:
            raise ValueError("bad LineLimiter settings")
        self.burst, self.interval_s, self.max_kinds = burst, interval_s, max_kinds
        self._kinds: dict[str, _Budget] = {}
        self._pending: dict[str, int] = {}  # suppressed counts of intervals that ended, not yet summarised

    def allow(self, kind: str, now: float) -> bool:
        """True if a line of `kind` may be written now; False if it is over budget (it is counted)."""
        budget = self._kinds.get(kind)
        if budget is None:
            if len(self._kinds) >= self.max_kinds:
                kind = "other"
                budget = self._kinds.get(kind)
            if budget is None:
                budget = self._kinds[kind] = _Budget(start=now)
        if now - budget.start >= self.interval_s:
            self._close(kind, budget, now)
        if budget.logged < self.burst:
            budget.logged += 1
            return True
        budget.suppressed += 1
        return False

    def _close(self, kind: str, budget: _Budget, now: float) -> None:
        if budget.suppressed:
            self._pending[kind] = self._pending.get(kind, 0) + budget.suppressed
        budget.start, budget.logged, budget.suppressed = now, 0, 0

    def summaries(self, now: float) -> list[tuple[str, int]]:
        """(kind, lines suppressed) for each kind whose interval has ended with lines suppressed, each count
        returned once; kinds quiet for a whole interval are forgotten."""
        for kind, budget in list(self._kinds.items()):
            if now - budget.start >= self.interval_s:
                self._close(kind, budget, now)
                if not self._pending.get(kind):
                    del self._kinds[kind]
        out = sorted(self._pending.items())
        self._pending.clear()
        return out
