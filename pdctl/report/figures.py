"""The report's figures: each a function of plain arrays that writes one PNG.

matplotlib's object API only (`Figure`, no pyplot): no global backend is switched, nothing is
drawn on a screen, and the PNG is rendered by Agg. Figures are saved at a fixed size (inches x
`DPI`, no tight bounding box), so every file's pixel size is known in advance: `size_of(name,
n_sites)` says what it is, and the tests pin it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pdctl.science.spd import evaluate

DPI = 100
WIDTH_IN = 12.0
ROW_IN = 3.0  # height of one row of per-site panels
SITE_COLS = 2  # per-site panels side by side
CI_MATRIX_IN = (9.0, 6.0)
TMS_COLS = 6
TMS_ROW_IN = 2.2
TMS_MAX_COMPONENTS = 10
CLUSTERS_IN = (9.0, 8.0)

# Keys of a metrics line that are bookkeeping or speed, not a quantity of the optimisation.
_NOT_PLOTTED = {
    "step",
    "finite",
    "max_bad_run",
    "bad_steps",
    "step_ms",
    "samples_per_s",
    "tokens_per_s",
    "tflops_per_s",
    "mfu",
    "total",  # the same value as `loss` in the SPD stages
}


def _figure(width_in: float, height_in: float) -> Figure:
    return Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, format="png")
    return path


def _grid_rows(n: int, cols: int) -> int:
    return max(1, math.ceil(n / cols))


def size_of(kind: str, n_panels: int = 1) -> tuple[int, int]:
    """(width, height) in pixels of a figure of `kind` with `n_panels` sites or components."""
    if kind == "curves":
        return round(WIDTH_IN * DPI), round(8.0 * DPI)
    if kind in ("l0", "eval_curves", "mmcs_ml2r", "by_layer"):
        return round(WIDTH_IN * DPI), round(4.5 * DPI)
    if kind == "ci_matrix":
        return round(CI_MATRIX_IN[0] * DPI), round(CI_MATRIX_IN[1] * DPI)
    if kind == "per_site":
        cols = min(SITE_COLS, max(1, n_panels))
        return round(WIDTH_IN * DPI), round(_grid_rows(n_panels, cols) * ROW_IN * DPI)
    if kind == "clusters":
        return round(CLUSTERS_IN[0] * DPI), round(CLUSTERS_IN[1] * DPI)
    if kind == "tms_2d":
        return round(WIDTH_IN * DPI), round(_grid_rows(n_panels, TMS_COLS) * TMS_ROW_IN * DPI)
    raise ValueError(f"unknown figure kind {kind!r}")


def site_figure(sites: Sequence[str]) -> tuple[str, int]:
    """(kind, n) of `size_of` for a per-site figure of `sites`: a panel per site, or for a whole
    model (more than `MAX_L0_LINES` sites, all in layers) a panel per matrix kind with a line
    per layer (`_layer_axes`)."""
    kinds = _whole_model(sites)
    return ("per_site", len(sites)) if kinds is None else ("by_layer", len(kinds))


def _kind_panels(
    kinds: Mapping[str, Mapping[int, str]], title: str
) -> tuple[Figure, list[tuple[Any, Mapping[int, str]]]]:
    """A whole model's figure: one panel per matrix kind side by side (a shared y axis), each
    titled with its kind; [(axes, {layer: site})] in the kinds' order."""
    fig = _figure(*(v / DPI for v in size_of("by_layer", len(kinds))))
    fig.suptitle(title)
    axes = fig.subplots(1, len(kinds), sharey=True, squeeze=False).ravel()
    panels = []
    for ax, (kind, layers) in zip(axes, sorted(kinds.items()), strict=True):
        ax.set_title(kind, fontsize="medium")
        ax.grid(alpha=0.3)
        panels.append((ax, layers))
    return fig, panels


