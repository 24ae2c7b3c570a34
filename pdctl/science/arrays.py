"""Small array helpers the targets and the decomposition share."""

import jax
import jax.numpy as jnp


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
