"""`pdctl attributions`: for an LM harvest, per component, the input positions and the
upstream components that most raise its CI, by gradient x input on the harvest's top examples,
written into harvest.db (`db.amend`).

What is attributed: the component's CI logit z (its CI function's output before the
squashing, `ci.squash`, which maps it monotonically to the CI); unlike the CI itself it is not
flat where the CI is clipped at 0 or 1, which is where a component's strongest examples sit.
At each of the component's top examples (sequence, position t) in the harvest:
- input position t' (offset t' - t, from -window to 0): g . e, the gradient of z with respect
  to the residual stream entering the first block at t' (the embedded token) dotted with it;
- upstream component c' of site s': sum over t' of the gradient of z with respect to the mask
  m[s', t', c'] at m = 1, in the forward where every site is `x -> (x V * (m - 1)) U + x W`
  (`components.masked_site_fn` with the delta mask at 1). At m = 1 that forward IS the
  target's, so the CI attributed is the harvested one; the mask's gradient is the gradient
  with respect to the component's output times that output (gradient x activation, the
  anchors' `attr` metric in goodfire-ai/param-decomp's dataset attributions).
Both are averaged over the examples. A positive value: the source raises the component's CI
(to first order, removing it would lower z by that much). A site's own components and those
downstream of it get 0.

One jitted program per site (the component is an argument), one backward per component over
its examples as one batch.

SIGTERM / SIGINT stop it after the component in flight (or, while a compile outlasts the
grace, at once): the components done are saved (`harvest/attributions-partial.json`, also every
`SAVE_EVERY` components, so a kill loses at most those since), exit 3 and one line; run again
with the same options over the same harvest, it attributes only the others and writes the
tables an uninterrupted run writes.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from pdctl.errors import PdctlError
from pdctl.harvest import db

COMPONENTS = 64  # the most often firing components attributed by default
TOP_SOURCES = 10  # upstream components kept per component and sign
WINDOW = 8  # input offsets kept: -WINDOW..0 (the harvest's example window)
SAVE_EVERY = 8  # components attributed between saves of those done
PARTIAL = "attributions-partial.json"

SCHEMA = """
DROP TABLE IF EXISTS attr_inputs;
DROP TABLE IF EXISTS attr_sources;
DROP TABLE IF EXISTS attr_examples;
DROP TABLE IF EXISTS attr_meta;
CREATE TABLE attr_inputs (site TEXT NOT NULL, component INTEGER NOT NULL, offset INTEGER NOT NULL,
  attr REAL NOT NULL, PRIMARY KEY (site, component, offset));
CREATE TABLE attr_sources (site TEXT NOT NULL, component INTEGER NOT NULL, kind TEXT NOT NULL,
  rank INTEGER NOT NULL, source_site TEXT NOT NULL, source_component INTEGER NOT NULL,
  attr REAL NOT NULL, PRIMARY KEY (site, component, kind, rank));
CREATE TABLE attr_examples (site TEXT NOT NULL, component INTEGER NOT NULL, rank INTEGER NOT NULL,
  position INTEGER NOT NULL, attrs TEXT NOT NULL, PRIMARY KEY (site, component, rank));
CREATE TABLE attr_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass
class Result:
    path: Path
    n_components: int
    n_examples: int


def check_options(n_components: int, top: int) -> None:
    if n_components < 1:
        raise PdctlError(f"--components: must be >= 1, got {n_components}")
    if top < 1:
        raise PdctlError(f"--top: must be >= 1, got {top}")


