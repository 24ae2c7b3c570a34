"""Decomposition parameters: per-site components, CI-function weights, PPGD sources.

Layout (plain nested dicts keyed by the target's dotted site path):
  components = {path: {"V": (d_in, C), "U": (C, d_out)}}
  ci_fns     = {path: {"0": {"W": ..., "b": ...}, "1": {...}, ...}}   (layers in order)
               or, for the transformer CI function, {path: {"in", "blocks", "out"}}
               or, for the global shared transformer, {path: {"in": {"W"}, "out": {"W", "b"}},
               ..., SHARED_CI_KEY: {"in": {"b"}, "blocks": {...}}}   (see below)
  sources    = {path: (C + 1,) or (seq_len, C + 1)}                   (last entry: delta)

The global shared transformer (`global_shared_transformer`, goodfire-ai/spd's
`GlobalSharedTransformerCiFn`) is ONE transformer over every site's input with one CI head per
site. Its reference input projection is one Linear over the concatenation of the sites'
RMS-normalised inputs; that matrix is stored here cut into its per-site row blocks, so the
projection is the sum over sites of rms(x_site) @ W_in[site] plus the one shared bias. What
belongs to one site (its row block of the input projection, its head: its columns of the
reference's output Linear) lives under the site's key like any per-site CI function: stacking
of repeated sites over layers (`stacked.Stacking`), the sharding rules, checkpoints and export
treat it as they treat today's per-site parameters. What all sites share (the input bias and
the blocks) lives under the reserved key `SHARED_CI_KEY`, which is no site path and no group
key: `Stacking.stack` / `per_site` pass it through unchanged.

Every per-site init function is a pure function of one raw uint32 key with no Python branching
on key values, so the engine can `vmap` it over a stack of same-shaped sites and get the same
bits as `init_decomposition_reference`, the per-site loop below.
"""

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from pdctl.science.arrays import expand_left

Array = jax.Array
Components = dict[str, dict[str, Array]]
CiParams = dict[str, dict[str, Array]]
CI_KINDS = ("mlp", "vector_mlp", "shared_mlp", "transformer", "global_shared_transformer")
# The CI function that reads every site's input at once, and the ci_fns key of its shared part.
GLOBAL_CI = "global_shared_transformer"
SHARED_CI_KEY = "_shared"
# The fold of the CI-function key stream that seeds the shared part: sites take fold i for
# i < n_sites, so this one is no site's whatever the number of sites.
_SHARED_FOLD = 2**32 - 1


def init_site_components(
    key: Array, d_in: int, d_out: int, C: int, dtype: jnp.dtype = jnp.float32
) -> dict[str, Array]:
    """V ~ N(0, 1/d_in), U ~ N(0, 1/C) (variances), drawn in float32 then cast."""
    k_v, k_u = jax.random.split(key)
    V = _scaled_normal(k_v, (d_in, C), 1.0 / d_in**0.5)
    U = _scaled_normal(k_u, (C, d_out), 1.0 / C**0.5)
    return {"V": V.astype(dtype), "U": U.astype(dtype)}


