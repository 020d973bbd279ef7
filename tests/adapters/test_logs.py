"""Structured logs: JSON lines off a TTY, readable text on one, fields carried through."""

import io
import json
import logging

import pytest

from peerloom.adapters.logs import setup_logging


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_json_lines_when_not_a_tty():
    stream = io.StringIO()
    setup_logging("auto", "info", name="v1", stream=stream)
    logging.getLogger("peerloom.engine").info("vote", extra={"fields": {"window": 3, "step": "prevote"}})
    logging.getLogger("peerloom.engine").debug("hidden below the level")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["event"] == "vote" and line["node"] == "v1" and line["window"] == 3 and line["level"] == "info"
    assert line["logger"] == "peerloom.engine" and isinstance(line["t"], float)


def test_text_on_a_tty_and_setup_replaces_the_handler():
    first, tty = io.StringIO(), _Tty()
    setup_logging("json", stream=first)
    setup_logging("auto", stream=tty, name="t1")
    logging.getLogger("peerloom.runtime").warning("dial failed", extra={"fields": {"peer": "127.0.0.1:1"}})
    assert first.getvalue() == ""  # the earlier handler is gone: no duplicate lines
    text = tty.getvalue()
    assert "warning" in text and "dial failed" in text and "peer=127.0.0.1:1" in text and "t1" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_exceptions_are_one_json_line():
    stream = io.StringIO()
    setup_logging("json", stream=stream)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("peerloom.runtime").exception("task failed")
    (line,) = stream.getvalue().splitlines()
    assert "RuntimeError: boom" in json.loads(line)["exception"]


def test_bad_format_is_refused():
    with pytest.raises(ValueError):
        setup_logging("xml", stream=io.StringIO())
