"""`pdctl init-weights`: seeded, sharded init of the target and the decomposition.

The target is born sharded (`jit(init, out_shardings=...)`). V/U, the CI functions and the PPGD
sources are initialised with few outputs under jit (`engine.init.grouped_init`), bit-identical
to the per-site reference init. Everything is saved as the `init_weights` checkpoint (step 0).
"""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import Any

import jax
import numpy as np

from pdctl.config import Config
from pdctl.engine import sharding
from pdctl.engine.init import grouped_init
from pdctl.errors import notify
from pdctl.project import Project
from pdctl.science.spd import components as comps
from pdctl.science.targets import Target
from pdctl.stages.decomposition import (  # aligned_components: also this module's name for it
    aligned_components,
    decomp_spec_fn,
    decomposed_sites,
    source_shape,
)
from pdctl.stages.env import StageEnv, pretrained_target
from pdctl.stages.inputs import STREAM_DECOMP, STREAM_TARGET, stream_key


def nonlinearity_aligned(env: Any, components: dict[str, Any]) -> dict[str, Any]:
    """`components` (init-weights' random ones) with the MLP sites' replaced by the
    `nonlinearity_aligned` init of the TRAINED target's weights: called when warmup starts
    (or train, after a warmup of `steps = 0`), because init-weights runs before pretrain (a
    self-trained target's weights are not yet the ones decomposed then); the stage's frozen
    target where it has restored it already. See `aligned_components`."""
    params = env.frozen_params if env.frozen_params is not None else pretrained_target(env)
    out, names, n_exact = aligned_components(env.cfg, env.target, env.mesh, params, components)
    notify(
        f"{env.stage}: {len(names)} MLP site(s) start nonlinearity-aligned ({n_exact} with C = "
        "their neurons: V U = W exactly)"
    )
    return out


def init_decomposition(cfg: Config, target: Target, mesh, key) -> tuple[dict[str, Any], dict]:
    """{"components", "ci_fns", "sources"} and the compile seconds of each init jit."""
    sites = decomposed_sites(cfg, target)
    names = list(sites)
    comp_keys, ci_keys, src_keys = comps.site_keys(key, len(names))
    spec_fn = decomp_spec_fn(cfg, target, mesh)
    dtype = jax.numpy.dtype(cfg.precision.param_dtype)
    hidden = cfg.decomp.ci_fn.arch()
    kind = cfg.decomp.ci_fn.type
    out, compile_s = {}, {}
    # Every site's components are drawn (so the keys, and the values of untied sites, do not
    # depend on the tying); a tied site's are then dropped: they are its source's transposes.
    ties = comps.component_ties(target.tied_sites(), sites)
    out["components"], t = grouped_init(
        partial(_components, dtype=dtype),
        names,
        [sites[n] for n in names],
        comp_keys,
        mesh,
        spec_fn,
    )
    out["components"] = {p: v for p, v in out["components"].items() if p not in ties}
    compile_s.update({f"components_{k}": v for k, v in t.items()})
    site_hidden = comps.site_ci_arch(kind, hidden, [sites[n][0] for n in names])
    out["ci_fns"], t = grouped_init(
        comps.init_ci_fn,
        names,
        [(kind, sites[n][0], sites[n][2], site_hidden) for n in names],
        ci_keys,
        mesh,
        spec_fn,
    )
    compile_s.update({f"ci_fns_{k}": v for k, v in t.items()})
    if kind == comps.GLOBAL_CI:
        # the part every site shares (the global CI function's trunk), under its reserved key
        shared, t = grouped_init(
            comps.init_shared_ci_fn,
            [comps.SHARED_CI_KEY],
            [(kind, tuple(hidden))],
            comps.shared_ci_key(key)[None],
            mesh,
            spec_fn,
        )
        out["ci_fns"].update(shared)
        compile_s.update({f"ci_shared_{k}": v for k, v in t.items()})
    out["sources"], t = grouped_init(
        comps.init_source,
        names,
        [(source_shape(cfg, sites[n][2]), cfg.train.ppgd.sigmoid) for n in names],
        src_keys,
        mesh,
        spec_fn,
    )
    compile_s.update({f"sources_{k}": v for k, v in t.items()})
    return out, compile_s


def _components(key, d_in, d_out, C, *, dtype):
    return comps.init_site_components(key, d_in, d_out, C, dtype)


def _nbytes(tree: Any) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def run(project: Project) -> dict[str, Any]:
    with StageEnv.open(project, "init_weights") as env:
        return _run(project, env)


def _run(project: Project, env: StageEnv) -> dict[str, Any]:
    cfg = env.cfg
    # Validate the decomposition config (and an imported checkpoint) before anything is written.
    sites = decomposed_sites(cfg, env.target)
    imported = imported_checkpoint(env.target, cfg)
    env.begin(fresh=True, seed=cfg.run.seed)
    t_start = time.perf_counter()
    key = stream_key(cfg, STREAM_TARGET)
    abstract = jax.eval_shape(env.target.init, key)
    items: dict[str, Any] = {}
    compile_s: dict[str, float] = {}
    if imported is None:
        t0 = time.perf_counter()
        init = jax.jit(env.target.init, out_shardings=env.shardings(abstract))
        init_c = init.lower(key).compile()
        compile_s["target"] = time.perf_counter() - t0
        items["target"] = init_c(key)
    decomp, t = init_decomposition(cfg, env.target, env.mesh, stream_key(cfg, STREAM_DECOMP))
    compile_s.update(t)
    items.update(decomp)
    ckpt = env.checkpointer()
    ckpt.save(0, items, {"step": 0})
    ckpt.wait()
    ckpt.close()
    shapes = {
        k: {sharding.path_str(p): list(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(v)}
        for k, v in items.items()
    }
    fields = {
        "status": "done",
        "step": 0,
        "checkpoint": 0,
        "sites": {p: int(s[2]) for p, s in sites.items()},
        "shapes": shapes,
        "bytes": {k: _nbytes(v) for k, v in items.items()},
        "compile_s": {k: round(v, 4) for k, v in compile_s.items()},
        "wall_s": round(time.perf_counter() - t_start, 3),
    }
    if imported is not None:
        # An imported target is not trained: [state.pretrain] says where its weights are. The
        # stages that need them read them from there into their own shardings (no copy of the
        # model is written into the run directory).
        fields["imported"] = imported
        project.reset_stage(
            "pretrain",
            status="imported",
            fingerprint=project.fingerprint("pretrain"),
            run_id=uuid.uuid4().hex[:12],
            upstream={"init_weights": project.stage("init_weights").get("run_id")},
            **imported,
        )
    env.on_state(**fields)
    return {
        "items": items,
        **fields,
        "param_count": int(sum(np.prod(x.shape) for x in jax.tree.leaves(abstract))),
    }


def imported_checkpoint(target: Target, cfg: Config) -> dict[str, Any] | None:
    """What `[state.pretrain]` records of an imported target (Hugging Face directory or GGUF
    file), after checking every tensor against its config from headers or metadata, its
    tokenizer against the model, and hashing the weights' bytes (`imported.check`); None for a
    target that pdctl trains itself."""
    if target.kind != "hf":
        return None
    from pdctl.science.targets import imported
    from pdctl.science.targets.hf import HFCausalLM

    assert isinstance(target, HFCausalLM)  # kind "hf"
    return imported.check(target, cfg.data.eos_id)
