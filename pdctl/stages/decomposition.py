"""The decomposition, below every stage that makes or reads one: which sites are decomposed and
with how many components (`decomposed_sites`), the shapes of what init-weights creates
(`abstract_decomposition`, computed without running anything), and a finished stage's
decomposition read back onto the host (`load_decomposition`) for report, harvest and the
benchmarks, with the decoder of the run's tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from pdctl.config import Config, match_sites, ppgd_source_layout
from pdctl.errors import PdctlError
from pdctl.project import Project
from pdctl.science.spd import components as comps
from pdctl.science.targets import Target
from pdctl.stages.inputs import target_from_config
from pdctl.stages.registry import command

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


# ---- a finished stage's decomposition, on the host --------------------------------------------


@dataclass
class Decomposition:
    """A decomposition on the host: the target and its trained parameters, every site's
    components (tied sites expanded) and the CI functions, from checkpoint `step` of `stage`."""

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
    elif stage == "warmup":
        items, step = _restore(project, "warmup", ["components"], step)
        free = items["components"]
        ci_fns = _restore(project, "init_weights", ["ci_fns"])[0]["ci_fns"]
    else:
        raise ValueError(f"no decomposition in stage {stage!r}")
    ties = comps.component_ties(target.tied_sites(), site_C)
    expanded = comps.expand_tied(free, ties, paths)
    return Decomposition(target, params, expanded, ci_fns, stage, step, dict(site_C))


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
