"""The `Target` interface: a model to decompose, as pure functions over a nested-dict pytree.

Every target exposes its decomposable matrices ("sites") as `(d_in, d_out)` arrays with the
convention `y = x @ W (+ b)`, and its forward pass accepts per-site overrides that replace the
matmul `x_in @ W`. The decomposition code only ever talks to targets through this interface.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp

from pdctl.science.arrays import expand_left
from pdctl.science.spd.grouped import sites_of

Params = dict[str, Any]
Override = Callable[[jax.Array], jax.Array]
Overrides = Mapping[str, Override]
# A block's projection: (name within the layer, x_in, that projection's params) -> output.
SiteFn = Callable[[str, jax.Array, Any], jax.Array]
# A site computed from data: (x_in, W, that site's data) -> x_in @ W's replacement. A target
# may also pass `tail=T` for a site whose output only reaches the model's output as `out @ T`
# (`ResidMLP.apply_sites`); the function then returns its replacement times T.
SiteDataFn = Callable[..., jax.Array]


@dataclass
class Residual:
    """The residual stream entering block `layer` of a target with blocks: a forward asked for
    it (`apply_sites(..., residual=Residual(L))`) fills in `x`; a forward given one
    (`apply_sites(..., start=Residual(L, x))`) skips the embedding and the blocks below L and
    starts there. Every masked forward of an SPD step equals the clean one below the first
    block with a decomposed site, so the step runs that prefix once (`losses.clean_forward`)."""

    layer: int
    x: jax.Array | None = None


# What `residual` may be: one stream to fill in, or several (the clean forward of a step
# with chunkwise recon keeps the stream entering each chunk's first block).
Residuals = Residual | Sequence[Residual] | None


def residuals(residual: Residuals) -> tuple[Residual, ...]:
    """`residual` as a tuple of the streams to fill in (none, one or several)."""
    if residual is None:
        return ()
    if isinstance(residual, Residual):
        return (residual,)
    return tuple(residual)


class Target:
    """Base class. Subclasses set `kind` / `output_kind` and implement the abstract methods.

    Instances hold only static hyperparameters, so bound methods are safe to close over in
    `jax.jit`; all arrays come in through arguments.
    """

    if TYPE_CHECKING:  # every concrete target is a dataclass (`dataclasses.replace` varies one)
        __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    kind: str = ""
    output_kind: str = ""  # "mse" for the toys, "logits" for the LM
    param_dtype: jnp.dtype = jnp.dtype(jnp.float32)

    def init(self, key: jax.Array) -> Params:
        raise NotImplementedError

    def site_shapes(self) -> dict[str, tuple[int, int]]:
        """path -> (d_in, d_out) of every decomposable matrix, in forward order."""
        raise NotImplementedError

    def site_paths(self) -> list[str]:
        return list(self.site_shapes())

    def layer_of(self, path: str) -> int | None:
        """The block (layer) a site path sits in; None for a target without blocks (whose
        forwards cannot start at a layer, `Residual`)."""
        return None

    def tied_sites(self) -> dict[str, str]:
        """{site: other site} where `site`'s matrix IS the transpose of the other's (one
        parameter, used twice). A decomposition of both ties their components the same way."""
        return {}

    def mlp_neuron_sides(self) -> dict[str, str]:
        """{site: "out" | "in"} for the sites that are MLP projections: "out" where W's columns
        are the MLP's neurons (up, gate), "in" where its rows are (down). What the
        `nonlinearity_aligned` init aligns components with; {} for a target without MLPs."""
        return {}

    def site_weights(self, params: Params) -> dict[str, jax.Array]:
        """path -> W (d_in, d_out), in forward order.

        The order is the dict's insertion order; a dict returned through `jax.jit` comes back
        with sorted keys, so callers that need forward order should use `site_paths()`.
        """
        raise NotImplementedError

    def apply(self, params: Params, x: jax.Array, overrides: Overrides | None = None) -> jax.Array:
        raise NotImplementedError

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
        """The forward with each site in `site_data` computed as `site_fn(x_in, W, data)`
        instead of `x_in @ W`, and the inputs of the sites in `capture`: (output, {path: x_in}).
        `residual`: filled in with the stream entering its layer (or each of several, at
        layers at or above `start`'s); `start`: begin at its layer from its stream
        (`Residual`; targets with blocks only, their `apply` takes both).

        The form of overrides a target can scan over layers (the data stack along a layer
        axis; closures cannot): targets with blocks override it. This default builds the
        equivalent closures for `apply`."""
        site_data = site_data or {}
        blocks = {k: v for k, v in (("residual", residual), ("start", start)) if v is not None}
        weights = self.site_weights(params) if site_data or capture else {}
        captured: dict[str, jax.Array] = {}

        def override(path: str) -> Override:
            def fn(x_in: jax.Array) -> jax.Array:
                if path in capture:
                    captured[path] = x_in
                if path in site_data:
                    assert site_fn is not None  # overriding a site takes its function
                    return site_fn(x_in, weights[path], site_data[path])
                return x_in @ weights[path]

            return fn

        paths = [p for p in self.site_paths() if p in site_data or p in capture]
        out = self.apply(params, x, {p: override(p) for p in paths} if paths else None, **blocks)
        return out, {p: captured[p] for p in capture}

    def tp_divisors(self) -> dict[str, int] | None:
        """The sizes a tensor-parallel mesh axis must divide, by the config key that sets each
        (heads, kv heads, MLP width); None: the target has no tensor-parallel layout."""
        return None

    def make_batch(self, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
        raise TypeError(f"target {self.kind!r} has no on-device data generator")

    def inputs(self, batch: Mapping[str, jax.Array]) -> jax.Array:
        return batch["x"]

    def loss(
        self, params: Params, batch: Mapping[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        raise NotImplementedError

    def trainable_mask(self, params: Params) -> Any:
        """Bool pytree like `params`; False leaves must not move. Freeze them with
        `optax.multi_transform({True: tx, False: optax.set_to_zero()}, mask)`: `optax.masked`
        passes the raw gradient of a False leaf through as its update."""
        return jax.tree.map(lambda _: True, params)

    def n_tokens_per_example(self) -> int:
        return 1

    # Helpers shared by the concrete targets.

    def _site(self, path: str, x_in: jax.Array, w: jax.Array, overrides: Overrides | None):
        """`x_in @ w`, or the override for `path`; the result is cast back to the compute dtype
        so that an override computing in float32 cannot silently promote a bf16 model."""
        if overrides is not None and path in overrides:
            return overrides[path](x_in).astype(x_in.dtype)
        return x_in @ w


def apply_sites(target: Any, params: Params, x: jax.Array, *args: Any, **kwargs: Any):
    """`target.apply_sites(...)`, or `Target`'s closure-based default for an object that only
    has `apply`, `site_paths` and `site_weights` (a test's stand-in target)."""
    method = getattr(target, "apply_sites", None)
    if method is None:
        return Target.apply_sites(target, params, x, *args, **kwargs)
    return method(params, x, *args, **kwargs)


def first_layer(target: Any, paths: Sequence[str]) -> int | None:
    """The lowest block holding one of `paths` (site paths or stacked units); None when the
    target has no blocks (`Target.layer_of`) or no path is inside one."""
    layer_of = getattr(target, "layer_of", None)
    if layer_of is None:
        return None
    layers = [layer_of(p) for p in sites_of(list(paths))]
    if not layers or any(i is None for i in layers):
        return None
    return min(layers)


def node_at(tree: Mapping[str, Any], path: str) -> Any:
    """The node of nested dicts at a dotted path: `node_at(p, "a.b")` is `p["a"]["b"]`."""
    node: Any = tree
    for part in path.split("."):
        node = node[part]
    return node


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': {'c': x}}} -> {'a.b.c': x}, in the nested dicts' order."""
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{path}."))
        else:
            out[path] = v
    return out


def unflatten(flat: Mapping[str, Any]) -> Params:
    """{'a.b.c': x} -> {'a': {'b': {'c': x}}}, keeping insertion order."""
    out: Params = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def add_bias(h: jax.Array, b: jax.Array) -> jax.Array:
    return h + expand_left(b, h.ndim)


def _flat(shape: tuple[int, ...]) -> tuple[int]:
    # Init draws are 1-D then reshaped: on XLA:CPU a rank-3 threefry draw compiled ~4x slower
    # than a flat one of the same size (1.2 s vs 0.25 s), and inits are compiled once per run.
    return (math.prod(shape),)


def normal_init(key: jax.Array, shape: tuple[int, ...], std: float, dtype) -> jax.Array:
    return (std * jax.random.normal(key, _flat(shape), jnp.float32)).reshape(shape).astype(dtype)


def uniform_fan_in(key: jax.Array, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): the default init of a torch `nn.Linear` (weight and
    bias), which the reference toy models use; keeping it keeps our toys' training comparable."""
    bound = 1.0 / (fan_in**0.5)
    w = jax.random.uniform(key, _flat(shape), jnp.float32, -bound, bound)
    return w.reshape(shape).astype(dtype)


def sparse_features(
    key: jax.Array, batch_size: int, n_features: int, p: float, low: float, high: float
) -> jax.Array:
    """Each feature independently active with probability p, value U[low, high), else 0."""
    # One flat draw serves both the activity mask and the values: half the RNG code to compile.
    u = jax.random.uniform(key, (2 * batch_size * n_features,)).reshape(2, batch_size, n_features)
    val_BxF = low + (high - low) * u[1]
    return jnp.where(u[0] < p, val_BxF, jnp.zeros_like(val_BxF))


def mse(out: jax.Array, y: jax.Array) -> jax.Array:
    diff = out.astype(jnp.float32) - y.astype(jnp.float32)
    return jnp.mean(diff * diff)
