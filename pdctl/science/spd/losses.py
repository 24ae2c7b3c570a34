"""The SPD loss terms (each its own small pure function) and the functions the train stage calls.

Conventions (see /work/shared/SPD.md; where it is silent we follow goodfire-ai/spd and
goodfire-ai/param-decomp, noted inline):
- Output distance D: `mse` = mean of squared differences over every element; `kl` =
  KL(target || masked) summed over the vocabulary, averaged over all leading axes (batch and
  positions). Recon terms average D over their forwards (samples, sites), which equals the
  references' sum/count accumulators because every forward has the same shape.
- Importance minimality: per site and component `S_c = sum over all leading axes of
  (ci_upper + eps)^p`, `m_c = S_c / n`, with n = the number of examples times positions (every
  leading axis), as `_importance_minimality_loss_update` in goodfire-ai/spd and `imp_min_terms`
  (B*T) in param-decomp's SPEC. Loss = sum_s sum_c [m_c + beta * m_c * log2(1 + S_c)]. The sums
  run over the whole (global) batch: under jit with a sharded batch GSPMD reduces them before the
  log.
- Masks: `m = ci + (1 - ci) * r`, r ~ U[0,1) (continuous) or r ~ Bernoulli(1/2) (binomial); the
  delta mask is U[0,1) per example/position in both modes (as goodfire-ai/spd's
  `calc_stochastic_component_mask_info`). PPGD masks: `m = ci + (1 - ci) * s[..., :C]`, delta
  mask = the raw last source entry (never interpolated with ci).
- CI-masked and unmasked recon run without the delta component (as goodfire-ai/spd's
  `CIMaskedReconLoss` / `UnmaskedReconLoss`).
- Layerwise recon draws one set of masks per sample and runs one forward per site with only that
  site masked (goodfire-ai/spd's `StochasticReconLayerwiseLoss`).
"""

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pdctl.config import Config, LossConfig
from pdctl.science.spd.ci import compute_ci
from pdctl.science.spd.components import expand_left, masked_overrides

Array = jax.Array
Dict = Mapping[str, Array]
Components = Mapping[str, Mapping[str, Array]]

# ---------------------------------------------------------------------------------------------
# target forwards


def clean_forward(
    target: Any, params: Any, x: Array, paths: list[str] | tuple[str, ...]
) -> tuple[Array, dict[str, Array]]:
    """The frozen target's output and the inputs of the sites in `paths`, stop-gradient.

    Site inputs are captured by overrides that store `x_in` and return `x_in @ W` (pure overall:
    the dict lives only inside this trace)."""
    weights = target.site_weights(params)
    captured: dict[str, Array] = {}

    def capture(path: str) -> Callable[[Array], Array]:
        W = weights[path]

        def fn(x_in: Array) -> Array:
            captured[path] = x_in
            return x_in @ W

        return fn

    if getattr(target, "remat", "none") != "none":
        # Capturing site inputs from inside a rematerialised block would leak its tracers;
        # this forward is stop-gradient anyway, so it has nothing to rematerialise.
        target = dataclasses.replace(target, remat="none")
    out = target.apply(params, x, {p: capture(p) for p in paths})
    site_inputs = {p: jax.lax.stop_gradient(captured[p]) for p in paths}
    return jax.lax.stop_gradient(out), site_inputs


def masked_forward(
    target: Any,
    params: Any,
    weights: Dict,
    components: Components,
    x: Array,
    masks: Dict,
    delta_masks: Dict | None,
) -> Array:
    """Target forward with the sites in `masks` replaced by their masked components."""
    return target.apply(params, x, masked_overrides(weights, components, masks, delta_masks))


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


# ---------------------------------------------------------------------------------------------
# masks


def stochastic_masks(
    key: Array, ci_lower: Dict, sampling: str, delta: bool
) -> tuple[dict[str, Array], dict[str, Array] | None]:
    """One draw of stochastic masks for every site in `ci_lower` (site i uses fold_in(key, i))."""
    masks: dict[str, Array] = {}
    delta_masks: dict[str, Array] | None = {} if delta else None
    for i, (path, ci) in enumerate(ci_lower.items()):
        k_r, k_d = jax.random.split(jax.random.fold_in(key, i))
        if sampling == "continuous":
            r = jax.random.uniform(k_r, ci.shape, ci.dtype)
        elif sampling == "binomial":
            r = jax.random.bernoulli(k_r, 0.5, ci.shape).astype(ci.dtype)
        else:
            raise ValueError(f"unknown sampling {sampling!r}")
        masks[path] = ci + (1 - ci) * r
        if delta_masks is not None:
            delta_masks[path] = jax.random.uniform(k_d, ci.shape[:-1], ci.dtype)
    return masks, delta_masks


