"""pdctl: Stochastic Parameter Decomposition with JAX, driven by a TOML project file."""

__version__ = "0.1.0"
