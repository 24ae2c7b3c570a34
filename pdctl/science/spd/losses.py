"""The SPD loss terms (each its own small pure function) and the functions the train stage calls.

Conventions (the SPD paper, Bushnaq et al. 2025, as goodfire-ai/spd implements it; noted inline):
- Output distance D: `mse` = mean of squared differences over every element; `kl` =
  KL(target || masked) summed over the vocabulary, averaged over all leading axes (batch and
  positions). Recon terms average D over their forwards (samples, sites), which equals the
  reference's sum/count accumulators because every forward has the same shape.
- Importance minimality: per site and component `S_c = sum over all leading axes of
  (ci_upper + eps)^p`, `m_c = S_c / n`, with n = the number of examples times positions (every
  leading axis), as the reference's `_importance_minimality_loss_update`. Loss = sum_s sum_c
  [m_c + beta * m_c * log2(1 + S_c)]. The sums run over the whole (global) batch: under jit with
  a sharded batch GSPMD reduces them before the log.
- The LM recipe (goodfire-ai/param-decomp, `param_decomp/core/SPEC.md`; each function cites
  its section): a per-CI penalty psi that is either L_p or smooth-L0 (`sparsity_penalty`,
  S9), the frequency term on the per-component mean penalty f_c (`frequency_loss`, S8-S8''),
  and the merged stochastic/PPGD term (`merged_recon_loss`, S34) with optionally pooled
  persistent sources (`sources.pick_particles`).
- Masks: see `masks.py`. CI-masked and unmasked recon run without the delta component (as the
  reference's `CIMaskedReconLoss` / `UnmaskedReconLoss`).
- Layerwise recon draws one set of masks per sample and runs one forward per site with only that
  site masked (`StochasticReconLayerwiseLoss`); subset recon draws masks and a routing per sample
  and masks every routed site at once (`StochasticReconSubsetLoss`); chunkwise recon
  (param-decomp's `ChunkwiseSubsetReconLoss`, `chunkwise_recon_loss`) cuts the sites into
  consecutive chunks and runs the subset forward per chunk, only its sites masked and routed,
  from the clean stream at the chunk's first block; the mean over chunks and samples.
- PPGD (persistent sources, `PersistentPGDReconLoss`): the term uses the sources as they are at
  this step; the train step takes their gradient from this same term, after the main loss, and
  moves them by ONE ascent step (see `pdctl.stages.train`).
- PGD (`PGDReconLoss`): sources re-initialised on every step (random / ones / zeroes, per example
  or shared), `n_steps` sign-ascent steps of `step_size` with everything else held fixed and
  the routing drawn once, then the term with the final sources (held constant).
- Components are always the expanded per-site set (tied sites included, see
  `components.expand_tied`); the train step folds their gradients back onto the parameters.
- Sites or units: every dict of per-site values may instead hold *stacked units*, a group key
  (`model.layers.0-29.mlp.down_proj`) whose arrays carry a leading axis over its member sites,
  as a scanned target's train state holds them (`science.spd.stacked`). The terms vmap their
  per-site work over that axis and the scanned forward scans over it, so a step's program has
  one copy of each per-site computation per group, whatever the depth. `order` (the step's
  sites, per site) fixes which draw each site gets, so both layouts draw the same bits.
"""

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp

from pdctl.config import Config, LossConfig, assigned_per_micro_batch, is_sequence_model
from pdctl.science.arrays import exact_matmul, is_traced
from pdctl.science.spd import sources as src_mod
from pdctl.science.spd.ci import compute_ci
from pdctl.science.spd.components import (
    component_ties,
    expand_tied,
    fold_tied,
    masked_site_fn,
)
from pdctl.science.spd.grouped import (
    group_key,
    map_sites,
    members,
    per_site_views,
    sites_of,
)
from pdctl.science.spd.masks import (
    Window,
    fixed_assignment,
    lead_shape,
    mixed_masks,
    route_assigned,
    routing_masks,
    source_masks,
    stochastic_masks,
    window_draw,
)
from pdctl.science.spd.stacked import is_stacked
from pdctl.science.targets.base import Residual, apply_sites, first_layer

Array = jax.Array
Dict = Mapping[str, Array]
Components = Mapping[str, Mapping[str, Array]]

# ---------------------------------------------------------------------------------------------
# target forwards


class Clean(NamedTuple):
    """One stop-gradient forward of the frozen target: its output and every site's input.
    Shared by the CI functions, the PPGD ascent and every loss term of a step.

    `residual`: for a target with blocks whose first site sits in block L > 0 (`prefix_layer`),
    the stream entering block L. Every masked forward of the step is the clean one below L, so
    they all start there from it (`Recon`, `masked_forward(start=...)`) instead of running the
    embedding and the L blocks below again; None otherwise (the forwards run whole)."""

    out: Array
    site_inputs: dict[str, Array]
    residual: Array | None = None
    # {block: the clean stream entering it} for each chunk's first block above block 0
    # (chunkwise recon, `clean_forward(starts=...)`): a chunk's forwards start there; None
    # when the step keeps none
    starts: dict[int, Array] | None = None


def prefix_layer(target: Any, paths: Sequence[str]) -> int | None:
    """The block L where the masked forwards of a step on the sites (or units) `paths` start:
    the lowest block holding one of them, when it is above the first; None when the target has
    no blocks or the first site is in block 0 (nothing to skip)."""
    layer = first_layer(target, paths)
    return layer if layer else None


def clean_forward(
    target: Any,
    params: Any,
    x: Array,
    paths: tuple[str, ...] | list[str],
    prefix: bool = True,
    starts: Sequence[int] = (),
) -> Clean:
    """The frozen target's output and the inputs of the sites in `paths`, stop-gradient
    (`Target.apply_sites` captures them); with `prefix` (and a block to start at,
    `prefix_layer`) also the stream the masked forwards start from (`Clean.residual`), and
    the stream entering each block of `starts` (`Clean.starts`, chunkwise recon's chunks;
    none of them below the prefix)."""
    if getattr(target, "remat", "none") != "none":
        # This forward is stop-gradient: it has nothing to rematerialise (and capturing site
        # inputs from inside a rematerialised block would leak its tracers).
        target = dataclasses.replace(target, remat="none")
    layer = prefix_layer(target, paths) if prefix else None
    kept_at = {i: Residual(i) for i in sorted({*starts, *([] if layer is None else [layer])})}
    # (targets without blocks take no `residual`: passed only when there is one to keep)
    wanted = tuple(kept_at.values())
    kw = {"residual": wanted[0] if len(wanted) == 1 else wanted} if wanted else {}
    out, captured = apply_sites(target, params, x, capture=tuple(paths), **kw)
    site_inputs = {p: jax.lax.stop_gradient(captured[p]) for p in paths}
    # every stream of `kept_at` was filled in by the forward
    kept = {i: jax.lax.stop_gradient(cast(Array, r.x)) for i, r in kept_at.items()}
    return Clean(
        jax.lax.stop_gradient(out),
        site_inputs,
        None if layer is None else kept[layer],
        {i: kept[i] for i in starts} if starts else None,
    )


# A masked site's data (`masked_site_fn`'s arguments after W): V, U, mask, delta mask, route,
# inner; () for a site passed through
SiteData = tuple[Array, Array, Array, Array | None, Array | None, Array | None] | tuple[()]


def masked_site(x_in: Array, W: Array, data: SiteData, tail: Array | None = None) -> Array:
    if not data:  # a site passed through (`masked_forward`'s `plain`): the target's own product
        return x_in @ W if tail is None else (x_in @ W) @ tail
    return masked_site_fn(W, *data, tail=tail)(x_in)


