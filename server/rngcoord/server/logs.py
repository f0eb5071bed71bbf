"""Structured logging for the coordinator server: one JSON object per line on stderr.

Every line has `ts` (UTC, ISO 8601 with microseconds), `level`, `logger`, `event` (a short
snake_case name for what happened) and `fields` (the event's details). A logged exception adds
`exc` with the formatted traceback. Log with `event(logger, level, "name", key=value, ...)`.

Other libraries' Python loggers (psycopg, psycopg_pool, asyncio, grpc's Python layer) and
Python warnings go through the same formatter from WARNING up: their message becomes `event`.
gRPC core's own C++ log lines bypass Python; `rngcoord serve` silences them
(GRPC_VERBOSITY=NONE) unless the environment sets GRPC_VERBOSITY, for debugging.

gRPC's aio server logs `ExecuteBatchError raised in core by servicer method` with a traceback
when a handler's answer finds its caller gone (cancelled, timed out, disconnected). That is
the caller's doing and the server is fine, so those lines are dropped (`_CallerGone`).

The servicer logs nothing per request at INFO: requests are counted in metrics instead, and
only failures the caller cannot explain (INTERNAL) are logged.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any

LOGGER_NAME = "rngcoord"


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object; `extra={"fields": {...}}` supplies the fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="microseconds"),
            "level": record.levelname,
            "logger": record.name,
            "event": record.getMessage(),
            "fields": getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        # default=str: a field that is not JSON (a path, an exception) still logs readably.
        return json.dumps(line, default=str, separators=(",", ":"))


class _CallerGone(logging.Filter):
    """Drops gRPC's traceback for an answer its caller was no longer there to take."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("ExecuteBatchError raised in core")


_GRPC_CORE_LOGGER = "grpc._cython.cygrpc"


def configure(level: int | str = logging.INFO, stream: IO[str] | None = None) -> logging.Logger:
    """Send the `rngcoord` loggers (from `level`) and every other logger (from WARNING) to
    `stream` as JSON lines; return the `rngcoord` logger.

    Args:
        level: the lowest level logged. Default INFO.
        stream: where lines go. Default: sys.stderr at the time of the call.

    Calling it again replaces the previous handler, so it never logs a line twice.
    """
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.captureWarnings(True)
    grpc_core = logging.getLogger(_GRPC_CORE_LOGGER)
    if not any(isinstance(f, _CallerGone) for f in grpc_core.filters):
        grpc_core.addFilter(_CallerGone())
    logger = logging.getLogger(LOGGER_NAME)
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(level)
    # rngcoord's lines are written once, by its own handler, at its own level.
    logger.propagate = False
    return logger


def get_logger(name: str) -> logging.Logger:
    """The logger `rngcoord.<name>`."""
    return logging.getLogger(f"{LOGGER_NAME}.{name}")


def event(
    logger: logging.Logger,
    level: int,
    name: str,
    *,
    exc_info: bool = False,
    **fields: object,
) -> None:
    """Log the event `name` with `fields`; `exc_info=True` attaches the current exception."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"fields": fields}, exc_info=exc_info)