def aligned_site_components(
    key: Array, W: Array, C: int, side: str, dtype: jnp.dtype = jnp.float32
) -> dict[str, Array]:
    """`nonlinearity_aligned` init of one MLP site W (d_in, d_out) whose MLP neurons index
    `side` of W: "out" (gate/up/c_fc: a neuron is a column) or "in" (down: a row). Each
    component is one neuron: V U's only non-zero rows (side "in") or columns ("out") are that
    neuron's, copied from W. As goodfire-ai/param-decomp's `nonlinearity_aligned_factors`:

    - C = neurons: component c is neuron c; V U = W exactly (each entry of V U is one product
      w * 1 plus exact zeros, so bit-equal in float32, and within one rounding of W when the
      components are stored in a narrower dtype than W).
    - C < neurons: C distinct neurons, drawn without replacement; the others are left out
      (V U != W: the faithfulness warmup must still fill them in).
    - C > neurons: every neuron is used, neuron j by q or q + 1 components (C = q neurons + r;
      the r neurons with one more are random); a neuron's vector over the other side of W is
      split among its components by a random partition of its coordinates into contiguous
      runs of a random permutation. The parts sum to W exactly again. Needs C <= d_in d_out.

    No float arithmetic but `w * 1` and `w * 0`, so the values are the same bits eagerly, under
    jit and under vmap."""
    Wn = W.astype(jnp.float32)
    rows = Wn if side == "in" else Wn.T  # (neurons, residual)
    n, resid = rows.shape
    if side not in ("in", "out"):
        raise ValueError(f"side must be 'in' or 'out', got {side!r}")
    k_units, k_coords = jax.random.split(key)
    if n >= C:
        units = jnp.arange(n) if n == C else jax.random.permutation(k_units, n)[:C]
        parts = rows[units]
    else:
        q, r = divmod(C, n)
        order = jax.random.permutation(k_units, n)
        counts = q + (jnp.arange(n) < r)  # components of the neuron order[j]
        units = jnp.repeat(order, counts, total_repeat_length=C)
        first = jnp.cumsum(counts) - counts  # its first component
        perm = jax.vmap(lambda k: jax.random.permutation(k, resid))(jax.random.split(k_coords, n))
        shard = jnp.arange(resid)[None, :] * counts[:, None] // resid  # (n, resid) in [0, count)
        owner = jnp.zeros((C, resid), jnp.float32)
        owner = owner.at[first[:, None] + shard, perm].set(1.0)
        parts = rows[units] * owner
    one_hot = jax.nn.one_hot(units, n, dtype=jnp.float32)  # (C, neurons)
    if side == "in":
        V, U = one_hot.T, parts  # (d_in = neurons, C), (C, d_out)
    else:
        V, U = parts.T, one_hot  # (d_in, C), (C, d_out = neurons)
    return {"V": V.astype(dtype), "U": U.astype(dtype)}


def _scaled_normal(key: Array, shape: tuple[int, ...], std: float) -> Array:
    """std * N(0, 1) in float32, the same bits eagerly, under jit and under vmap.

    Without the barrier XLA folds `std` into the sqrt(2) inside `jax.random.normal` when the
    two are compiled together, which changes the last bit of about half the values."""
    z = jax.lax.optimization_barrier(jax.random.normal(key, shape, jnp.float32))
    return z * std


def ci_layer_dims(kind: str, d_in: int, C: int, hidden: Sequence[int]) -> list[int]:
    """Widths from input to output of one CI MLP (per component for mlp / vector_mlp); for
    the transformer, of its input projection, residual stream and output head."""
    if kind in ("transformer", GLOBAL_CI):
        return [d_in, hidden[0], C]
    if kind == "mlp":
        return [1, *hidden, 1]
    if kind == "vector_mlp":
        return [d_in, *hidden, 1]
    if kind == "shared_mlp":
        return [d_in, *hidden, C]
    raise ValueError(f"unknown CI function type {kind!r}; expected one of {CI_KINDS}")