def masked_forward(
    target: Any,
    params: Any,
    components: Components,
    x: Array,
    masks: Dict,
    delta_masks: Dict | None,
    routes: Dict | None = None,
    inner: Dict | None = None,
    start: Residual | None = None,
    plain: Sequence[str] = (),
) -> Array:
    """Target forward with the sites in `masks` replaced by their masked components
    (`components.masked_site_fn`, with each site's W as the target reads it from `params`);
    `inner` {path: x @ V} for sites whose input in this forward is known (`Recon.inner`);
    `start`: begin at that block from that stream (the clean prefix, `Clean.residual`; no site
    of `masks` may sit below it). `plain`: sites or units (none of `masks`) that compute
    `x_in @ W` as the target does, but as sites with (empty) data: a scanned target then scans
    their layers like any with sites, where it would unroll layers without any
    (`HFCausalLM.apply_sites`)."""
    inner = inner or {}
    data: dict[str, SiteData] = {
        path: (
            components[path]["V"],
            components[path]["U"],
            mask,
            None if delta_masks is None else delta_masks[path],
            None if routes is None else routes[path],
            inner.get(path),
        )
        for path, mask in masks.items()
    }
    data.update({path: () for path in plain})
    if start is None:
        out, _ = apply_sites(target, params, x, masked_site, data)
    else:
        out, _ = apply_sites(target, params, x, masked_site, data, start=start)
    return out


# ---------------------------------------------------------------------------------------------
# output distances


def mse_distance(pred: Array, target: Array) -> Array:
    diff = pred.astype(jnp.float32) - target.astype(jnp.float32)
    return jnp.mean(diff * diff)


def kl_distance(pred_logits: Array, target_logits: Array) -> Array:
    """KL(softmax(target) || softmax(pred)) over the last axis, mean over all other axes."""
    logp_t = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
    logp_m = jax.nn.log_softmax(pred_logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(logp_t) * (logp_t - logp_m), axis=-1))


def output_distance(kind: str, pred: Array, target: Array) -> Array:
    if kind == "mse":
        return mse_distance(pred, target)
    if kind == "kl":
        return kl_distance(pred, target)
    raise ValueError(f"unknown output distance {kind!r}")


@dataclass(frozen=True)
class Recon:
    """What every reconstruction term needs; calling it with masks gives D(masked model, target)."""

    target: Any
    params: Any
    weights: Dict
    components: Components
    x: Array
    clean_out: Array
    delta: bool
    out_kind: str
    grouped: bool = False  # same-shaped sites' per-site work (mask draws) as one vmap
    order: tuple[str, ...] | None = None  # the step's sites, per site (see the module doc)
    # {site: clean site input @ V} (the CI functions' own product) for plain sites: the first
    # masked site of a forward (in `order`, the forward order) sees the clean input, so it
    # reuses this product instead of forming its own, and the backward forms V's gradient
    # from the summed cotangents once (`components.masked_site_fn`)
    inner: Dict | None = None
    # the clean stream entering the first block with a site (`Clean.residual`): every forward
    # starts there (`order` gives the block); None: forwards run whole
    residual: Array | None = None
    # {block: the clean stream entering it} (`Clean.starts`): where chunkwise recon's forwards
    # may start instead (`start_at`)
    starts: Mapping[int, Array] | None = None

    def __call__(
        self,
        masks: Dict,
        delta_masks: Dict | None,
        routes: Dict | None = None,
        start: Residual | None = None,
        plain: Sequence[str] = (),
    ) -> Array:
        """D(the forward with `masks`, the clean output), from the clean prefix, or from
        `start` (a clean stream at or below the lowest block of `masks`, `start_at`); `plain`
        as `masked_forward`'s."""
        shared = None
        # (a stacked unit among the masks would hide where its members run: no sharing)
        if self.inner and self.order and all(members(p) is None for p in masks):
            first = next((p for p in self.order if p in masks), None)
            if first is not None and first in self.inner:
                shared = {first: self.inner[first]}
        if start is None and self.residual is not None:
            if not self.order:  # the block is the first of ALL the step's sites, not of `masks`
                raise ValueError("Recon.residual needs Recon.order (the step's sites)")
            layer = prefix_layer(self.target, self.order)
            assert layer is not None  # the clean forward keeps a residual only above block 0
            start = Residual(layer, self.residual)
        out = masked_forward(
            self.target, self.params, self.components, self.x, masks, delta_masks, routes, shared,
            start, plain,
        )  # fmt: skip
        return output_distance(self.out_kind, out, self.clean_out)

    def start_at(self, layer: int | None) -> Residual | None:
        """The clean stream entering block `layer`, if the clean forward kept it (`starts`);
        None (the forward starts at the clean prefix, or runs whole) otherwise."""
        if layer is None or self.starts is None or layer not in self.starts:
            return None
        return Residual(layer, self.starts[layer])

    def detached(self) -> "Recon":
        """The same with the components held constant (the adversary's objective)."""
        return dataclasses.replace(
            self,
            components=jax.lax.stop_gradient(self.components),
            inner=None if self.inner is None else jax.lax.stop_gradient(self.inner),
        )


# ---------------------------------------------------------------------------------------------
# loss terms


@jax.named_scope("faithfulness")
def faithfulness_loss(
    weights: Dict, components: Components, layout: Any = None, grouped: bool = False
) -> Array:
    """sum_s ||W_s - V_s U_s||_F^2 / sum_s numel(W_s), over the sites in `components`.

    `weights` per site; `components` per site or per stacked unit (a unit's W stacked from
    its members'). `layout` (`engine.sharding.WeightSpace`, for components sharded over the
    mesh): the same value computed on gathered V / U, each device forming its rows of the
    residual. `grouped`: same-shaped sites as one vmap (`grouped.map_sites`; sums in another
    order).

    V @ U is formed at full float32 precision from float32 values on every platform
    (`arrays.exact_matmul`): at a TPU's default (one bf16 pass) its rounding alone is ~1e-7,
    larger than the term it measures (`pdctl.engine.precision`). The term runs under the
    named scope "faithfulness", so a test can find its dots in the lowered program."""

    def site(i, W: Array, comp: Mapping[str, Array], role: str | None = None) -> Array:
        V, U = comp["V"].astype(jnp.float32), comp["U"].astype(jnp.float32)
        W = W.astype(jnp.float32)
        if layout is not None:
            V, U = layout.gathered(V, role, "V"), layout.gathered(U, role, "U")
            W, V = layout.rows(W, role, "W"), layout.rows(V, role, "V")
        diff = W - exact_matmul(V, U)
        return jnp.sum(diff * diff)

    paths = list(components)
    W = {
        u: weights[u] if (ms := members(u)) is None else jnp.stack([weights[m] for m in ms])
        for u in paths
    }
    # Under tensor parallelism sites split over tp differently (column / row) are laid out
    # differently, so they are never stacked into one vmap together.
    by_role: dict[str | None, list[str]] = {}
    for p in paths:
        by_role.setdefault(None if layout is None else layout.role(p), []).append(p)
    sums: dict[str, Array] = {}
    for role, ps in by_role.items():
        fn = functools.partial(site, role=role)
        sums.update(map_sites(fn, ps, W, components, grouped=grouped))
    total = jnp.zeros((), jnp.float32)
    for p in paths:
        total = total + (sums[p] if members(p) is None else jnp.sum(sums[p]))
    # a float: the element count of every site of an 8B model (7.0e9) overflows an int32
    return total / float(sum(weights[p].size for p in sites_of(paths)))