def _layer_axes(sites: Sequence[str], title: str) -> tuple[Figure, list[tuple[Any, list]]] | None:
    """For a whole model (`site_figure` says "by_layer"): the figure and, per panel (matrix
    kind), its axes and [(layer, site, colour)] in layer order, the colour going with the
    layer (a colour bar says which); None for a figure with a panel per site."""
    kinds = _whole_model(sites)
    if kinds is None:
        return None
    import matplotlib
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    fig, panels = _kind_panels(kinds, title)
    top = max(max(layers) for layers in kinds.values()) or 1
    cmap = matplotlib.colormaps["viridis"]
    bar = ScalarMappable(Normalize(0, top), cmap)
    fig.colorbar(bar, ax=[ax for ax, _ in panels], label="layer", fraction=0.025, pad=0.01)
    return fig, [
        (ax, [(i, site, cmap(i / top)) for i, site in sorted(layers.items())])
        for ax, layers in panels
    ]


def _site_axes(fig: Figure, n: int) -> list[Any]:
    cols = min(SITE_COLS, max(1, n))
    axes = fig.subplots(_grid_rows(n, cols), cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return axes[:n]


def _log_if_useful(ax: Any, values: Sequence[float], min_ratio: float = 20.0) -> None:
    """Log y when every value is positive and they span more than a factor of `min_ratio`."""
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=np.float64)
    if v.size and v.min() > 0 and v.max() / v.min() > min_ratio:
        ax.set_yscale("log")


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


# ---- training curves -------------------------------------------------------------------------


