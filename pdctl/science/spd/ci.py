"""Causal importance: the CI functions and the two squashings of their logits.

`ci_lower` (lower-leaky) feeds every mask; `ci_upper` (upper-leaky) feeds importance
minimality only. Both are squashings of the same logits `z`.

Every CI function type but one is per site (`ci_fn_apply`: one site's logits from that site's
input). `global_shared_transformer` is one transformer over all sites' inputs with a head per
site (`global_ci_logits`; its parameters' layout is in `components`' module docstring);
`compute_ci` runs either kind behind the same interface.
"""

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from pdctl.science import arrays
from pdctl.science.spd.components import GLOBAL_CI, SHARED_CI_KEY, expand_left
from pdctl.science.spd.grouped import map_sites, members
from pdctl.science.spd.masks import window_draw

Array = jax.Array
ALPHA = 0.01


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _lower_leaky(z: Array, alpha: float) -> Array:
    return jnp.clip(z, 0.0, 1.0)


def _lower_leaky_fwd(z: Array, alpha: float) -> tuple[Array, Array]:
    return jnp.clip(z, 0.0, 1.0), z


def _lower_leaky_bwd(alpha: float, z: Array, g: Array) -> tuple[Array]:
    # Nested `where` with `<=` boundaries, so z == 0 takes the leaky branch (as the references
    # do). Below 0 only a negative cotangent leaks: gradient descent then raises z, which lets a
    # dead component come back; a positive one would only push z further down.
    zero = jnp.zeros_like(g)
    leak = jnp.where(g < 0, alpha * g, zero)
    return (jnp.where(z <= 0, leak, jnp.where(z <= 1, g, zero)),)


_lower_leaky.defvjp(_lower_leaky_fwd, _lower_leaky_bwd)


def lower_leaky(z: Array, alpha: float = ALPHA) -> Array:
    """Forward `clip(z, 0, 1)`; backward passes g on 0 < z <= 1, alpha*g on z <= 0 only where
    g < 0, and 0 on z > 1."""
    return _lower_leaky(z, alpha)


def upper_leaky(z: Array, alpha: float = ALPHA) -> Array:
    """`z > 1 ? 1 + alpha * (z - 1) : clip(z, 0, 1)`, ordinary autodiff."""
    return jnp.where(z > 1, 1 + alpha * (z - 1), jnp.clip(z, 0.0, 1.0))


def hard(z: Array) -> Array:
    """Plain `clip(z, 0, 1)` (both squashings when `decomp.sigmoid = "hard"`)."""
    return jnp.clip(z, 0.0, 1.0)


def squash(z: Array, sigmoid: str) -> tuple[Array, Array]:
    """(ci_lower, ci_upper) from logits.

    - `leaky_hard`: lower-leaky for the masks, upper-leaky for importance minimality (the SPEC's
      pair, goodfire-ai/param-decomp `core/SPEC.md` §4.2 / S6). Its lower squashing already is
      the forward clamp with the sign-gated leak only in the backward.
    - `lower_leaky_hard`: that same forward clamp (`lower_leaky`) for BOTH, as goodfire-ai/spd's
      `sigmoid_type = "lower_leaky_hard"` (`spd/models/sigmoids.py`): no value above 1 or below
      0 anywhere, so importance minimality sees the clamped CI and gets no gradient from z > 1
      (nor, since its gradient is >= 0, from z <= 0).
    - `hard`: plain clip for both, ordinary autodiff."""
    if sigmoid == "leaky_hard":
        return lower_leaky(z), upper_leaky(z)
    if sigmoid == "lower_leaky_hard":
        lo = lower_leaky(z)
        return lo, lo
    if sigmoid == "hard":
        return hard(z), hard(z)
    raise ValueError(f"unknown sigmoid {sigmoid!r}")


_INV_SQRT2 = 0.7071067811865476


