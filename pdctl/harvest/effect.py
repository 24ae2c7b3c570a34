"""A component's output effect: what it does to the next-token distribution where it fires.

For component c of site s and K of its firing positions (the harvest's uniform sample, so the
effect is an average over where it fires, not over its strongest cases), the CI-masked model
(every site's components masked by its CI, `evaluate`'s "ci_masked" forward) against the same
model with c's mask set to 0 at every position:

    effect[v] = mean_k ( log p_masked(v | x_<=t_k) - log p_ablated(v | x_<=t_k) )

in nats: positive for the tokens c raises, negative for those it lowers. One jitted program
serves every component (the ablated component is a one-hot argument, not a shape), on the
sequences the sampled positions sit in.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

TOP_TOKENS = 10


@lru_cache(maxsize=8)
def _effect_fn(target: Any, paths: tuple[str, ...], kind: str, sigmoid: str, sampling: str):
    from pdctl.science.spd.ci import compute_ci
    from pdctl.science.spd.evaluate import EVAL_KEY
    from pdctl.science.spd.losses import clean_forward, masked_forward

    def run(params, components, ci_fns, x, t, weight, keep):
        site_inputs = clean_forward(target, params, x, paths, prefix=False).site_inputs
        grouped = bool(getattr(target, "scan_layers", False))
        ci, _ = compute_ci(components, ci_fns, site_inputs, kind, sigmoid, "none", sampling,
                           jax.random.PRNGKey(EVAL_KEY), grouped)  # fmt: skip
        ablated = {p: c * keep[p] for p, c in ci.items()}
        rows = jnp.arange(x.shape[0])

        def logp(masks):
            logits = masked_forward(target, params, components, x, masks, None)
            return jax.nn.log_softmax(logits[rows, t].astype(jnp.float32), axis=-1)  # (K, V)

        diff = logp(ci) - logp(ablated)
        return jnp.sum(diff * weight[:, None], axis=0) / jnp.maximum(jnp.sum(weight), 1.0)

    return jax.jit(run)


def output_effects(
    target: Any,
    params: Any,
    components: dict[str, Any],
    ci_fns: Any,
    cfg: Any,
    windows: np.ndarray,
    chosen: list[tuple[str, int, np.ndarray]],
    k: int,
    check: Any = None,
    out: dict[tuple[str, int], np.ndarray] | None = None,
) -> dict[tuple[str, int], np.ndarray]:
    """{(site, component): effect (vocab,)} for each (site, component, positions) in `chosen`;
    positions index `windows` (n, T) flattened (window * T + t), at most `k` used. `check()`,
    when given, is called before each component (it may raise to stop); `out`, when given, is
    the dict filled (as each component is measured) and returned, so a caller that stops it
    has the effects measured so far."""
    d = cfg.decomp
    paths = tuple(components)
    fn = _effect_fn(target, paths, d.ci_fn.type, d.sigmoid, d.sampling)
    T = windows.shape[1]
    ones = {p: np.ones(c["V"].shape[1], np.float32) for p, c in components.items()}
    out = {} if out is None else out
    for site, c, positions in chosen:
        if check is not None:
            check()
        pos = np.asarray(positions[:k], np.int64)
        weight = np.zeros(k, np.float32)
        weight[: pos.size] = 1.0
        pos = np.resize(pos, k) if pos.size else np.zeros(k, np.int64)
        w, t = np.divmod(pos, T)
        keep = dict(ones)
        keep[site] = ones[site].copy()
        keep[site][c] = 0.0
        x, t_dev, weight_dev = jnp.asarray(windows[w]), jnp.asarray(t), jnp.asarray(weight)
        out[(site, c)] = np.asarray(fn(params, components, ci_fns, x, t_dev, weight_dev, keep))
    return out


def top_changes(effect: np.ndarray, n: int = TOP_TOKENS) -> dict[str, list[tuple[int, float]]]:
    """The `n` tokens most raised and most lowered (token id, nats), ties by token id."""
    ids = np.arange(effect.size)
    up = np.lexsort((ids, -effect))[:n]
    down = np.lexsort((ids, effect))[:n]
    return {
        "raised": [(int(i), float(effect[i])) for i in up if effect[i] > 0],
        "lowered": [(int(i), float(effect[i])) for i in down if effect[i] < 0],
    }