def init_ci_fn(key: Array, kind: str, d_in: int, C: int, hidden: Sequence[int]) -> CiParams:
    """Weights of one site's CI function, float32. For `transformer`, `hidden` is the
    architecture `(d_model, n_heads, n_blocks, ffn_hidden)` (`init_transformer_ci_fn`); for
    `global_shared_transformer` that with the input projection's fan-in appended
    (`site_ci_arch`), and the result only the site's own part (`init_global_site_ci_fn`; the
    shared part: `init_shared_ci_fn`).

    Hidden layers: N(0, 2/fan_in) (Kaiming, ReLU gain, as the references do even though the
    nonlinearity is GELU); the output layer: N(0, 1/fan_in); biases zero. `mlp` and
    `vector_mlp` stack C independent MLPs along a leading axis: W (C, fan_in, fan_out),
    b (C, fan_out). `shared_mlp` is one MLP: W (fan_in, fan_out), b (fan_out,).
    """
    if kind == "transformer":
        return init_transformer_ci_fn(key, d_in, C, *hidden)
    if kind == GLOBAL_CI:
        if len(hidden) != 5:
            raise ValueError(
                f"{GLOBAL_CI}: a site's init takes (d_model, n_heads, n_blocks, ffn_hidden, "
                f"fan_in) (`site_ci_arch`), got {tuple(hidden)}"
            )
        return init_global_site_ci_fn(key, d_in, C, hidden[0], hidden[4])
    dims = ci_layer_dims(kind, d_in, C, hidden)
    n_layers = len(dims) - 1
    stacked = (C,) if kind in ("mlp", "vector_mlp") else ()
    keys = jax.random.split(key, n_layers)
    params: CiParams = {}
    for i in range(n_layers):
        fan_in, fan_out = dims[i], dims[i + 1]
        gain = 2.0 if i < n_layers - 1 else 1.0
        std = (gain / fan_in) ** 0.5
        W = _scaled_normal(keys[i], (*stacked, fan_in, fan_out), std)
        params[str(i)] = {"W": W, "b": jnp.zeros((*stacked, fan_out), jnp.float32)}
    return params


def init_transformer_ci_fn(
    key: Array, d_in: int, C: int, d_model: int, n_heads: int, n_blocks: int, ffn_hidden: int
) -> CiParams:
    """The transformer CI function of one site (one chunk of one site: the layerwise chunking
    of goodfire-ai/param-decomp `core/SPEC.md` §4.6), float32, initialised as §4.6 says:
    input projection and FFN-in N(0, 2/fan_in) (Kaiming, ReLU gain), FFN-out and output head
    N(0, 1/fan_in), the bias-free attention projections U(-1/sqrt(d_model), 1/sqrt(d_model))
    (torch's Linear default), biases zero.

    Layout (the blocks stacked along a leading axis of n_blocks, run as a scan):
      {"in": {"W": (d_in, d), "b": (d,)},
       "blocks": {"wq", "wk", "wv": (n, d, n_heads, head_dim), "wo": (n, n_heads, head_dim, d),
                  "w1": (n, d, ffn), "b1": (n, ffn), "w2": (n, ffn, d), "b2": (n, d)},
       "out": {"W": (d, C), "b": (C,)}}
    The head count is an axis of wq, so the parameters alone say how to apply them. All
    normal weights come from ONE draw and all uniform ones from another, split afterwards:
    each RNG body costs a long compile on CPU, so their number must not grow with the blocks."""
    d, n, f = d_model, n_blocks, ffn_hidden
    k_normal, k_uniform = jax.random.split(key)
    normal_parts = [((d_in, d), 2.0 / d_in), ((n, d, f), 2.0 / d), ((n, f, d), 1.0 / f),
                    ((d, C), 1.0 / d)]  # fmt: skip
    sizes = [math.prod(shape) for shape, _ in normal_parts]
    z = jax.lax.optimization_barrier(jax.random.normal(k_normal, (sum(sizes),), jnp.float32))
    w_in, w1, w2, w_out = (
        part.reshape(shape) * var**0.5
        for part, (shape, var) in zip(
            jnp.split(z, list(itertools.accumulate(sizes[:-1]))), normal_parts, strict=True
        )
    )
    zeros = partial(jnp.zeros, dtype=jnp.float32)
    return {
        "in": {"W": w_in, "b": zeros((d,))},
        "blocks": _transformer_blocks(k_uniform, w1, w2, n_heads),
        "out": {"W": w_out, "b": zeros((C,))},
    }


def _transformer_blocks(k_uniform: Array, w1: Array, w2: Array, n_heads: int) -> CiParams:
    """The blocks of a transformer CI function from their FFN weights w1 (n, d, ffn) and w2
    (n, ffn, d): the bias-free attention projections U(+-1/sqrt(d)) from ONE draw of
    `k_uniform`, zero biases."""
    n, d, f = w1.shape
    hd = d // n_heads
    u = jax.random.uniform(k_uniform, (4, n, d, d), jnp.float32, -1.0, 1.0)
    u = jax.lax.optimization_barrier(u) * (1.0 / d**0.5)
    heads = u.reshape(4, n, d, n_heads, hd)
    zeros = partial(jnp.zeros, dtype=jnp.float32)
    return {
        "wq": heads[0],
        "wk": heads[1],
        "wv": heads[2],
        "wo": u[3].reshape(n, n_heads, hd, d),
        "w1": w1,
        "b1": zeros((n, f)),
        "w2": w2,
        "b2": zeros((n, d)),
    }


