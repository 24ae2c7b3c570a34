"""Toy model of superposition: `relu((x @ W1 [@ H_k ...]) @ W2 + b)`, trained to reconstruct x."""

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from pdctl.science.targets.base import (
    Overrides,
    Params,
    Target,
    add_bias,
    mse,
    sparse_features,
    uniform_fan_in,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TMS(Target):
    """Sites: `linear1` (n_features, n_hidden), `hidden_layers.{i}` (n_hidden, n_hidden),
    `linear2` (n_hidden, n_features).

    When tied, params hold only W1 and `linear2` is W1.T: it is still a site of its own (its
    own CI function and sources), but `tied_sites` tells the decomposition to tie its components
    to `linear1`'s transposes, as the reference does. Hidden layers start as the identity
    and are frozen in `trainable_mask`, as in the reference "-id" toys, so they stay a known
    identity that a decomposition must recover.
    """

    kind = "tms"
    output_kind = "mse"

    n_features: int = 5
    n_hidden: int = 2
    n_hidden_layers: int = 0
    tied_weights: bool = True
    bias: bool = True
    feature_probability: float = 0.05
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))

    def init(self, key: jax.Array) -> Params:
        k_w1, k_w2 = jax.random.split(key)
        F, H, dt = self.n_features, self.n_hidden, self.param_dtype
        params: Params = {"linear1": {"W": uniform_fan_in(k_w1, (F, H), F, dt)}}
        if self.n_hidden_layers:
            params["hidden_layers"] = {
                str(i): {"W": jnp.eye(H, dtype=dt)} for i in range(self.n_hidden_layers)
            }
        linear2: Params = {}
        if not self.tied_weights:
            linear2["W"] = uniform_fan_in(k_w2, (H, F), H, dt)
        if self.bias:
            # Zero, unlike torch's default U(+-1/sqrt(H)) that the reference 5-2 keeps: a feature
            # whose bias starts negative and whose row shrinks early goes dead for good (output
            # and gradient stuck at relu's flat side). With Adam 5e-3 for 3000 steps, 4/16 seeds
            # reached the pentagon with that init, 16/16 with zeros (as the reference's 40-10).
            linear2["b"] = jnp.zeros((F,), dt)
        if linear2:
            params["linear2"] = linear2
        return params

    def site_shapes(self) -> dict[str, tuple[int, int]]:
        F, H = self.n_features, self.n_hidden
        shapes = {"linear1": (F, H)}
        shapes.update({f"hidden_layers.{i}": (H, H) for i in range(self.n_hidden_layers)})
        shapes["linear2"] = (H, F)
        return shapes

    def tied_sites(self) -> dict[str, str]:
        return {"linear2": "linear1"} if self.tied_weights else {}

    def site_weights(self, params: Params) -> dict[str, jax.Array]:
        weights = {"linear1": params["linear1"]["W"]}
        for i in range(self.n_hidden_layers):
            weights[f"hidden_layers.{i}"] = params["hidden_layers"][str(i)]["W"]
        weights["linear2"] = (
            params["linear1"]["W"].T if self.tied_weights else params["linear2"]["W"]
        )
        return weights

    def apply(self, params: Params, x: jax.Array, overrides: Overrides | None = None) -> jax.Array:
        w = self.site_weights(params)
        h = self._site("linear1", x.astype(self.param_dtype), w["linear1"], overrides)
        for i in range(self.n_hidden_layers):
            path = f"hidden_layers.{i}"
            h = self._site(path, h, w[path], overrides)
        out = self._site("linear2", h, w["linear2"], overrides)
        if self.bias:
            out = add_bias(out, params["linear2"]["b"])
        return jax.nn.relu(out)

    def make_batch(self, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
        x_BxF = sparse_features(key, batch_size, self.n_features, self.feature_probability, 0, 1)
        return {"x": x_BxF, "y": x_BxF}

    def loss(
        self, params: Params, batch: Mapping[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        loss = mse(self.apply(params, batch["x"]), batch["y"])
        return loss, {"mse": loss}

    def trainable_mask(self, params: Params) -> Any:
        mask = jax.tree.map(lambda _: True, params)
        if "hidden_layers" in mask:
            mask["hidden_layers"] = jax.tree.map(lambda _: False, mask["hidden_layers"])
        return mask
