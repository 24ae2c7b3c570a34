"""Evaluation of a decomposition: CI error against the toy ground truth, MMCS / ML2R, L0 and
alive counts, and the LM's CE / KL under different masks.

CI and masked forwards run under `jax.jit`; matching and reductions to Python floats happen on
the host (numpy / scipy).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdctl.config import Config
from pdctl.science.spd.ci import compute_ci
from pdctl.science.spd.grouped import map_sites, members, per_site_views, sites_of
from pdctl.science.spd.losses import (
    Recon,
    clean_forward,
    kl_distance,
    l0_per_site,
    masked_forward,
    pgd_sources,
    ppgd_recon_loss,
    prefix_layer,
)
from pdctl.science.spd.masks import source_masks, stochastic_masks, window_draw
from pdctl.science.targets.base import Residual

Array = jax.Array
TOY_INPUT_MAGNITUDE = 0.75


def unit_order(target: Any, components: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys of `components` (site paths, or stacked units: a scanned train state's groups)
    in the target's order of their (first) sites."""
    rank = {p: i for i, p in enumerate(target.site_paths())}
    return tuple(sorted(components, key=lambda k: rank[(members(k) or [k])[0]]))


def _order(target: Any, paths: tuple[str, ...]) -> tuple[str, ...]:
    """The sites of `paths` in the target's order: which draw each site gets."""
    sites = set(sites_of(paths))
    return tuple(p for p in target.site_paths() if p in sites)


# Binomial sampling makes the lower-leaky CI random (see `compute_ci`); evaluations draw that
# noise from this fixed key, so an evaluation is a function of the parameters alone.
EVAL_KEY = 20250701


@lru_cache(maxsize=32)
def ci_program(target: Any, paths: tuple[str, ...], kind: str, sigmoid: str, sampling: str):
    """The jitted CI evaluation of the units `paths` (as `unit_order` gives them), cached:
    `compute_ci_jit` runs it, the fit check (`pdctl.inspect.fit`) lowers it."""

    def run(target_params, components, ci_fns, x):
        # (no masked forward follows: nothing to keep for one)
        site_inputs = clean_forward(target, target_params, x, paths, prefix=False).site_inputs
        key = jax.random.PRNGKey(EVAL_KEY)
        grouped = bool(getattr(target, "scan_layers", False))
        return compute_ci(
            components, ci_fns, site_inputs, kind, sigmoid, "none", sampling, key, grouped,
            _order(target, paths),
        )  # fmt: skip

    return jax.jit(run)


def compute_ci_jit(
    target: Any, target_params: Any, components: Any, ci_fns: Any, cfg: Config, x: Array
) -> tuple[dict[str, Array], dict[str, Array]]:
    """(ci_lower, ci_upper) for the sites in `components` (all sites, tied ones expanded; or
    stacked units, whose CI comes back stacked), under a cached jit."""
    d = cfg.decomp
    fn = ci_program(target, unit_order(target, components), d.ci_fn.type, d.sigmoid, d.sampling)
    return fn(target_params, components, ci_fns, x)


def toy_ci_matrices(
    target: Any, target_params: Any, components: Any, ci_fns: Any, cfg: Config
) -> dict[str, np.ndarray]:
    """{site: (n_features, C)}: lower-leaky CI of each one-hot input of magnitude 0.75
    (goodfire-ai/spd's `get_single_feature_causal_importances`)."""
    n = target.n_features
    x = TOY_INPUT_MAGNITUDE * jnp.eye(n, dtype=jnp.float32)
    ci_lower, _ = compute_ci_jit(target, target_params, components, ci_fns, cfg, x)
    return {p: np.asarray(v) for p, v in ci_lower.items()}


def toy_ci_matrix(
    target: Any, target_params: Any, components: Any, ci_fns: Any, cfg: Config, site: str
) -> np.ndarray:
    """(n_features, C) CI matrix of one site (see `toy_ci_matrices`)."""
    return toy_ci_matrices(target, target_params, {site: components[site]}, ci_fns, cfg)[site]