def site_ci_arch(kind: str, arch: Sequence[int], d_ins: Sequence[int]) -> tuple[int, ...]:
    """The `hidden` argument `init_ci_fn` takes for every site: the config's `arch` as it is,
    or for the global shared transformer with the sum of every site's d_in appended (the
    fan-in of its one input projection, of which each site holds a row block)."""
    if kind == GLOBAL_CI:
        return (*arch, int(sum(d_ins)))
    return tuple(arch)


def init_global_site_ci_fn(key: Array, d_in: int, C: int, d_model: int, fan_in: int) -> CiParams:
    """One site's part of the global shared transformer, float32: its row block of the input
    projection, N(0, 2/fan_in) with fan_in the summed d_in of all sites (Kaiming, ReLU gain, as
    the reference initialises its one Linear over the concatenated inputs), and its CI head,
    N(0, 1/d_model) with a zero bias (the reference's output Linear, cut by site):
      {"in": {"W": (d_in, d_model)}, "out": {"W": (d_model, C), "b": (C,)}}
    One normal draw, split afterwards."""
    d = d_model
    z = jax.lax.optimization_barrier(jax.random.normal(key, (d_in * d + d * C,), jnp.float32))
    w_in = z[: d_in * d].reshape(d_in, d) * (2.0 / fan_in) ** 0.5
    w_out = z[d_in * d :].reshape(d, C) * (1.0 / d) ** 0.5
    return {"in": {"W": w_in}, "out": {"W": w_out, "b": jnp.zeros((C,), jnp.float32)}}


def init_shared_ci_fn(key: Array, kind: str, arch: Sequence[int]) -> dict[str, Any] | None:
    """The part of the CI function all sites share (`ci_fns[SHARED_CI_KEY]`), float32; None
    for the per-site kinds. For the global shared transformer, `arch` = (d_model, n_heads,
    n_blocks, ffn_hidden): the input projection's bias (zero) and the blocks, initialised as
    the per-site transformer's (`init_transformer_ci_fn`: FFN-in N(0, 2/d), FFN-out N(0, 1/ffn),
    the bias-free attention U(+-1/sqrt(d)), biases zero), laid out as its "blocks":
      {"in": {"b": (d,)}, "blocks": {"wq", "wk", "wv": (n, d, heads, head_dim),
                                     "wo": (n, heads, head_dim, d), "w1": (n, d, ffn),
                                     "b1": (n, ffn), "w2": (n, ffn, d), "b2": (n, d)}}"""
    if kind != GLOBAL_CI:
        return None
    d, n_heads, n, f = (int(a) for a in arch[:4])
    k_normal, k_uniform = jax.random.split(key)
    z = jax.lax.optimization_barrier(jax.random.normal(k_normal, (2 * n * d * f,), jnp.float32))
    w1 = z[: n * d * f].reshape(n, d, f) * (2.0 / d) ** 0.5
    w2 = z[n * d * f :].reshape(n, f, d) * (1.0 / f) ** 0.5
    return {
        "in": {"b": jnp.zeros((d,), jnp.float32)},
        "blocks": _transformer_blocks(k_uniform, w1, w2, n_heads),
    }


def shared_ci_key(key: Array) -> Array:
    """The raw key of the shared CI part: the CI-function stream of `site_keys` folded with
    an index no site takes."""
    stream = jax.random.split(_raw_key(key), 3)[1]
    return jax.random.fold_in(stream, _SHARED_FOLD)


