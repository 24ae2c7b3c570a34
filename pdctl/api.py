"""pdctl as a library: a run directory read from Python, read-only (docs/api.md).

    import pdctl
    run = pdctl.open("run1")
    run.config, run.status, run.metrics("train")
    dec = run.decomposition()       # V, U per site and the CI functions (`Decomposition`)
    model = run.target()            # logits / ci / masked_logits / tokenize / decode
    h = run.harvest()               # harvest.db's tables

A thin facade over what `pdctl report` and `pdctl harvest` run, not a second engine: the
decomposition is read by `stages.decomposition.load_decomposition` (orbax through
`engine.checkpoint.read_host`, no CheckpointManager), the CI by `evaluate.compute_ci_jit` (the
harvest's CI program), the masked model by `losses.masked_forward` (the evaluations' and the
output effects'), the metrics by `engine.tracking.read_metrics`, harvest.db by
`harvest.db.open_readonly` (SQLite immutable: no lock, no -wal / -shm / journal).

Read-only: nothing here writes into the run directory or takes its lock (`Project.locked`, the
flock a stage holds while it runs), so a run can be opened while a stage trains in it: the
state is read from pdctl.toml (written whole and renamed by the stage), a decomposition from the
stage's newest *complete* checkpoint. `pdctl status` also tells a crashed `running` stage from a
live one by trying that lock; `Run.status` never does.

Importing this module (and `pdctl.open`, `config`, `status`, `metrics`, `harvest`) imports no
JAX; the methods that compute (`decomposition`, `target` and the model's methods) import it when
called.
Their forwards run at `[precision] eval_matmul`, as pdctl's evaluations do.

Tables (`metrics`, the harvest's) are pandas DataFrames where pandas is installed, else lists
of dict rows; `open(..., tables="rows")` asks for rows either way.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from pdctl.errors import PdctlError
from pdctl.project import PROJECT_FILE, Project, find_project_file
from pdctl.registry import STAGES, command

__all__ = ["Harvest", "Model", "Run", "open"]

TABLES = ("auto", "pandas", "rows")
DECOMPOSED = ("train", "warmup")  # the stages whose checkpoints hold a decomposition
MASKS = ("ci", "zero", "ones")
RETRIES = 3  # reads of a running stage's newest checkpoint, which may go while it is read
# harvest.db's tables a command adds after the harvest (absent: read as empty)
LATER_TABLES = ("labels", "clusters", "cluster_meta", "attr_inputs", "attr_sources",
                "attr_examples", "attr_meta")  # fmt: skip
# columns stored as JSON text, decoded to lists
JSON_COLUMNS = {"components": ("hist",), "examples": ("tokens", "cis"),
                "attr_examples": ("attrs",)}  # fmt: skip


def open(path: str | os.PathLike[str] | None = None, *, tables: str = "auto") -> Run:
    """The run directory at `path` (or its pdctl.toml; None: the current directory or the
    nearest parent holding a pdctl.toml), read-only. `tables`: "auto" (pandas DataFrames where
    pandas is installed, else lists of dict rows), "pandas" or "rows"."""
    if tables not in TABLES:
        raise PdctlError(f"tables: {tables!r} is not one of {', '.join(TABLES)}")
    if tables == "pandas" and importlib.util.find_spec("pandas") is None:
        raise PdctlError("tables='pandas': pandas is not installed (`pip install pandas`)")
    if path is None:
        file = find_project_file()
    else:
        p = Path(path).expanduser()
        if not (p / PROJECT_FILE if p.is_dir() else p).is_file():
            raise PdctlError(
                f"pdctl.open: no {PROJECT_FILE} at {p}; pass a run directory (made by "
                "`pdctl new NAME`) or its pdctl.toml"
            )
        file = find_project_file(explicit=p)
    return Run(Project.load(file), tables)


def _table(rows: list[dict[str, Any]], kind: str) -> Any:
    """`rows` as a pandas DataFrame (columns in their order of appearance), or as they are."""
    if kind == "rows" or (kind == "auto" and importlib.util.find_spec("pandas") is None):
        return rows
    import pandas as pd

    columns = list(dict.fromkeys(k for r in rows for k in r))
    return pd.DataFrame.from_records(rows, columns=columns)


def _number(v: Any) -> Any:
    """A metric value as logged: non-finite floats are written as "nan" / "inf" strings."""
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    return v


def _check_stage(stage: str, allowed: tuple[str, ...] = STAGES, what: str = "stage") -> None:
    if stage not in allowed:
        raise PdctlError(f"{what}: {stage!r} is not one of {', '.join(allowed)}")


class Run:
    """One run directory, read-only. `config`: its parsed pdctl.toml as it was opened;
    `status`: the stages' `[state.*]` records, read again at every access."""

    def __init__(self, project: Project, tables: str = "auto"):
        self.project = project
        self.path = project.root
        self.tables = tables
        self._decompositions: dict[tuple[str, int, str | None], Any] = {}  # stage, step, run

    def __repr__(self) -> str:
        return f"<pdctl run {str(self.path)!r}>"

    @property
    def config(self) -> Any:
        """The `pdctl.config.Config` of pdctl.toml (the user's tables), as opened."""
        return self.project.config

    @property
    def status(self) -> dict[str, dict[str, Any]]:
        """{stage: its `[state.<stage>]` record} in the stages' order, as pdctl.toml holds it
        now (read again at every access): `status` (pending when the stage never ran), step,
        steps, checkpoint, metrics, eval, ..., and `stale` (its config or an upstream stage
        changed since it ran), as `pdctl status --json` shows them but for `crashed`."""
        project = Project.load(self.project.path)
        out = {}
        for name in STAGES:
            st = dict(project.stage(name))
            st.setdefault("status", "pending")
            st["stale"] = project.is_stale(name)
            out[name] = st
        return out

    def metrics(self, stage: str, kind: str = "log") -> Any:
        """The metrics `stage` logged (metrics/<stage>.jsonl), one row per line: kind "log"
        the training log, "eval" the evaluations (their keys start with `eval/`)."""
        from pdctl.engine.tracking import read_metrics

        _check_stage(stage)
        if kind not in ("log", "eval"):
            raise PdctlError(f"kind: {kind!r} is not one of log, eval")
        path = self.project.metrics_path(stage)
        if not path.is_file():
            status = Project.load(self.project.path).stage(stage).get("status", "pending")
            if status == "pending":
                raise PdctlError(f"{stage} has not run yet: run `pdctl {command(stage)}`")
            raise PdctlError(f"{stage} ({status}) has logged no metrics: {path} does not exist")
        log, evals = read_metrics(path)
        rows = [{k: _number(v) for k, v in r.items()} for r in (log if kind == "log" else evals)]
        return _table(rows, self.tables)

    def checkpoints(self, stage: str) -> list[int]:
        """The steps of `stage`'s complete checkpoints, oldest first ([0] for a warmup that ran
        with `steps = 0`: it saves none, its components are init-weights')."""
        from pdctl.engine.checkpoint import complete_steps
        from pdctl.stages.decomposition import warmup_kept_init

        _check_stage(stage)
        if stage == "warmup" and warmup_kept_init(Project.load(self.project.path)):
            return [0]
        return complete_steps(self.project.checkpoint_dir(stage))

    def decomposition(self, stage: str = "train", step: int | None = None) -> Any:
        """The decomposition in checkpoint `step` of `stage` (train or warmup; None: its
        newest complete checkpoint), on the host: a `stages.decomposition.Decomposition`, with
        `components` {site: {"V": (d_in, C), "U": (C, d_out)}} (tied sites expanded),
        `ci_fns` {site: the CI function's params}, `params` (the target's), `target`, `step`
        and `site_C`. As `pdctl report` and `pdctl harvest` read it; kept for later calls."""
        from pdctl.engine import runtime
        from pdctl.stages import decomposition as D

        _check_stage(stage, DECOMPOSED)
        runtime.cpu_without_tpu_chips()  # before JAX starts, as the commands do
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise PdctlError(f"step: must be an integer checkpoint step, got {step!r}")
        asked = step
        for _ in range(RETRIES):
            now = Project.load(self.project.path)  # the state as it is now
            state = now.stage(stage)
            if asked is None:
                steps = self.checkpoints(stage)
                if not steps:
                    status = state.get("status", "pending")
                    todo = ("wait for its first checkpoint" if status == "running"
                            else f"run `pdctl {command(stage)}`")  # fmt: skip
                    raise PdctlError(f"{stage} has no checkpoint yet ({status}): {todo}")
                step = steps[-1]
            assert step is not None  # the one asked for, or the newest
            key = (stage, step, state.get("run_id"))  # a rerun stage numbers its steps anew
            if key in self._decompositions:
                return self._decompositions[key]
            try:
                dec = D.load_decomposition(now, stage, step)
            except LookupError as e:
                # the newest checkpoint went while it was read (a running stage keeps only
                # `checkpoint.keep`): read the newest again
                if asked is None and step not in self.checkpoints(stage):
                    continue
                raise PdctlError(str(e)) from None
            self._decompositions[key] = dec
            return dec
        raise PdctlError(
            f"{stage}: its newest checkpoint was replaced {RETRIES} times while it was read; "
            "try again, or name a `step`"
        )

    def target(self, stage: str = "train", step: int | None = None) -> Model:
        """The target with the decomposition of `decomposition(stage, step)`: a `Model`."""
        return Model(self.project, self.decomposition(stage, step))

    def harvest(self) -> Harvest:
        """The tables of <run>/harvest/harvest.db (`pdctl harvest`), read-only."""
        from pdctl.harvest import db

        path = self.path / "harvest" / "harvest.db"
        if not path.is_file():
            raise PdctlError(f"{path}: no harvest yet: run `pdctl harvest` first")
        return Harvest(path, db.read_meta(path), self.tables)


