"""What a report reads from a run directory: the metrics log, a stage's arrays (host copies,
no mesh), the evaluation batch the train stage uses, and CI statistics over that batch.

Nothing here writes into the run directory; what cannot be read is returned as a one-line
reason (the report shows what exists and lists the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdctl.engine.tracking import read_metrics as read_metrics  # the report's reader
from pdctl.errors import PdctlError
from pdctl.project import Project
from pdctl.registry import command
from pdctl.science.spd import evaluate
from pdctl.science.spd.losses import l0_per_site
from pdctl.stages.decomposition import Decomposition
from pdctl.stages.inputs import STREAM_TRAIN, stream_key

HIST_BINS = 50
HIST_EDGES = np.linspace(0.0, 1.0, HIST_BINS + 1)
# CI values one chunk of the evaluation batch may hold on the host (float32): keeps a large LM
# report within a few hundred MB whatever eval_batch_size is.
CHUNK_VALUES = 2**24
TOP_K = 5  # contexts per component (LMs)


# ---- arrays ----------------------------------------------------------------------------------


# ---- the evaluation batch --------------------------------------------------------------------


def eval_inputs(project: Project, target: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """(inputs, tokens) of the batch the train stage evaluates on (`train_eval.make_eval`): for toys
    `target.make_batch` from the same key (tokens None); for LMs the first batch of the text
    pipeline with seed `run.seed + 1` (tokens: (B, T + 1), inputs their first T)."""
    cfg = project.config
    n = cfg.train.eval_batch_size
    if target.output_kind != "logits":
        key = jax.random.fold_in(stream_key(cfg, STREAM_TRAIN), 10**6)
        batch = jax.jit(lambda k: target.make_batch(k, n))(key)
        return np.asarray(target.inputs(batch)), None
    from pdctl.engine import sharding
    from pdctl.stages.env import StageEnv, text_batches

    mesh = sharding.make_mesh(1, 1, jax.local_devices()[:1])
    env = StageEnv(project, "train", mesh, target)  # a view only: no lock, nothing written
    it = text_batches(
        env,
        n,
        seed=cfg.run.seed + 1,
        state=None,
        sharding=sharding.batch_sharding(mesh, 2),
        split="eval",
    )
    try:
        batch = next(it)
    finally:
        it.close()
    tokens = np.asarray(batch["tokens"])
    return np.asarray(target.inputs({"tokens": tokens})), tokens


# ---- CI statistics over the evaluation batch -------------------------------------------------


@dataclass
class CiStats:
    """Per site, over every input (and position) of the evaluation batch: a histogram of the
    CI values (`HIST_EDGES`), how often each component's CI is above the threshold, whether it
    ever is (`alive`), the mean L0, and for LMs the `TOP_K` largest CI values per component
    with their flat (example * T + position) indices."""

    n_inputs: int = 0
    hist: dict[str, np.ndarray] = field(default_factory=dict)
    active: dict[str, np.ndarray] = field(default_factory=dict)
    alive: dict[str, np.ndarray] = field(default_factory=dict)
    l0_sum: dict[str, float] = field(default_factory=dict)
    top_vals: dict[str, np.ndarray] = field(default_factory=dict)
    top_pos: dict[str, np.ndarray] = field(default_factory=dict)

    def density(self) -> dict[str, np.ndarray]:
        return {s: a / max(self.n_inputs, 1) for s, a in self.active.items()}

    def l0(self) -> dict[str, float]:
        return {s: v / max(self.n_inputs, 1) for s, v in self.l0_sum.items()}


def chunk_plan(dec: Decomposition, inputs: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) rows of the evaluation batch per chunk: one chunk's CI (every site, every
    position) holds at most `CHUNK_VALUES` floats."""
    n = inputs.shape[0]
    positions = inputs.shape[1] if dec.target.output_kind == "logits" else 1
    per_example = positions * sum(dec.site_C.get(s, 0) for s in dec.components)
    size = max(1, min(n, CHUNK_VALUES // max(per_example, 1)))
    return [(start, min(n, start + size)) for start in range(0, n, size)]


def _merge_top(vals, pos, new_vals, new_pos, k):
    if vals is not None:
        new_vals = np.concatenate([vals, new_vals])
        new_pos = np.concatenate([pos, new_pos])
    if new_vals.shape[0] > k:
        idx = np.argpartition(-new_vals, k - 1, axis=0)[:k]
        new_vals = np.take_along_axis(new_vals, idx, axis=0)
        new_pos = np.take_along_axis(new_pos, idx, axis=0)
    order = np.argsort(-new_vals, axis=0, kind="stable")
    return np.take_along_axis(new_vals, order, axis=0), np.take_along_axis(new_pos, order, axis=0)


def ci_stats(
    dec: Decomposition,
    cfg: Any,
    inputs: np.ndarray,
    top_k: int = 0,
    on_chunk: Callable[[], None] | None = None,
) -> CiStats:
    """Stream the evaluation batch through `evaluate.compute_ci_jit` in chunks sized so that
    one chunk's CI fits `CHUNK_VALUES` floats (every chunk padded to the same shape: one
    compile), accumulating `CiStats`."""
    thr = cfg.decomp.ci_threshold
    positions = inputs.shape[1] if dec.target.output_kind == "logits" else 1
    chunks = chunk_plan(dec, inputs)
    size = chunks[0][1] - chunks[0][0]
    out = CiStats()
    for start, stop in chunks:
        x = inputs[start:stop]
        if x.shape[0] < size:  # pad the last chunk to the common shape, drop the padding below
            pad = np.zeros((size - x.shape[0], *x.shape[1:]), x.dtype)
            x = np.concatenate([x, pad])
        ci_dev, _ = evaluate.compute_ci_jit(
            dec.target, dec.params, dec.components, dec.ci_fns, cfg, jnp.asarray(x)
        )
        valid = stop - start
        ci_lower = {s: np.asarray(c, np.float32)[:valid] for s, c in ci_dev.items()}
        # alive / l0_per_site run jnp ops, which take numpy arrays too (annotated Array only)
        alive = evaluate.alive(ci_lower, thr)  # type: ignore[arg-type]
        l0 = l0_per_site(ci_lower, thr)  # type: ignore[arg-type]
        n_here = int(np.prod(next(iter(ci_lower.values())).shape[:-1]))
        for s, c in ci_lower.items():
            flat = c.reshape(-1, c.shape[-1])
            h, _ = np.histogram(np.clip(flat, 0.0, 1.0), bins=HIST_EDGES)
            out.hist[s] = out.hist.get(s, 0) + h
            out.active[s] = out.active.get(s, 0) + (flat > thr).sum(axis=0)
            out.alive[s] = out.alive.get(s, False) | np.asarray(alive[s])
            out.l0_sum[s] = out.l0_sum.get(s, 0.0) + float(l0[s]) * n_here
            if top_k:
                k = min(top_k, flat.shape[0])
                pos = np.arange(flat.shape[0])[:, None] + start * positions
                pos = np.broadcast_to(pos, flat.shape)
                idx = np.argpartition(-flat, k - 1, axis=0)[:k]
                v, p = np.take_along_axis(flat, idx, 0), np.take_along_axis(pos, idx, 0)
                out.top_vals[s], out.top_pos[s] = _merge_top(
                    out.top_vals.get(s), out.top_pos.get(s), v, p, top_k
                )
        out.n_inputs += n_here
        if on_chunk is not None:
            on_chunk()
    return out


# ---- LM contexts -----------------------------------------------------------------------------


def top_contexts(
    stats: CiStats,
    tokens: np.ndarray,
    decode: Callable[[list[int]], str],
    n_components: int = 8,
    before: int = 24,
    after: int = 8,
) -> dict[str, list[dict[str, Any]]]:
    """Per site, the `n_components` components most often above the threshold, each with its
    top contexts: text before, the token (highlighted in the page), text after, and its CI."""
    T = tokens.shape[1] - 1
    density = stats.density()
    out: dict[str, list[dict[str, Any]]] = {}
    for site, d in density.items():
        order = [int(c) for c in np.argsort(-d, kind="stable")[:n_components] if d[c] > 0]
        comps = []
        for c in order:
            ctxs = []
            for v, p in zip(stats.top_vals[site][:, c], stats.top_pos[site][:, c], strict=True):
                b, t = divmod(int(p), T)
                row = tokens[b, :T]
                ctxs.append(
                    {
                        "example": b,
                        "position": t,
                        "ci": float(v),
                        "before": decode(row[max(0, t - before) : t].tolist()),
                        "token": decode([int(row[t])]),
                        "after": decode(row[t + 1 : t + 1 + after].tolist()),
                    }
                )
            comps.append({"component": c, "density": float(d[c]), "contexts": ctxs})
        out[site] = comps
    return out


def describe_missing_stage(project: Project, stage: str) -> str | None:
    """One line when `stage` has not finished (None when done)."""
    st = project.stage(stage)
    status = st.get("status", "pending")
    if status == "done":
        return None
    step, steps = st.get("step"), st.get("steps")
    where = f" at step {step}" + (f" of {steps}" if steps else "") if step is not None else ""
    hint = {
        "pending": f"run `pdctl {command(stage)}`",
        "interrupted": "continue it with `pdctl resume`",
        "failed": f"see `pdctl status`; rerun with `pdctl {command(stage)} --fresh`",
        "running": "still running (or crashed: see `pdctl status`)",
    }.get(status, "see `pdctl status`")
    return f"{stage} is {status}{where}: {hint}"


def checked_stage(stage: str, allowed: tuple[str, ...]) -> str:
    if stage not in allowed:
        raise PdctlError(f"--stage: {stage!r} has no report (choose from {', '.join(allowed)})")
    return stage


def site_slug(site: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in site)
