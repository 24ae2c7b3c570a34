"""A small Llama-style decoder LM: RMSNorm, causal RoPE attention, GELU MLP (or GLU), no biases."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from pdctl.science.arrays import expand_left
from pdctl.science.targets.base import (
    Overrides,
    Params,
    Residual,
    Residuals,
    node_at,
    normal_init,
    residuals,
)
from pdctl.science.targets.lm import LMTarget, rope


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaMLP(LMTarget):
    """Sites per layer, in forward order: `layers.{i}.attn.q|k|v|o`, then `layers.{i}.mlp.up`,
    `layers.{i}.mlp.down` (with glu: `gate`, `up`, `down`). Each site's matrix lives at exactly
    that path in the params dict, so weights imported from elsewhere only need transposing into
    the (d_in, d_out) convention. RoPE uses the rotate-half layout of Hugging Face Llama.
    """

    kind = "llama_mlp"
    NEURON_SIDES: ClassVar[Mapping[str, str]] = {
        "mlp.gate": "out",
        "mlp.up": "out",
        "mlp.down": "in",
    }

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_mlp: int = 256
    seq_len: int = 64
    glu: bool = False
    tied_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    param_dtype: Any = jnp.float32
    remat: str = "none"  # none | dots_saveable | full: rematerialise each block in the backward

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
        self._check_remat()
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"d_model ({self.d_model}) must split into n_heads ({self.n_heads}) heads of "
                "even size (RoPE rotates pairs of dimensions)"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def _mlp_names(self) -> tuple[str, ...]:
        return ("gate", "up", "down") if self.glu else ("up", "down")

    def layer_prefix(self) -> str:
        return "layers"

    def layer_sites(self) -> list[tuple[str, tuple[int, int], bool]]:
        d, m = self.d_model, self.d_mlp
        mlp_shapes = {"gate": (d, m), "up": (d, m), "down": (m, d)}
        attn = [(f"attn.{name}", (d, d), False) for name in ("q", "k", "v", "o")]
        return attn + [(f"mlp.{name}", mlp_shapes[name], False) for name in self._mlp_names()]

    def tp_divisors(self) -> dict[str, int]:
        return {"target.n_heads": self.n_heads, "target.d_mlp": self.d_mlp}

    def site_weights(self, params: Params) -> dict[str, jax.Array]:
        return {path: node_at(params, path) for path in self.site_shapes()}

    def init(self, key: jax.Array) -> Params:
        """N(0, 0.02) matrices, unit norm scales. Same-shaped sites are drawn as one stacked
        array and sliced: one RNG body per distinct shape keeps the compile of a jitted init
        small however deep the model (each RNG body costs about as much as a forward pass)."""
        d, V, dt = self.d_model, self.vocab_size, self.param_dtype
        shapes = self.site_shapes()
        k_embed, k_unembed, k_sites = jax.random.split(key, 3)

        def normal(k: jax.Array, shape: tuple[int, ...]) -> jax.Array:
            return normal_init(k, shape, 0.02, dt)

        by_shape: dict[tuple[int, int], list[str]] = {}
        for path, shape in shapes.items():
            by_shape.setdefault(shape, []).append(path)
        drawn: dict[str, jax.Array] = {}
        for (shape, group), k in zip(
            by_shape.items(), jax.random.split(k_sites, len(by_shape)), strict=True
        ):
            stacked = normal(k, (len(group), *shape))
            drawn.update({path: stacked[j] for j, path in enumerate(group)})

        layers: Params = {}
        for path, w in drawn.items():
            _, i, block, name = path.split(".")
            layer = layers.setdefault(
                i, {"attn_norm": jnp.ones((d,), dt), "mlp_norm": jnp.ones((d,), dt)}
            )
            layer.setdefault(block, {})[name] = w
        params: Params = {
            "embed": normal(k_embed, (V, d)),
            "layers": layers,
            "final_norm": jnp.ones((d,), dt),
        }
        if not self.tied_embeddings:
            params["unembed"] = normal(k_unembed, (d, V))
        return params

    def _rms_norm(self, x: jax.Array, scale: jax.Array) -> jax.Array:
        # Statistics in float32: a bf16 mean of squares over d_model loses too many bits.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.norm_eps)
        return x32.astype(x.dtype) * expand_left(scale, x.ndim)

    def _rope(self, x_BxTxNxH: jax.Array) -> jax.Array:
        H = x_BxTxNxH.shape[3]
        inv_freq = 1.0 / (self.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
        return rope(x_BxTxNxH, inv_freq)

    def _attention(
        self, x_BxTxD: jax.Array, p: Params, prefix: str, overrides: Overrides | None
    ) -> jax.Array:
        B, T, _ = x_BxTxD.shape
        N, H = self.n_heads, self.head_dim

        def proj(name: str) -> jax.Array:
            return self._site(f"{prefix}.{name}", x_BxTxD, p[name], overrides).reshape(B, T, N, H)

        q, k, v = self._rope(proj("q")), self._rope(proj("k")), proj("v")
        # Scores and softmax in float32 so that a bf16 model's attention stays well-conditioned.
        scores_BxNxTxT = jnp.einsum(
            "btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32
        ) / math.sqrt(H)
        causal_TxT = jnp.tril(jnp.ones((T, T), dtype=bool))
        scores_BxNxTxT = jnp.where(causal_TxT[None, None], scores_BxNxTxT, -jnp.inf)
        probs = jax.nn.softmax(scores_BxNxTxT, axis=-1).astype(v.dtype)
        out_BxTxD = jnp.einsum("bnts,bsnh->btnh", probs, v).reshape(B, T, N * H)
        return self._site(f"{prefix}.o", out_BxTxD, p["o"], overrides)

    def _mlp(self, x: jax.Array, p: Params, prefix: str, overrides: Overrides | None) -> jax.Array:
        up = self._site(f"{prefix}.up", x, p["up"], overrides)
        if self.glu:
            hidden = jax.nn.gelu(self._site(f"{prefix}.gate", x, p["gate"], overrides)) * up
        else:
            hidden = jax.nn.gelu(up)
        return self._site(f"{prefix}.down", hidden, p["down"], overrides)

    def apply(
        self,
        params: Params,
        tokens: jax.Array,
        overrides: Overrides | None = None,
        residual: Residuals = None,
        start: Residual | None = None,
    ) -> jax.Array:
        """tokens (B, T) int -> logits (B, T, vocab) float32. `residual` / `start`: the stream
        entering a layer (or several, `residual`), filled in / started from (`base.Residual`)."""
        if start is None:
            first, x_BxTxD = 0, jnp.take(params["embed"], tokens, axis=0)
        else:
            assert start.x is not None  # a start is given with its stream
            first, x_BxTxD = start.layer, start.x
        wanted = residuals(residual)
        for i in range(first, self.n_layers):
            for r in wanted:
                if i == r.layer:
                    r.x = x_BxTxD

            def block(x_BxTxD, layer, i=i):
                h = self._rms_norm(x_BxTxD, layer["attn_norm"])
                x_BxTxD = x_BxTxD + self._attention(h, layer["attn"], f"layers.{i}.attn", overrides)
                h = self._rms_norm(x_BxTxD, layer["mlp_norm"])
                return x_BxTxD + self._mlp(h, layer["mlp"], f"layers.{i}.mlp", overrides)

            x_BxTxD = self._remat(block)(x_BxTxD, params["layers"][str(i)])
        h = self._rms_norm(x_BxTxD, params["final_norm"])
        if self.tied_embeddings:
            return jnp.einsum("btd,vd->btv", h, params["embed"], preferred_element_type=jnp.float32)
        return jnp.einsum("btd,dv->btv", h, params["unembed"], preferred_element_type=jnp.float32)