def init_source(key: Array, shape: tuple[int, ...], sigmoid: bool = False) -> Array:
    """PPGD source, float32: U[0, 1) per entry, or N(0, 1) with the sigmoid parametrisation
    (the masks then see sigmoid(s)), as the reference's `PersistentPGDState`."""
    if sigmoid:
        return jax.random.normal(key, shape, jnp.float32)
    return jax.random.uniform(key, shape, jnp.float32)


def _raw_key(key: Array) -> Array:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def site_keys(key: Array, n_sites: int) -> tuple[Array, Array, Array]:
    """THE key-derivation rule for decomposition init.

    `key` is split into three streams (components, CI functions, sources); site i (its index
    in the target's forward order, restricted to decomposed sites) gets `fold_in(stream, i)`.
    Returns three raw uint32 key stacks of shape (n_sites, 2) (for the default threefry impl).
    Adding a site at the end therefore leaves the other sites' values unchanged.
    """
    streams = jax.random.split(_raw_key(key), 3)
    idx = jnp.arange(n_sites, dtype=jnp.uint32)

    def derive(stream: Array) -> Array:
        if n_sites == 0:
            return jnp.zeros((0, *stream.shape), stream.dtype)
        return jax.vmap(lambda i: jax.random.fold_in(stream, i))(idx)

    return derive(streams[0]), derive(streams[1]), derive(streams[2])


def init_decomposition_reference(
    key: Array,
    sites: Mapping[str, tuple[int, int, int]],
    ci_kind: str,
    hidden: Sequence[int],
    source_shape: Callable[[int], tuple[int, ...]],
    dtype: jnp.dtype = jnp.float32,
    sigmoid_sources: bool = False,
) -> tuple[Components, dict[str, CiParams], dict[str, Array]]:
    """The straightforward per-site init: `sites` is {path: (d_in, d_out, C)} in forward order,
    `source_shape(C)` the shape of that site's source (e.g. `lambda C: (C + 1,)`), `hidden`
    the config's CI architecture (`CiFnConfig.arch()`). A CI function with a shared part
    (`init_shared_ci_fn`) has it under `SHARED_CI_KEY`, drawn from `shared_ci_key(key)`.

    The engine's grouped/vmapped init must reproduce these values bit for bit."""
    comp_keys, ci_keys, src_keys = site_keys(key, len(sites))
    components: Components = {}
    ci_fns: dict[str, CiParams] = {}
    sources: dict[str, Array] = {}
    arch = tuple(hidden)
    hidden = site_ci_arch(ci_kind, arch, [s[0] for s in sites.values()])
    for i, (path, (d_in, d_out, C)) in enumerate(sites.items()):
        components[path], ci_fns[path], sources[path] = _init_site_jit(
            comp_keys[i],
            ci_keys[i],
            src_keys[i],
            (
                d_in,
                d_out,
                C,
                ci_kind,
                tuple(hidden),
                tuple(source_shape(C)),
                dtype,
                sigmoid_sources,
            ),
        )
    shared = _init_shared_jit(shared_ci_key(key), ci_kind, arch)
    if shared is not None:
        ci_fns[SHARED_CI_KEY] = shared
    return components, ci_fns, sources


_init_shared_jit = jax.jit(init_shared_ci_fn, static_argnums=(1, 2))


@partial(jax.jit, static_argnums=(3,))
def _init_site_jit(
    comp_key: Array, ci_key: Array, src_key: Array, spec: tuple
) -> tuple[dict[str, Array], CiParams, Array]:
    # One site's three per-site functions under one jit, only to save compiles and op-by-op
    # dispatch: the values are the same bits eagerly, under jit and under vmap (see
    # `_scaled_normal`).
    d_in, d_out, C, ci_kind, hidden, src_shape, dtype, sigmoid = spec
    return (
        init_site_components(comp_key, d_in, d_out, C, dtype),
        init_ci_fn(ci_key, ci_kind, d_in, C, hidden),
        init_source(src_key, src_shape, sigmoid),
    )


