"""The precision policy, by operation, for every stage: what is stored, what is computed in
which dtype, and at which matmul precision.

- Parameters are stored in `param_dtype`; forward passes run in `compute_dtype`. Gradients flow
  back through the cast, so the optimizer always updates the stored (usually float32) values.
- **Faithfulness** (train and warmup, every site, stacked units and tp layouts included) forms
  V @ U and W - V @ U from float32 values at full float32 precision on every platform,
  whatever `compute_dtype` and `matmul` say (`science.arrays.exact_matmul`, called by
  `science.spd.losses.faithfulness_loss`). The term measures a residual near 1e-12: a TPU's
  default float32 matmul (one bf16 pass) rounds V @ U by ~1e-7, which would be the whole term.
- **Every other matmul of a step** (target forwards, CI functions, masked forwards, PGD) runs at
  `[precision] matmul`: "default" (the platform's fastest: one bf16 pass on a TPU, float32 on
  a CPU), "high" (three bf16 passes) or "highest" (float32). A process-wide
  `JAX_DEFAULT_MATMUL_PRECISION` still applies under "default".
- **Evaluations** (CE / KL of the masked models, in train and report) run at `eval_matmul`
  ("highest" by default): they are a small share of the time, and at one bf16 pass the
  unmasked model alone is off by a KL of ~1e-4 on a TPU.
- Losses and metrics are float32 (each distance casts its inputs).

On a CPU every setting computes float32 products: the numerics there do not depend on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pdctl.config import PrecisionConfig


def matmul_scope(precision: str) -> contextlib.AbstractContextManager:
    """A context under which JAX traces dots at `precision`; "default" changes nothing (not even
    the lowered program, so a CPU's numerics stay as they were)."""
    if precision == "default":
        return contextlib.nullcontext()
    return jax.default_matmul_precision(precision)


@dataclass(frozen=True)
class Policy:
    param: jnp.dtype
    compute: jnp.dtype
    matmul: str = "default"
    eval_matmul: str = "highest"

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> Policy:
        return cls(
            jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype), cfg.matmul, cfg.eval_matmul
        )

    def to_compute(self, tree: Any) -> Any:
        """Cast floating leaves to the compute dtype (a no-op when they already are)."""
        return jax.tree.map(
            lambda x: x.astype(self.compute) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            tree,
        )

    def scoped(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """`step` traced at the step's matmul precision (`StepProgram.jit` wraps every stage's
        step in it)."""
        if self.matmul == "default":
            return step

        def run(*args: Any) -> Any:
            with matmul_scope(self.matmul):
                return step(*args)

        return run

    def eval_scope(self) -> contextlib.AbstractContextManager:
        """The context evaluations are traced in."""
        return matmul_scope(self.eval_matmul)
