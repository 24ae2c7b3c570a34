"""The CI-function / init half of the LM recipe (issue 36): the lower-leaky clamp for both
squashings, the transformer CI function, the nonlinearity-aligned init, and the CI functions'
own gradient clip. Closed forms first; then numbers from goodfire-ai/spd's torch code, produced
by `benchmarks/spd_ci_reference.py` (which runs that code on the cases built here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdctl.science.spd import ci as ci_mod
from pdctl.science.spd import components as comp_mod

# ---------------------------------------------------------------------------------------------
# lower_leaky_hard: the forward clamp for both squashings

Z = [-2.0, -0.5, 0.0, 0.25, 1.0, 1.5, 3.0]
G = [0.7, -0.7, -1.3, 0.4, -0.9, 2.0, -2.0]


def _squash_vjp(sigmoid: str, which: int, g: list[float]) -> tuple[np.ndarray, np.ndarray]:
    out, vjp = jax.vjp(lambda z: ci_mod.squash(z, sigmoid)[which], jnp.asarray(Z, jnp.float32))
    return np.asarray(out), np.asarray(vjp(jnp.asarray(g, jnp.float32))[0])


@pytest.mark.parametrize("which", [0, 1])
def test_lower_leaky_hard_is_the_clamp_with_the_sign_gated_leak_for_both(which):
    # SPEC §4.2 / S6: forward clamp(z, 0, 1); backward g on 0 < z <= 1, 0.01 g on z <= 0 only
    # where g < 0, 0 on z > 1. Both squashings (ci_lower: masks, ci_upper: importance
    # minimality) are that function under `lower_leaky_hard`.
    out, grad = _squash_vjp("lower_leaky_hard", which, G)
    np.testing.assert_array_equal(out, np.clip(Z, 0, 1).astype(np.float32))
    z, g = np.asarray(Z, np.float32), np.asarray(G, np.float32)
    want = np.where(z <= 0, np.where(g < 0, np.float32(0.01) * g, 0), np.where(z <= 1, g, 0))
    np.testing.assert_array_equal(grad, want.astype(np.float32))


def test_leaky_hard_keeps_its_upper_leaky_importance_squashing():
    # the default pair is unchanged: ci_upper = z > 1 ? 1 + 0.01 (z - 1) : clip(z, 0, 1)
    out, _ = _squash_vjp("leaky_hard", 1, G)
    np.testing.assert_allclose(out, [0, 0, 0, 0.25, 1, 1.005, 1.02], rtol=1e-6)
    lo, _ = _squash_vjp("leaky_hard", 0, G)
    np.testing.assert_array_equal(lo, np.clip(Z, 0, 1).astype(np.float32))


# goodfire-ai/spd `spd/models/sigmoids.py` (`SIGMOID_TYPES["lower_leaky_hard"]`) on Z, its
# gradient for the cotangents G and -G (benchmarks/spd_ci_reference.py, spd commit 3f0bb61e).
SPD_LOWER_LEAKY = {
    "out": [0.0, 0.0, 0.0, 0.25, 1.0, 1.0, 1.0],
    1.0: [0.0, -0.007, -0.013, 0.4, -0.9, 0.0, 0.0],
    -1.0: [-0.007, 0.0, 0.0, -0.4, 0.9, 0.0, 0.0],
}


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("which", [0, 1])
def test_lower_leaky_hard_matches_the_torch_reference(sign, which):
    out, grad = _squash_vjp("lower_leaky_hard", which, [sign * g for g in G])
    np.testing.assert_array_equal(out, np.float32(SPD_LOWER_LEAKY["out"]))
    # float32 0.01 * g against the reference printed to 6 decimals
    np.testing.assert_allclose(grad, SPD_LOWER_LEAKY[sign], rtol=0, atol=1e-7)