def source_masks(
    ci_lower: Dict, sources: Dict, delta: bool
) -> tuple[dict[str, Array], dict[str, Array] | None]:
    """PPGD masks from sources of shape (C[+1],) or (T, C[+1]) broadcast over the batch."""
    masks: dict[str, Array] = {}
    delta_masks: dict[str, Array] | None = {} if delta else None
    for path, ci in ci_lower.items():
        C = ci.shape[-1]
        s = expand_left(sources[path], ci.ndim).astype(ci.dtype)
        masks[path] = ci + (1 - ci) * s[..., :C]
        if delta_masks is not None:
            delta_masks[path] = jnp.broadcast_to(s[..., C], ci.shape[:-1])
    return masks, delta_masks


# ---------------------------------------------------------------------------------------------
# loss terms


def faithfulness_loss(weights: Dict, components: Components) -> Array:
    """sum_s ||W_s - V_s U_s||_F^2 / sum_s numel(W_s), over the sites in `components`."""
    total = jnp.zeros((), jnp.float32)
    numel = 0
    for path, comp in components.items():
        V, U = comp["V"].astype(jnp.float32), comp["U"].astype(jnp.float32)
        diff = weights[path].astype(jnp.float32) - V @ U
        total = total + jnp.sum(diff * diff)
        numel += diff.size
    return total / numel


def p_at(loss_cfg: LossConfig, step_frac: Array | float) -> Array | float:
    """p, annealed linearly from `p` to `p_final` between fractions `p_anneal_start` and
    `p_anneal_end` of training (constant `p` when `p_final` is None), as goodfire-ai/spd's
    `_get_linear_annealed_p`: p before the start, p_final from the end on."""
    if loss_cfg.p_final is None:
        return loss_cfg.p
    start, end = loss_cfg.p_anneal_start, loss_cfg.p_anneal_end
    step_frac = jnp.asarray(step_frac, jnp.float32)
    progress = jnp.clip((step_frac - start) / max(end - start, 1e-12), 0.0, 1.0)
    progress = jnp.where(step_frac >= end, 1.0, progress)
    return loss_cfg.p + (loss_cfg.p_final - loss_cfg.p) * progress


def importance_sums(ci_upper: Dict, p: Array | float, eps: float) -> dict[str, Array]:
    """S_c = sum over all leading axes of (ci_upper + eps)^p, per site (C,)."""
    return {
        path: jnp.sum(jnp.power(ci.astype(jnp.float32) + eps, p), axis=tuple(range(ci.ndim - 1)))
        for path, ci in ci_upper.items()
    }


def importance_minimality_loss(
    ci_upper: Dict,
    p: Array | float,
    eps: float,
    beta: float,
    totals: tuple[Mapping[str, Array], int] | None = None,
) -> Array:
    """sum_s sum_c [m_c + beta * m_c * log2(1 + S_c)], S_c = sum over all leading axes of
    (ci_upper + eps)^p, m_c = S_c / (number of examples x positions).

    With gradient accumulation the sums must cover the whole accumulated batch: `totals` =
    ({site: S_c over all micro-batches}, examples x positions of all of them), computed in a
    first pass. The term is then the first-order surrogate L'(S_total) * S_c(this micro-batch),
    whose gradients, summed over the micro-batches, equal the gradient of the loss of the
    whole batch (its value is not the loss; the step reports that from `totals`)."""
    total = jnp.zeros((), jnp.float32)
    for path, S_C in importance_sums(ci_upper, p, eps).items():
        if totals is None:
            ci = ci_upper[path]
            n_examples = ci.size // ci.shape[-1]
            m_C = S_C / n_examples
            site = jnp.sum(m_C)
            if beta:
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
        total = total + jnp.sum(m_C) + (beta * jnp.sum(m_C * jnp.log2(1 + S_C)) if beta else 0.0)
    return total


