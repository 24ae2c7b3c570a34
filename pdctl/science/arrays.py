"""Small array helpers the targets and the decomposition share."""

import jax
import jax.numpy as jnp


def expand_left(a: jax.Array, ndim: int) -> jax.Array:
    """Prepend singleton axes so `a` has rank `ndim` (an explicit broadcast, so code stays
    valid under `jax_numpy_rank_promotion="raise"`)."""
    a = jnp.asarray(a)
    return a.reshape((1,) * (ndim - a.ndim) + a.shape)