def masked_site_fn(
    W: Array,
    V: Array,
    U: Array,
    mask_C: Array,
    delta_mask: Array | None,
    route: Array | None = None,
    inner: Array | None = None,
    tail: Array | None = None,
) -> Callable[[Array], Array]:
    """The override for one site: `x -> ((x @ V) * m) @ U [+ m_delta * (x @ (W - V @ U))]`.

    With a routing mask (bool, the leading axes of x), only routed examples/positions take the
    components; the others keep the target's own `x @ W`. Computed in the components' dtype;
    the target casts the result back to its own.

    The delta term is computed without forming `W - V @ U`: since m_delta is one number per
    example/position, `(xV * m) U + m_delta (x (W - VU)) = (xV * (m - m_delta)) U + m_delta xW`.
    That costs one `x @ W` (token work the unmasked target pays too) instead of a d_in x d_out
    matrix per site and per masked forward, and its backward (two more C x d_in x d_out
    products) - weight-space work that grew the step with every decomposed site. Only the
    faithfulness term forms `V @ U`, once per step. Equal to the direct formula up to float
    reassociation (tests/science/test_spd_math.py); at m = m_delta = 1 it gives `x @ W` exactly.

    `inner`: `x @ V` already computed for this very input (the clean site input, which the
    CI function also multiplies by V): the forward reuses it, so the backward sums the
    cotangents of every use before one `x.T @ g` for V instead of one such product per use.
    `tail` (d_out, n): the function returns the site's output times `tail`, through `U @ tail`
    and `W @ tail` (a target whose output is `... + site_out @ tail`: `ResidMLP.apply_sites`):
    when n < d_out the (.., d_out) output and its backward are never formed."""

    def fn(x_in: Array) -> Array:
        x = x_in.astype(V.dtype)
        h = x @ V if inner is None else inner
        U_, W_ = U, W.astype(V.dtype)
        if tail is not None:
            U_, W_ = U @ tail.astype(V.dtype), W_ @ tail.astype(V.dtype)
        m = expand_left(mask_C, h.ndim).astype(V.dtype)
        own = x @ W_ if delta_mask is not None or route is not None else None
        if delta_mask is None:
            out = (h * m) @ U_
        else:
            dm = expand_left(jnp.asarray(delta_mask)[..., None], h.ndim).astype(V.dtype)
            assert own is not None  # formed whenever delta_mask is set
            out = (h * (m - dm)) @ U_ + dm * own
        if route is not None:
            assert own is not None  # formed whenever route is set
            out = jnp.where(expand_left(route[..., None], out.ndim), out, own)
        return out

    return fn


# ---------------------------------------------------------------------------------------------
# tied components
#
# When a target uses one matrix twice (TMS: linear2 = linear1.T), the reference ties the two
# sites' components: V_linear2 = U_linear1.T, U_linear2 = V_linear1.T. Only the source site's
# V/U are parameters; `expand_tied` derives the tied site's, and `fold_tied` (its transpose, a
# linear map) brings per-site updates back onto the one parameter set.


def component_ties(tied_sites: Mapping[str, str], site_C: Mapping[str, object]) -> dict[str, str]:
    """{tied site: source site} for the target's tied matrices when both are decomposed
    (`site_C`: keyed by the decomposed sites; only its keys are read)."""
    return {t: s for t, s in tied_sites.items() if t in site_C and s in site_C}


def expand_tied(free: Mapping[str, Any], ties: Mapping[str, str], paths: Sequence[str]) -> Any:
    """All sites' components in `paths` order, the tied ones as transposes of their source."""
    out = {}
    for p in paths:
        if p in ties:
            src = free[ties[p]]
            out[p] = {"V": src["U"].T, "U": src["V"].T}
        else:
            out[p] = free[p]
    return out


def fold_tied(per_site: Mapping[str, Any], ties: Mapping[str, str]) -> dict[str, Any]:
    """The transpose of `expand_tied`: per-site values (gradients, updates) of the tied sites
    are transposed back and added to their source's."""
    out = {p: dict(v) for p, v in per_site.items() if p not in ties}
    for t, s in ties.items():
        out[s]["V"] = out[s]["V"] + per_site[t]["U"].T
        out[s]["U"] = out[s]["U"] + per_site[t]["V"].T
    return out