def stochastic_recon_loss(
    target: Any,
    params: Any,
    weights: Dict,
    components: Components,
    x: Array,
    clean_out: Array,
    ci_lower: Dict,
    key: Array,
    n_samples: int,
    sampling: str,
    delta: bool,
    out_kind: str,
) -> Array:
    """Mean over `n_samples` draws of D(f(x | all sites masked), f(x))."""
    total = jnp.zeros((), jnp.float32)
    for s in range(n_samples):
        masks, dmasks = stochastic_masks(jax.random.fold_in(key, s), ci_lower, sampling, delta)
        out = masked_forward(target, params, weights, components, x, masks, dmasks)
        total = total + output_distance(out_kind, out, clean_out)
    return total / n_samples


def stochastic_recon_layerwise_loss(
    target: Any,
    params: Any,
    weights: Dict,
    components: Components,
    x: Array,
    clean_out: Array,
    ci_lower: Dict,
    key: Array,
    n_samples: int,
    sampling: str,
    delta: bool,
    out_kind: str,
) -> Array:
    """Mean over samples and sites of D(f(x | only that site masked), f(x))."""
    total = jnp.zeros((), jnp.float32)
    for s in range(n_samples):
        masks, dmasks = stochastic_masks(jax.random.fold_in(key, s), ci_lower, sampling, delta)
        for path in masks:
            one = {path: masks[path]}
            one_d = None if dmasks is None else {path: dmasks[path]}
            out = masked_forward(target, params, weights, components, x, one, one_d)
            total = total + output_distance(out_kind, out, clean_out)
    return total / (n_samples * len(ci_lower))


def ppgd_recon_loss(
    target: Any,
    params: Any,
    weights: Dict,
    components: Components,
    x: Array,
    clean_out: Array,
    ci_lower: Dict,
    sources: Dict,
    delta: bool,
    out_kind: str,
) -> Array:
    """D of the forward with every site masked by its adversarial source."""
    masks, dmasks = source_masks(ci_lower, sources, delta)
    out = masked_forward(target, params, weights, components, x, masks, dmasks)
    return output_distance(out_kind, out, clean_out)


def ci_masked_recon_loss(
    target: Any,
    params: Any,
    weights: Dict,
    components: Components,
    x: Array,
    clean_out: Array,
    ci_lower: Dict,
    out_kind: str,
) -> Array:
    """D with mask = ci_lower at every site, no delta component."""
    out = masked_forward(target, params, weights, components, x, dict(ci_lower), None)
    return output_distance(out_kind, out, clean_out)


def unmasked_recon_loss(
    target: Any,
    params: Any,
    weights: Dict,
    components: Components,
    x: Array,
    clean_out: Array,
    ci_lower: Dict,
    out_kind: str,
) -> Array:
    """D with mask = 1 at every site, no delta component."""
    masks = {p: jnp.ones_like(ci) for p, ci in ci_lower.items()}
    out = masked_forward(target, params, weights, components, x, masks, None)
    return output_distance(out_kind, out, clean_out)


def l0_per_site(ci_lower: Dict, threshold: float) -> dict[str, Array]:
    """Mean number of components with ci > threshold per example/position, per site."""
    return {
        p: jnp.mean(jnp.sum((ci > threshold).astype(jnp.float32), axis=-1))
        for p, ci in ci_lower.items()
    }


# ---------------------------------------------------------------------------------------------
# the adversary's optimizer

ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-8  # goodfire-ai/spd's AdamPGDConfig defaults


def init_source_opt_state(sources: Dict, optimizer: str) -> dict[str, Any]:
    """{"count", "m", "v"} for Adam, {"count"} for sign steps (a plain dict, so it checkpoints
    and shards like the sources themselves)."""
    state: dict[str, Any] = {"count": jnp.zeros((), jnp.float32)}
    if optimizer == "adam":
        state["m"] = {p: jnp.zeros_like(s) for p, s in sources.items()}
        state["v"] = {p: jnp.zeros_like(s) for p, s in sources.items()}
    elif optimizer != "sign":
        raise ValueError(f"unknown source optimizer {optimizer!r}")
    return state


