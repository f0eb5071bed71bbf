"""Argument types and environment defaults of the `rngcoord` command line: each parses one
value and says what is wrong with it in argparse's terms."""

from __future__ import annotations

import argparse
import os
from datetime import UTC, datetime
from pathlib import Path

__all__ = [
    "env_flag",
    "env_float",
    "env_int",
    "env_path",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "time_us",
]


def env_path(env: os._Environ[str], name: str) -> Path | None:
    value = env.get(name)
    return Path(value) if value else None


def time_us(text: str) -> int:
    """Parse ISO 8601 (UTC unless it carries an offset) or Unix seconds into microseconds."""
    try:
        return round(float(text) * 1_000_000)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither ISO 8601 (2024-05-01T12:00:00) nor Unix seconds"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return round(when.timestamp() * 1_000_000)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def env_int(env: os._Environ[str], name: str, default: int) -> int:
    value = env.get(name)
    return int(value) if value else default


def env_float(env: os._Environ[str], name: str, default: float) -> float:
    value = env.get(name)
    return float(value) if value else default


def env_flag(env: os._Environ[str], name: str) -> bool:
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value