def identity_assignment(ci_matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of the Hungarian assignment of features to components maximising the
    matched CI (the permutation the CI-error count and the permuted CI plots use)."""
    # imported here: scipy.optimize takes ~0.4 s to import, which a stage would pay before its
    # first step (the train stage imports this module for its evaluation)
    from scipy.optimize import linear_sum_assignment

    return linear_sum_assignment(-np.asarray(ci_matrix, dtype=np.float64))


def ci_errors(ci_matrix: np.ndarray, tol: float = 0.1) -> int:
    """CI errors against the identity pattern (one component per feature, up to permutation).

    Features (rows) are matched to components (columns) by the Hungarian assignment maximising
    the matched CI; errors = unmatched entries > tol plus matched entries < 1 - tol
    (goodfire-ai/spd's `IdentityCIPattern.distance_from`). That reference assigns only the first
    min(n, C) rows (and switches to a greedy match from 500 components on); with n <= C (every
    toy config) and C < 500 the two agree."""
    ci = np.asarray(ci_matrix, dtype=np.float64)
    rows, cols = identity_assignment(ci)
    matched = np.zeros(ci.shape, dtype=bool)
    matched[rows, cols] = True
    off = int(np.sum(ci[~matched] > tol))
    on = int(np.sum(ci[matched] < 1 - tol))
    return off + on


def dense_ci_errors(ci_matrix: np.ndarray, k: int, tol: float = 0.1) -> int:
    """CI errors against a dense block of k always-co-firing components (ResidMLP `mlp_out`):
    columns sorted by total CI; each of the first k lacking an entry >= 1 - tol counts 1, every
    entry > tol in the other columns counts 1 (goodfire-ai/spd's `DenseCIPattern`, min_entries=1).
    """
    ci = np.asarray(ci_matrix, dtype=np.float64)
    order = np.argsort(-ci.sum(axis=0), kind="stable")
    ci = ci[:, order]
    missing = np.maximum(1 - (ci[:, :k] >= 1 - tol).sum(axis=0), 0).sum()
    extra = (ci[:, k:] > tol).sum()
    return int(missing + extra)


def mmcs_and_ml2r(
    W: Array | np.ndarray, V: Array | np.ndarray, U: Array | np.ndarray, per: str = "in"
) -> tuple[float, float]:
    """Mean-max cosine similarity and mean L2 ratio between the target and rank-one components.

    per="in": for each row i of W (an input dimension; for TMS `linear1` a feature), compare
    W[i, :] with every component's row V[i, c] * U[c, :]; take the best cosine (signed), and
    the norm ratio ||V[i, c*] U[c*, :]|| / ||W[i, :]|| of that best component; average over i.
    per="out" does the same for the columns of W (for TMS `linear2`, W = W1.T, a feature is a
    column). This is goodfire-ai/spd's `TMSAnalyzer.compute_cosine_similarities` (per feature).
    """
    W, V, U = (np.asarray(a, dtype=np.float64) for a in (W, V, U))
    if per == "out":
        W, V, U = W.T, U.T, V.T
    elif per != "in":
        raise ValueError(f"per must be 'in' or 'out', got {per!r}")
    eps = 1e-12
    comp_CxIxO = V.T[:, :, None] * U[:, None, :]
    comp_norm = np.linalg.norm(comp_CxIxO, axis=-1)
    w_norm = np.linalg.norm(W, axis=-1)
    cos_CxI = np.einsum("cio,io->ci", comp_CxIxO, W) / ((comp_norm + eps) * (w_norm + eps))
    best_I = np.argmax(cos_CxI, axis=0)
    idx = np.arange(W.shape[0])
    mmcs = float(np.mean(cos_CxI[best_I, idx]))
    ml2r = float(np.mean(comp_norm[best_I, idx] / (w_norm + eps)))
    return mmcs, ml2r


# A component is alive in the reference's sense when its mean CI over the evaluation batch (and
# positions) exceeds this (goodfire-ai/param-decomp's LM evaluations).
ALIVE_MEAN_THRESHOLD = 1e-6


def alive_by_mean(ci_lower: Mapping[str, Array], threshold: float) -> dict[str, Array]:
    """Per site: (C,) bool, the component's mean ci over every example and position of the
    batch exceeds threshold (stacked units split into their sites)."""

    def site(_, ci: Array) -> Array:
        return jnp.mean(ci.astype(jnp.float32), axis=tuple(range(ci.ndim - 1))) > threshold

    return per_site_views(map_sites(site, list(ci_lower), ci_lower, grouped=False))


def alive(ci_lower: Mapping[str, Array], threshold: float) -> dict[str, Array]:
    """Per site: (C,) bool, the component's ci exceeds threshold on at least one example or
    position of the batch (stacked units split into their sites)."""

    def site(_, ci: Array) -> Array:
        return jnp.any(ci > threshold, axis=tuple(range(ci.ndim - 1)))

    return per_site_views(map_sites(site, list(ci_lower), ci_lower, grouped=False))


def ci_stats(
    target: Any, target_params: Any, components: Any, ci_fns: Any, cfg: Config, x: Array
) -> dict[str, float]:
    """`l0/<site>`, `alive/<site>` (components with ci > decomp.ci_threshold somewhere in the
    batch) and `alive_mean/<site>` (components whose mean ci over the batch exceeds
    `ALIVE_MEAN_THRESHOLD`, the reference's alive count) on one eval batch."""
    ci_lower, _ = compute_ci_jit(target, target_params, components, ci_fns, cfg, x)
    thr = cfg.decomp.ci_threshold
    out: dict[str, float] = {}
    for p, v in l0_per_site(ci_lower, thr).items():
        out[f"l0/{p}"] = float(v)
    for p, v in alive(ci_lower, thr).items():
        out[f"alive/{p}"] = float(np.sum(np.asarray(v)))
    for p, v in alive_by_mean(ci_lower, ALIVE_MEAN_THRESHOLD).items():
        out[f"alive_mean/{p}"] = float(np.sum(np.asarray(v)))
    return out


def toy_patterns(target: Any, paths: Sequence[str]) -> dict[str, tuple[str, int]]:
    """The ground-truth CI pattern of each toy site on one-hot inputs, in ONE place:
    ("identity", n): one component per feature (n features); ("dense", k): a block of k
    components that always fire together.

    - TMS `linear1` / `linear2`: identity over n_features. TMS `hidden_layers.*` (fixed
      identities of size n_hidden): dense with k = n_hidden, as the reference's 5-2-id config
      (every feature passes through all n_hidden directions of the hidden space).
    - ResidMLP `layers.*.mlp_in`: identity over n_features; `layers.*.mlp_out`: dense with
      k = d_mlp (the reference's ResidMLP configs).
    """
    out: dict[str, tuple[str, int]] = {}
    for p in paths:
        if target.kind == "tms":
            if p.startswith("hidden_layers."):
                out[p] = ("dense", target.n_hidden)
            else:
                out[p] = ("identity", target.n_features)
        elif target.kind == "resid_mlp":
            if p.endswith("mlp_out"):
                out[p] = ("dense", target.d_mlp)
            else:
                out[p] = ("identity", target.n_features)
    return out


def pattern_errors(ci_matrix: np.ndarray, pattern: tuple[str, int], tol: float = 0.1) -> float:
    """CI errors of one site against its pattern; NaN when the matrix is not finite (a
    diverged decomposition has no meaningful count, and the caller must see that)."""
    if not np.all(np.isfinite(ci_matrix)):
        return float("nan")
    kind, n = pattern
    if kind == "identity":
        return float(ci_errors(ci_matrix, tol))
    return float(dense_ci_errors(ci_matrix, n, tol))


def recovered_features(
    mats: Mapping[str, np.ndarray], patterns: Mapping[str, tuple[str, int]], tol: float = 0.1
) -> int:
    """Features that EVERY identity-pattern site gives exactly one component with CI >= 1 - tol
    and no other component above tol (on the one-hot inputs). Dense-pattern sites (hidden
    layers, ResidMLP mlp_out) have no one-feature-one-component answer and are not counted."""
    ok = None
    for p, m in mats.items():
        if patterns.get(p, ("", 0))[0] != "identity":
            continue
        m = np.nan_to_num(np.asarray(m, np.float64), nan=0.5)
        above = (m > tol).sum(axis=1)
        good = (above == 1) & (m.max(axis=1) >= 1 - tol)
        ok = good if ok is None else ok & good
    return int(ok.sum()) if ok is not None else 0


def toy_eval(
    target: Any, target_params: Any, components: Any, ci_fns: Any, cfg: Config, tol: float = 0.1
) -> dict[str, float]:
    """`ci_error/<site>` and `ci_error/total` against each site's ground-truth pattern
    (`toy_patterns`), `recovered` (see `recovered_features`), and for TMS `mmcs/<site>` and
    `ml2r/<site>`, per feature: rows of `linear1`, columns of `linear2` (hidden layers: per
    row). `components` holds every site (tied ones expanded)."""
    mats = toy_ci_matrices(target, target_params, components, ci_fns, cfg)
    patterns = toy_patterns(target, list(mats))
    weights = target.site_weights(target_params)
    out: dict[str, float] = {}
    total = 0.0
    for p, m in mats.items():
        errors = pattern_errors(m, patterns[p], tol)
        out[f"ci_error/{p}"] = errors
        total += errors
        if target.kind == "tms":
            per = "out" if p == "linear2" else "in"
            mmcs, ml2r = mmcs_and_ml2r(weights[p], components[p]["V"], components[p]["U"], per)
            out[f"mmcs/{p}"], out[f"ml2r/{p}"] = mmcs, ml2r
    out["ci_error/total"] = total
    out["recovered"] = float(recovered_features(mats, patterns, tol))
    return out


LM_MASKINGS = ("ci_masked", "stoch_masked", "random_masked", "rounded_masked", "unmasked")
# The fresh-PGD evaluation's masking (`[train.eval_pgd]`): its KL is the robustness figure.
PGD_MASKING = "pgd"


@dataclass(frozen=True)
class FreshPgd:
    """The fresh-PGD evaluation's settings (`[train.eval_pgd]`), hashable for the jit cache."""

    n_steps: int = 20
    step_size: float = 0.1
    init: str = "random"
    scope: str = "shared"


def fresh_pgd_sources(
    recon: Recon,
    ci_lower: Mapping[str, Array],
    key: Array,
    pgd: FreshPgd,
    window: tuple[Array | int, int] | None = None,
) -> dict[str, Array]:
    """Fresh sources (`losses.pgd_sources`: C + 1 entries per site with the delta component;
    `scope` shared: one set for the whole batch and every position), then `pgd.n_steps` steps
    s <- clip(s + step_size * sign(dD/ds), 0, 1) ascending D = `recon` (KL(target || masked)
    for an LM) with the CI and the components held fixed (goodfire-ai/param-decomp's fresh
    sign-PGD probe, `recon_eval.fresh_pgd_recon_sources`; SPEC.md section 10). `window`: the
    batch is rows of a larger one (per-example sources drawn as its rows)."""
    recon = recon.detached()
    ci_lower = jax.lax.stop_gradient(dict(ci_lower))
    srcs = pgd_sources(key, ci_lower, recon.delta, pgd.init, pgd.scope, recon.order, window)
    grad = jax.grad(lambda s_: ppgd_recon_loss(recon, ci_lower, s_))
    return _sign_ascent(srcs, grad, pgd)


def _sign_ascent(srcs: dict[str, Array], grad: Any, pgd: FreshPgd) -> dict[str, Array]:
    """`pgd.n_steps` steps s <- clip(s + step_size * sign(grad(s)), 0, 1)."""

    def ascend(s: dict[str, Array], _: Any) -> tuple[dict[str, Array], None]:
        g = grad(s)
        return {p: jnp.clip(s[p] + pgd.step_size * jnp.sign(g[p]), 0.0, 1.0) for p in s}, None

    if pgd.n_steps:
        srcs, _ = jax.lax.scan(ascend, srcs, None, length=pgd.n_steps)
    return srcs


def _ce(logits: Array, labels: Array) -> Array:
    return jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    )


@lru_cache(maxsize=8)
def lm_eval_program(
    target: Any,
    paths: tuple[str, ...],
    kind: str,
    sigmoid: str,
    sampling: str,
    delta: bool,
    rounding: float,
    pgd: FreshPgd | None = None,
    accum: int = 1,
):
    """The jitted masked-forwards evaluation of an LM (`lm_eval` runs it, the fit check lowers
    it), cached per target and options. `accum` > 1 (`[train] eval_accum_steps`): the batch
    in that many equal micro-batches, one after another (`_accumulated`)."""
    grouped = bool(getattr(target, "scan_layers", False))
    order = _order(target, paths)

    def prepare(target_params, components, ci_fns, x, key, window=None):
        """(clean logits, the stream the masked forwards start from or None, the Recon's
        residual, ci_lower, the maskings' keys) of batch x."""
        clean, site_inputs, residual = clean_forward(target, target_params, x, paths)[:3]
        k_ci, k_mask, k_rand = jax.random.split(key, 3)
        # every masked forward starts where the first site is (`losses.Clean.residual`)
        start = None if residual is None else Residual(prefix_layer(target, order), residual)
        ci_lower, _ = compute_ci(
            components, ci_fns, site_inputs, kind, sigmoid, "none", sampling, k_ci, grouped,
            order, window=window,
        )  # fmt: skip
        return clean, start, residual, ci_lower, (k_mask, k_rand)

    def recon_of(target_params, components, x, clean, residual) -> Recon:
        return Recon(
            target, target_params, {}, components, x, clean, delta, "kl", grouped, order,
            None, residual,
        )  # fmt: skip

    def figures(target_params, components, x, labels, clean, start, ci_lower, keys, pgd_srcs,
                window=None):  # fmt: skip
        """{ce/target, ce/<masking>, kl/<masking>} of batch x (`pgd_srcs()`: the fresh-PGD
        sources; None without them)."""
        k_mask, k_rand = keys
        stoch, stoch_delta = stochastic_masks(
            k_mask, ci_lower, sampling, delta, grouped, order, window
        )
        mask_sets = {
            "ci_masked": (ci_lower, None),
            "stoch_masked": (stoch, stoch_delta),
            "random_masked": (
                map_sites(
                    lambda i, c: window_draw(
                        partial(jax.random.uniform, dtype=c.dtype),
                        jax.random.fold_in(k_rand, i),
                        c.shape,
                        window,
                    ),
                    list(ci_lower),
                    ci_lower,
                    grouped=grouped,
                    order=order,
                ),
                None,
            ),
            "rounded_masked": (
                {p: (c > rounding).astype(c.dtype) for p, c in ci_lower.items()},
                None,
            ),
            "unmasked": ({p: jnp.ones_like(c) for p, c in ci_lower.items()}, None),
            "zero_masked": ({p: jnp.zeros_like(c) for p, c in ci_lower.items()}, None),
        }
        if pgd_srcs is not None:
            mask_sets[PGD_MASKING] = source_masks(ci_lower, pgd_srcs(), delta)
        out = {"ce/target": _ce(clean, labels)}
        for name, (masks, dmasks) in mask_sets.items():
            logits = masked_forward(
                target, target_params, components, x, masks, dmasks, start=start
            )
            out[f"ce/{name}"] = _ce(logits, labels)
            out[f"kl/{name}"] = kl_distance(logits, clean)
        return out

    def run(target_params, components, ci_fns, x, labels, key):
        clean, start, residual, ci_lower, keys = prepare(target_params, components, ci_fns, x, key)

        def srcs():
            # its own fold of the key: the draws of the maskings above stay as they were
            recon = recon_of(target_params, components, x, clean, residual)
            return fresh_pgd_sources(recon, ci_lower, jax.random.fold_in(key, 3), pgd)

        return figures(target_params, components, x, labels, clean, start, ci_lower, keys,
                       None if pgd is None else srcs)  # fmt: skip

    def accumulated(target_params, components, ci_fns, x, labels, key):
        """`run`'s figures from `accum` micro-batches of b = B / accum examples: micro-batch j
        draws rows j b .. (j + 1) b of every draw the whole batch makes (`masks.window_draw`),
        each mean is the mean of the micro-batches' means, and the fresh-PGD ascent with
        shared sources steps on the sign of the mean of the micro-batches' gradients (their
        clean forward and CI computed again at each step; per-example sources ascend on their
        own micro-batch, whose loss alone depends on them). So the same figures as `run` to
        float32 reassociation, with one micro-batch's activations live at a time."""
        k_pgd = jax.random.fold_in(key, 3)
        B = x.shape[0]
        b = B // accum
        xs = x.reshape(accum, b, *x.shape[1:])
        ls = labels.reshape(accum, b, *labels.shape[1:])

        def micro(j):
            x_j = jax.lax.dynamic_index_in_dim(xs, j, keepdims=False)
            window = (j * b, B)
            return x_j, window, prepare(target_params, components, ci_fns, x_j, key, window)

        shared = None
        if pgd is not None and pgd.scope == "shared":
            # the sources' shapes do not depend on the batch: draw them as `run` does
            ci_shapes = jax.eval_shape(lambda: micro(0)[2][3])  # ci_lower
            ci_like = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), ci_shapes)
            srcs0 = pgd_sources(k_pgd, ci_like, delta, pgd.init, pgd.scope, order)

            def grad(s):
                def one(total, j):
                    x_j, _, (clean, _, residual, ci_lower, _) = micro(j)
                    recon = recon_of(target_params, components, x_j, clean, residual).detached()
                    ci_lower = jax.lax.stop_gradient(dict(ci_lower))
                    g = jax.grad(lambda s_: ppgd_recon_loss(recon, ci_lower, s_))(s)
                    return jax.tree.map(jnp.add, total, g), None

                zero = jax.tree.map(jnp.zeros_like, s)
                total, _ = jax.lax.scan(one, zero, jnp.arange(accum))
                return jax.tree.map(lambda t: t / accum, total)

            shared = _sign_ascent(srcs0, grad, pgd)

        def one(j):
            x_j, window, (clean, start, residual, ci_lower, keys) = micro(j)

            def srcs():
                if shared is not None:
                    return shared
                recon = recon_of(target_params, components, x_j, clean, residual)
                return fresh_pgd_sources(recon, ci_lower, k_pgd, pgd, window)

            l_j = jax.lax.dynamic_index_in_dim(ls, j, keepdims=False)
            return figures(target_params, components, x_j, l_j, clean, start, ci_lower, keys,
                           None if pgd is None else srcs, window)  # fmt: skip

        def body(total, j):
            return jax.tree.map(jnp.add, total, one(j)), None

        zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(one, 0))
        total, _ = jax.lax.scan(body, zero, jnp.arange(accum))
        return jax.tree.map(lambda t: t / accum, total)

    return jax.jit(run if accum == 1 else accumulated)


