"""The log formats of the service processes (batchplane.core.logformat): BATCHPLANE_LOG_FORMAT
is read and checked, and a JSON line carries the record and the process's context."""

from __future__ import annotations

import io
import json
import logging

import pytest

from batchplane.core import logformat
from batchplane.core.errors import ConfigError


@pytest.mark.parametrize(("value", "expected"), [(None, "text"), ("", "text"), ("text", "text"), ("json", "json"), (" JSON ", "json")])
def test_the_format_names(value: str | None, expected: str) -> None:
    assert logformat.parse_log_format(value) == expected


def test_a_bad_format_names_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        logformat.parse_log_format("xml")
    assert str(info.value) == "BATCHPLANE_LOG_FORMAT: must be one of text, json, got 'xml'"
    with pytest.raises(ConfigError, match="^--log-format: "):
        logformat.parse_log_format("yaml", field="--log-format")


def emit(log_format: str, context: logformat.LogContext, fn) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logformat.formatter(log_format, "loader-1"))
    handler.addFilter(context)
    logger = logging.getLogger("batchplane.test.logformat")
    logger.propagate, logger.level = False, logging.DEBUG
    logger.addHandler(handler)
    try:
        fn(logger)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_a_json_line_carries_the_record_the_context_and_the_exception() -> None:
    context = logformat.LogContext(part="loader", index=1, replica=None)
    context.update(job="pretrain", source=("web", "code"))

    def log(logger: logging.Logger) -> None:
        logger.info("read %d rows\nof %s", 40, "web")
        try:
            raise ValueError("bad row group")
        except ValueError:
            logger.exception("skipped a row group", extra={"source": "web"})

    lines = emit("json", context, log).splitlines()
    assert len(lines) == 2  # a newline in a message or a traceback stays inside its line
    first, second = (json.loads(line) for line in lines)
    assert first.keys() == {"time", "level", "logger", "message", "job", "part", "index", "source"}
    assert (first["level"], first["logger"], first["message"]) == ("INFO", "batchplane.test.logformat", "read 40 rows\nof web")
    assert (first["job"], first["part"], first["index"], first["source"]) == ("pretrain", "loader", 1, ["web", "code"])
    assert first["time"].endswith("Z") and len(first["time"]) == len("2025-01-01T00:00:00.000Z")
    assert second["source"] == "web"  # the record's own field wins over the process's
    assert second["level"] == "ERROR" and second["exception"].startswith("Traceback") and "ValueError: bad row group" in second["exception"]
    context.update(source=None)
    third = json.loads(emit("json", context, lambda logger: logger.warning("x")))
    assert "source" not in third and third["part"] == "loader"


def test_the_text_format_is_the_one_people_read() -> None:
    out = emit("text", logformat.LogContext(part="loader"), lambda logger: logger.warning("buffer full"))
    assert out.rstrip().endswith("WARNING loader-1 batchplane.test.logformat: buffer full")
