"""pdctl: Stochastic Parameter Decomposition with JAX, driven by a TOML project file.

As a library: `pdctl.open("run1")` reads a run directory (docs/api.md, `pdctl.api`); it is
imported on first use, and nothing here imports JAX."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["open"]


def __getattr__(name: str) -> Any:
    if name == "open":
        from pdctl.api import open

        return open
    raise AttributeError(f"module 'pdctl' has no attribute {name!r}")
