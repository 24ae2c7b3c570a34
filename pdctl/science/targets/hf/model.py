"""The forward pass of a Hugging Face causal LM (Llama, Qwen2, Qwen3, GPT-2) described by an
`HfSpec`.

`HFCausalLM` runs over a params pytree whose nested dict keys are the Hugging Face module names,
so a leaf's dotted path is the name of its tensor in the checkpoint
(`model.layers.3.mlp.down_proj.weight`). Site paths are the module paths of every attention and
MLP projection. Site weights are stored as (d_in, d_out) for `y = x @ W (+ b)`: torch
`nn.Linear` weights are transposed on load, GPT-2's `Conv1D` weights already are (d_in, d_out).
Everything else keeps its checkpoint layout (embeddings and `lm_head` are (vocab, d)). The spec
comes from `hf.spec`, the weights from `hf.load`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pdctl.errors import PdctlError
from pdctl.science.arrays import expand_left
from pdctl.science.spd.grouped import members, per_site_views, sites_of
from pdctl.science.targets.base import (
    Overrides,
    Params,
    Residual,
    Residuals,
    SiteDataFn,
    SiteFn,
    add_bias,
    node_at,
    normal_init,
    residuals,
    unflatten,
)
from pdctl.science.targets.hf.spec import HfSpec, read_hf_config
from pdctl.science.targets.lm import LMTarget, rope


def _act(name: str, x: jax.Array) -> jax.Array:
    if name in ("silu", "swish"):
        return jax.nn.silu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.relu(x)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one params leaf comes from: the checkpoint tensor `name` of `stored_shape`, which
    is the leaf transposed when `transposed` (torch nn.Linear keeps weights as (d_out, d_in))."""

    name: str
    stored_shape: tuple[int, ...]
    transposed: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFCausalLM(LMTarget):
    """A Hugging Face causal LM. Sites, per layer in forward order:
    Llama / Qwen2 / Qwen3: `model.layers.{i}.self_attn.{q,k,v,o}_proj`,
    `model.layers.{i}.mlp.{gate,up,down}_proj`; GPT-2: `transformer.h.{i}.attn.c_attn` (fused
    q|k|v), `transformer.h.{i}.attn.c_proj`, `transformer.h.{i}.mlp.c_fc`,
    `transformer.h.{i}.mlp.c_proj`. The site's matrix is the leaf `<site>.weight`, its bias
    (if any) `<site>.bias`, added after the site output.
    Every leaf is trainable (`Target.trainable_mask`), positions and norms included, as in
    transformers.
    """

    kind = "hf"
    NEURON_SIDES: ClassVar[Mapping[str, str]] = {
        "mlp.gate_proj": "out", "mlp.up_proj": "out", "mlp.down_proj": "in",  # Llama, Qwen2/3
        "mlp.c_fc": "out", "mlp.c_proj": "in",  # GPT-2
    }  # fmt: skip

    spec: HfSpec
    seq_len: int = 128
    param_dtype: Any = jnp.float32
    # the dtype the forwards cast the stored weights to on entry (`[precision] target_dtype`
    # stores them apart from the compute dtype); None: they compute in the stored dtype
    compute_dtype: Any = None
    remat: str = "none"  # none | dots_saveable | full: rematerialise each block in the backward
    # `apply_sites` runs the blocks as a scan over layers (`[train] scan_layers`)
    scan_layers: bool = False
    # with `scan_layers`, also scan each run of two or more consecutive layers without sites
    # (the layers after a single decomposed layer, say; `[train] scan_layers = "all"`); off:
    # those stay unrolled
    scan_siteless: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
        if self.compute_dtype is not None:
            object.__setattr__(self, "compute_dtype", jnp.dtype(self.compute_dtype))
        self._check_remat()
        s = self.spec
        if self.seq_len > s.max_positions:
            if s.is_gpt2:
                what = f"{s.max_positions} learned positions (n_positions) of the GPT-2 model"
            else:
                what = (
                    f"{s.max_positions} positions (max_position_embeddings) that the "
                    f"{s.architecture} model was trained for"
                )
            raise PdctlError(f"data.seq_len: {self.seq_len} exceeds the {what} in {s.config_path}")

    @classmethod
    def from_dir(cls, model_dir: str | Path, **kwargs: Any) -> HFCausalLM:
        return cls(spec=read_hf_config(model_dir), **kwargs)

    # Layout.

    @property
    def n_layers(self) -> int:
        return self.spec.n_layers

    def layer_prefix(self) -> str:
        return "transformer.h" if self.spec.is_gpt2 else "model.layers"

    def layer_sites(self) -> list[tuple[str, tuple[int, int], bool]]:
        s = self.spec
        d, m = s.d_model, s.d_mlp
        if s.is_gpt2:
            return [
                ("attn.c_attn", (d, 3 * d), True),
                ("attn.c_proj", (d, d), True),
                ("mlp.c_fc", (d, m), True),
                ("mlp.c_proj", (m, d), True),
            ]
        q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        return [
            ("self_attn.q_proj", (d, q), s.qkv_bias),
            ("self_attn.k_proj", (d, kv), s.qkv_bias),
            ("self_attn.v_proj", (d, kv), s.qkv_bias),
            ("self_attn.o_proj", (q, d), s.o_bias),
            ("mlp.gate_proj", (d, m), s.mlp_bias),
            ("mlp.up_proj", (d, m), s.mlp_bias),
            ("mlp.down_proj", (m, d), s.mlp_bias),
        ]

    def site_weights(self, params: Params) -> dict[str, jax.Array]:
        return {path: node_at(params, path)["weight"] for path in self.site_shapes()}

    def tp_divisors(self) -> dict[str, int]:
        """Column-parallel q/k/v (or c_attn) split heads, gate/up (c_fc) the MLP width, over
        tp devices (`engine.sharding.COLUMN_SITES`)."""
        s = self.spec
        if s.is_gpt2:
            return {"n_head": s.n_heads, "n_inner": s.d_mlp}
        return {
            "num_attention_heads": s.n_heads,
            "num_key_value_heads": s.n_kv_heads,
            "intermediate_size": s.d_mlp,
        }

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Dotted leaf path (= checkpoint tensor name) -> shape as pdctl stores it."""
        s = self.spec
        d, V = s.d_model, s.vocab_size
        shapes: dict[str, tuple[int, ...]] = {}
        if s.is_gpt2:
            shapes["transformer.wte.weight"] = (V, d)
            shapes["transformer.wpe.weight"] = (s.max_positions, d)
            norms, final = ("ln_1", "ln_2"), "transformer.ln_f"
        else:
            shapes["model.embed_tokens.weight"] = (V, d)
            norms, final = ("input_layernorm", "post_attention_layernorm"), "model.norm"
        for i in range(s.n_layers):
            layer = f"{self.layer_prefix()}.{i}"
            for norm in norms:
                shapes[f"{layer}.{norm}.weight"] = (d,)
                if s.is_gpt2:
                    shapes[f"{layer}.{norm}.bias"] = (d,)
            for name, (a, b), bias in self.layer_sites():
                shapes[f"{layer}.{name}.weight"] = (a, b)
                if bias:
                    shapes[f"{layer}.{name}.bias"] = (b,)
            if s.qk_norm:  # Qwen3's per-head RMSNorm of queries and keys
                shapes[f"{layer}.self_attn.q_norm.weight"] = (s.head_dim,)
                shapes[f"{layer}.self_attn.k_norm.weight"] = (s.head_dim,)
        shapes[f"{final}.weight"] = (d,)
        if s.is_gpt2:
            shapes[f"{final}.bias"] = (d,)
        if not s.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, d)
        return shapes

    def checkpoint_layout(self) -> dict[str, Tensor]:
        """Dotted leaf path -> the checkpoint tensor it is read from."""
        sites = set(self.site_shapes())
        out = {}
        for path, shape in self.param_shapes().items():
            # nn.Linear stores (d_out, d_in); GPT-2's Conv1D already stores (d_in, d_out).
            transposed = not self.spec.is_gpt2 and path.endswith(".weight") and path[:-7] in sites
            out[path] = Tensor(path, shape[::-1] if transposed else shape, transposed)
        return out

    # Init.

    def init(self, key: jax.Array) -> Params:
        """N(0, 0.02) matrices, zero biases, unit norm scales (for shapes, tests and toy runs;
        real weights come from `hf.load`). Same-shaped matrices are drawn as one stacked array
        and sliced: one RNG body per distinct shape keeps the jitted init's compile small."""
        dt = self.param_dtype
        flat: dict[str, jax.Array] = {}
        by_shape: dict[tuple[int, ...], list[str]] = {}
        for path, shape in self.param_shapes().items():
            if len(shape) == 2:
                by_shape.setdefault(shape, []).append(path)
            elif path.endswith(".bias"):
                flat[path] = jnp.zeros(shape, dt)
            else:
                flat[path] = jnp.ones(shape, dt)
        keys = jax.random.split(key, len(by_shape))
        for (shape, group), k in zip(by_shape.items(), keys, strict=True):
            stacked = normal_init(k, (len(group), *shape), 0.02, dt)
            flat.update({path: stacked[j] for j, path in enumerate(group)})
        return unflatten({p: flat[p] for p in self.param_shapes()})

    # Forward.

    def _norm(self, x: jax.Array, p: Params) -> jax.Array:
        """RMSNorm (Llama, Qwen2, Qwen3) or LayerNorm (GPT-2) over the last axis, statistics in
        float32 as transformers."""
        x32 = x.astype(jnp.float32)
        eps = self.spec.norm_eps
        if self.spec.is_gpt2:
            mean = jnp.mean(x32, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
            y = (x32 - mean) * jax.lax.rsqrt(var + eps)
            y = y * expand_left(p["weight"].astype(jnp.float32), y.ndim)
            y = y + expand_left(p["bias"].astype(jnp.float32), y.ndim)
            return y.astype(x.dtype)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return expand_left(p["weight"], x.ndim) * y.astype(x.dtype)

    def _inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies, float32 as transformers computes them (with llama3 or
        linear scaling applied)."""
        H, theta = self.spec.head_dim, self.spec.rope_theta
        exps = np.arange(0, H, 2, dtype=np.int64).astype(np.float32) / np.float32(H)
        inv = (1.0 / (np.float32(theta) ** exps)).astype(np.float32)
        kind, factor, low, high, orig = self.spec.rope_scaling
        if kind == "linear":
            return (inv / np.float32(factor)).astype(np.float32)
        if kind == "llama3":
            wavelen = 2 * math.pi / inv
            low_wl, high_wl = orig / low, orig / high
            scaled = np.where(wavelen > low_wl, inv / factor, inv)
            smooth = (orig / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        return inv

    def _rope(self, x_BxTxNxH: jax.Array) -> jax.Array:
        return rope(x_BxTxNxH, self._inv_freq())

    def _proj(self, path: str, x: jax.Array, p: Params, overrides: Overrides | None) -> jax.Array:
        h = self._site(path, x, p["weight"], overrides)
        return add_bias(h, p["bias"]) if "bias" in p else h

    def _attend(self, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, scale: float) -> jax.Array:
        """Causal softmax attention; each of the K kv heads serves N/K query heads (query head
        n uses kv head n // (N/K), as transformers' repeat_kv). Scores in float32."""
        B, T, N, H = q_BxTxNxH.shape
        K = k_BxTxKxH.shape[2]
        q_BxTxKxGxH = q_BxTxNxH.reshape(B, T, K, N // K, H)
        scores = jnp.einsum(
            "btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxTxKxH, preferred_element_type=jnp.float32
        )
        scores = scores * jnp.float32(scale)
        causal_TxT = jnp.tril(jnp.ones((T, T), dtype=bool))
        scores = jnp.where(causal_TxT[None, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_BxTxKxH.dtype)
        out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxTxKxH)
        return out.reshape(B, T, N * H)

    def _llama_block(self, x, layer: Params, i: Any, site: SiteFn) -> jax.Array:
        """One Llama / Qwen2 / Qwen3 block; `site(name, x_in, p)` computes the projection
        `name` (e.g. "self_attn.q_proj") of this layer from its params `p` (weight, bias).
        Qwen3 RMS-normalises each query and key head (q_norm, k_norm) before RoPE."""
        s = self.spec
        B, T, _ = x.shape
        attn, mlp = layer["self_attn"], layer["mlp"]
        h = self._norm(x, layer["input_layernorm"])

        def heads(name: str, n: int) -> jax.Array:
            out = site(f"self_attn.{name}", h, attn[name])
            return out.reshape(B, T, n, s.head_dim)

        q, k = heads("q_proj", s.n_heads), heads("k_proj", s.n_kv_heads)
        if s.qk_norm:
            q, k = self._norm(q, attn["q_norm"]), self._norm(k, attn["k_norm"])
        q, k = self._rope(q), self._rope(k)
        v = heads("v_proj", s.n_kv_heads)
        o = self._attend(q, k, v, s.head_dim**-0.5)
        x = x + site("self_attn.o_proj", o, attn["o_proj"])
        h = self._norm(x, layer["post_attention_layernorm"])
        gate = site("mlp.gate_proj", h, mlp["gate_proj"])
        up = site("mlp.up_proj", h, mlp["up_proj"])
        hidden = _act(s.act, gate) * up
        return x + site("mlp.down_proj", hidden, mlp["down_proj"])

    def _gpt2_block(self, x, layer: Params, i: Any, site: SiteFn) -> jax.Array:
        s = self.spec
        B, T, d = x.shape
        attn, mlp = layer["attn"], layer["mlp"]
        h = self._norm(x, layer["ln_1"])
        qkv = site("attn.c_attn", h, attn["c_attn"])
        q, k, v = (
            qkv[..., j * d : (j + 1) * d].reshape(B, T, s.n_heads, s.head_dim) for j in range(3)
        )
        scale = s.head_dim**-0.5 if s.attn_scale_weights else 1.0
        if s.attn_scale_by_layer:  # i is a Python int unrolled, a traced index under scan
            scale = scale / (float(i + 1) if isinstance(i, int) else (i + 1).astype(jnp.float32))
        o = self._attend(q, k, v, scale)
        x = x + site("attn.c_proj", o, attn["c_proj"])
        h = self._norm(x, layer["ln_2"])
        hidden = _act(s.act, site("mlp.c_fc", h, mlp["c_fc"]))
        return x + site("mlp.c_proj", hidden, mlp["c_proj"])

    def _embed(self, params: Params, tokens: jax.Array) -> tuple[jax.Array, Params, Params]:
        """(the embedded tokens, the params of the root module, its layers)."""
        s = self.spec
        n_tok = tokens.shape[1]
        if s.is_gpt2:
            if n_tok > s.max_positions:
                raise ValueError(f"{n_tok} tokens exceed GPT-2's {s.max_positions} positions")
            root = params["transformer"]
            x_BxTxD = jnp.take(root["wte"]["weight"], tokens, axis=0)
            x_BxTxD = x_BxTxD + expand_left(root["wpe"]["weight"][:n_tok], x_BxTxD.ndim)
            return x_BxTxD, root, root["h"]
        root = params["model"]
        return jnp.take(root["embed_tokens"]["weight"], tokens, axis=0), root, root["layers"]

    def _start(
        self, params: Params, tokens: jax.Array, start: Residual | None
    ) -> tuple[jax.Array, Params, Params, int]:
        """(the stream the blocks start from, the root module's params, its layers, the first
        layer to run): the embedded tokens and 0, or `start`'s stream and layer (the embedding
        is then unused, and XLA drops it)."""
        x_BxTxD, root, layers = self._embed(params, tokens)
        if start is None:
            return x_BxTxD, root, layers, 0
        assert start.x is not None  # a start is given with its stream
        return start.x, root, layers, start.layer

    def computed(self, params: Params) -> Params:
        """The weights as the forwards compute with them: cast to `compute_dtype` (a no-op
        when unset, or when they already are, as in the train step)."""
        if self.compute_dtype is None:
            return params
        dt = self.compute_dtype
        return jax.tree.map(
            lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a, params
        )

    def _unembed(self, params: Params, root: Params, x_BxTxD: jax.Array) -> jax.Array:
        s = self.spec
        h = self._norm(x_BxTxD, root["ln_f" if s.is_gpt2 else "norm"])
        if s.tie_word_embeddings:
            unembed_VxD = root["wte" if s.is_gpt2 else "embed_tokens"]["weight"]
        else:
            unembed_VxD = params["lm_head"]["weight"]
        return jnp.einsum("btd,vd->btv", h, unembed_VxD, preferred_element_type=jnp.float32)

    def _block_fn(self):
        return self._gpt2_block if self.spec.is_gpt2 else self._llama_block

    def apply(
        self,
        params: Params,
        tokens: jax.Array,
        overrides: Overrides | None = None,
        residual: Residuals = None,
        start: Residual | None = None,
    ) -> jax.Array:
        """tokens (B, T) int -> logits (B, T, vocab) float32, the blocks unrolled (one copy of
        the block per layer in the program; `apply_sites` scans them). `residual` / `start`:
        the stream entering a layer (or several, `residual`), filled in / started from
        (`base.Residual`)."""
        params = self.computed(params)
        x_BxTxD, root, layers, first = self._start(params, tokens, start)
        block_fn = self._block_fn()
        wanted = residuals(residual)
        for i in range(first, self.spec.n_layers):
            for r in wanted:
                if i == r.layer:
                    r.x = x_BxTxD
            pre = f"{self.layer_prefix()}.{i}"

            def block(x, layer, i=i, pre=pre):
                def site(name, x_in, p):
                    return self._proj(f"{pre}.{name}", x_in, p, overrides)

                return block_fn(x, layer, i, site)

            x_BxTxD = self._remat(block)(x_BxTxD, layers[str(i)])
        return self._unembed(params, root, x_BxTxD)

    # The scanned forward.

    def apply_sites(
        self,
        params: Params,
        tokens: jax.Array,
        site_fn: SiteDataFn | None = None,
        site_data: Mapping[str, Any] | None = None,
        capture: Sequence[str] = (),
        residual: Residuals = None,
        start: Residual | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The forward with the sites in `site_data` computed by `site_fn(x_in, W, data)` and
        the inputs of the sites in `capture` returned: (logits, {key: x_in}). `residual` /
        `start`: the stream entering a layer (or several, `residual`), filled in / started
        from (`base.Residual`; no site below `start`'s layer may be in `site_data` or
        `capture`).

        Keys are site paths or stacked units (`science.spd.grouped`: a group of one site name
        over consecutive layers, `model.layers.0-29.mlp.down_proj`, whose data carry a leading
        layer axis; its captured inputs come back stacked the same way).

        With `scan_layers` the blocks run as `jax.lax.scan` over each run of two or more
        consecutive layers whose sites are treated alike (the same units, or per-site data of
        the same shapes): the layer params are stacked along a leading layer axis and each
        unit's data are scanned over as they are (sliced when a run covers part of a unit), so
        the program holds one block per run instead of one per layer and nothing per site,
        whatever the depth. Other layers (alone, or without sites unless `scan_siteless`)
        stay unrolled. The values are those of the unrolled forward up to float reassociation
        inside the loop body (tests/science/test_scan.py)."""
        params = self.computed(params)
        site_data = dict(site_data or {})
        capture = tuple(capture)
        if not self.scan_layers:
            if not any(members(k) for k in (*site_data, *capture)):
                return super().apply_sites(
                    params, tokens, site_fn, site_data, capture, residual, start
                )
            # stacked units without a scan: site by site, the captures stacked back
            out, got = super().apply_sites(
                params, tokens, site_fn, per_site_views(site_data), sites_of(capture), residual,
                start,
            )  # fmt: skip
            return out, {
                c: got[c] if (ms := members(c)) is None else jnp.stack([got[m] for m in ms])
                for c in capture
            }
        data_at, cap_at = self._where(site_data), self._where(capture)
        x, root, layers, first = self._start(params, tokens, start)
        block_fn = self._block_fn()
        single: dict[str, jax.Array] = {}  # captured inputs of per-site keys
        pieces: dict[str, list[jax.Array]] = {}  # captured inputs of units, run by run

        def one_layer(unit_j: tuple[str, int | None]) -> Any:
            unit, j = unit_j
            return site_data[unit] if j is None else jax.tree.map(lambda a: a[j], site_data[unit])

        wanted = residuals(residual)
        # a run starts at `start` and at every stream to keep (its layer's input is the carry)
        cuts = [i for i in (first, *(r.layer for r in wanted)) if i]
        for lo, stop in self._runs(site_data, capture, cuts):
            if stop <= first:
                continue
            for r in wanted:
                if lo == r.layer:
                    r.x = x
            ids = range(lo, stop)
            names = [n for n, _, _ in self.layer_sites()]
            fed = [n for n in names if (lo, n) in data_at]
            caught = tuple(n for n in names if (lo, n) in cap_at)
            if stop - lo < 2 or not (caught or fed or self.scan_siteless):
                # Nothing repeats here (one layer, or layers without sites): unrolled. On
                # XLA:CPU a scan slices (copies) each layer's weights out of the stack on every
                # iteration of every forward and backward, which cost a 30-layer SmolLM2 step
                # with 3 sites 1.45x its unrolled time; layers without sites compile cheaply
                # there. XLA:TPU compiles them at a cost: `scan_siteless` scans them too
                # (benchmarks/lm/scan_suffix.py measures both sides, docs/performance.md).
                for i in ids:

                    def site(name, x_in, proj, i=i):
                        where = cap_at.get((i, name))
                        if where is not None:
                            unit, j = where
                            if j is None:
                                single[unit] = x_in
                            else:
                                pieces.setdefault(unit, []).append(x_in[None])
                        if (i, name) not in data_at:
                            return _project(x_in, proj, None, None)
                        return _project(x_in, proj, site_fn, one_layer(data_at[(i, name)]))

                    def block(x, layer, i=i, site=site):
                        return block_fn(x, layer, i, site)

                    x = (block if capture else self._remat(block))(x, layers[str(i)])
                continue
            stacked = _stack([layers[str(i)] for i in ids])
            data = {}
            for n in fed:
                unit, j = data_at[(lo, n)]
                if j is None:  # per-site keys of equal shapes: stacked here
                    data[n] = _stack([site_data[data_at[(i, n)][0]] for i in ids])
                else:
                    data[n] = _take(site_data[unit], j, stop - lo)

            def body(x, xs, data_names=tuple(data), caught=caught):
                layer, d, i = xs
                got: dict[str, jax.Array] = {}

                def site(site_name, x_in, proj):
                    if site_name in caught:
                        got[site_name] = x_in
                    fn = site_fn if site_name in data_names else None
                    return _project(x_in, proj, fn, d.get(site_name))

                return block_fn(x, layer, i, site), got

            body_fn = body if caught else self._remat(body)
            x, got = jax.lax.scan(body_fn, x, (stacked, data, jnp.arange(lo, stop)))
            for n in caught:
                unit, j = cap_at[(lo, n)]
                if j is not None:
                    pieces.setdefault(unit, []).append(got[n])
                    continue
                parts = jax.lax.split(got[n], [1] * len(ids), axis=0)
                single.update({cap_at[(i, n)][0]: a[0] for i, a in zip(ids, parts, strict=True)})
        captured = {c: single[c] if members(c) is None else _concat(pieces[c]) for c in capture}
        return self._unembed(params, root, x), captured

    def _where(self, keys: Any) -> dict[tuple[int, str], tuple[str, int | None]]:
        """(layer, site name) -> (the key of `keys` that holds it, its index in a unit or None
        for a site path)."""
        out: dict[tuple[int, str], tuple[str, int | None]] = {}
        for k in keys:
            ms = members(k)
            for j, m in enumerate(ms or [k]):
                where = self.layer_site(m)
                if where is None:
                    raise ValueError(f"{m} is not a site inside the layers of this model")
                out[where] = (k, None if ms is None else j)
        return out

    def _runs(
        self, site_data: Mapping[str, Any], capture: Sequence[str], cuts: Sequence[int] = ()
    ) -> list[tuple[int, int]]:
        """[start, stop) runs of consecutive layers whose sites are treated alike: per site
        name, the same unit (data or capture), or per-site data of the same shapes; a run
        also starts at each layer of `cuts`."""
        names = [n for n, _, _ in self.layer_sites()]
        data_at, cap_at = self._where(site_data), self._where(capture)

        def key(i: int) -> tuple:
            out = []
            for n in names:
                at = data_at.get((i, n))
                d: object = at  # what the run's key holds of the site's data
                if at is not None and at[1] is None:
                    leaves, tree = jax.tree.flatten(site_data[at[0]])
                    d = (tree, tuple((a.shape, str(a.dtype)) for a in leaves))
                elif at is not None:
                    d = at[0]
                c = cap_at.get((i, n))
                out.append((d, None if c is None else (c[0] if c[1] is not None else True)))
            return tuple(out)

        runs: list[tuple[int, int]] = []
        prev = None
        for i in range(self.spec.n_layers):
            k = key(i)
            if runs and k == prev and i not in cuts:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
            prev = k
        return runs


def _project(x_in: jax.Array, proj: Params, site_fn: SiteDataFn | None, data: Any) -> jax.Array:
    """One projection of `apply_sites`: `site_fn(x_in, W, data)` (cast back to the compute
    dtype) or, without a site_fn, `x_in @ W`; then the bias, if the projection has one."""
    W = proj["weight"]
    h = x_in @ W if site_fn is None else site_fn(x_in, W, data).astype(x_in.dtype)
    return add_bias(h, proj["bias"]) if "bias" in proj else h


def _stack(trees: Sequence[Any]) -> Any:
    """Same-structured pytrees stacked leaf by leaf along a new leading axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _take(tree: Any, start: int, n: int) -> Any:
    """Members [start, start + n) of a unit's stacked data (itself when that is all of it)."""

    def take(a: jax.Array) -> jax.Array:
        if start == 0 and a.shape[0] == n:
            return a
        return jax.lax.slice_in_dim(a, start, start + n, axis=0)

    return jax.tree.map(take, tree)


def _concat(parts: Sequence[jax.Array]) -> jax.Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
