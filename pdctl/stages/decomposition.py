"""The decomposition, below every stage that makes or reads one: which sites are decomposed and
with how many components (`decomposed_sites`), the shapes of what init-weights creates
(`abstract_decomposition`, computed without running anything), the nonlinearity-aligned init
(`aligned_components`), warmup's result when it ran with `steps = 0` and saved none
(`warmup_kept_init`, `warmup_components`), and a finished stage's decomposition read back onto
the host (`load_decomposition`) for report, harvest and the benchmarks, with the decoder of the
run's tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import numpy as np

from pdctl.config import Config, match_sites, ppgd_source_layout
from pdctl.engine import sharding
from pdctl.engine.init import grouped_init
from pdctl.errors import PdctlError
from pdctl.project import Project
from pdctl.registry import command
from pdctl.science.spd import components as comps
from pdctl.science.targets import Target
from pdctl.stages.inputs import (
    STREAM_DECOMP,
    as_trained,
    decomp_layout,
    stream_key,
    target_from_config,
)

# ---- the decomposition's shape ----------------------------------------------------------------


def source_shape(cfg: Config, C: int) -> tuple[int, ...]:
    """One site's persistent PPGD source: leading axes by scope, then C (+1 delta)."""
    n = C + 1 if cfg.decomp.delta_component else C
    return (*ppgd_source_layout(cfg)["leading"], n)


def decomposed_sites(cfg: Config, target: Target) -> dict[str, tuple[int, int, int]]:
    """{path: (d_in, d_out, C)} of the configured sites, in the target's forward order.

    Sites whose matrices the target ties (TMS linear2 = linear1.T) get tied components, so both
    need the same C."""
    shapes = target.site_shapes()
    sites = {p: (*shapes[p], C) for p, C in match_sites(cfg, target.site_paths()).items()}
    if cfg.decomp.init == "nonlinearity_aligned":
        aligned_sites(cfg, target, sites)
    for tied, src in comps.component_ties(target.tied_sites(), sites).items():
        if sites[tied][2] != sites[src][2]:
            raise PdctlError(
                f"decomp.sites: {tied} is {src} transposed in this {target.kind} target, so "
                f"their components are tied and need the same C (got {sites[tied][2]} and "
                f"{sites[src][2]})"
            )
    return sites


def aligned_sites(
    cfg: Config, target: Target, sites: dict[str, tuple[int, int, int]]
) -> dict[str, str]:
    """{site: side of W its MLP neurons index} of the decomposed sites that `decomp.init =
    "nonlinearity_aligned"` aligns (the MLP projections; other sites keep the random init).
    A config with none of them, or with more components than a site has entries, is an error."""
    sides = target.mlp_neuron_sides()
    out = {p: sides[p] for p in sites if p in sides}
    if not out:
        mlp = ", ".join(list(sides)[:4]) or "none"
        raise PdctlError(
            "decomp.init: 'nonlinearity_aligned' aligns components with MLP neurons, but no "
            f"decomposed site of this {target.kind} target is an MLP projection (its MLP "
            f"sites: {mlp})"
        )
    for p in out:
        d_in, d_out, C = sites[p]
        if d_in * d_out < C:
            raise PdctlError(
                f"decomp.sites: {p} has C = {C}, more components than its {d_in} x {d_out} "
                "matrix has entries; nonlinearity_aligned init gives every component some"
            )
    return out


def site_layout(cfg: Config, target: Target) -> tuple[tuple[str, ...], dict[str, str]]:
    """(decomposed site paths in forward order, {tied site: source site})."""
    sites = decomposed_sites(cfg, target)
    paths = tuple(p for p in target.site_paths() if p in sites)
    return paths, comps.component_ties(target.tied_sites(), sites)


def abstract_decomposition(cfg: Config, target: Target) -> dict[str, Any]:
    """Shapes and dtypes of what init-weights creates ({"components", "ci_fns", "sources"},
    `init_weights.init_decomposition`), without computing anything."""
    sites = decomposed_sites(cfg, target)
    dtype = jax.numpy.dtype(cfg.precision.param_dtype)
    hidden = cfg.decomp.ci_fn.arch()
    key = jax.random.PRNGKey(0)

    ties = comps.component_ties(target.tied_sites(), sites)
    kind = cfg.decomp.ci_fn.type
    site_hidden = comps.site_ci_arch(kind, hidden, [s[0] for s in sites.values()])

    def build(key):
        ci_fns = {p: comps.init_ci_fn(key, kind, s[0], s[2], site_hidden) for p, s in sites.items()}
        shared = comps.init_shared_ci_fn(key, kind, hidden)  # the global CI function's trunk
        if shared is not None:
            ci_fns[comps.SHARED_CI_KEY] = shared
        return {
            "components": {
                p: comps.init_site_components(key, *s, dtype)
                for p, s in sites.items()
                if p not in ties
            },
            "ci_fns": ci_fns,
            "sources": {
                p: comps.init_source(key, source_shape(cfg, s[2]), cfg.train.ppgd.sigmoid)
                for p, s in sites.items()
            },
        }

    return jax.eval_shape(build, key)