def _gelu(a: Array) -> Array:
    """Exact GELU in torch's nn.GELU() form, 0.5 a (1 + erf(a / sqrt 2)), as the reference CI
    functions compute it. (`jax.nn.gelu(approximate=False)` goes through erfc, whose XLA:CPU
    kernel (an exp and several selects) made the CI functions ~10% slower; the two agree to
    1e-6.)"""
    return 0.5 * a * (1.0 + jax.lax.erf(a * _INV_SQRT2))


def ci_fn_apply(
    kind: str, params: Mapping[str, Mapping[str, Array]], x_in: Array, h: Array
) -> Array:
    """CI logits z (..., C) for one site.

    `x_in` (..., d_in) is the site input, `h` (..., C) = x_in @ V the component activations
    (only `mlp` uses h, the others only x_in). Not for `global_shared_transformer`, whose
    sites' logits all depend on every site's input: `compute_ci` / `global_ci_logits`."""
    if kind == "transformer":
        return transformer_ci(params, x_in)
    if kind == GLOBAL_CI:
        raise ValueError(
            f"{GLOBAL_CI} reads every site's input at once: use compute_ci (or "
            "global_ci_logits), not one site's CI function"
        )
    n_layers = len(params)
    if kind == "shared_mlp":
        a = x_in.astype(jnp.float32)
        for i in range(n_layers):
            layer = params[str(i)]
            a = a @ layer["W"] + expand_left(layer["b"], a.ndim)
            if i < n_layers - 1:
                a = _gelu(a)
        return a
    if kind == "mlp":
        a = h.astype(jnp.float32)[..., None]  # (..., C, 1)
        first = 0
    elif kind == "vector_mlp":
        layer = params["0"]
        a = jnp.einsum("...i,cio->...co", x_in.astype(jnp.float32), layer["W"])
        a = a + expand_left(layer["b"], a.ndim)
        if n_layers > 1:
            a = _gelu(a)
        first = 1
    else:
        raise ValueError(f"unknown CI function type {kind!r}")
    for i in range(first, n_layers):
        layer = params[str(i)]
        a = _per_component(a, layer["W"]) + expand_left(layer["b"], a.ndim)
        if i < n_layers - 1:
            a = _gelu(a)
    return a[..., 0]


# The transformer CI function (goodfire-ai/param-decomp `core/SPEC.md` §4.6, one chunk per
# site): weightless RMSNorm with eps = float32 machine epsilon, RoPE base 10000 (rotate-half,
# the inverse frequencies a constant, never a parameter: S27), exact-erf GELU.
RMS_EPS = float(jnp.finfo(jnp.float32).eps)
ROPE_BASE = 10000.0


def _rms(a: Array) -> Array:
    return a * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + RMS_EPS)