def weighted(coeff: Array | float, value: Array) -> Array:
    """coeff * value; a traced coefficient of 0 (a sweep member without this term) contributes
    exactly 0 to the value, even where the term is not finite (forward only: for a term
    inside the differentiated loss use `term_if_on`)."""
    if is_traced(coeff):
        return jnp.where(coeff > 0, coeff * value, 0.0)
    return coeff * value


def term_if_on(coeff: Array, fn: Callable[[Array], Array], key: Array) -> tuple[Array, Array]:
    """(value, coeff * value) of a term whose coefficient is traced (a sweep varies it): the
    term is computed only where coeff > 0 (`lax.cond`), else (0, 0), so a member without the
    term gets neither its value nor its gradient, and a term that is not finite for it (e.g.
    eps = 0 with p < 1) cannot reach it. Under `vmap` a cond becomes a select of both
    branches: there the 0 is exact in the loss but a non-finite gradient can still pass."""

    def on(k: Array) -> tuple[Array, Array]:
        v = fn(k).astype(jnp.float32)
        return v, coeff * v

    def off(k: Array) -> tuple[Array, Array]:
        z = jnp.zeros((), jnp.float32)
        return z, z

    return jax.lax.cond(coeff > 0, on, off, key)


def p_at(loss_cfg: LossConfig, step_frac: Array | float) -> Array | float:
    """p, annealed linearly from `p` to `p_final` between fractions `p_anneal_start` and
    `p_anneal_end` of training (constant `p` when `p_final` is None), as goodfire-ai/spd's
    `_get_linear_annealed_p`: p before the start, p_final from the end on."""
    c = loss_cfg
    if c.p_final is None:
        return c.p
    return _linear_anneal(c.p, c.p_final, c.p_anneal_start, c.p_anneal_end, step_frac)


def _linear_anneal(
    first: float, final: float, start: float, end: float, step_frac: Array | float
) -> Array:
    """`first` before fraction `start` of training, `final` from `end` on, linear between."""
    step_frac = jnp.asarray(step_frac, jnp.float32)
    progress = jnp.clip((step_frac - start) / max(end - start, 1e-12), 0.0, 1.0)
    progress = jnp.where(step_frac >= end, 1.0, progress)
    return first + (final - first) * progress


def gamma_at(loss_cfg: LossConfig, step_frac: Array | float) -> Array | float:
    """Smooth-L0's gamma, annealed linearly from `gamma` to `gamma_final` between fractions
    `gamma_anneal_start` and `gamma_anneal_end` of training, exactly as `p_at` anneals p
    (param-decomp SPEC S9 anneals it over the schedule's steps - 1; pdctl's anneals share
    p's step / steps)."""
    c = loss_cfg
    if c.gamma_final is None:
        return c.gamma
    return _linear_anneal(
        c.gamma, c.gamma_final, c.gamma_anneal_start, c.gamma_anneal_end, step_frac
    )


def lp_penalty(p: Array | float, eps: float) -> Callable[[Array], Array]:
    """The paper's per-CI penalty psi(c) = (c + eps)^p (c in float32)."""
    return lambda ci: jnp.power(ci.astype(jnp.float32) + eps, p)


def smooth_l0_penalty(gamma: Array | float, normalize_at_one: bool) -> Callable[[Array], Array]:
    """param-decomp SPEC S7-S9 (`importance_minimality_terms`): psi(c) = c^2 / (c^2 + gamma^2),
    times (1 + gamma^2) with `normalize_at_one` (so psi(1) = 1); c in float32. Flat at 0, its
    gradient bounded by ~0.65 / gamma, and -> 1[c != 0] as gamma -> 0."""
    g2 = jnp.square(jnp.asarray(gamma, jnp.float32))

    def psi(ci: Array) -> Array:
        c2 = jnp.square(ci.astype(jnp.float32))
        out = c2 / (c2 + g2)
        return (1.0 + g2) * out if normalize_at_one else out

    return psi


def sparsity_penalty(loss_cfg: LossConfig, step_frac: Array | float) -> Callable[[Array], Array]:
    """The per-CI penalty `[train.loss] sparsity` names, at this point of training."""
    if loss_cfg.sparsity == "smooth_l0":
        return smooth_l0_penalty(gamma_at(loss_cfg, step_frac), loss_cfg.normalize_at_one)
    return lp_penalty(p_at(loss_cfg, step_frac), loss_cfg.eps)


def penalty_sums(
    ci_upper: Dict, penalty: Callable[[Array], Array], grouped: bool = False
) -> dict[str, Array]:
    """S_c = sum over all leading axes of penalty(ci_upper), per site (C,) (a stacked unit:
    (members, C))."""

    def site(i, ci: Array) -> Array:
        return jnp.sum(penalty(ci), axis=tuple(range(ci.ndim - 1)))

    return map_sites(site, list(ci_upper), ci_upper, grouped=grouped)


def importance_sums(
    ci_upper: Dict, p: Array | float, eps: float, grouped: bool = False
) -> dict[str, Array]:
    """S_c = sum over all leading axes of (ci_upper + eps)^p, per site (C,) (a stacked unit:
    (members, C))."""
    return penalty_sums(ci_upper, lp_penalty(p, eps), grouped)


def importance_minimality_loss(
    ci_upper: Dict,
    p: Array | float,
    eps: float,
    beta: float,
    # (a step's `imp_totals` also carries the whole batch's count, unused here)
    totals: tuple[Mapping[str, Array], int] | tuple[Mapping[str, Array], int, int] | None = None,
    grouped: bool = False,
    penalty: Callable[[Array], Array] | None = None,
) -> Array:
    """sum_s sum_c [m_c + beta * m_c * log2(1 + S_c)], S_c = sum over all leading axes of
    (ci_upper + eps)^p, m_c = S_c / (number of examples x positions). With `penalty` (e.g.
    `smooth_l0_penalty`), S_c sums that per-CI penalty instead (p and eps unused): m_c is then
    param-decomp's f_c, sum_c m_c its activity term (SPEC S8') and beta's term its rolled
    frequency term with a' = examples x positions.

    With gradient accumulation the sums must cover the whole accumulated batch: `totals` =
    ({site: S_c over all micro-batches}, examples x positions of ONE micro-batch[, of all of
    them]), computed in a first pass. The term is then the first-order surrogate
    L'(S_total) * S_c(this micro-batch) with L' divided by the micro-batch's count: the step
    averages the k micro-batches' gradients, so their mean is the gradient of the loss of the
    whole batch (divided by all k micro-batches' count). Its value is not the loss; the step
    reports that from `totals`."""
    total = jnp.zeros((), jnp.float32)
    penalty = penalty if penalty is not None else lp_penalty(p, eps)
    for path, S_C in penalty_sums(ci_upper, penalty, grouped).items():
        if totals is None:
            n_examples = math.prod(lead_shape(path, ci_upper[path]))
            m_C = S_C / n_examples
            site = jnp.sum(m_C)
            if is_traced(beta) or beta:
                site = site + beta * jnp.sum(m_C * jnp.log2(1 + S_C))
        else:
            S_tot, n = jax.lax.stop_gradient(totals[0][path]), totals[1]
            dL_dS = (1 + beta * (jnp.log2(1 + S_tot) + S_tot / ((1 + S_tot) * jnp.log(2.0)))) / n
            site = jnp.sum(dL_dS * S_C)
        total = total + site
    return total


def importance_minimality_from_sums(S: Mapping[str, Array], n: int, beta: float) -> Array:
    """The loss value from whole-batch sums (what `importance_minimality_loss` would give)."""
    total = jnp.zeros((), jnp.float32)
    for S_C in S.values():
        m_C = S_C / n
        extra = is_traced(beta) or beta
        total = total + jnp.sum(m_C) + (beta * jnp.sum(m_C * jnp.log2(1 + S_C)) if extra else 0.0)
    return total


