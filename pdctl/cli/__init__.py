"""The pdctl command line (`pdctl.cli.app` wires it; `main` is the `pdctl` entry point)."""

from pdctl.cli.app import app, main
from pdctl.cli.base import console

__all__ = ["app", "console", "main"]
