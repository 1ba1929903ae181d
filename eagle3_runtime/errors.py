"""The one base class of every refusal a user can act on (builder and runtime), and how CLIs report it.

The message names the problem and the fix; CLIs print it as one line and exit 2 (HTTP: a 4xx). The cause
is kept (`raise ... from e`): `--debug` (or EAGLE3_DEBUG=1) prints the chained traceback as well.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

DEBUG_ENV = "EAGLE3_DEBUG"


class Eagle3Error(Exception):
    """A refusal with the fix in its message."""


def debug_enabled(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes")


def enable_debug() -> None:
    os.environ[DEBUG_ENV] = "1"


def print_cause(exc: BaseException | None = None, file=None) -> None:
    """With --debug / EAGLE3_DEBUG: the exception being handled (or `exc`) with its chained causes."""
    if not debug_enabled():
        return
    exc = exc or sys.exc_info()[1]
    if exc is not None:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=file or sys.stderr)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit 2, like every other refusal."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def whole_number(lo: int, hi: int, what: str = "a whole number"):
    """An argparse type: an integer in [lo, hi] (at most 18 digits: no 4,300-digit parse), else one line."""
    def parse(text: str) -> int:
        t = text.strip()
        n = int(t) if t.lstrip("+-").isdigit() and len(t) <= 19 else None
        if n is None or not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"must be {what} from {lo} to {hi}, got {text!r}")
        return n
    return parse


def seconds(lo: float, hi: float):
    """An argparse type: a finite number of seconds in [lo, hi], else one line."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            x = float("nan")
        if not lo <= x <= hi:  # (NaN and inf fail it too)
            raise argparse.ArgumentTypeError(f"must be a number of seconds from {lo:g} to {hi:g}, got {text!r}")
        return x
    return parse