def source_ascent_step(
    sources: Dict,
    grads: Dict,
    opt_state: Mapping[str, Any],
    optimizer: str,
    lr: Array | float,
) -> tuple[dict[str, Array], dict[str, Any]]:
    """One ASCENT step on the sources (Adam with bias correction, or lr * sign(grad)), then
    projection onto [0, 1]. Written out rather than taken from optax so that it also runs under
    `jax_numpy_dtype_promotion="strict"` (optax's bias correction mixes int and float)."""
    count = opt_state["count"] + 1
    new_state: dict[str, Any] = {"count": count}
    if optimizer == "adam":
        m = {p: ADAM_B1 * opt_state["m"][p] + (1 - ADAM_B1) * g for p, g in grads.items()}
        v = {p: ADAM_B2 * opt_state["v"][p] + (1 - ADAM_B2) * g * g for p, g in grads.items()}
        c1 = 1 - jnp.power(ADAM_B1, count)
        c2 = 1 - jnp.power(ADAM_B2, count)
        direction = {p: (m[p] / c1) / (jnp.sqrt(v[p] / c2) + ADAM_EPS) for p in grads}
        new_state["m"], new_state["v"] = m, v
    elif optimizer == "sign":
        direction = {p: jnp.sign(g) for p, g in grads.items()}
    else:
        raise ValueError(f"unknown source optimizer {optimizer!r}")
    new = {p: jnp.clip(sources[p] + lr * direction[p], 0.0, 1.0) for p in sources}
    return new, new_state


# ---------------------------------------------------------------------------------------------
# entry points for the train stage

TERMS = (
    "faithfulness",
    "importance_minimality",
    "stochastic_recon",
    "stochastic_recon_layerwise",
    "ppgd_recon",
    "ci_masked_recon",
    "unmasked_recon",
)


@dataclass(frozen=True)
class SpdFns:
    """Closures over (target, sites, config); all pure and jit-able.

    - `loss(trainable, target_params, sources, x, key, step_frac) -> (total, metrics)`;
      `trainable = {"components": ..., "ci_fns": ...}`, x = `target.inputs(batch)`. Sources are
      NOT stop-gradient'ed here: d total / d sources = ppgd_recon coeff * d L_ppgd / d sources,
      should the step want the final source ascent from the main backward.
    - `faithfulness_loss(components, target_params) -> scalar` (warmup stage).
    - `ppgd_ascent(sources, src_opt_state, trainable, target_params, x, key, n_steps, lr=None)
      -> (sources, src_opt_state, metrics)`: n_steps (static) ascent steps on L_ppgd w.r.t. the
      sources with components and CI detached. `key` is unused (the adversary is deterministic)
      and kept for a stable signature. `lr` overrides `train.ppgd.lr` (e.g. a schedule value).
    - `source_step(sources, grads, src_opt_state, lr=None) -> (sources, src_opt_state)`: one
      ascent step (Adam or sign) followed by clipping to [0, 1].
    - `init_source_opt(sources)`: the source optimizer state, a dict: {"count", "m", "v"} for
      Adam (betas 0.9 / 0.999, eps 1e-8), {"count"} for sign steps.
    - `ci(components, ci_fns, target_params, x) -> (ci_lower, ci_upper)`.
    """

    paths: tuple[str, ...]
    loss: Callable[..., tuple[Array, dict[str, Array]]]
    faithfulness_loss: Callable[[Components, Any], Array]
    ppgd_ascent: Callable[..., tuple[dict[str, Array], Any, dict[str, Array]]]
    source_step: Callable[..., tuple[dict[str, Array], Any]]
    init_source_opt: Callable[[Dict], Any]
    ci: Callable[..., tuple[dict[str, Array], dict[str, Array]]]