def frequency_curve(f: Array, a: Array | float) -> Array:
    """Phi(f) = f log2(1 + a f), the frequency penalty of one component (SPEC S8')."""
    return f * jnp.log2(1.0 + a * f)


def frequency_slope(f: Array, a: Array | float) -> Array:
    """Phi'(f) = log2(1 + a f) + a f / ((1 + a f) ln 2)."""
    af = a * f
    return jnp.log2(1.0 + af) + af / ((1.0 + af) * math.log(2.0))


# The frequency term's EMA (train state, a plain dict so that it checkpoints and shards as
# the rest): {"ema": {unit: running f_c, (C,) or a stacked unit's (members, C)}, "count": how
# many batches it has seen (int32)}.
FreqState = dict


def init_freq_state(C: Mapping[str, tuple[int, ...]]) -> FreqState:
    """A fresh EMA (zeros, count 0) for units whose f_c has shape `C[unit]`."""
    ema = {u: jnp.zeros(shape, jnp.float32) for u, shape in C.items()}
    return {"ema": ema, "count": jnp.zeros((), jnp.int32)}


def ema_update(state: FreqState, f: Mapping[str, Array], halflife: float):
    """(new state, debiased estimate) after observing the batch's f (held constant): SPEC
    S8'', `ema' = decay ema + (1 - decay) f`, decay = 2^(-1 / halflife), `f_hat = ema' / (1 -
    decay^(count + 1))`, so f_hat = f at the first step. decay is kept in log space (expm1):
    formed directly it rounds towards 1 for long half-lives."""
    log_decay = -math.log(2.0) / halflife
    alpha = -math.expm1(log_decay)  # 1 - decay
    debias = -jnp.expm1(log_decay * (state["count"].astype(jnp.float32) + 1.0))
    old = state["ema"]
    ema = {
        u: old[u] + alpha * (jax.lax.stop_gradient(f[u]).astype(jnp.float32) - old[u]) for u in old
    }
    return {"ema": ema, "count": state["count"] + 1}, {u: e / debias for u, e in ema.items()}


def frequency_loss(
    f: Mapping[str, Array], a: Array | float, at: Mapping[str, Array] | None = None
) -> Array:
    """SPEC S8'-S8'': sum_s sum_c Phi(f_c) with f_c the batch's mean penalty (per component,
    over examples and positions). With `at` (the EMA's debiased estimate, or the whole batch's f
    under accumulation) the value is sum Phi(at) and the gradient Phi'(at) df/dtheta, through
    `f` at full scale: the first-order surrogate Phi(at) + sg(Phi'(at)) (f - sg(f)), `at`
    held constant."""
    total = jnp.zeros((), jnp.float32)
    for u, fu in f.items():
        if at is None:
            total = total + jnp.sum(frequency_curve(fu, a))
            continue
        e = jax.lax.stop_gradient(at[u])
        live = fu - jax.lax.stop_gradient(fu)
        total = total + jnp.sum(
            frequency_curve(e, a) + jax.lax.stop_gradient(frequency_slope(e, a)) * live
        )
    return total


def faithfulness_once(
    coeff: float, value: Array, grad: Any, loss: Array, metrics: dict[str, Array], g_comps: Any
) -> tuple[Array, dict[str, Array], Any]:
    """With gradient accumulation, the faithfulness term formed once a step (it has no batch in
    it) rather than in every micro-batch: `value` and its gradient `grad` added, times `coeff`,
    to the accumulated loss and components' gradients `g_comps`."""
    loss = loss + coeff * value
    g_comps = jax.tree.map(lambda a, b: a + coeff * b, g_comps, grad)
    return loss, {**metrics, "faithfulness": value, "total": loss}, g_comps


def whole_batch_terms(
    loss_cfg: LossConfig,
    loss: Array,
    metrics: dict[str, Array],
    S: Mapping[str, Array],
    n: int,
    freq: FreqState | None,
) -> tuple[Array, dict[str, Array], FreqState | None]:
    """With gradient accumulation, importance minimality and the frequency term of the whole
    batch (`S`: the penalty's sums over all `n` examples x positions of the step, before their
    logs) in place of the mean of the micro-batches' surrogates, which carried the gradient:
    the loss corrected by each coefficient times the difference, the metrics reporting the
    whole batch's values, and the frequency EMA's new state (None without one)."""
    new_freq = None
    if is_traced(loss_cfg.importance_minimality) or loss_cfg.importance_minimality > 0:
        value = importance_minimality_from_sums(S, n, loss_cfg.beta)
        loss = loss + weighted(
            loss_cfg.importance_minimality, value - metrics["importance_minimality"]
        )
        metrics = {**metrics, "importance_minimality": value}
    if loss_cfg.frequency > 0:
        f = {u: S_u / n for u, S_u in S.items()}
        a = loss_cfg.frequency_a if loss_cfg.frequency_a is not None else float(n)
        if loss_cfg.frequency_ema_halflife is not None:
            # the state exists whenever a halflife is set (`init_freq_state`)
            new_freq, f = ema_update(cast(FreqState, freq), f, loss_cfg.frequency_ema_halflife)
        value = frequency_loss(f, a)
        loss = loss + loss_cfg.frequency * (value - metrics["frequency"])
        metrics = {**metrics, "frequency": value}
    return loss, {**metrics, "total": loss}, new_freq


def stochastic_recon_loss(
    recon: Recon,
    ci_lower: Dict,
    key: Array,
    n_samples: int,
    sampling: str,
    routing: str = "all",
    routing_p: float = 0.5,
) -> Array:
    """Mean over `n_samples` draws of D(f(x | every (routed) site masked), f(x)). With routing
    "all" this is the stochastic recon term; with "uniform_k" / "static_p" the subset one."""
    total = jnp.zeros((), jnp.float32)
    paths = tuple(ci_lower)
    lead = _lead(ci_lower)
    for s in range(n_samples):
        k_mask, k_route = jax.random.split(jax.random.fold_in(key, s))
        masks, dmasks = stochastic_masks(
            k_mask, ci_lower, sampling, recon.delta, recon.grouped, recon.order
        )
        routes = routing_masks(k_route, paths, lead, routing, routing_p, recon.order)
        total = total + recon(masks, dmasks, routes)
    return total / n_samples


def _lead(ci: Dict) -> tuple[int, ...]:
    """The example/position axes of one site's CI."""
    unit, a = next(iter(ci.items()))
    return lead_shape(unit, a)


def stochastic_recon_layerwise_loss(
    recon: Recon, ci_lower: Dict, key: Array, n_samples: int, sampling: str
) -> Array:
    """Mean over samples and sites of D(f(x | only that site masked), f(x)). One forward per
    site by definition: stacked units are split into their sites here."""
    total = jnp.zeros((), jnp.float32)
    if is_stacked(ci_lower):
        recon = dataclasses.replace(recon, components=per_site_views(recon.components))
    for s in range(n_samples):
        k_mask, _ = jax.random.split(jax.random.fold_in(key, s))
        masks, dmasks = stochastic_masks(
            k_mask, ci_lower, sampling, recon.delta, recon.grouped, recon.order
        )
        masks = per_site_views(masks)
        dmasks = None if dmasks is None else per_site_views(dmasks)
        for path in masks:
            one_d = None if dmasks is None else {path: dmasks[path]}
            total = total + recon({path: masks[path]}, one_d)
    return total / (n_samples * len(sites_of(ci_lower)))