# ---- the nonlinearity-aligned init (computed from the trained target's weights) -----------------


def aligned_components(
    cfg: Config, target: Target, mesh, params: Any, components: dict[str, Any]
) -> tuple[dict[str, Any], list[str], int]:
    """(`components` with the MLP sites' aligned to the target weights in `params`, the sites
    aligned, how many of them have V U = W exactly). Seeded with the sites' component keys
    (`site_keys`), grouped and vmapped as the random init (`engine.init.grouped_init`),
    bit-identical to calling `components.aligned_site_components` site by site."""
    sites = decomposed_sites(cfg, target)
    aligned = aligned_sites(cfg, target, sites)
    order = list(sites)
    comp_keys, _, _ = comps.site_keys(stream_key(cfg, STREAM_DECOMP), len(order))
    weights = target.site_weights(params)
    names = [p for p in order if p in aligned]
    dtype = jax.numpy.dtype(cfg.precision.param_dtype)
    out, _ = grouped_init(
        _aligned,
        names,
        [(sites[p][2], aligned[p], tuple(weights[p].shape), dtype) for p in names],
        comp_keys[jax.numpy.asarray([order.index(p) for p in names])],
        mesh,
        decomp_spec_fn(cfg, target, mesh),
        arrays=[weights[p] for p in names],
    )
    n_exact = sum(sites[p][2] == sites[p][0 if aligned[p] == "in" else 1] for p in names)
    return {**components, **out}, names, n_exact


def _aligned(key, W, C, side, shape, dtype):
    return comps.aligned_site_components(key, W, C, side, dtype)


def decomp_spec_fn(cfg: Config, target: Target, mesh):
    """path, shape -> the PartitionSpec of a decomposition array on `mesh` (`grouped_init`'s)."""
    return partial(
        sharding.spec_for,
        fsdp=sharding.axis_size(mesh, "fsdp"),
        tp=sharding.axis_size(mesh, "tp"),
        min_size=cfg.mesh.fsdp_min_param_size,
        decomp=decomp_layout(cfg, mesh, target),
    )


# ---- warmup at `steps = 0`: its result is where it starts ------------------------------------

# `[state.warmup] components_from`: warmup ran with `steps = 0` and saved no checkpoint; its
# components are init-weights' (nonlinearity-aligned where `[decomp] init` says so)
KEPT_INIT = "init_weights"


def warmup_kept_init(project: Project) -> bool:
    """Warmup is done with `steps = 0` and no checkpoint of its own (`stages.runner._run_idle`):
    whoever reads its components builds them from init-weights' checkpoint, as warmup starts
    (`warmup.start_components` on the devices, `warmup_components` on the host)."""
    st = project.stage("warmup")
    return st.get("status") == "done" and st.get("components_from") == KEPT_INIT


def warmup_components(
    project: Project, target: Any | None = None, params: Any | None = None
) -> dict[str, Any]:
    """Warmup's components on the host when it ran with `steps = 0` (`warmup_kept_init`):
    init-weights' (tied sites folded), the MLP sites nonlinearity-aligned to the trained target
    `params` where `[decomp] init` says so; the same bits as `warmup.start_components` (the
    aligned init does no float arithmetic but w * 1 and w * 0). Raises LookupError when
    init-weights or pretrain changed since warmup ran: what it stood for is gone."""
    changed = project.rerun_upstream("warmup") or [
        s for s in ("init_weights", "pretrain") if project.is_stale(s)
    ]
    if changed:
        raise LookupError(
            f"warmup ran with steps = 0 (its components are init-weights', not saved) and "
            f"{', '.join(changed)} changed since; rerun `pdctl {command('warmup')}`"
        )
    cfg = project.config
    components = _restore(project, "init_weights", ["components"])[0]["components"]
    if cfg.decomp.init != "nonlinearity_aligned":
        return components
    target = target if target is not None else target_from_config(cfg, project.root)
    params = params if params is not None else target_params(project, target)
    mesh = sharding.make_mesh(1, 1, jax.local_devices()[:1])
    aligned, _, _ = aligned_components(cfg, target, mesh, params, components)
    return _host(aligned)


# ---- a finished stage's decomposition, on the host --------------------------------------------


@dataclass
class Decomposition:
    """A decomposition on the host: the target and its trained parameters, every site's
    components (tied sites expanded) and the CI functions, from checkpoint `step` of `stage`.
    The target runs as the train stage's evaluation ran it (`inputs.as_trained`: scanned over
    layers by `[train] scan_layers`), so what reads it (harvest, report, attributions)
    compiles the program the run was sized and timed with, not the unrolled one (on a v5e the
    unrolled all-MLP train step had not compiled after 518 s; a harvest of that run, read
    unrolled, had not finished after 250 s)."""

    target: Any
    params: Any
    components: dict[str, dict[str, np.ndarray]]
    ci_fns: dict[str, Any]
    stage: str
    step: int
    site_C: dict[str, int] = field(default_factory=dict)


