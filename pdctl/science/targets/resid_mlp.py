"""Residual MLP toy: features written into a residual stream by a fixed random embedding, MLP
layers that must compute `relu(x_i)` for more features than they have neurons, read out by W_E.T.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pdctl.science.targets.base import (
    Overrides,
    Params,
    Residual,
    Residuals,
    SiteDataFn,
    Target,
    add_bias,
    mse,
    normal_init,
    sparse_features,
    uniform_fan_in,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResidMLP(Target):
    """Sites per layer: `layers.{i}.mlp_in` (d_embed, d_mlp), `layers.{i}.mlp_out` (d_mlp, d_embed).

    Data follows the SPD paper's reference implementation (goodfire-ai/spd, resid_mlp): each
    feature independently active with probability p with value U[-1, 1] (negative values make
    the identity and the ReLU parts of the label distinguishable), label `x + relu(x)` (the
    "act_plus_resid" label with unit coefficients), loss the MSE read off at the n_features
    outputs. The reference's canonical 1-layer model has no MLP biases; `bias=False` gives that.
    """

    kind = "resid_mlp"
    output_kind = "mse"

    n_features: int = 100
    d_embed: int = 1000
    d_mlp: int = 50
    n_layers: int = 1
    feature_probability: float = 0.01
    embed_seed: int = 0
    bias: bool = True
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))

    def embedding(self) -> jax.Array:
        """W_E (n_features, d_embed), unit-norm rows, a function of `embed_seed` alone so every
        run (whatever its init seed) decomposes a model over the same feature directions."""
        shape = (self.n_features, self.d_embed)
        w = normal_init(jax.random.key(self.embed_seed), shape, 1.0, jnp.float32)
        w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
        return w.astype(self.param_dtype)

    def init(self, key: jax.Array) -> Params:
        # One stacked draw per weight kind across layers: few RNG bodies in a compiled init.
        D, M, L, dt = self.d_embed, self.d_mlp, self.n_layers, self.param_dtype
        k_in, k_out = jax.random.split(key)
        w_in_LxDxM = uniform_fan_in(k_in, (L, D, M), D, dt)
        w_out_LxMxD = uniform_fan_in(k_out, (L, M, D), M, dt)
        layers: Params = {}
        for i in range(L):
            mlp_in: Params = {"W": w_in_LxDxM[i]}
            mlp_out: Params = {"W": w_out_LxMxD[i]}
            if self.bias:
                mlp_in["b"] = jnp.zeros((M,), dt)
                mlp_out["b"] = jnp.zeros((D,), dt)
            layers[str(i)] = {"mlp_in": mlp_in, "mlp_out": mlp_out}
        return {"W_E": self.embedding(), "layers": layers}

    def site_shapes(self) -> dict[str, tuple[int, int]]:
        shapes: dict[str, tuple[int, int]] = {}
        for i in range(self.n_layers):
            shapes[f"layers.{i}.mlp_in"] = (self.d_embed, self.d_mlp)
            shapes[f"layers.{i}.mlp_out"] = (self.d_mlp, self.d_embed)
        return shapes

    def site_weights(self, params: Params) -> dict[str, jax.Array]:
        weights: dict[str, jax.Array] = {}
        for i in range(self.n_layers):
            layer = params["layers"][str(i)]
            weights[f"layers.{i}.mlp_in"] = layer["mlp_in"]["W"]
            weights[f"layers.{i}.mlp_out"] = layer["mlp_out"]["W"]
        return weights

    def apply(self, params: Params, x: jax.Array, overrides: Overrides | None = None) -> jax.Array:
        def site(path: str, x_in: jax.Array, W: jax.Array, tail: None) -> jax.Array:
            return self._site(path, x_in, W, overrides)

        return self._forward(params, x, site, fold=False)

    def apply_sites(
        self,
        params: Params,
        x: jax.Array,
        site_fn: SiteDataFn | None = None,
        site_data: Mapping[str, Any] | None = None,
        capture: Sequence[str] = (),
        residual: Residuals = None,
        start: Residual | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`Target.apply_sites`; a forward with overridden sites reads the last layer's
        `mlp_out` out through `W_E.T` folded into it: the output is `r @ W_E.T + out @ W_E.T`
        and `out` is linear in that site's weights, so `site_fn` gets `tail=W_E.T` and
        computes `out @ W_E.T` through `U @ W_E.T` / `W @ W_E.T` (`masked_site_fn`); an
        unmasked last `mlp_out` is `relu(h) @ (W @ W_E.T)`. The (batch, d_embed) output of
        that site and its backward are never formed: with d_embed 1000 and 100 features (the
        canonical ResidMLP-1) they were most of the SPD step's FLOPs. Equal to the plain
        forward up to float reassociation. Forwards without overrides (the clean forward,
        pretraining) are the plain ones. No blocks: `residual` and `start` are refused."""
        if residual is not None or start is not None:
            raise TypeError("ResidMLP has no blocks: apply_sites takes no residual / start")
        if not site_data or self.n_features >= self.d_embed:
            return super().apply_sites(params, x, site_fn, site_data, capture)
        assert site_fn is not None
        captured: dict[str, jax.Array] = {}

        def site(path: str, x_in: jax.Array, W: jax.Array, tail: jax.Array | None):
            if path in capture:
                captured[path] = x_in
            if path in site_data:
                kw = {} if tail is None else {"tail": tail}
                return site_fn(x_in, W, site_data[path], **kw).astype(x_in.dtype)
            return x_in @ W if tail is None else x_in @ (W @ tail)

        out = self._forward(params, x, site, fold=True)
        return out, {p: captured[p] for p in capture}

    def _forward(self, params: Params, x: jax.Array, site, fold: bool) -> jax.Array:
        """The forward with each site computed as `site(path, x_in, W, tail)`; with `fold`, the
        last `mlp_out` gets `tail = W_E.T` and returns its output already read out."""
        W_E = params["W_E"]
        r = x.astype(self.param_dtype) @ W_E
        for i in range(self.n_layers):
            layer = params["layers"][str(i)]
            h = site(f"layers.{i}.mlp_in", r, layer["mlp_in"]["W"], None)
            if self.bias:
                h = add_bias(h, layer["mlp_in"]["b"])
            tail = W_E.T if fold and i == self.n_layers - 1 else None
            out = site(f"layers.{i}.mlp_out", jax.nn.relu(h), layer["mlp_out"]["W"], tail)
            if self.bias:
                b = layer["mlp_out"]["b"]
                out = add_bias(out, b if tail is None else b @ tail)
            if tail is not None:
                return r @ W_E.T + out
            r = r + out
        return r @ W_E.T

    def make_batch(self, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
        x_BxF = sparse_features(key, batch_size, self.n_features, self.feature_probability, -1, 1)
        return {"x": x_BxF, "y": x_BxF + jax.nn.relu(x_BxF)}

    def loss(
        self, params: Params, batch: Mapping[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        loss = mse(self.apply(params, batch["x"]), batch["y"])
        return loss, {"mse": loss}

    def trainable_mask(self, params: Params) -> Any:
        mask = jax.tree.map(lambda _: True, params)
        mask["W_E"] = False
        return mask