def ppgd_recon_loss(
    recon: Recon, ci_lower: Dict, sources: Dict, routes: Dict | None = None
) -> Array:
    """D of the forward with every (routed) site masked by its adversarial source (sources in
    [0, 1], i.e. after the sigmoid parametrisation if any)."""
    masks, dmasks = source_masks(ci_lower, sources, recon.delta)
    return recon(masks, dmasks, routes)


def merged_recon_loss(
    recon: Recon,
    ci_lower: Dict,
    sources: Dict,
    key: Array,
    adv_fraction: float | Array,
    routing: str = "uniform_k",
    routing_p: float = 0.5,
    n_assigned: int | None = None,
) -> Array:
    """SPEC S34, the merged stochastic/PPGD term: ONE masked forward in which each example is,
    with probability `adv_fraction`, masked by the adversarial `sources` (in [0, 1], aligned as
    in `ppgd_recon_loss`) at every site and position, and otherwise by fresh uniform masks
    routed by `routing` (`masks.mixed_masks`). In expectation over the draw, adv_fraction *
    (PPGD term, routed everywhere) + (1 - adv_fraction) * (stochastic subset term); the
    sources' gradient comes from the adversarial examples only. `n_assigned`: exactly that
    many adversarial examples (`masks.fixed_assignment`; `merged_assignment` gives the same
    ones from the loss key)."""
    k_mask, k_route = jax.random.split(key)
    masks, dmasks, assign = mixed_masks(
        k_mask, ci_lower, sources, adv_fraction, recon.delta, recon.grouped, recon.order,
        n_assigned,
    )  # fmt: skip
    routes = routing_masks(
        k_route, tuple(ci_lower), _lead(ci_lower), routing, routing_p, recon.order
    )
    return recon(masks, dmasks, route_assigned(routes, assign))


def merged_assignment(loss_key: Array, n_examples: int, n_assigned: int) -> Array:
    """The indices (int32, ascending) of the examples that the merged term of the loss drawn
    from `loss_key` masks by the sources, when it assigns exactly `n_assigned`: the draw
    `merged_recon_loss` makes from its term's fold of the key."""
    k_term = jax.random.fold_in(loss_key, _term_fold("merged_recon"))
    k_mask, _ = jax.random.split(k_term)
    k_assign, _ = jax.random.split(k_mask)
    return fixed_assignment(k_assign, n_examples, n_assigned)[1]


def take_examples(tree: Any, idx: Array, seq: bool) -> Any:
    """Examples `idx` of every array in `tree` whose axes end in (examples, [positions,]
    features), a stacked unit's leading layer axis included: logits, site inputs, CI,
    per-example sources, residual streams."""
    return jax.tree.map(lambda a: jnp.take(a, idx, axis=a.ndim - 2 - int(seq)), tree)


def site_chunks(paths: Sequence[str], sites_per_chunk: int | None) -> tuple[tuple[str, ...], ...]:
    """The step's sites (per site, in the target's forward order) cut into consecutive chunks
    of `sites_per_chunk`, the last one shorter when they do not divide (as param-decomp's
    `ChunkwiseSubsetReconLoss`); None: one chunk of every site."""
    paths = tuple(paths)
    if sites_per_chunk is None:
        return (paths,)
    if sites_per_chunk < 1:
        raise ValueError(f"sites_per_chunk must be positive, not {sites_per_chunk}")
    return tuple(paths[i : i + sites_per_chunk] for i in range(0, len(paths), sites_per_chunk))


_UNIT = re.compile(r"^(?P<pre>.+)\.(?P<a>\d+)-\d+\.(?P<name>.+)$")


def _slice_key(unit: str, j: int, n: int) -> str:
    """The key of members j .. j + n - 1 of a stacked unit: a group key of their layers, or
    the member's own path when n = 1."""
    if n == 1:
        ms = members(unit)
        assert ms is not None  # `unit` is a stacked unit's group key
        return ms[j]
    where = _UNIT.match(unit)
    assert where is not None  # likewise
    first = int(where["a"]) + j
    return group_key(where["pre"], first, first + n - 1, where["name"])


def _keys_of(units: Sequence[str], sites: set[str]) -> list[str]:
    """Keys naming exactly the sites of `sites` among `units` (whose members in `sites` are
    consecutive): plain sites, and a slice of each unit (`_slice_key`)."""
    out = []
    for u in units:
        ms = members(u)
        if ms is None:
            if u in sites:
                out.append(u)
            continue
        idx = [j for j, m in enumerate(ms) if m in sites]
        if idx:
            if idx != list(range(idx[0], idx[-1] + 1)):
                raise ValueError(f"the sites of {u} asked for are not consecutive members")
            out.append(_slice_key(u, idx[0], len(idx)))
    return out