def make_spd_fns(target: Any, site_C: Mapping[str, int], cfg: Config) -> SpdFns:
    paths = tuple(p for p in target.site_paths() if p in site_C)
    missing = set(site_C) - set(paths)
    if missing:
        raise ValueError(f"sites {sorted(missing)} are not sites of this target")
    dcfg, lcfg, pcfg = cfg.decomp, cfg.train.loss, cfg.train.ppgd
    kind, sigmoid, delta = dcfg.ci_fn.type, dcfg.sigmoid, dcfg.delta_component
    remat = cfg.train.remat
    out_kind = lcfg.output

    def site_weights(target_params: Any) -> dict[str, Array]:
        w = target.site_weights(target_params)
        return {p: jax.lax.stop_gradient(w[p]) for p in paths}

    def ci(components: Components, ci_fns: Any, target_params: Any, x: Array):
        _, site_inputs = clean_forward(target, target_params, x, paths)
        return compute_ci(components, ci_fns, site_inputs, kind, sigmoid, remat)

    def loss(
        trainable: Mapping[str, Any],
        target_params: Any,
        sources: Dict,
        x: Array,
        key: Array,
        step_frac: Array | float,
        imp_totals: tuple[Mapping[str, Array], int] | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        comps, ci_fns = trainable["components"], trainable["ci_fns"]
        weights = site_weights(target_params)
        clean_out, site_inputs = clean_forward(target, target_params, x, paths)
        ci_lower, ci_upper = compute_ci(comps, ci_fns, site_inputs, kind, sigmoid, remat)
        fwd = (target, target_params, weights, comps, x, clean_out, ci_lower)
        # Each random term gets its own fold of the key, so switching one term on or off
        # leaves the others' draws unchanged.
        compute: dict[str, Callable[[], Array]] = {
            "faithfulness": lambda: faithfulness_loss(weights, comps),
            "importance_minimality": lambda: importance_minimality_loss(
                ci_upper, p_at(lcfg, step_frac), lcfg.eps, lcfg.beta, imp_totals
            ),
            "stochastic_recon": lambda: stochastic_recon_loss(
                *fwd,
                jax.random.fold_in(key, 0),
                dcfg.n_mask_samples,
                dcfg.sampling,
                delta,
                out_kind,
            ),
            "stochastic_recon_layerwise": lambda: stochastic_recon_layerwise_loss(
                *fwd,
                jax.random.fold_in(key, 1),
                dcfg.n_mask_samples,
                dcfg.sampling,
                delta,
                out_kind,
            ),
            "ppgd_recon": lambda: ppgd_recon_loss(*fwd, sources, delta, out_kind),
            "ci_masked_recon": lambda: ci_masked_recon_loss(*fwd, out_kind),
            "unmasked_recon": lambda: unmasked_recon_loss(*fwd, out_kind),
        }
        total = jnp.zeros((), jnp.float32)
        metrics: dict[str, Array] = {}
        for name in TERMS:
            coeff = getattr(lcfg, name)
            if coeff > 0:
                value = compute[name]().astype(jnp.float32)
                metrics[name] = value
                total = total + coeff * value
        metrics["total"] = total
        for p, v in l0_per_site(jax.lax.stop_gradient(ci_lower), dcfg.ci_threshold).items():
            metrics[f"l0/{p}"] = v
        return total, metrics

    def faithfulness(components: Components, target_params: Any) -> Array:
        return faithfulness_loss(site_weights(target_params), components)

    def init_source_opt(sources: Dict) -> dict[str, Any]:
        return init_source_opt_state(sources, pcfg.optimizer)

    def source_step(
        sources: Dict, grads: Dict, opt_state: Mapping[str, Any], lr: Array | float | None = None
    ) -> tuple[dict[str, Array], dict[str, Any]]:
        return source_ascent_step(
            sources, grads, opt_state, pcfg.optimizer, pcfg.lr if lr is None else lr
        )

    def ppgd_ascent(
        sources: Dict,
        src_opt_state: Any,
        trainable: Mapping[str, Any],
        target_params: Any,
        x: Array,
        key: Array,
        n_steps: int,
        lr: Array | float | None = None,
    ) -> tuple[dict[str, Array], Any, dict[str, Array]]:
        del key
        if n_steps == 0:
            return dict(sources), src_opt_state, {}
        comps = jax.lax.stop_gradient(trainable["components"])
        ci_fns = jax.lax.stop_gradient(trainable["ci_fns"])
        weights = site_weights(target_params)
        clean_out, site_inputs = clean_forward(target, target_params, x, paths)
        ci_lower, _ = compute_ci(comps, ci_fns, site_inputs, kind, sigmoid, remat)
        ci_lower = jax.lax.stop_gradient(ci_lower)

        def objective(srcs: Dict) -> Array:
            return ppgd_recon_loss(
                target,
                target_params,
                weights,
                comps,
                x,
                clean_out,
                ci_lower,
                srcs,
                delta,
                out_kind,
            )

        def body(carry, _):
            srcs, opt = carry
            value, grads = jax.value_and_grad(objective)(srcs)
            srcs, opt = source_step(srcs, grads, opt, lr)
            return (srcs, opt), value

        (new_sources, new_opt), values = jax.lax.scan(
            body, (dict(sources), src_opt_state), None, length=n_steps
        )
        metrics = {"ppgd/loss_first": values[0], "ppgd/loss_last": values[-1]}
        return new_sources, new_opt, metrics

    return SpdFns(
        paths=paths,
        loss=loss,
        faithfulness_loss=faithfulness,
        ppgd_ascent=ppgd_ascent,
        source_step=source_step,
        init_source_opt=init_source_opt,
        ci=ci,
    )
