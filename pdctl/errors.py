"""Errors that are the user's to fix: the CLI prints them on one line and exits 2."""

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 3  # a stage stopped by SIGTERM/SIGINT after saving a checkpoint


class PdctlError(Exception):
    """A mistake in the input (config, command line, order of stages). One line, no traceback."""

    exit_code = EXIT_USER_ERROR


class StageFailed(PdctlError):
    """A stage stopped for a reason the user can act on (too many bad steps, ...)."""

    exit_code = 1