# ---- the model ----------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _programs(target: Any) -> tuple[Any, Any]:
    """(jitted target forward, jitted masked forward) of `target`."""
    import jax

    from pdctl.science.spd.losses import masked_forward

    def masked(params, components, x, masks, delta_masks):
        return masked_forward(target, params, components, x, masks, delta_masks)

    return jax.jit(target.apply), jax.jit(masked)


class Model:
    """A decomposed target: its forward, its CI and its forward with masked components.

    Inputs (`tokens`): token ids (T,) or (B, T) for an LM (`tokenize` makes them), feature
    vectors (n,) or (B, n) for a toy; outputs keep their leading axes. Per site, masks and CI
    have C (the site's components) as their last axis: (T, C) / (B, T, C), or (B, C) for a
    toy. `sites` are in the target's forward order, `C` {site: components}, `threshold` the
    run's `decomp.ci_threshold` (above it a component counts as firing)."""

    def __init__(self, project: Project, decomposition: Any):
        import jax

        dec = decomposition
        self.decomposition = dec
        self.stage, self.step = dec.stage, dec.step
        self._project = project
        self._cfg = project.config
        target = dec.target
        self._target = target
        self.kind = target.kind
        self.is_lm = target.output_kind == "logits"
        self.sites = tuple(p for p in target.site_paths() if p in dec.components)
        self.C = {p: int(dec.components[p]["V"].shape[1]) for p in self.sites}
        self.threshold = float(self._cfg.decomp.ci_threshold)
        # on the default device once, not at every call
        self._params = jax.device_put(dec.params)
        self._components = jax.device_put(dec.components)
        self._ci_fns = jax.device_put(dec.ci_fns)
        self._decoder: Callable[[list[int]], str] | None = None
        self._tokenizer: Any = None  # a `tokenizers.Tokenizer`, once `tokenize` needs it
        if self.is_lm:
            self.vocab_size = int(
                target.spec.vocab_size if target.kind == "hf" else target.vocab_size
            )
        else:
            batch = jax.eval_shape(lambda k: target.inputs(target.make_batch(k, 1)),
                                   jax.random.PRNGKey(0))  # fmt: skip
            self._example = tuple(batch.shape[1:])

    def __repr__(self) -> str:
        sites = ", ".join(f"{s} ({self.C[s]})" for s in self.sites)
        return f"<pdctl {self.kind} target, {self.stage} checkpoint {self.step}: {sites}>"

    # ---- inputs and outputs ----

    def _inputs(self, tokens: Any) -> tuple[Any, bool]:
        """(the batched input array, whether the caller gave one example)."""
        import numpy as np

        a = np.asarray(tokens)
        if self.is_lm:
            if a.dtype.kind not in "iu":
                raise PdctlError(
                    f"tokens: integer token ids expected, got {a.dtype} (`tokenize(text)` "
                    "makes them)"
                )
            if a.ndim not in (1, 2) or a.size == 0:
                raise PdctlError(f"tokens: shape (T,) or (B, T) expected, got {a.shape}")
            if a.min() < 0 or a.max() >= self.vocab_size:
                raise PdctlError(
                    f"tokens: ids must be in [0, {self.vocab_size}), got {int(a.min())}.."
                    f"{int(a.max())}"
                )
            most = getattr(getattr(self._target, "spec", None), "max_positions", None)
            if most is not None and a.shape[-1] > most:
                raise PdctlError(f"tokens: {a.shape[-1]} positions, more than the model's {most}")
            one = a.ndim == 1
            return (a[None] if one else a).astype(np.int32), one
        n = len(self._example)
        if a.dtype.kind not in "biuf" or a.ndim not in (n, n + 1) or a.shape[-n:] != self._example:
            raise PdctlError(
                f"tokens: this {self.kind} target takes inputs of shape {self._example} or "
                f"(B, *{self._example}), got {a.shape} {a.dtype}"
            )
        one = a.ndim == n
        return (a[None] if one else a).astype(np.float32), one

    @staticmethod
    def _out(x: Any, one: bool) -> Any:
        import numpy as np

        a = np.asarray(x, np.float32)
        return a[0] if one else a

    def _scope(self) -> Any:
        from pdctl.engine.precision import matmul_scope

        return matmul_scope(self._cfg.precision.eval_matmul)

    def _lead(self, x: Any) -> tuple[int, ...]:
        """The leading axes masks and CI have before C: (B, T) for an LM, (B,) for a toy."""
        return tuple(x.shape) if self.is_lm else tuple(x.shape[:1])

    # ---- the forwards ----

    def logits(self, tokens: Any) -> Any:
        """The target's output (an LM's next-token logits (.., T, vocab); a toy's output)."""
        x, one = self._inputs(tokens)
        apply, _ = _programs(self._target)
        with self._scope():
            return self._out(apply(self._params, x), one)

    def _ci(self, x: Any) -> dict[str, Any]:
        from pdctl.science.spd import evaluate

        with self._scope():
            lower, _ = evaluate.compute_ci_jit(self._target, self._params, self._components,
                                               self._ci_fns, self._cfg, x)  # fmt: skip
        return {s: lower[s] for s in self.sites}

    def ci(self, tokens: Any) -> dict[str, Any]:
        """{site: causal importance (.., C)} per position: the lower-leaky CI the harvest
        counts and the evaluations mask with (`evaluate.compute_ci_jit`)."""
        x, one = self._inputs(tokens)
        return {s: self._out(v, one) for s, v in self._ci(x).items()}

    def masked_logits(self, tokens: Any, masks: Any, delta: Any = None) -> Any:
        """The target's output with every site in `masks` computed from its components, each
        component's output scaled by its mask: `((x V) * mask) U` (`losses.masked_forward`).

        `masks`: "ci" (each site masked by its CI: the evaluations' ci_masked model), "ones"
        (V U for W), "zero" (nothing), or {site: an array broadcasting to (.., C), or one of
        those words}; a site left out of the dict keeps the target's own weights. `delta`
        (None: no delta term, as the evaluations' ci_masked model) adds `delta * x (W - V U)`
        for every masked site: a number, "ones" / "zero", an array broadcasting to (..) (one
        value per position), or {site: one of those}. With masks "ones" and delta 1 the
        output is the target's (to float32 rounding; bit for bit for the toys)."""
        import numpy as np

        x, one = self._inputs(tokens)
        lead = self._lead(x)
        shown = lead[1:] if one else lead  # the shapes as the caller sees them
        if isinstance(masks, str):
            spec = dict.fromkeys(self.sites, masks)
        elif isinstance(masks, Mapping):
            spec = dict(masks)
            self._known(spec, "masks")
        else:
            raise PdctlError(
                "masks: give 'ci', 'zero', 'ones' or {site: an array or one of those}, got "
                f"{type(masks).__name__}"
            )
        ci = None
        resolved = {}
        for s in self.sites:
            if s not in spec:
                continue
            m, C = spec[s], self.C[s]
            if isinstance(m, str):
                if m not in MASKS:
                    raise PdctlError(f"masks[{s!r}]: {m!r} is not one of {', '.join(MASKS)}")
                if m == "ci":
                    ci = self._ci(x) if ci is None else ci
                    resolved[s] = ci[s]
                else:
                    resolved[s] = np.full((*lead, C), float(m == "ones"), np.float32)
            else:
                resolved[s] = _broadcast(m, (*lead, C), (*shown, C), f"masks[{s!r}]")
        if not resolved:
            raise PdctlError(f"masks: no site given (sites: {', '.join(self.sites)})")
        delta_masks = None
        if delta is not None:
            if isinstance(delta, Mapping):
                self._known(delta, "delta")
                extra = [s for s in delta if s not in resolved]
                if extra:
                    raise PdctlError(f"delta: site {extra[0]!r} is not masked (give it a mask)")
                dspec = {s: delta.get(s, 0.0) for s in resolved}
            else:
                dspec = dict.fromkeys(resolved, delta)
            delta_masks = {}
            for s, d in dspec.items():
                if isinstance(d, str):
                    if d not in ("zero", "ones"):
                        raise PdctlError(f"delta: {d!r} is not one of zero, ones")
                    d = float(d == "ones")
                delta_masks[s] = _broadcast(d, lead, shown, f"delta[{s!r}]")
        _, masked = _programs(self._target)
        with self._scope():
            out = masked(self._params, self._components, x, resolved, delta_masks)
        return self._out(out, one)

    def _known(self, spec: Mapping[str, Any], what: str) -> None:
        unknown = [s for s in spec if s not in self.C]
        if unknown:
            raise PdctlError(
                f"{what}: no site {unknown[0]!r} in this decomposition (sites: "
                f"{', '.join(self.sites)})"
            )

    # ---- text ----

    def tokenize(self, text: str) -> Any:
        """`text` as the token ids (T,) the run's corpus is made of: UTF-8 bytes for a
        byte-level LM, the model's own tokenizer (special tokens as its template adds them)
        for an imported one."""
        import numpy as np

        if not self.is_lm:
            raise PdctlError(f"tokenize: the {self.kind} target takes feature vectors, not text")
        if not isinstance(text, str):
            raise PdctlError(f"tokenize: text must be a str, got {type(text).__name__}")
        if self.kind == "hf":
            if self._tokenizer is None:
                from pdctl.science import data
                from pdctl.science.targets import imported

                try:
                    self._tokenizer = data.corpus_tokenizer(
                        imported.tokenizer_path(self._target), eos_id=self._cfg.data.eos_id
                    ).tokenizer
                except ValueError as e:
                    raise PdctlError(f"tokenize: {e}") from None
            ids = self._tokenizer.encode(text, add_special_tokens=True).ids
        else:
            ids = list(text.encode("utf-8"))
        return np.asarray(ids, np.int32)

    def decode(self, ids: Any) -> str:
        """Token ids as text, as the report and the harvest show them."""
        import numpy as np

        if not self.is_lm:
            raise PdctlError(f"decode: the {self.kind} target has no tokens")
        if self._decoder is None:
            from pdctl.stages.decomposition import token_decoder

            self._decoder, _ = token_decoder(self._project, self._target)
        return self._decoder([int(t) for t in np.asarray(ids).reshape(-1)])


