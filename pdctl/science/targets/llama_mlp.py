"""A small Llama-style decoder LM: RMSNorm, causal RoPE attention, GELU MLP (or GLU), no biases."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pdctl.science.arrays import expand_left
from pdctl.science.targets.base import Overrides, Params, Residual, Target, normal_init

REMAT_POLICIES = {"dots_saveable": jax.checkpoint_policies.dots_saveable, "full": None}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaMLP(Target):
    """Sites per layer, in forward order: `layers.{i}.attn.q|k|v|o`, then `layers.{i}.mlp.up`,
    `layers.{i}.mlp.down` (with glu: `gate`, `up`, `down`). Each site's matrix lives at exactly
    that path in the params dict, so weights imported from elsewhere only need transposing into
    the (d_in, d_out) convention. RoPE uses the rotate-half layout of Hugging Face Llama.
    """

    kind = "llama_mlp"
    output_kind = "logits"

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

    def site_shapes(self) -> dict[str, tuple[int, int]]:
        d, m = self.d_model, self.d_mlp
        mlp_shapes = {"gate": (d, m), "up": (d, m), "down": (m, d)}
        shapes: dict[str, tuple[int, int]] = {}
        for i in range(self.n_layers):
            for name in ("q", "k", "v", "o"):
                shapes[f"layers.{i}.attn.{name}"] = (d, d)
            for name in self._mlp_names():
                shapes[f"layers.{i}.mlp.{name}"] = mlp_shapes[name]
        return shapes

    def tp_divisors(self) -> dict[str, int]:
        return {"target.n_heads": self.n_heads, "target.d_mlp": self.d_mlp}

    def mlp_neuron_sides(self) -> dict[str, str]:
        side = {"gate": "out", "up": "out", "down": "in"}
        return {
            f"layers.{i}.mlp.{name}": side[name]
            for i in range(self.n_layers)
            for name in self._mlp_names()
        }

    def site_weights(self, params: Params) -> dict[str, jax.Array]:
        weights: dict[str, jax.Array] = {}
        for path in self.site_shapes():
            node: Any = params
            for part in path.split("."):
                node = node[part]
            weights[path] = node
        return weights

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
        T, H = x_BxTxNxH.shape[1], x_BxTxNxH.shape[3]
        inv_freq = 1.0 / (self.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
        angle_TxH2 = jnp.arange(T, dtype=jnp.float32)[:, None] * inv_freq[None, :]
        cos = jnp.cos(angle_TxH2)[None, :, None, :]
        sin = jnp.sin(angle_TxH2)[None, :, None, :]
        x32 = x_BxTxNxH.astype(jnp.float32)
        x1, x2 = x32[..., : H // 2], x32[..., H // 2 :]
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return rotated.astype(x_BxTxNxH.dtype)

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

    def layer_of(self, path: str) -> int | None:
        parts = path.split(".")
        return int(parts[1]) if len(parts) > 2 and parts[0] == "layers" else None

    def apply(
        self,
        params: Params,
        tokens: jax.Array,
        overrides: Overrides | None = None,
        residual: Residual | None = None,
        start: Residual | None = None,
    ) -> jax.Array:
        """tokens (B, T) int -> logits (B, T, vocab) float32. `residual` / `start`: the stream
        entering a layer, filled in / started from (`base.Residual`)."""
        if start is None:
            first, x_BxTxD = 0, jnp.take(params["embed"], tokens, axis=0)
        else:
            first, x_BxTxD = start.layer, start.x
        for i in range(first, self.n_layers):
            if residual is not None and i == residual.layer:
                residual.x = x_BxTxD

            def block(x_BxTxD, layer, i=i):
                h = self._rms_norm(x_BxTxD, layer["attn_norm"])
                x_BxTxD = x_BxTxD + self._attention(h, layer["attn"], f"layers.{i}.attn", overrides)
                h = self._rms_norm(x_BxTxD, layer["mlp_norm"])
                return x_BxTxD + self._mlp(h, layer["mlp"], f"layers.{i}.mlp", overrides)

            if self.remat != "none":
                block = jax.checkpoint(block, policy=REMAT_POLICIES[self.remat])
            x_BxTxD = block(x_BxTxD, params["layers"][str(i)])
        h = self._rms_norm(x_BxTxD, params["final_norm"])
        if self.tied_embeddings:
            return jnp.einsum("btd,vd->btv", h, params["embed"], preferred_element_type=jnp.float32)
        return jnp.einsum("btd,dv->btv", h, params["unembed"], preferred_element_type=jnp.float32)

    def make_batch(self, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
        raise TypeError("llama_mlp reads text batches from pdctl.science.data, not make_batch")

    def inputs(self, batch: Mapping[str, jax.Array]) -> jax.Array:
        return batch["tokens"][:, :-1]

    def loss(
        self, params: Params, batch: Mapping[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        tokens = batch["tokens"]
        logits_BxTxV = self.apply(params, tokens[:, :-1])
        labels_BxT = tokens[:, 1:]
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, labels_BxT))
        accuracy = jnp.mean((jnp.argmax(logits_BxTxV, axis=-1) == labels_BxT).astype(jnp.float32))
        return ce, {"ce": ce, "accuracy": accuracy}

    def n_tokens_per_example(self) -> int:
        return self.seq_len
