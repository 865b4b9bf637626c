"""How service processes format their log records: the text lines people read (the default), or
one JSON object per line for log collectors (`BATCHPLANE_LOG_FORMAT=json`).

A JSON line holds `time` (UTC, RFC 3339 with milliseconds), `level`, `logger`, `message`,
`exception` (the traceback, when the record has one) and the context of the process and of the
record: `job` (the job's name), `part` (planner, loader, constructor, operator), `index` (a
loader's or constructor's index), `replica` (a loader's replica id), `rank` (the global ranks a
constructor serves, or the one rank a record is about), `source` (the sources a loader reads, or
the one source a record is about) and `dataplane` (the operator's DataPlane, namespace/name).
Fields without a value are left out.

Formatting only: no handlers, streams or environment here (`core.process.configure_logging`
installs them).
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Mapping
from typing import Any

from batchplane.core.errors import ConfigError

#: The environment variable that picks the format of every process's log.
ENV = "BATCHPLANE_LOG_FORMAT"
#: The formats, the default first.
LOG_FORMATS = ("text", "json")
#: Context fields a JSON line may carry, in the order written.
CONTEXT_FIELDS = ("job", "part", "index", "replica", "rank", "source", "dataplane")


def parse_log_format(value: str | None, *, field: str = ENV) -> str:
    """The log format `value` names; None or "" mean the default, "text".

    Args:
        value: "text" or "json" (any case, surrounding blanks ignored).
        field: What the value came from, for the error (the environment variable or a flag).
    Raises:
        ConfigError: any other value, naming `field`.
    """
    name = (value or "").strip().lower() or LOG_FORMATS[0]
    if name not in LOG_FORMATS:
        raise ConfigError(field, f"must be one of {', '.join(LOG_FORMATS)}", value)
    return name


class LogContext(logging.Filter):
    """Adds the process's context to every record that does not carry the field itself (a
    record's own `extra={"source": ...}` wins).

    Args:
        fields: Initial context, e.g. part="loader", index=0; None values are left out.
    """

    def __init__(self, **fields: Any) -> None:
        super().__init__()
        self.fields: dict[str, Any] = {}
        self.update(**fields)

    def update(self, **fields: Any) -> None:
        """Sets context fields (once the job is known, say); None removes one."""
        for key, value in fields.items():
            if value is None:
                self.fields.pop(key, None)
            else:
                self.fields[key] = value

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages and tracebacks escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = _plain(value)
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def text_format(name: str) -> str:
    """The text format's pattern for a process called `name` (e.g. "loader-0")."""
    return f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s"


def formatter(log_format: str, name: str) -> logging.Formatter:
    """The formatter of `log_format` ("text" or "json") for a process called `name`."""
    return JsonFormatter() if log_format == "json" else logging.Formatter(text_format(name))


def _rfc3339(created: float) -> str:
    moment = datetime.datetime.fromtimestamp(created, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _plain(value: Any) -> Any:
    """JSON-ready: tuples, sets and other sequences as lists."""
    if isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset, range)):
        return [_plain(v) for v in value]
    return str(value)