def _broadcast(value: Any, shape: tuple[int, ...], shown: tuple[int, ...], what: str) -> Any:
    """`value` as float32 of `shape` (broadcast); `shown`: that shape as the caller sees it."""
    import numpy as np

    try:
        a = np.asarray(value, np.float32)
    except (TypeError, ValueError):
        raise PdctlError(f"{what}: not a number or an array of numbers") from None
    try:
        return np.broadcast_to(a, shape)
    except ValueError:
        raise PdctlError(f"{what}: shape {a.shape} does not broadcast to {shown}") from None


# ---- the harvest --------------------------------------------------------------------------


class Harvest:
    """harvest.db's tables (`pdctl/harvest/db.py` describes every column), each read when
    asked for. `meta`: how the harvest was made (stage, step, n_positions, seq_len, ...).
    Components are numbered within their site; an example's `position` is window * seq_len
    + t over the harvested windows, its `tokens` / `cis` the window around it. Tables another
    command adds (labels: `pdctl interp`, clusters: `pdctl cluster`, attributions: `pdctl
    attributions`) are empty until it has run."""

    def __init__(self, path: Path, meta: dict[str, Any], tables: str = "auto"):
        self.path = path
        self.meta = meta
        self.tables = tables

    def __repr__(self) -> str:
        m = self.meta
        return (f"<pdctl harvest {str(self.path)!r}: {m.get('stage')} checkpoint "
                f"{m.get('step')}, {m.get('n_positions')} positions>")  # fmt: skip

    def table(self, name: str) -> Any:
        """Any table of harvest.db by name, in the order it was written."""
        import json

        from pdctl.harvest import db

        known = (*db.TABLES, *LATER_TABLES)
        if name not in known:
            raise PdctlError(f"table: {name!r} is not one of {', '.join(known)}")
        con = db.open_readonly(self.path)
        try:
            if not db.has_table(con, name):
                return _table([], self.tables)
            cur = con.execute(f"SELECT * FROM {name} ORDER BY rowid")  # a name from `known`
            columns = [d[0] for d in cur.description]
            rows = [dict(zip(columns, r, strict=True)) for r in cur]
        finally:
            con.close()
        for col in JSON_COLUMNS.get(name, ()):
            for r in rows:
                r[col] = json.loads(r[col]) if isinstance(r[col], str) else r[col]
        return _table(rows, self.tables)

    @property
    def sites(self) -> Any:
        """Per site: its index, C, offset, L0 and alive count."""
        return self.table("sites")

    @property
    def components(self) -> Any:
        """Per component: count, frequency, mean / max CI, CI histogram, |V| and |U|."""
        return self.table("components")

    @property
    def examples(self) -> Any:
        """Per component its top (`kind` top) and sampled (sample) firing positions."""
        return self.table("examples")

    @property
    def tokens(self) -> Any:
        """Per component the input tokens it fires on most (`kind` count) and by PMI (pmi)."""
        return self.table("tokens")

    @property
    def cooc(self) -> Any:
        """Pairs of components that fire together: count, precision, recall, Jaccard, PMI."""
        return self.table("cooc")

    @property
    def effects(self) -> Any:
        """LMs: the tokens a component raises / lowers most where it fires (nats)."""
        return self.table("effects")

    @property
    def labels(self) -> Any:
        """`pdctl interp`'s labels and scores, per component."""
        return self.table("labels")

    @property
    def clusters(self) -> Any:
        """`pdctl cluster`'s clusters: (cluster, site, component) rows."""
        return self.table("clusters")

    @property
    def attributions(self) -> dict[str, Any]:
        """`pdctl attributions`: {"inputs": attribution by input offset, "sources": the
        upstream components that raise / lower a component, "examples": per top example}."""
        return {k: self.table(f"attr_{k}") for k in ("inputs", "sources", "examples")}