@lru_cache(maxsize=16)
def _attr_fn(target: Any, paths: tuple[str, ...], site: str, kind: str):
    """jit((params, components, ci_fns, x (B, T), t (B,), weight (B,), c) -> (z (B,), input
    attributions (B, T), {path: (B, C)} component attributions)) for component c of `site`."""
    import jax
    import jax.numpy as jnp

    from pdctl.science.spd.ci import ci_fn_apply
    from pdctl.science.spd.losses import masked_site
    from pdctl.science.targets.base import Residual, apply_sites

    def run(params, components, ci_fns, x, t, weight, c):
        B, T = x.shape
        first = Residual(0)  # the stream entering block 0: the embedded tokens
        apply_sites(target, params, x, residual=first)
        embedded = jax.lax.stop_gradient(first.x)
        rows = jnp.arange(B)

        def z_of(scale, masks):
            start = Residual(0, embedded * scale[..., None].astype(embedded.dtype))
            data = {p: (components[p]["V"], components[p]["U"], masks[p], delta[p], None, None)
                    for p in paths}  # fmt: skip
            _, got = apply_sites(target, params, x, masked_site, data, capture=(site,),
                                 start=start)  # fmt: skip
            x_in = got[site]
            V = components[site]["V"]
            z = ci_fn_apply(kind, ci_fns[site], x_in, x_in.astype(V.dtype) @ V)  # (B, T, C)
            z_b = jnp.take(z[rows, t], c, axis=-1)
            return jnp.sum(z_b * weight), z_b

        scale = jnp.ones((B, T), embedded.dtype)
        # one mask per example, broadcast over its positions: its gradient is the sum over
        # positions of the per-position ones, at B x C per site instead of B x T x C
        masks = {p: jnp.ones((B, 1, components[p]["V"].shape[1]), components[p]["V"].dtype)
                 for p in paths}  # fmt: skip
        delta = {p: jnp.ones((B, 1), components[p]["V"].dtype) for p in paths}
        (g_scale, g_masks), z_b = jax.grad(z_of, argnums=(0, 1), has_aux=True)(scale, masks)
        return z_b, g_scale, {p: g[:, 0] for p, g in g_masks.items()}

    return jax.jit(run)