def fresh_pgd_config(cfg: Config) -> FreshPgd | None:
    """`[train.eval_pgd]` as the evaluation takes it; None when it is off."""
    e = cfg.train.eval_pgd
    return FreshPgd(e.n_steps, e.step_size, e.init, e.scope) if e.enabled else None


def lm_eval(
    target: Any,
    target_params: Any,
    components: Any,
    ci_fns: Any,
    cfg: Config,
    batch: Mapping[str, Array],
    key: Array,
) -> dict[str, float]:
    """CE (vs the next tokens) and KL (vs the target) of the models masked by: CI, a stochastic
    mask (with the delta component when it is on), uniform random masks, CI rounded at
    `train.eval_rounding_threshold`, all ones (unmasked) and all zeros, on one token batch, as
    the reference's `CEandKLLosses`; and, with `[train.eval_pgd]` on, by the sources of a fresh
    sign-PGD ascent (`fresh_pgd_sources`; `ce/pgd`, `kl/pgd`: the robustness figure). Also
    `ce_difference/<kind>` = ce - ce/target and `ce_unrecovered/<kind>` = (ce - ce/target) /
    (ce/zero_masked - ce/target). With `[train] eval_accum_steps` > 1 the batch goes through
    in that many micro-batches (`lm_eval_program`): the same figures to float32 reassociation."""
    x = target.inputs(batch)
    labels = batch["tokens"][:, 1:]
    d = cfg.decomp
    fn = lm_eval_program(
        target,
        unit_order(target, components),
        d.ci_fn.type,
        d.sigmoid,
        d.sampling,
        d.delta_component,
        cfg.train.eval_rounding_threshold,
        fresh_pgd_config(cfg),
        cfg.train.eval_accum_steps,
    )
    raw = {k: float(v) for k, v in fn(target_params, components, ci_fns, x, labels, key).items()}
    out = dict(raw)
    ce_t, ce_zero = raw["ce/target"], raw["ce/zero_masked"]
    for name in (*LM_MASKINGS, PGD_MASKING):
        if f"ce/{name}" not in raw:
            continue
        diff = raw[f"ce/{name}"] - ce_t
        out[f"ce_difference/{name}"] = diff
        denom = ce_zero - ce_t
        out[f"ce_unrecovered/{name}"] = diff / denom if denom != 0 else float("nan")
    return out
