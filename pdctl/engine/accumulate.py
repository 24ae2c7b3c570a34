"""Gradient accumulation with a scan over micro-batches inside one step.

Chosen over `optax.MultiSteps` because a step stays one optimizer update: schedules,
checkpoint cadence, `--until`, resume and logging keep counting optimizer steps whatever
`grad_accum_steps` is, and the parameters never move before the accumulation boundary (there
is no intermediate state to observe). Memory is that of one micro-batch's activations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pdctl.engine.sharding import BATCH_AXES


def split_micro(tree: Any, k: int, mesh, batch_axes: Any = 0) -> Any:
    """(B, ...) -> (k, B/k, ...), each micro-batch still sharded over the batch axes.

    `batch_axes`: where each leaf's batch axis is, one int for all or a tree of ints like
    `tree` (a stacked site's inputs have its layers ahead of the batch: (L, B, ...) ->
    (k, L, B/k, ...)). The micro-batch index always comes first."""

    def one(axis, x):
        n = x.shape[axis]
        y = x.reshape(*x.shape[:axis], k, n // k, *x.shape[axis + 1 :])
        y = jnp.moveaxis(y, axis, 0)
        spec = P(None, *([None] * axis), BATCH_AXES, *([None] * (x.ndim - axis - 1)))
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))

    if isinstance(batch_axes, int):
        return jax.tree.map(functools.partial(one, batch_axes), tree)
    return jax.tree.map(one, batch_axes, tree)


def accumulate(
    # called with a traced index inside the scan, and with the literal 0 to evaluate shapes
    value_and_grad: Callable[[Any, jax.Array | int], tuple[tuple[jax.Array, dict], Any]],
    micro: Any,
    k: int,
) -> tuple[tuple[jax.Array, dict], Any]:
    """Mean over the k micro-batches of `value_and_grad(micro_batch, i)`'s loss, metrics and
    gradients (what one batch k times larger gives for losses that are means over examples)."""

    def body(carry, i):
        mb = jax.tree.map(lambda x: x[i], micro)
        (loss, metrics), grads = value_and_grad(mb, i)
        acc = jax.tree.map(jnp.add, carry, ((loss, metrics), grads))
        return acc, None

    first = jax.eval_shape(lambda: value_and_grad(jax.tree.map(lambda x: x[0], micro), 0))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first)
    total, _ = jax.lax.scan(body, zeros, jnp.arange(k))
    return jax.tree.map(lambda x: x / k, total)
