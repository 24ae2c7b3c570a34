"""One precision policy for every stage: parameters stored in `param_dtype`, forward passes in
`compute_dtype`, losses and metrics in `output_dtype`. Gradients flow back through the cast, so
the optimizer always updates the stored (usually float32) parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pdctl.config import PrecisionConfig


@dataclass(frozen=True)
class Policy:
    param: jnp.dtype
    compute: jnp.dtype
    output: jnp.dtype

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> Policy:
        return cls(
            jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype), jnp.dtype(cfg.output_dtype)
        )

    def to_compute(self, tree: Any) -> Any:
        """Cast floating leaves to the compute dtype (a no-op when they already are)."""
        return jax.tree.map(
            lambda x: x.astype(self.compute) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            tree,
        )

    def to_output(self, x: jax.Array) -> jax.Array:
        return x.astype(self.output)
