"""Small array helpers the targets and the decomposition share."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# `[train] remat` / `[pretrain] remat`: what a rematerialised block may keep from its forward
# ("none" = no remat: the block is not wrapped).
REMAT_POLICIES = {"dots_saveable": jax.checkpoint_policies.dots_saveable, "full": None}


def remat(fn: Callable, policy: str, **kw: Any) -> Callable:
    """`fn` rematerialised in the backward under the named `REMAT_POLICIES` entry; `fn` itself
    for "none". `kw` goes to `jax.checkpoint` (static_argnums)."""
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[policy], **kw)


def expand_left(a: jax.Array, ndim: int) -> jax.Array:
    """Prepend singleton axes so `a` has rank `ndim` (an explicit broadcast, so code stays
    valid under `jax_numpy_rank_promotion="raise"`)."""
    a = jnp.asarray(a)
    return a.reshape((1,) * (ndim - a.ndim) + a.shape)


def is_traced(x: object) -> bool:
    """A config value that arrives as an array (a tracer): a key a sweep varies inside one program
    (`pdctl.sweep.hyper`). Code that decides the program's structure from such a value (a term
    with coefficient 0 is not computed) treats a traced one as "on", and never calls `float`
    or `bool` on it."""
    return isinstance(x, jax.Array)  # a tracer, or a concrete array under jax.disable_jit


def exact_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b in float32 at full float32 precision on every platform (`Precision.HIGHEST`: six
    bf16 passes on a TPU, plain float32 on a CPU), whatever the process's default matmul
    precision. For products whose rounding is the quantity being measured (the faithfulness
    term's V @ U: see `pdctl.engine.precision`)."""
    return jnp.matmul(
        a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