def _rope(x: Array) -> Array:
    """Rotate-half RoPE of x (..., T, heads, head_dim) at positions 0..T-1."""
    T, hd = x.shape[-3], x.shape[-1]
    inv_freq = 1.0 / (ROPE_BASE ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    angle = jnp.arange(T, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]  # (T, 1, hd/2)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def transformer_ci(params: Mapping[str, Any], x_in: Array) -> Array:
    """CI logits (..., T, C) of one site from its inputs x_in (..., T, d_in):

        a = rms(x) @ W_in + b_in                                   (no nonlinearity)
        per block: a += attn(rms(a));  a += W2 gelu(rms(a) W1 + b1) + b2
        z = a @ W_out + b_out

    attn is bidirectional (every position sees every position of its sequence) multi-head
    attention with RoPE on q and k and no biases; pre-norm blocks, all norms weightless. The
    blocks run as a scan over their stacked parameters."""
    a = _rms(x_in.astype(jnp.float32)) @ params["in"]["W"] + params["in"]["b"]
    a = _transformer_blocks(a, params["blocks"])
    return a @ params["out"]["W"] + params["out"]["b"]


def _block(a: Array, blk: Mapping[str, Array]) -> tuple[Array, None]:
    """One pre-norm block (the scan's body): a += attn(rms(a)); a += mlp(rms(a))."""
    h = _rms(a)
    q, k, v = (jnp.einsum("...td,dnh->...tnh", h, blk[w]) for w in ("wq", "wk", "wv"))
    q, k = _rope(q), _rope(k)
    scores = jnp.einsum("...tnh,...snh->...nts", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    o = jnp.einsum("...nts,...snh->...tnh", jax.nn.softmax(scores, axis=-1), v)
    a = a + jnp.einsum("...tnh,nhd->...td", o, blk["wo"])
    h = _rms(a)
    return a + _gelu(h @ blk["w1"] + blk["b1"]) @ blk["w2"] + blk["b2"], None


def _transformer_blocks(a: Array, blocks: Mapping[str, Array]) -> Array:
    """The residual stream a (..., T, d) through the blocks stacked along their leading axis,
    as a scan (none when there are no blocks)."""
    if blocks["wq"].shape[0]:
        a, _ = jax.lax.scan(_block, a, blocks)
    return a


# ---------------------------------------------------------------------------------------------
# The global shared transformer (goodfire-ai/spd `GlobalSharedTransformerCiFn`): one trunk for
# every site. Parameter layout: `components` module docstring.


def global_ci_logits(
    ci_fns: Mapping[str, Any], site_inputs: Mapping[str, Array]
) -> dict[str, Array]:
    """CI logits {unit: z} of every unit of `site_inputs` (site paths, or stacked units whose
    inputs come as (L, ..., T, d_in) and whose logits go back as (L, ..., T, C)):

        a = sum over sites of rms(x_site) @ W_in[site]  +  b_in
        per block (shared): a += attn(rms(a));  a += W2 gelu(rms(a) W1 + b1) + b2
        z_site = a @ W_out[site] + b_out[site]

    which is the reference's forward: its input Linear over the concatenation of the
    independently RMS-normalised inputs IS the sum of the per-site row blocks' products (up to
    float reassociation), and its output Linear split by site the per-site heads. The sites
    of a stacked unit are summed inside one contraction over (layer, d_in)."""
    shared = ci_fns[SHARED_CI_KEY]
    a = None
    for u, x in site_inputs.items():
        W = ci_fns[u]["in"]["W"]
        h = _rms(x.astype(jnp.float32))
        # a stacked unit: (L, ..., d_in) with W (L, d_in, d), its members summed in the product
        p = jnp.einsum("l...i,lid->...d", h, W) if members(u) is not None else h @ W
        a = p if a is None else a + p
    if a is None:
        raise ValueError(f"{GLOBAL_CI} needs at least one site's input")
    a = a + expand_left(shared["in"]["b"], a.ndim)
    a = _transformer_blocks(a, shared["blocks"])
    out = {}
    for u in site_inputs:
        head = ci_fns[u]["out"]
        if members(u) is not None:  # W (L, d, C), b (L, C) -> (L, ..., C)
            z = jnp.einsum("...d,ldc->l...c", a, head["W"])
            out[u] = z + head["b"].reshape(head["b"].shape[0], *(1,) * (a.ndim - 1), -1)
        else:
            out[u] = a @ head["W"] + expand_left(head["b"], a.ndim)
    return out


def _per_component(a: Array, W: Array) -> Array:
    """`einsum("...ci,cio->...co", a, W)`: each component's own layer. A width-1 side is
    written as a broadcast product (in = 1) or a product summed over the last axis (out = 1),
    not a batched dot: XLA:CPU then fuses the (..., C, hidden) work into a few loops instead
    of materialising broadcasts of W for a dot with a contraction of 1 (docs/performance.md,
    measured by the since removed benchmarks/ci_mlp.py: the TMS CI function's forward +
    backward about 2x faster with `runtime.cpu_xla_flags`)."""
    if W.shape[-2] == 1:
        return a[..., :1] * W[:, 0, :]
    if W.shape[-1] == 1:
        return jnp.sum(a * W[:, :, 0], axis=-1, keepdims=True)
    return jnp.einsum("...ci,cio->...co", a, W)


def compute_ci(
    components: Mapping[str, Mapping[str, Array]],
    ci_fns: Mapping[str, Mapping[str, Mapping[str, Array]]],
    site_inputs: Mapping[str, Array],
    kind: str,
    sigmoid: str,
    remat: str = "none",
    sampling: str = "continuous",
    key: Array | None = None,
    grouped: bool = False,
    order: Sequence[str] | None = None,
    inner: Mapping[str, Array] | None = None,
    window: tuple[Array | int, int] | None = None,
) -> tuple[dict[str, Array], dict[str, Array]]:
    """(ci_lower, ci_upper) per site in `site_inputs`, each (..., C) float32.

    For `mlp` the CI input h = x @ V is not detached from V (as in goodfire-ai/spd, whose
    `calc_causal_importances` defaults to `detach_inputs=False`). With binomial sampling the
    lower-leaky squashing sees `1.05 z - 0.05 u`, u ~ U[0, 1) per element (site i draws from
    `fold_in(key, i)`), as the reference's `_apply_sigmoid_to_ci_outputs`; the upper-leaky one
    always sees z. Keys may be stacked units (a group's arrays with a leading member axis: its
    CI function runs vmapped over the members) and `order` the per-site order that fixes the
    draws; with `grouped`, same-shaped plain sites run as one vmap too (`grouped.map_sites`).
    `inner` {site: x @ V}, computed by the caller (which shares it with other uses), replaces
    the site's own product. `window` (start, full): the inputs are rows of a batch of `full`
    examples, and binomial sampling's noise is those rows of that batch's draw
    (`masks.window_draw`).

    `global_shared_transformer`: the logits of every site come from one function of all the
    sites' inputs (`global_ci_logits`), so `site_inputs` must hold every site of `ci_fns`;
    the squashing and its noise are then per site as above (same draws)."""
    # remat: recompute the CI MLP's (..., C, hidden) activations in the backward
    apply = arrays.remat(ci_fn_apply, remat, static_argnums=(0,))
    if sampling == "binomial" and key is None:
        raise ValueError("binomial sampling needs a key for the lower-leaky input noise")
    if sampling not in ("continuous", "binomial"):
        raise ValueError(f"unknown sampling {sampling!r}")

    def squashed(i, z: Array) -> tuple[Array, Array]:
        if sampling == "continuous":
            return squash(z, sigmoid)
        draw = partial(jax.random.uniform, dtype=z.dtype)
        assert key is not None  # binomial: checked above
        u = window_draw(draw, jax.random.fold_in(key, i), z.shape, window)
        return squash(1.05 * z - 0.05 * u, sigmoid)[0], squash(z, sigmoid)[1]

    def one(i, x_in: Array, V: Array, params: Any, h: Array | None) -> tuple[Array, Array]:
        if h is None:
            h = x_in.astype(V.dtype) @ V
        return squashed(i, apply(kind, params, x_in, h))

    paths = list(site_inputs)
    if kind == GLOBAL_CI:
        missing = sorted(set(ci_fns) - {SHARED_CI_KEY} - set(paths))
        if missing:
            # every site's CI depends on every site's input: a subset would be another function
            raise ValueError(f"{GLOBAL_CI} needs every site's input; missing {missing}")
        z = arrays.remat(global_ci_logits, remat)(ci_fns, site_inputs)
        out = map_sites(squashed, paths, z, grouped=grouped, order=order)
        return {p: out[p][0] for p in paths}, {p: out[p][1] for p in paths}
    V_of = {p: components[p]["V"] for p in paths}
    h_of = {p: (inner or {}).get(p) for p in paths}
    out = map_sites(one, paths, site_inputs, V_of, ci_fns, h_of, grouped=grouped, order=order)
    return {p: out[p][0] for p in paths}, {p: out[p][1] for p in paths}