def series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key` over the rows that hold it as a number."""
    pts = [
        (r["step"], float(r[key]))
        for r in rows
        if isinstance(r.get(key), int | float) and isinstance(r.get("step"), int | float)
    ]
    if not pts:
        return np.zeros(0), np.zeros(0)
    s, v = zip(*pts, strict=True)
    return np.asarray(s, dtype=np.float64), np.asarray(v, dtype=np.float64)


def curve_groups(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """The keys of the training log lines, grouped into the panels of `plot_curves`."""
    keys: list[str] = []
    for r in rows:
        keys.extend(k for k in r if k not in keys)
    groups: dict[str, list[str]] = {"terms": [], "total": [], "lr": [], "grad_norm": []}
    for k in keys:
        if k in _NOT_PLOTTED or k.startswith(("l0/", "eval/")) or "memory" in k:
            continue
        if not any(isinstance(r.get(k), int | float) for r in rows):
            continue
        if k == "loss":
            groups["total"].append(k)
        elif k == "lr" or k.endswith("_lr") or k.startswith("lr/"):
            groups["lr"].append(k)
        elif k.startswith("grad_norm"):
            groups["grad_norm"].append(k)
        else:
            groups["terms"].append(k)
    return groups


def plot_curves(path: Path, rows: Sequence[Mapping[str, Any]], stage: str) -> Path:
    """2 x 2: loss terms, total loss, learning rates and gradient norm over steps."""
    groups = curve_groups(rows)
    fig = _figure(WIDTH_IN, 8.0)
    axes = fig.subplots(2, 2).ravel()
    titles = {
        "terms": "loss terms (unweighted)",
        "total": "total loss",
        "lr": "learning rate",
        "grad_norm": "gradient norm (global, before clipping)",
    }
    for ax, (name, keys) in zip(axes, groups.items(), strict=True):
        ax.set_title(titles[name])
        if not keys:
            _empty(ax, "not logged")
            continue
        everything: list[float] = []
        for k in keys:
            s, v = series(rows, k)
            ax.plot(s, v, label=k, lw=1.4, marker="." if len(s) < 30 else None)
            everything.extend(v.tolist())
        # losses and gradient norms fall over orders of magnitude; a learning rate schedule
        # reads better on a linear axis unless it decays exponentially
        _log_if_useful(ax, everything, 100.0 if name == "lr" else 2.0)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1 or name == "terms":
            ax.legend(fontsize="small")
    fig.suptitle(f"{stage}: metrics/{stage}.jsonl")
    return _save(fig, path)


def plot_l0(
    path: Path, rows: Sequence[Mapping[str, Any]], eval_rows: Sequence[Mapping[str, Any]]
) -> Path:
    """L0 (mean number of components with CI above the threshold) per site over steps: the
    training batches as lines, the evaluation batch as markers."""
    sites: list[str] = []
    for r in (*rows, *eval_rows):
        for k in r:
            site = k[len("l0/") :] if k.startswith("l0/") else None
            site = k[len("eval/l0/") :] if k.startswith("eval/l0/") else site
            if site and site not in sites:
                sites.append(site)
    by_layer = _whole_model(sites)
    if by_layer is not None:
        return _plot_l0_by_layer(path, by_layer, rows, eval_rows)
    fig = _figure(WIDTH_IN, 4.5)
    ax = fig.subplots()
    ax.set_title("L0 per site (components with CI > threshold, mean per input)")
    if not sites:
        _empty(ax, "no L0 logged")
        return _save(fig, path)
    everything: list[float] = []
    for i, site in enumerate(sites):
        color = f"C{i % 10}"
        s, v = series(rows, f"l0/{site}")
        if len(s):
            ax.plot(s, v, color=color, lw=1.4, label=f"{site} (train batch)")
            everything.extend(v.tolist())
        s, v = series(eval_rows, f"eval/l0/{site}")
        if len(s):
            ax.plot(s, v, color=color, ls="none", marker="o", label=f"{site} (eval batch)")
            everything.extend(v.tolist())
    _log_if_useful(ax, everything)
    ax.set_xlabel("step")
    ax.set_ylabel("L0")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncols=2 if len(sites) > 4 else 1)
    return _save(fig, path)


MAX_L0_LINES = 12  # more sites than this, in layers: L0 against the layer instead (`_by_layer`)
_LAYER = re.compile(r"^(.*?\blayers?)\.(\d+)\.(.+)$")


def _whole_model(sites: Sequence[str]) -> dict[str, dict[int, str]] | None:
    """`_by_layer` of a whole model's sites (more than `MAX_L0_LINES`), else None: the
    figures draw those against the layer instead of a line or panel per site."""
    return _by_layer(sites) if len(sites) > MAX_L0_LINES else None


def _by_layer(sites: Sequence[str]) -> dict[str, dict[int, str]] | None:
    """{kind: {layer: site}} when every site is a layer's (`model.layers.3.mlp.down_proj`:
    kind `mlp.down_proj`) and there are at most 7 kinds (a Llama block's matrices); else
    None."""
    kinds: dict[str, dict[int, str]] = {}
    for site in sites:
        m = _LAYER.match(site)
        if m is None:
            return None
        kinds.setdefault(m.group(3), {})[int(m.group(2))] = site
    return kinds if len(kinds) <= 7 else None


def _plot_l0_by_layer(
    path: Path,
    kinds: Mapping[str, Mapping[int, str]],
    rows: Sequence[Mapping[str, Any]],
    eval_rows: Sequence[Mapping[str, Any]],
) -> Path:
    """A whole model's L0: one panel per matrix kind, L0 against the layer, one line per
    evaluation (the eval batch; without evaluations, up to 6 logged training steps), darker
    the later: a legend of 90 sites would cover the plot."""
    src, prefix = (eval_rows, "eval/l0/") if eval_rows else (rows, "l0/")
    steps = [r for r in src if any(k.startswith(prefix) for k in r)]
    if not eval_rows and len(steps) > 6:
        steps = [steps[round(i * (len(steps) - 1) / 5)] for i in range(6)]
    what = "evaluation batch" if eval_rows else "training batch"
    fig, panels = _kind_panels(kinds, f"L0 per site against the layer ({what}; darker: later step)")
    axes = [ax for ax, _ in panels]
    everything: list[float] = []
    for ax, layers in panels:
        for j, r in enumerate(steps):
            pts = [(i, r.get(prefix + site)) for i, site in sorted(layers.items())]
            pts = [(i, float(v)) for i, v in pts if isinstance(v, int | float)]
            if not pts:
                continue
            x, y = zip(*pts, strict=True)
            shade = 0.25 + 0.75 * (j + 1) / len(steps)
            ax.plot(x, y, marker=".", lw=1.2, color=(0.1, 0.2, 0.6, shade),
                    label=f"step {r.get('step')}")  # fmt: skip
            everything.extend(y)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel("L0")
    if everything:
        _log_if_useful(axes[0], everything)
        axes[-1].legend(fontsize="x-small")
    else:
        _empty(axes[0], "no L0 logged")
    return _save(fig, path)


def plot_eval_curves(path: Path, eval_rows: Sequence[Mapping[str, Any]], toy: bool) -> Path:
    """The periodic evaluations over steps. Toys: CI errors and MMCS per site. LMs: CE and
    KL of the masked models, the fresh-PGD masking's drawn thicker."""
    keys: list[str] = []
    for r in eval_rows:
        keys.extend(k for k in r if k not in keys)
    if toy:
        left = [k for k in keys if k.startswith("eval/ci_errors/")]
        right = [k for k in keys if k.startswith("eval/mmcs/")]
        titles = ("CI errors on one-hot inputs", "MMCS (target vs components)")
    else:
        left = [k for k in keys if k.startswith("eval/ce_") and "_difference" not in k]
        left = [k for k in left if "_unrecovered" not in k]
        right = [k for k in keys if k.startswith("eval/kl_")]
        titles = ("CE of the masked models", "KL(target || masked)")
    fig = _figure(WIDTH_IN, 4.5)
    axes = fig.subplots(1, 2)
    for ax, group, title in zip(axes, (left, right), titles, strict=True):
        ax.set_title(title)
        if not group:
            _empty(ax, "not evaluated")
            continue
        everything: list[float] = []
        for k in group:
            s, v = series(eval_rows, k)
            robust = k.endswith("_pgd")  # the fresh-PGD masking: the robustness figure
            label = k[len("eval/") :] + (" (fresh PGD)" if robust else "")
            ax.plot(s, v, marker="o", lw=2.4 if robust else 1.2, label=label)
            everything.extend(v.tolist())
        if not toy:
            _log_if_useful(ax, everything)
        elif group is left:
            ax.set_ylim(bottom=0)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        else:
            ax.ticklabel_format(axis="y", useOffset=False)
            ax.set_ylim(min([0.9, *[x for x in everything if np.isfinite(x)]]) - 0.02, 1.01)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path)


# ---- CI on one-hot inputs (toys) -------------------------------------------------------------


def permute_ci(ci: np.ndarray, pattern: tuple[str, int]) -> tuple[np.ndarray, np.ndarray, int]:
    """(permuted matrix, column order, matched columns) of a (features x components) CI matrix.

    Identity pattern: the columns the Hungarian assignment of `evaluate.identity_assignment`
    (the one the CI-error count uses) matches to features 0, 1, ... come first, in feature
    order, so a correct decomposition shows the identity in its leading square; the unmatched
    components follow, most important first. Dense pattern (k co-firing components): columns
    sorted by total CI, as `evaluate.dense_ci_errors` orders them."""
    ci = np.asarray(ci, dtype=np.float64)
    finite = np.nan_to_num(ci, nan=0.0, posinf=1.0, neginf=0.0)
    kind, k = pattern
    if kind == "identity":
        rows, cols = evaluate.identity_assignment(finite)
        matched = [int(c) for c in cols[np.argsort(rows, kind="stable")]]
        rest = [c for c in np.argsort(-finite.max(axis=0), kind="stable") if c not in matched]
        order = np.asarray(matched + [int(c) for c in rest], dtype=np.int64)
        n_matched = len(matched)
    else:
        order = np.argsort(-finite.sum(axis=0), kind="stable").astype(np.int64)
        n_matched = min(k, ci.shape[1])
    return ci[:, order], order, n_matched


def plot_ci_matrix(
    png: Path,
    ci: np.ndarray,
    alive: np.ndarray | None,
    site: str,
    pattern: tuple[str, int],
    threshold: float,
) -> tuple[Path, Path]:
    """The site's CI on one-hot inputs, columns permuted by `permute_ci`, with a strip above
    marking the components alive on the evaluation batch. Writes the PNG and, beside it, an
    .npz with the data behind it (`ci`, `ci_permuted`, `order`, `alive`, `alive_permuted`,
    `pattern`, `matched`, `ci_errors`)."""
    permuted, order, n_matched = permute_ci(ci, pattern)
    errors = evaluate.pattern_errors(np.asarray(ci), pattern)
    n_features, C = permuted.shape
    alive_arr = np.ones(C, bool) if alive is None else np.asarray(alive, bool)
    npz = png.with_suffix(".npz")
    np.savez(
        npz,
        ci=np.asarray(ci, np.float32),
        ci_permuted=permuted.astype(np.float32),
        order=order,
        alive=alive_arr,
        alive_permuted=alive_arr[order],
        pattern=np.asarray(f"{pattern[0]}:{pattern[1]}"),
        matched=np.asarray(n_matched),
        ci_errors=np.asarray(errors),
        threshold=np.asarray(threshold),
    )
    fig = _figure(*CI_MATRIX_IN)
    strip, ax = fig.subplots(2, 1, height_ratios=(1, 14), sharex=True)
    strip.imshow(
        alive_arr[order][None, :].astype(float),
        aspect="auto",
        cmap=ListedColormap(["#dddddd", "#2ca02c"]),
        vmin=0,
        vmax=1,
        interpolation="nearest",
    )
    strip.set_yticks([0], ["alive" if alive is not None else "alive: n/a"])
    strip.tick_params(axis="x", bottom=False, labelbottom=False)
    n_alive = int(alive_arr.sum())
    how = "Hungarian match first" if pattern[0] == "identity" else "sorted by total CI"
    fig.suptitle(
        f"{site}: CI on one-hot inputs of magnitude {evaluate.TOY_INPUT_MAGNITUDE}; "
        f"CI errors {errors:g}\n"
        f"columns permuted ({how}); {n_alive}/{C} components alive (green: CI > "
        f"{threshold:g} on the evaluation batch)",
        fontsize="medium",
    )
    im = ax.imshow(permuted, aspect="auto", cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    if 0 < n_matched < C:
        ax.axvline(n_matched - 0.5, color="tab:red", lw=1, ls="--")
    ax.set_xlabel(f"component (permuted; original index on the ticks; {n_matched} matched)")
    ax.set_ylabel("input feature (one-hot)")
    if C <= 48:
        ax.set_xticks(range(C), [str(int(c)) for c in order], fontsize="x-small")
    if n_features <= 48:
        ax.set_yticks(range(n_features))
    fig.colorbar(im, ax=[strip, ax], label="CI (lower-leaky)", shrink=0.8)
    _save(fig, png)
    return png, npz


def plot_mmcs_ml2r(path: Path, values: Mapping[str, tuple[float, float]]) -> Path:
    """Per site: mean-max cosine similarity and mean L2 ratio of the best-matching rank-one
    components against the target's feature directions (1 and 1 for a perfect match)."""
    fig = _figure(WIDTH_IN, 4.5)
    axes = fig.subplots(1, 2)
    sites = list(values)
    for ax, j, title in zip(axes, (0, 1), ("MMCS", "ML2R"), strict=True):
        v = [values[s][j] for s in sites]
        bars = ax.bar(range(len(sites)), v, color="tab:blue" if j == 0 else "tab:orange")
        ax.bar_label(bars, fmt="%.3f", fontsize="small")
        ax.axhline(1.0, color="0.3", lw=1, ls="--")
        ax.set_xticks(range(len(sites)), sites, rotation=20 if len(sites) > 4 else 0)
        ax.set_title(
            title + (" (cosine, best component per feature)" if j == 0 else " (norm ratio)")
        )
        top = max([1.0, *[x for x in v if np.isfinite(x)]])
        ax.set_ylim(min(0.0, *[x for x in v if np.isfinite(x)]), top * 1.15)
    return _save(fig, path)


# ---- every target ----------------------------------------------------------------------------


def plot_component_norms(
    path: Path, norms: Mapping[str, np.ndarray], alive: Mapping[str, np.ndarray] | None
) -> Path:
    """Per site: ||V[:, c]|| * ||U[c, :]|| (the Frobenius norm of the rank-one component),
    sorted, alive components in colour. A whole model: a line per layer (`_layer_axes`)."""
    layered = _layer_axes(list(norms), "component norms ||V_c|| ||U_c||, sorted; a line per layer")
    if layered is not None:
        fig, panels = layered
        values: list[float] = []
        for ax, lines in panels:
            for _, site, color in lines:
                n = np.sort(np.asarray(norms[site], np.float64))[::-1]
                ax.plot(np.arange(n.size), n, color=color, lw=0.8)
                values.extend(n.tolist())
            ax.set_xlabel("component (sorted by norm)")
        panels[0][0].set_ylabel("||V_c|| ||U_c||")
        _log_if_useful(panels[0][0], values)
        return _save(fig, path)
    fig = _figure(*(v / DPI for v in size_of("per_site", len(norms))))
    for ax, (site, n) in zip(_site_axes(fig, len(norms)), norms.items(), strict=True):
        n = np.asarray(n, np.float64)
        order = np.argsort(-n, kind="stable")
        a = np.ones(n.shape, bool) if alive is None or site not in alive else alive[site]
        colors = np.where(np.asarray(a)[order], "tab:green", "0.7")
        ax.bar(np.arange(n.size), n[order], color=colors, width=1.0)
        ax.set_xlim(-0.5, n.size - 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _log_if_useful(ax, n.tolist())
        ax.set_title(f"{site}: component norms (green: alive)", fontsize="medium")
        ax.set_xlabel("component (sorted by norm)")
        ax.set_ylabel("||V_c|| ||U_c||")
    return _save(fig, path)


def plot_ci_histograms(
    path: Path, hist: Mapping[str, np.ndarray], edges: np.ndarray, threshold: float
) -> Path:
    """Per site: the distribution of CI values over every (input, position, component) of the
    evaluation batch, log counts. A whole model: a line per layer (`_layer_axes`)."""
    layered = _layer_axes(list(hist), f"CI values (threshold {threshold:g}); a line per layer")
    if layered is not None:
        fig, panels = layered
        for ax, lines in panels:
            for _, site, color in lines:
                ax.stairs(np.asarray(hist[site], np.float64), edges, color=color, lw=0.8)
            ax.axvline(threshold, color="tab:red", lw=1, ls="--")
            ax.set_yscale("log")
            ax.set_xlabel("CI (lower-leaky)")
        panels[0][0].set_ylabel("count")
        return _save(fig, path)
    fig = _figure(*(v / DPI for v in size_of("per_site", len(hist))))
    for ax, (site, counts) in zip(_site_axes(fig, len(hist)), hist.items(), strict=True):
        counts = np.asarray(counts, np.float64)
        ax.stairs(counts, edges, fill=True, color="tab:blue", alpha=0.8)
        if counts.max(initial=0) > 0:
            ax.set_yscale("log")
        ax.axvline(threshold, color="tab:red", lw=1, ls="--")
        ax.set_title(f"{site}: CI values (threshold {threshold:g})", fontsize="medium")
        ax.set_xlabel("CI (lower-leaky)")
        ax.set_ylabel("count")
    return _save(fig, path)


def plot_activation_density(
    path: Path, density: Mapping[str, np.ndarray], threshold: float, n_inputs: int
) -> Path:
    """Per site: for each component, the fraction of evaluation inputs (positions, for LMs)
    with CI > threshold, sorted. A whole model: a line per layer (`_layer_axes`)."""
    layered = _layer_axes(
        list(density), f"activation density (CI > {threshold:g}), sorted; a line per layer"
    )
    if layered is not None:
        fig, panels = layered
        for ax, lines in panels:
            for _, site, color in lines:
                d = np.sort(np.asarray(density[site], np.float64))[::-1]
                ax.plot(np.arange(d.size)[d > 0], d[d > 0], color=color, lw=0.8)
            ax.set_yscale("log")
            ax.set_ylim(1.0 / max(n_inputs, 1) / 2, 1.5)
            ax.set_xlabel("component (sorted)")
        panels[0][0].set_ylabel(f"fraction of {n_inputs} inputs")
        return _save(fig, path)
    fig = _figure(*(v / DPI for v in size_of("per_site", len(density))))
    for ax, (site, d) in zip(_site_axes(fig, len(density)), density.items(), strict=True):
        d = np.sort(np.asarray(d, np.float64))[::-1]
        x = np.arange(d.size)
        pos = d > 0
        ax.bar(x[pos], d[pos], width=1.0, color="tab:purple")
        if pos.any():
            ax.set_yscale("log")
            ax.set_ylim(min(d[pos].min(), 1.0 / max(n_inputs, 1)) / 2, 1.5)
        else:
            _empty(ax, "no component above the threshold")
        ax.set_xlim(-0.5, d.size - 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        dead = int((~pos).sum())
        ax.set_title(
            f"{site}: activation density ({dead}/{d.size} never > {threshold:g})",
            fontsize="medium",
        )
        ax.set_xlabel("component (sorted)")
        ax.set_ylabel(f"fraction of {n_inputs} inputs")
    return _save(fig, path)


def tms_panels(C: int) -> int:
    """Panels of `plot_tms_2d` for C components: the target, the sum, and at most
    TMS_MAX_COMPONENTS components."""
    return 2 + min(C, TMS_MAX_COMPONENTS)


def plot_tms_2d(
    path: Path, W: np.ndarray, V: np.ndarray, U: np.ndarray, alive: np.ndarray | None
) -> Path:
    """TMS with n_hidden = 2 (`linear1`, W: n_features x 2): the target's feature directions
    (rows of W), the sum of the rank-one components (rows of V U), and per component c the
    vectors V[f, c] U[c, :] for every feature f, over the target's directions in grey.
    Components are shown largest first (sum over features of the vectors' norms)."""
    W, V, U = (np.asarray(a, np.float64) for a in (W, V, U))
    n_features = V.shape[0]
    per_comp = V.T[:, :, None] * U[:, None, :]  # (C, F, 2)
    size = np.linalg.norm(per_comp, axis=-1).sum(axis=1)
    shown = np.argsort(-size, kind="stable")[:TMS_MAX_COMPONENTS]
    panels = [("target W (rows)", W), ("sum of components (V U)", V @ U)]
    for c in shown:
        mark = "" if alive is None else (" alive" if alive[c] else " dead")
        panels.append((f"component {int(c)}{mark}", per_comp[c]))
    lim = 1.15 * max(np.abs(W).max(initial=0), np.abs(V @ U).max(initial=0), 1e-6)
    n = len(panels)
    fig = _figure(*(v / DPI for v in size_of("tms_2d", n)))
    axes = fig.subplots(_grid_rows(n, TMS_COLS), TMS_COLS, squeeze=False).ravel()
    colors = [f"C{f % 10}" for f in range(n_features)]
    for ax, (title, vecs) in zip(axes, panels, strict=False):
        for f in range(n_features):
            ax.plot([0, W[f, 0]], [0, W[f, 1]], color="0.85", lw=3, zorder=1)
        for f in range(n_features):
            ax.plot([0, vecs[f, 0]], [0, vecs[f, 1]], color=colors[f], lw=1.5, zorder=2)
            ax.scatter([vecs[f, 0]], [vecs[f, 1]], color=colors[f], s=10, zorder=3)
        ax.set_xlim(-lim, lim)
        ax.set_ylim(-lim, lim)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(title, fontsize="small")
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle("linear1 in the 2-D hidden space: colour = feature; grey = target directions")
    return _save(fig, path)


def plot_clusters(path: Path, S: np.ndarray, names: Sequence[str], sizes: Sequence[int]) -> Path:
    """`pdctl cluster`: the Jaccard similarity of firing between the members of the clusters
    of two or more (`S`, members in cluster order, `sizes` per cluster), each cluster's block
    outlined; members are named on the axes while there are at most 40."""
    from matplotlib.patches import Rectangle

    S = np.asarray(S, np.float64)
    fig = _figure(*CLUSTERS_IN)
    ax = fig.subplots()
    im = ax.imshow(S, cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    lo = 0
    for n in sizes:
        ax.add_patch(Rectangle((lo - 0.5, lo - 0.5), n, n, fill=False, ec="tab:red", lw=1.2))
        lo += n
    if len(names) <= 40:
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize="x-small")
        ax.set_yticks(range(len(names)), names, fontsize="x-small")
    else:
        ax.set_xlabel("component (cluster order)")
        ax.set_ylabel("component (cluster order)")
    fig.colorbar(im, ax=ax, label="Jaccard (fire together / either fires)")
    ax.set_title(f"{len(sizes)} clusters of two or more components ({len(names)} components)")
    return _save(fig, path)
