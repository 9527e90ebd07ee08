"""One log line per Generate call (from its CallRecord), and the process's two log formats.

Text (the default) writes `key=value` pairs; any value that is not a plain token (letters, digits, `._:/@+-`)
is written as a JSON string, so a caller's request id, session id or prompt can neither end the line nor
imitate another field. `--log-format json` writes every log record as one JSON object per line, with the
request line's fields as keys.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

from llmserve.telemetry.call import CallRecord

log = logging.getLogger("llmserve.requests")

_PLAIN = re.compile(r"[A-Za-z0-9._:/@+-]+")
# A prompt logged with --log-prompts is cut to this many characters.
MAX_LOGGED_PROMPT_CHARS = 2000
# A request id is logged whole only within the request-id limit; past it (a refused request), cut to this.
MAX_LOGGED_ID_CHARS = 128


def logfmt_value(value: object) -> str:
    """`value` as it appears after `key=`: bare when it is a plain token, else a JSON string (ASCII only)."""
    text = value if isinstance(value, str) else str(value)
    if _PLAIN.fullmatch(text):
        return text
    return json.dumps(text, ensure_ascii=True)


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def call_fields(call: CallRecord) -> dict[str, Any]:
    """The line's fields, in order; caller-controlled values are clipped here and quoted by the formatter."""
    first = call.first_token
    out: dict[str, Any] = {
        "request_id": clip(call.request_id, MAX_LOGGED_ID_CHARS),
        "status": call.status,
        "finish": call.finish_reason or "-",
        "prompt_tokens": call.prompt_tokens,
        "cached_tokens": call.cached_prompt_tokens,
        "completion_tokens": call.completion_tokens,
        "ttft_ms": None if first is None else round((first - call.start) * 1e3, 1),
        "duration_ms": round((call.end - call.start) * 1e3, 1),
    }
    if call.method != "Generate":
        out["method"] = call.method
        out["inputs"] = call.inputs
    if call.identity is not None:
        out["identity"] = call.identity
    if call.prompt is not None:
        out["prompt"] = clip(call.prompt, MAX_LOGGED_PROMPT_CHARS)
    return out


def log_call(call: CallRecord) -> None:
    """The one log line of a closed call."""
    fields = call_fields(call)
    log.info(format_fields(fields), extra={"fields": fields})


def format_fields(fields: dict[str, Any]) -> str:
    """`key=value ...` with every value through logfmt_value; None is written as `-`."""
    return " ".join(f"{key}={'-' if value is None else logfmt_value(value)}" for key, value in fields.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message (or a request line's fields), exception."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=True, default=str)


def configure_logging(level: str, log_format: str) -> None:
    """The process's logging: to stderr, as text lines or (`json`) JSON objects."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