def chunk_views(tree: Mapping[str, Any], chunks: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    """Per chunk, the entries of `tree` (keyed by sites or stacked units) for its sites. A
    plain site is its own entry; a unit whose members fall in several chunks is split once
    along its member axis (`lax.split`: its backward is one concatenate) into one entry per
    chunk: a group key of those layers with that slice, or the plain site for a single member.
    A unit inside one chunk stays as it is."""
    chunk_of = {site: c for c, sites in enumerate(chunks) for site in sites}
    out: list[dict[str, Any]] = [{} for _ in chunks]
    for u, value in tree.items():
        ms = members(u)
        if ms is None:
            if u not in chunk_of:
                raise ValueError(f"{u} is in no chunk")
            out[chunk_of[u]][u] = value
            continue
        runs: list[list[int]] = []  # [chunk, first member, members]
        for j, m in enumerate(ms):
            if m not in chunk_of:
                raise ValueError(f"{m} is in no chunk")
            if runs and runs[-1][0] == chunk_of[m]:
                runs[-1][2] += 1
            else:
                runs.append([chunk_of[m], j, 1])
        if len(runs) == 1:
            out[runs[0][0]][u] = value
            continue
        leaves, tree_def = jax.tree.flatten(value)
        pieces = [jax.lax.split(a, [n for _, _, n in runs], axis=0) for a in leaves]
        for k, (c, j, n) in enumerate(runs):
            part = [p[k] for p in pieces]
            if n == 1:
                part = [jnp.squeeze(a, 0) for a in part]
            out[c][_slice_key(u, j, n)] = jax.tree.unflatten(tree_def, part)
    return out


def chunkwise_recon_loss(
    recon: Recon,
    ci_lower: Dict,
    key: Array,
    n_samples: int,
    sampling: str,
    chunks: Sequence[Sequence[str]],
    routing: str = "uniform_k",
    routing_p: float = 0.5,
) -> Array:
    """goodfire-ai/param-decomp's `ChunkwiseSubsetReconLoss`: the step's sites in consecutive
    `chunks` (`site_chunks`); per sample and chunk ONE forward in which only that chunk's
    sites take stochastic masks, routed by `routing` among the chunk's sites (uniform_k: k ~
    U{1..sites in the chunk}), every other site keeping the target's weight; the term is the
    mean of D over all (sample, chunk) forwards. Below a chunk's first block everything is the
    clean forward, so its forwards start there from the clean stream (`Recon.start_at`;
    else from the clean prefix, or whole).

    Draws: sample s splits fold_in(key, s) into a mask key and a routing key as
    `stochastic_recon_loss` does; each site's masks are its draw of that mask key (one draw
    per site per sample: a site is in one chunk), chunk 0 routes with the routing key itself
    and chunk c > 0 with fold_in(routing key, c). So with one chunk of every site this is the
    subset term (`stochastic_recon_loss` with this routing) on the same key, draw for draw.

    On a scanned target (`recon.grouped`) the step's sites after a chunk go through its
    forwards as `plain` sites (the target's own product), so the layers above the chunk run
    as one scan, not unrolled: the program stays the same size at any depth."""
    order = recon.order or tuple(sites_of(list(ci_lower)))
    ci_views = chunk_views(ci_lower, chunks)
    comps = {k: v for view in chunk_views(recon.components, chunks) for k, v in view.items()}
    chunk_recon = dataclasses.replace(recon, components=comps)
    starts = [chunk_recon.start_at(first_layer(recon.target, sites)) for sites in chunks]
    after = [
        _keys_of(tuple(ci_lower), {s for later in chunks[c + 1 :] for s in later})
        if recon.grouped
        else []
        for c in range(len(chunks))
    ]
    lead = _lead(ci_lower)
    total = jnp.zeros((), jnp.float32)
    for s in range(n_samples):
        k_mask, k_route = jax.random.split(jax.random.fold_in(key, s))
        for c, (sites, ci_c) in enumerate(zip(chunks, ci_views, strict=True)):
            masks, dmasks = stochastic_masks(
                k_mask, ci_c, sampling, recon.delta, recon.grouped, order
            )
            k_c = k_route if c == 0 else jax.random.fold_in(k_route, c)
            routes = routing_masks(k_c, tuple(ci_c), lead, routing, routing_p, tuple(sites))
            total = total + chunk_recon(masks, dmasks, routes, starts[c], after[c])
    return total / (n_samples * len(chunks))


def pgd_sources(
    key: Array,
    ci_lower: Dict,
    delta: bool,
    init: str,
    scope: str,
    order: Sequence[str] | None = None,
    window: Window = None,
) -> dict[str, Array]:
    """Fresh PGD sources: per example (the leading axes of ci) or shared, C (+1) entries.
    `window` (start, full): per-example sources are those rows of a batch of `full` examples'
    draw (`masks.window_draw`)."""
    if init not in ("random", "ones", "zeroes"):
        raise ValueError(f"unknown PGD init {init!r}")

    def one(i, ci: Array) -> Array:
        n = ci.shape[-1] + (1 if delta else 0)
        shape = (*ci.shape[:-1], n) if scope == "per_example" else (n,)
        if init == "random":
            draw = functools.partial(jax.random.uniform, dtype=jnp.float32)
            rows = window if scope == "per_example" else None
            return window_draw(draw, jax.random.fold_in(key, i), shape, rows)
        return (jnp.ones if init == "ones" else jnp.zeros)(shape, jnp.float32)

    return map_sites(one, list(ci_lower), ci_lower, grouped=False, order=order)


def pgd_recon_loss(
    recon: Recon,
    ci_lower: Dict,
    key: Array,
    *,
    init: str,
    step_size: float,
    n_steps: int,
    scope: str,
    routing: str = "all",
    routing_p: float = 0.5,
) -> Array:
    """Non-persistent PGD: fresh sources, `n_steps` steps `s <- clip(s + step_size *
    sign(dD/ds), 0, 1)` with CI and components held fixed and one routing draw, then D with
    the final sources held constant (gradients flow to CI and components only)."""
    k_init, k_route = jax.random.split(key)
    routes = routing_masks(
        k_route, tuple(ci_lower), _lead(ci_lower), routing, routing_p, recon.order
    )
    srcs = pgd_sources(k_init, ci_lower, recon.delta, init, scope, recon.order)
    fixed, ci_fixed = recon.detached(), jax.lax.stop_gradient(dict(ci_lower))

    def body(s, _):
        g = jax.grad(lambda s_: ppgd_recon_loss(fixed, ci_fixed, s_, routes))(s)
        return {p: jnp.clip(s[p] + step_size * jnp.sign(g[p]), 0.0, 1.0) for p in s}, None

    if n_steps:
        srcs, _ = jax.lax.scan(body, srcs, None, length=n_steps)
    return ppgd_recon_loss(recon, ci_lower, jax.lax.stop_gradient(srcs), routes)


def ci_masked_recon_loss(recon: Recon, ci_lower: Dict) -> Array:
    """D with mask = ci_lower at every site, no delta component."""
    return recon(dict(ci_lower), None)


def unmasked_recon_loss(recon: Recon, ci_lower: Dict) -> Array:
    """D with mask = 1 at every site, no delta component."""
    return recon({p: jnp.ones_like(ci) for p, ci in ci_lower.items()}, None)


def l0_per_site(ci_lower: Dict, threshold: float, grouped: bool = False) -> dict[str, Array]:
    """Mean number of components with ci > threshold per example/position, per site (stacked
    units are split into their sites)."""

    def site(i, ci: Array) -> Array:
        return jnp.mean(jnp.sum((ci > threshold).astype(jnp.float32), axis=-1))

    return per_site_views(map_sites(site, list(ci_lower), ci_lower, grouped=grouped))


# ---------------------------------------------------------------------------------------------
# entry points for the stages

# The loss terms, each a `[train.loss]` coefficient of that name: the one list that the loss,
# the report's config table and a sweep's traced keys read. Order matters: a term's index is the
# fold of the loss key it draws from (`_term_fold`), so a new term goes at the end.
TERMS = (
    "faithfulness",
    "importance_minimality",
    "stochastic_recon",
    "stochastic_recon_layerwise",
    "stochastic_recon_subset",
    "ppgd_recon",
    "pgd_recon",
    "ci_masked_recon",
    "unmasked_recon",
)
# The adversarial terms: PPGD / PGD settings shape the step (ppgd_recon > 0 keeps persistent
# sources, `SpdFns.source_coeff`), so a sweep does not vary their coefficients inside one
# program (`sweep.hyper.TRACED`).
ADVERSARIAL_TERMS = ("ppgd_recon", "pgd_recon")
_CI_KEY = len(TERMS)  # fold of the loss key that the CI noise (binomial sampling) uses
# The LM recipe's terms, after the CI's fold so that every earlier draw keeps its bits.
RECIPE_TERMS = ("frequency", "merged_recon")
_POOL_KEY = _CI_KEY + 1 + len(RECIPE_TERMS)  # the pooled sources' particle draw
# Terms added after that, each after the pooled draw's fold so that it keeps its bits.
LATE_TERMS = ("chunkwise_recon",)
FREQ_STATE = "_freq_state"  # the loss's aux entry with the frequency EMA's new state


def _term_fold(name: str) -> int:
    if name in TERMS:
        return TERMS.index(name)
    if name in RECIPE_TERMS:
        return _CI_KEY + 1 + RECIPE_TERMS.index(name)
    return _POOL_KEY + 1 + LATE_TERMS.index(name)


@dataclass(frozen=True)
class SpdFns:
    """Closures over (target, sites, config); all pure and jit-able. `components` arguments are
    the expanded per-site set (`expand`), `free` the parameters (tied sites folded away); with
    a stacking, every dict is keyed by `units` (stacked groups and plain sites) instead.

    - `clean(target_params, x) -> Clean`: the one stop-gradient target forward of a step.
    - `ci(components, ci_fns, site_inputs, key) -> (ci_lower, ci_upper)`; `ci_key(loss_key)` is
      the key `loss` uses for it (binomial sampling draws noise from it).
    - `loss(trainable, target_params, sources, clean, x, key, step_frac, imp_totals=None,
      freq_state=None) -> (total, metrics)` with `trainable = {"components": expanded,
      "ci_fns": ...}` and the raw persistent sources. d total / d sources = coeff * dL / d
      sources of the one term that uses them (ppgd_recon or merged_recon). `imp_totals` =
      (whole-batch penalty sums, tokens of this micro-batch, tokens of the whole batch) under
      gradient accumulation; `freq_state` the frequency EMA (`FreqState`), whose new value the
      metrics then carry under `FREQ_STATE`. `exact=(components, target_params)` as stored
      (before any compute-dtype cast): what the faithfulness term compares
      (`pdctl.engine.precision`); default: the ones given.
    - `ppgd_loss(components, ci_lower, target_params, sources, clean, x, key, loss_key=None)`:
      the adversary's objective (the step holds components and CI constant for it): the PPGD
      term, routed everywhere when the sources serve merged_recon (SPEC S24); `loss_key` is
      the step's loss key, which fixes a pooled scope's particles.
    - `source_coeff`: the coefficient of that term (0: no persistent sources in use).
    - `source_step(sources, grads, opt_state, lr) -> (sources, opt_state)`: one ascent step.
    - `init_source_opt(sources)`, `faithfulness_loss(components, target_params)`.
    """

    paths: tuple[str, ...]
    units: tuple[str, ...]
    ties: dict[str, str]
    expand: Callable[[Any], dict[str, Any]]
    fold: Callable[[Any], dict[str, Any]]
    clean: Callable[[Any, Array], Clean]
    ci: Callable[..., tuple[dict[str, Array], dict[str, Array]]]
    ci_key: Callable[[Array], Array]
    loss: Callable[..., tuple[Array, dict[str, Array]]]
    ppgd_loss: Callable[..., Array]
    source_step: Callable[..., tuple[dict[str, Array], Any]]
    init_source_opt: Callable[[Dict], Any]
    faithfulness_loss: Callable[[Components, Any], Array]
    source_coeff: Any = 0.0


def make_spd_fns(
    target: Any,
    site_C: Mapping[str, int],
    cfg: Config,
    weight_space: Any = None,
    stacking: Any = None,
) -> SpdFns:
    """The step's SPD functions; `weight_space` lays out the faithfulness term over the mesh
    (`faithfulness_loss`). With a `stacking` (`science.spd.stacked.Stacking`) every dict the
    functions take and return is keyed as the stacked train state is (`units`): the clean
    forward captures each group's inputs stacked, and the CI, masks and loss terms run on the
    groups as they are. Metrics stay per site."""
    paths = tuple(p for p in target.site_paths() if p in site_C)
    missing = set(site_C) - set(paths)
    if missing:
        raise ValueError(f"sites {sorted(missing)} are not sites of this target")
    ties = component_ties(target.tied_sites(), site_C)
    dcfg, lcfg, pcfg, gcfg = cfg.decomp, cfg.train.loss, cfg.train.ppgd, cfg.train.pgd
    kind, sigmoid, delta, sampling = (
        dcfg.ci_fn.type, dcfg.sigmoid, dcfg.delta_component, dcfg.sampling,
    )  # fmt: skip
    remat = cfg.train.remat
    out_kind = lcfg.output
    # A target whose layers run as a scan has its per-site work grouped as well: both keep
    # the program's size flat in depth.
    grouped = bool(getattr(target, "scan_layers", False))

    def site_weights(target_params: Any) -> dict[str, Array]:
        w = target.site_weights(target_params)
        return {p: jax.lax.stop_gradient(w[p]) for p in paths}

    units = tuple(paths if stacking is None else stacking.units(paths))
    # chunkwise recon: the clean forward keeps the stream entering each chunk's first block
    # (above block 0; its forwards start there), only when the term is on
    chunks = site_chunks(paths, lcfg.sites_per_chunk)
    chunk_on = is_traced(lcfg.chunkwise_recon) or lcfg.chunkwise_recon > 0
    chunk_starts = sorted({s for c in chunks if (s := first_layer(target, c))}) if chunk_on else []

    def clean(target_params: Any, x: Array) -> Clean:
        return clean_forward(target, target_params, x, units, starts=chunk_starts)

    def ci(
        components: Components,
        ci_fns: Any,
        site_inputs: Dict,
        key: Array | None = None,
        inner: Dict | None = None,
    ):
        return compute_ci(
            components, ci_fns, site_inputs, kind, sigmoid, remat, sampling, key, grouped, paths,
            inner,
        )  # fmt: skip

    def clean_inner(components: Components, site_inputs: Dict) -> Dict | None:
        """{site: clean input @ V} for the plain sites, shared by the CI functions and the
        recon forwards (`Recon.inner`); None for a grouped (scanned) target, whose forwards
        take their sites' data stacked over the layers."""
        if grouped:
            return None
        plain = [p for p in units if members(p) is None]
        return {
            p: site_inputs[p].astype(components[p]["V"].dtype) @ components[p]["V"] for p in plain
        }

    def ci_key(key: Array) -> Array:
        return jax.random.fold_in(key, _CI_KEY)

    def recon_of(
        components: Components, target_params: Any, c: Clean, x: Array, inner: Dict | None = None
    ) -> Recon:
        return Recon(
            target, target_params, site_weights(target_params), components, x, c.out, delta,
            out_kind, grouped, paths, inner, c.residual, c.starts,
        )  # fmt: skip

    pooled = pcfg.scope == "pooled"
    merged = is_traced(lcfg.merged_recon) or lcfg.merged_recon > 0
    # [train.ppgd] ascent_examples = "assigned": the merged term masks exactly n_assigned
    # examples of each micro-batch by the sources, and the warm-up ascents run on those only
    n_assigned = None
    if pcfg.ascent_examples == "assigned":
        if is_traced(lcfg.adv_fraction) or is_traced(lcfg.merged_recon):
            raise ValueError("ascent_examples 'assigned' needs adv_fraction fixed, not swept")
        n_assigned = assigned_per_micro_batch(cfg.train)
    seq = is_sequence_model(cfg)
    per_example_sources = pcfg.scope == "per_batch_per_position"

    def adversary(sources: Dict, ci_lower: Dict, loss_key: Array | None) -> dict[str, Array]:
        """The sources as this step's masks see them: in [0, 1] and, pooled, each example's
        particle (drawn from the loss key, so every ascent step of the step picks the same)."""
        if pooled:
            if loss_key is None:
                raise ValueError("pooled sources need the step's loss key")
            lead = _lead(ci_lower)
            idx = src_mod.particle_indices(
                jax.random.fold_in(loss_key, _POOL_KEY), lead[0], pcfg.pool_size
            )
            sources = src_mod.pick_particles(sources, idx, len(lead) - 1)
        return src_mod.effective(sources, pcfg.sigmoid)

    def ppgd_term(
        recon: Recon, ci_lower: Dict, sources: Dict, key: Array, loss_key: Array | None = None
    ) -> Array:
        # the merged term's ascent steps mask every site of every example (SPEC S24)
        routing = "all" if merged else pcfg.routing
        routes = routing_masks(key, units, _lead(ci_lower), routing, pcfg.routing_p, paths)
        return ppgd_recon_loss(recon, ci_lower, adversary(sources, ci_lower, loss_key), routes)

    def frequency_term(
        ci_upper: Dict,
        step_frac: Array | float,
        totals: tuple[Mapping[str, Array], int, int] | None,
        freq_state: FreqState | None,
        aux: dict[str, Any],
    ) -> Array:
        """SPEC S8-S8'': f_c = S_c / (examples x positions) with S_c the penalty sums of
        importance minimality; under accumulation the surrogate whose gradients, summed over
        micro-batches, are those of the whole batch's term (its value is the whole batch's)."""
        S = penalty_sums(ci_upper, sparsity_penalty(lcfg, step_frac), grouped)
        if totals is None:
            n = math.prod(_lead(ci_upper))
            f = {u: S[u] / n for u in S}
            at = None
        else:
            S_tot, n, n_total = totals
            f = {u: S[u] / n for u in S}
            at = {u: jax.lax.stop_gradient(S_tot[u]) / n_total for u in S}
        a = (
            lcfg.frequency_a
            if lcfg.frequency_a is not None
            else float(n if totals is None else totals[2])
        )
        if lcfg.frequency_ema_halflife is not None:
            if freq_state is None:
                raise ValueError("frequency_ema_halflife needs the step's FreqState")
            state, at = ema_update(freq_state, f if at is None else at, lcfg.frequency_ema_halflife)
            if totals is None:
                aux[FREQ_STATE] = state
        return frequency_loss(f, a, at)

    def loss(
        trainable: Mapping[str, Any],
        target_params: Any,
        sources: Dict,
        c: Clean,
        x: Array,
        key: Array,
        step_frac: Array | float,
        imp_totals: tuple[Mapping[str, Array], int, int] | None = None,
        freq_state: FreqState | None = None,
        exact: tuple[Components, Any] | None = None,
        skip: tuple[str, ...] = (),
    ) -> tuple[Array, dict[str, Array]]:
        comps, ci_fns = trainable["components"], trainable["ci_fns"]
        aux: dict[str, Any] = {}
        # faithfulness compares the stored values, not their compute-dtype casts
        f_comps, f_weights = comps, None
        if exact is not None:
            f_comps, f_weights = exact[0], site_weights(exact[1])
        inner = clean_inner(comps, c.site_inputs)
        recon = recon_of(comps, target_params, c, x, inner)
        ci_lower, ci_upper = ci(comps, ci_fns, c.site_inputs, ci_key(key), inner)
        n = dcfg.n_mask_samples
        # Each term draws from its own fold of the key, so switching one term on or off leaves
        # the others' draws unchanged.
        compute: dict[str, Callable[[Array], Array]] = {
            "faithfulness": lambda k: faithfulness_loss(
                recon.weights if f_weights is None else f_weights, f_comps, weight_space, grouped
            ),
            "importance_minimality": lambda k: importance_minimality_loss(
                ci_upper, p_at(lcfg, step_frac), lcfg.eps, lcfg.beta, imp_totals, grouped
            ),
            "stochastic_recon": lambda k: stochastic_recon_loss(recon, ci_lower, k, n, sampling),
            "stochastic_recon_layerwise": lambda k: stochastic_recon_layerwise_loss(
                recon, ci_lower, k, n, sampling
            ),
            "stochastic_recon_subset": lambda k: stochastic_recon_loss(
                recon, ci_lower, k, n, sampling, lcfg.subset_routing, lcfg.subset_p
            ),
            "ppgd_recon": lambda k: ppgd_term(recon, ci_lower, sources, k, key),
            "pgd_recon": lambda k: pgd_recon_loss(
                recon,
                ci_lower,
                k,
                init=gcfg.init,
                step_size=gcfg.step_size,
                n_steps=gcfg.n_steps,
                scope=gcfg.scope,
                routing=gcfg.routing,
                routing_p=gcfg.routing_p,
            ),
            "ci_masked_recon": lambda k: ci_masked_recon_loss(recon, ci_lower),
            "unmasked_recon": lambda k: unmasked_recon_loss(recon, ci_lower),
            "frequency": lambda k: frequency_term(ci_upper, step_frac, imp_totals, freq_state, aux),
            "merged_recon": lambda k: merged_recon_loss(
                recon,
                ci_lower,
                adversary(sources, ci_lower, key),
                k,
                lcfg.adv_fraction,
                lcfg.subset_routing,
                lcfg.subset_p,
                n_assigned,
            ),
            "chunkwise_recon": lambda k: chunkwise_recon_loss(
                recon, ci_lower, k, n, sampling, chunks, lcfg.subset_routing, lcfg.subset_p
            ),
        }
        if lcfg.sparsity == "smooth_l0":
            compute["importance_minimality"] = lambda k: importance_minimality_loss(
                ci_upper, 0.0, 0.0, lcfg.beta, imp_totals, grouped,
                penalty=sparsity_penalty(lcfg, step_frac),
            )  # fmt: skip
        total = jnp.zeros((), jnp.float32)
        metrics: dict[str, Array] = {}
        for name in TERMS + RECIPE_TERMS + LATE_TERMS:
            if name in skip:  # the caller adds it (a term that does not depend on the batch)
                continue
            coeff, k_i = getattr(lcfg, name), jax.random.fold_in(key, _term_fold(name))
            if is_traced(coeff):  # a sweep's member may have it or not: computed where on
                value, part = term_if_on(coeff, compute[name], k_i)
            elif coeff > 0:
                value = compute[name](k_i).astype(jnp.float32)
                part = coeff * value
            else:
                continue
            metrics[name] = value
            total = total + part
        metrics["total"] = total
        l0 = l0_per_site(jax.lax.stop_gradient(ci_lower), dcfg.ci_threshold, grouped)
        for p, v in l0.items():
            metrics[f"l0/{p}"] = v
        metrics.update(aux)
        return total, metrics

    def ppgd_loss(
        components: Components,
        ci_lower: Dict,
        target_params: Any,
        sources: Dict,
        c: Clean,
        x: Array,
        key: Array,
        loss_key: Array | None = None,
    ) -> Array:
        """The warm-up ascents' objective. With `ascent_examples = "assigned"`, on the examples
        the merged term of the loss drawn from `loss_key` masks by the sources, scaled by their
        share of the micro-batch: for those examples' sources the gradient of the PPGD term over
        every example (the others' is 0), for a fraction of the forward's cost."""
        if n_assigned is not None:
            if loss_key is None:
                raise ValueError("ascent_examples 'assigned' needs the step's loss key")
            n = x.shape[0]
            idx = merged_assignment(loss_key, n, n_assigned)
            c = Clean(*take_examples(tuple(c), idx, seq))
            ci_lower = take_examples(ci_lower, idx, seq)
            x = jnp.take(x, idx, axis=0)
            if per_example_sources:
                sources = take_examples(sources, idx, seq)
        recon = recon_of(components, target_params, c, x)
        value = ppgd_term(recon, ci_lower, sources, key, loss_key)
        if n_assigned is None:
            return value
        return value * (n_assigned / n)  # the assigned examples' share of the micro-batch

    def source_step(
        sources: Dict, grads: Dict, opt_state: Mapping[str, Any], lr: Array | float
    ) -> tuple[dict[str, Array], dict[str, Any]]:
        return src_mod.ascent_step(
            sources,
            grads,
            opt_state,
            optimizer=pcfg.optimizer,
            lr=lr,
            b1=pcfg.b1,
            b2=pcfg.b2,
            eps=pcfg.eps,
            sigmoid=pcfg.sigmoid,
        )

    def faithfulness(components: Components, target_params: Any) -> Array:
        return faithfulness_loss(site_weights(target_params), components, weight_space, grouped)

    return SpdFns(
        paths=paths,
        units=units,
        ties=ties,
        # stacked train state (`stacked.Stacking`) is never tied: it passes through
        expand=lambda free: dict(free) if is_stacked(free) else expand_tied(free, ties, paths),
        fold=lambda per_site: fold_tied(per_site, ties),
        clean=clean,
        ci=ci,
        ci_key=ci_key,
        loss=loss,
        ppgd_loss=ppgd_loss,
        source_step=source_step,
        init_source_opt=lambda sources: src_mod.init_opt(sources, pcfg.optimizer),
        faithfulness_loss=faithfulness,
        source_coeff=lcfg.merged_recon if merged else lcfg.ppgd_recon,
    )
