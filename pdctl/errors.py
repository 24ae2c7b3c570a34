"""Errors that are the user's to fix (the CLI prints them on one line and exits 2), and the
helpers that put an error or a notice on one line."""

import sys

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 3  # a stage stopped by SIGTERM/SIGINT after saving a checkpoint


class PdctlError(Exception):
    """A mistake in the input (config, command line, order of stages). One line, no traceback."""

    exit_code = EXIT_USER_ERROR


class StageFailed(PdctlError):
    """A stage stopped for a reason the user can act on (too many bad steps, ...)."""

    exit_code = 1


def one_line(e: BaseException, limit: int = 160) -> str:
    """An exception as one line for an error message: `Type: message`, whitespace collapsed,
    cut to `limit` characters."""
    text = " ".join(str(e).split())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (its type when it has none), cut to `limit`:
    how a reader quotes a parser's error after naming the file itself."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__


def notify(message: str) -> None:
    """A line on stderr for the user (what pdctl decided on their behalf)."""
    print(f"pdctl: {message}", file=sys.stderr, flush=True)