def _host(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


def _restore(
    project: Project, stage: str, names: list[str], step: int | None = None
) -> tuple[dict[str, Any], int]:
    """Items of `stage`'s latest complete checkpoint (or of checkpoint `step`), as host arrays.

    Read-only on purpose: no CheckpointManager, whose opening cleans up temporary directories
    (an in-flight save of a stage running right now) and creates missing ones."""
    import orbax.checkpoint as ocp

    from pdctl.engine.checkpoint import read_host
    from pdctl.science.spd.stacked import per_site_tree

    directory = project.checkpoint_dir(stage)
    found = ocp.step.standard_name_format().find_all(directory) if directory.is_dir() else []
    steps = sorted(found, key=lambda m: m.step)
    if not steps:
        raise LookupError(f"{stage} has no checkpoint (run `pdctl {command(stage)}`)")
    latest = steps[-1]
    if step is not None:
        latest = next((m for m in steps if int(m.step) == step), None)
        if latest is None:
            have = ", ".join(str(int(m.step)) for m in steps)
            raise LookupError(f"{stage} has no checkpoint {step} (its checkpoints: {have})")
    try:
        step = int(latest.step)
        # a train state's stacked sites come out per site (`science.spd.stacked`)
        return {n: per_site_tree(read_host(directory, step, n)) for n in names}, step
    except Exception as e:  # orbax raises many kinds; the report lists it and goes on
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise LookupError(f"{stage} checkpoint {latest.step} is unreadable ({reason})") from None


def target_params(project: Project, target: Any) -> Any:
    """The decomposed target's parameters: pretrain's latest checkpoint, or for an imported
    Hugging Face model its safetensors (onto the first device)."""
    pre = project.stage("pretrain")
    if pre.get("status") == "imported":
        from pdctl.science.targets import imported

        abstract = jax.eval_shape(target.init, jax.random.PRNGKey(0))
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        imported.verify(target, pre)
        return _host(imported.load(target, jax.tree.map(lambda _: one, abstract)))
    items, _ = _restore(project, "pretrain", ["params"])
    return items["params"]


def load_decomposition(project: Project, stage: str, step: int | None = None) -> Decomposition:
    """The decomposition as `stage` (warmup or train) left it in its latest checkpoint (or in
    checkpoint `step`); the warmup stage's CI functions are init-weights' (warmup does not
    train them). Raises LookupError with a one-line reason when something is not there."""
    cfg = project.config
    target = target_from_config(cfg, project.root)
    site_C = match_sites(cfg, target.site_paths())
    paths = tuple(p for p in target.site_paths() if p in site_C)
    params = target_params(project, target)
    if stage == "train":
        items, step = _restore(project, "train", ["trainable"], step)
        free, ci_fns = items["trainable"]["components"], items["trainable"]["ci_fns"]
    elif stage == "warmup" and warmup_kept_init(project):
        if step not in (None, 0):
            raise LookupError(
                f"warmup has no checkpoint {step} (it ran with steps = 0: its components are "
                "init-weights', at step 0)"
            )
        free, step = warmup_components(project, target, params), 0
        ci_fns = _restore(project, "init_weights", ["ci_fns"])[0]["ci_fns"]
    elif stage == "warmup":
        items, step = _restore(project, "warmup", ["components"], step)
        free = items["components"]
        ci_fns = _restore(project, "init_weights", ["ci_fns"])[0]["ci_fns"]
    else:
        raise ValueError(f"no decomposition in stage {stage!r}")
    ties = comps.component_ties(target.tied_sites(), site_C)
    expanded = comps.expand_tied(free, ties, paths)
    trained = as_trained(cfg, target, step=False)
    return Decomposition(trained, params, expanded, ci_fns, stage, step, dict(site_C))


def token_decoder(project: Project, target: Any) -> tuple[Callable[[list[int]], str], str]:
    """(decode(token ids) -> text, how). Byte-level targets decode bytes; an imported Hugging
    Face model uses its tokenizer.json; anything else shows the ids."""
    if getattr(target, "vocab_size", None) == 256 and target.kind == "llama_mlp":
        return (lambda ids: bytes(int(t) for t in ids).decode("utf-8", errors="replace")), "bytes"
    if target.kind == "hf":
        try:
            from pdctl.science import data
            from pdctl.science.targets import imported

            file = imported.tokenizer_path(target)
            tok = data.corpus_tokenizer(file).tokenizer
            return (lambda ids: tok.decode([int(t) for t in ids], skip_special_tokens=False)), (
                "the GGUF's tokenizer" if imported.is_gguf(target) else "tokenizer.json"
            )
        except Exception:  # a tokenizer that cannot be read: fall back to ids, say so
            pass
    return (lambda ids: "".join(f"⟨{int(t)}⟩" for t in ids)), "token ids (no decoder)"