def attribute(
    target: Any,
    params: Any,
    components: dict[str, Any],
    ci_fns: Any,
    kind: str,
    site: str,
    c: int,
    x: np.ndarray,
    t: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """For component c of `site` at examples (x[b], position t[b]): (its CI logit (B,), the
    gradient x input of every input position (B, T), {site: (B, C)} the gradient x activation
    of every component summed over positions); see the module."""
    paths = tuple(p for p in target.site_paths() if p in components)
    fn = _attr_fn(target, paths, site, kind)
    B = x.shape[0]
    z, g_in, g_comp = fn(params, components, ci_fns, np.asarray(x, np.int32),
                         np.asarray(t, np.int32), np.ones(B, np.float32), c)  # fmt: skip
    return np.asarray(z), np.asarray(g_in), {p: np.asarray(v) for p, v in g_comp.items()}


def _ranked(mean: dict[str, np.ndarray], order: list[str], top: int):
    """{"raises": [(site, c, attr)], "lowers": [...]}: the `top` largest positive and most
    negative, ties by site order then component."""
    flat = [(s, c, float(v)) for s in order for c, v in enumerate(mean[s])]
    up = sorted((r for r in flat if r[2] > 0), key=lambda r: -r[2])[:top]
    down = sorted((r for r in flat if r[2] < 0), key=lambda r: r[2])[:top]
    return {"raises": up, "lowers": down}


def _read_partial(path: Path, key: str) -> dict[tuple[str, int], list]:
    """{(site, component): [n examples, input rows, source rows, example rows]} saved by an
    interrupted run with `key` (empty: none, torn, or another harvest's or options')."""
    try:
        got = json.loads(path.read_text())
        if got.get("key") != key:
            return {}
        return {(str(s), int(c)): [int(n), rin, rsrc, rex] for s, c, n, rin, rsrc, rex
                in got["done"]}  # fmt: skip
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def _save_partial(path: Path, key: str, done: dict[tuple[str, int], list]) -> None:
    from pdctl.files import atomic_write, refuse_links

    refuse_links(path)
    rows = [[s, c, *v] for (s, c), v in done.items()]
    try:
        atomic_write(path, json.dumps({"key": key, "done": rows}).encode())
    except OSError as e:
        raise PdctlError(f"attributions: cannot write {path} ({e.strerror or e})") from None


def attributions(
    project: Any,
    n_components: int = COMPONENTS,
    top: int = TOP_SOURCES,
    on_component: Any = None,
) -> Result:
    """Attribute the `n_components` most often firing components of the run's LM harvest and
    write the results into its harvest.db (holding the run directory's lock); SIGTERM /
    SIGINT stop it with what was done saved (see the module)."""
    from pdctl.engine import runtime

    with runtime.stop_signals():
        try:
            return _attributions(project, n_components, top, on_component)
        except runtime.StopNow as e:  # a compile left running: what was saved is kept
            from pdctl.engine.loop import Interrupted

            raise Interrupted(
                f"attributions: stopped by {e.name} while {e.what} (left unfinished); the "
                "components done are saved: run `pdctl attributions` again with the same "
                "options to go on"
            ) from None


def _attributions(project: Any, n_components: int, top: int, on_component: Any) -> Result:
    import hashlib

    import jax

    from pdctl.engine import runtime, sharding
    from pdctl.harvest.run import harvest_dir
    from pdctl.project import now
    from pdctl.stages import decomposition as load
    from pdctl.stages.env import StageEnv, corpus_tokens

    check_options(n_components, top)
    kind = project.config.decomp.ci_fn.type
    if kind == "global_shared_transformer":
        # (each component's CI logit comes from one function of every site's input: the
        # per-site gradient below would have to capture them all)
        raise PdctlError(
            f"attributions: not available for decomp.ci_fn.type = {kind!r} (one site's CI "
            "depends on every site's input); the harvest, clusters and browse work as usual"
        )
    path = harvest_dir(project) / "harvest.db"
    with project.locked():
        con = db.open_readonly(path)
        try:
            meta = db.read_pairs(con)
            if not meta.get("lm"):
                raise PdctlError(
                    f"attributions: language-model harvests only (this harvest is of a "
                    f"{meta.get('kind')} run)"
                )
            chosen = con.execute(
                "SELECT c.site, c.component FROM components c JOIN sites s ON s.site = c.site "
                "WHERE c.count > 0 ORDER BY c.count DESC, s.idx, c.component LIMIT ?",
                (n_components,),
            ).fetchall()
            examples = {
                (s, c): [(r, p) for r, p in con.execute(
                    "SELECT rank, position FROM examples WHERE site = ? AND component = ? AND "
                    "kind = 'top' ORDER BY rank", (s, c))]
                for s, c in chosen
            }  # fmt: skip
        finally:
            con.close()
        if not chosen:
            raise PdctlError("attributions: no component fired in this harvest")
        stage = meta.get("stage", "train")
        try:
            dec = load.load_decomposition(project, stage)
        except LookupError as e:
            raise PdctlError(f"attributions: {e}") from None
        st = project.stage(stage)
        if dec.step != meta.get("step") or st.get("run_id") != meta.get("run_id"):
            raise PdctlError(
                f"attributions: harvest.db is of {stage} checkpoint {meta.get('step')}, the run's "
                f"is {dec.step}: run `pdctl harvest` again"
            )
        T = int(meta["seq_len"])
        mesh = sharding.make_mesh(1, 1, jax.local_devices()[:1])
        env = StageEnv(project, "train", mesh, dec.target)  # a view only: nothing written
        stream = np.asarray(corpus_tokens(env, meta.get("split", "eval")))
        # the sequences harvested: each counted T positions less those its start left out
        skip = int((meta.get("options") or {}).get("skip_first", 0))
        n_windows = int(meta["n_positions"]) // (T - skip)
        windows = stream[: n_windows * T].reshape(n_windows, T).astype(np.int32)
        kind = project.config.decomp.ci_fn.type
        order = [p for p in dec.target.site_paths() if p in dec.components]
        # what makes a saved part this run's: the harvest (its meta, written once), the options
        ident = {"meta": meta, "components": n_components, "top": top, "window": WINDOW,
                 "chosen": chosen}  # fmt: skip
        key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
        partial = harvest_dir(project) / PARTIAL
        done = _read_partial(partial, key)  # {(site, component): [n, rows_in, rows_src, rows_ex]}
        new = 0
        for i, (s, c) in enumerate(chosen):
            ex = examples[(s, c)]
            if not ex or (s, c) in done:
                continue
            rows_in, rows_src, rows_ex = [], [], []
            pos = np.asarray([p for _, p in ex], np.int64)
            w, t = np.divmod(pos, T)
            if w.max() >= n_windows:
                raise PdctlError(
                    f"attributions: harvest.db's example at position {int(pos.max())} lies "
                    f"outside the {meta.get('split')} split's {n_windows * T} harvested "
                    "tokens: run `pdctl harvest` again"
                )
            try:
                _, g_in, g_comp = runtime.interruptible(
                    attribute, dec.target, dec.params, dec.components, dec.ci_fns, kind, s,
                    int(c), windows[w], t, what=f"attributing {s} #{c}")  # fmt: skip
            except runtime.StopNow:
                if new:
                    _save_partial(partial, key, done)
                raise
            b = np.arange(len(ex))
            for off in range(-WINDOW, 1):
                ok = t + off >= 0
                if ok.any():
                    v = g_in[b[ok], (t + off)[ok]].sum() / len(ex)
                    rows_in.append((s, c, off, float(np.float32(v))))
            for (rank, p), bb, tt in zip(ex, b, t, strict=True):
                lo, hi = tt - WINDOW, tt + WINDOW + 1
                vals = [float(np.float32(g_in[bb, j])) if 0 <= j < T else 0.0
                        for j in range(lo, hi)]  # fmt: skip
                rows_ex.append((s, c, rank, p, json.dumps(vals)))
            mean = {p: g.mean(axis=0) for p, g in g_comp.items()}
            for k, got in _ranked(mean, order, top).items():
                rows_src += [(s, c, k, r, ss, sc, float(np.float32(v)))
                             for r, (ss, sc, v) in enumerate(got)]  # fmt: skip
            done[(s, c)] = [len(ex), rows_in, rows_src, rows_ex]
            new += 1
            signum = runtime.stop_requested()
            if signum is not None and i + 1 < len(chosen):
                _save_partial(partial, key, done)
                raise _stopped(signum, len(done), len(chosen))
            if new % SAVE_EVERY == 0:
                _save_partial(partial, key, done)
            if on_component is not None:
                on_component(i + 1, len(chosen))
        rows_in, rows_src, rows_ex = [], [], []
        n_ex = 0
        for s, c in chosen:  # in this order whichever run attributed them
            if (s, c) in done:
                n, r_in, r_src, r_ex = done[(s, c)]
                n_ex += n
                rows_in += [tuple(r) for r in r_in]
                rows_src += [tuple(r) for r in r_src]
                rows_ex += [tuple(r) for r in r_ex]
        info = {"method": "gradient x input of the CI logit over the top examples",
                "components": len(chosen), "examples": n_ex, "window": WINDOW, "top": top,
                "created": now()}  # fmt: skip

        def write(dst: sqlite3.Connection) -> None:
            dst.executescript(SCHEMA)
            dst.executemany("INSERT INTO attr_inputs VALUES (?, ?, ?, ?)", rows_in)
            dst.executemany("INSERT INTO attr_sources VALUES (?, ?, ?, ?, ?, ?, ?)", rows_src)
            dst.executemany("INSERT INTO attr_examples VALUES (?, ?, ?, ?, ?)", rows_ex)
            dst.executemany(
                "INSERT INTO attr_meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in info.items()]
            )

        db.amend(path, write, "attributions")
        partial.unlink(missing_ok=True)
    return Result(path, len(chosen), n_ex)


def _stopped(signum: int, done: int, total: int) -> PdctlError:
    import signal

    from pdctl.engine.loop import Interrupted

    return Interrupted(
        f"attributions: stopped by {signal.Signals(signum).name} after {done} of {total} "
        "components; those are saved: run `pdctl attributions` again with the same options "
        "to go on"
    )
