"""`build_report`: a stage's figures and the index.html that shows them."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdctl import __version__
from pdctl.errors import EXIT_INTERRUPTED, PdctlError
from pdctl.harvest.run import harvest_line
from pdctl.project import Project, split_state
from pdctl.registry import STAGES
from pdctl.report import figures as F
from pdctl.report import load as L
from pdctl.report import page as P
from pdctl.report.status import INDEX, MANIFEST
from pdctl.science.spd import evaluate
from pdctl.science.spd.losses import TERMS
from pdctl.stages import decomposition as D

REPORT_STAGES = ("pretrain", "warmup", "train")


@dataclass
class ReportResult:
    """What `build_report` did: every file written (figures, their data, index.html, the
    manifest), and one line per thing it could not show, with the reason."""

    out: Path
    index: Path
    stage: str
    step: int | None  # the checkpoint step the component figures show (None: no components)
    files: list[Path] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _Steps:
    """Advance an optional rich Progress; no-op without one."""

    def __init__(self, progress: Any, total: int):
        self.progress = progress
        self.total = total
        self.task = progress.add_task("report", total=total) if progress is not None else None

    def __call__(self, description: str, advance: float = 1) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=description, advance=advance)

    def grow(self, n: int) -> None:
        """More work than first counted (chunks of the evaluation batch, optional figures)."""
        self.total += n
        if self.progress is not None:
            self.progress.update(self.task, total=self.total)


@contextlib.contextmanager
def progress_bar(console: Any) -> Iterator[Any]:
    """A rich Progress on `console` for `build_report`, silent when it is not a terminal."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    progress = Progress(
        TextColumn("{task.description:<32}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with progress:
        yield progress


class _Out:
    """The output directory of one report: writes files and records them in the result."""

    def __init__(self, directory: Path, res: ReportResult):
        self.dir = directory
        self.res = res

    def fig(self, path: Path, kind: str, caption: str, n: int = 1, data: Path | None = None):
        self.res.files.extend([path] if data is None else [path, data])
        w, h = F.size_of(kind, n)
        return P.Fig(path.name, w, h, caption, data.name if data is not None else None)

    def json(self, name: str, obj: Any) -> Path:
        path = self.dir / name
        path.write_text(json.dumps(obj, indent=1, default=_jsonable) + "\n", encoding="utf-8")
        self.res.files.append(path)
        return path


class ReportStopped(PdctlError):
    """SIGTERM/SIGINT while a report was being built: the previous report is left as it was."""

    exit_code = EXIT_INTERRUPTED


class _Stop(BaseException):
    """Raised by the signal handler inside the build (a BaseException: figure code that
    catches Exception lets it through)."""


def build_report(
    project: Project, stage: str = "train", out: Path | str | None = None, progress: Any = None
) -> ReportResult:
    """Write the figures of `stage` (pretrain, warmup or train) and an index.html that shows
    them into `out` (default: <run>/report/). What does not exist yet (an unfinished stage, no
    checkpoint, no final evaluation) is listed in `ReportResult.missing` and on the page; the
    rest is drawn. Raises PdctlError (one line) for a bad stage or output directory.

    The new report is built in a temporary directory beside `out` and then put in place in one
    step (the two directories exchanged), so `out` always holds one whole report, the old or
    the new: a SIGTERM/SIGINT while it is built leaves the old one as it was (ReportStopped,
    exit 3). When `out` also holds files that are not the previous report's, the new files
    are moved in one by one instead (index.html and the manifest last, signals held off)."""
    L.checked_stage(stage, REPORT_STAGES)
    out_dir = Path(out).expanduser() if out is not None else project.report_dir
    if out_dir.exists() and not out_dir.is_dir():
        raise PdctlError(f"--out: {out_dir} exists and is not a directory")
    if out_dir.is_symlink():  # a link to a directory: the report goes where it points
        out_dir = out_dir.resolve()
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError:
        try:  # the parent is not writable: build inside `out` itself
            out_dir.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=".pdctl-report-tmp-", dir=out_dir))
        except OSError as e:
            raise PdctlError(f"--out: cannot create {out_dir} ({e.strerror})") from None
    trash: list[Path | None] = [work]
    stop = _StopFlag()
    try:
        with stop.installed():
            res = _build(project, stage, work, progress)
            with _signals_held():
                trash.append(_publish(work, out_dir, res))
                stop.published = True
    except _Stop:
        name = signal.Signals(stop.signum or signal.SIGTERM).name
        raise ReportStopped(
            f"report: stopped by {name}; {out_dir} is as it was (the new report was not kept)"
        ) from None
    finally:
        for path in trash:
            if path is not None and path.exists() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
    res.out, res.index = out_dir, out_dir / INDEX
    res.files = [out_dir / p.name for p in res.files]
    return res


class _StopFlag:
    """SIGTERM/SIGINT stop the build (raise `_Stop`) until the report is in place; after that
    they are only noted (the report is whole: the command ends as it would have)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.published = False

    def handler(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        if not self.published:
            raise _Stop()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self.handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM/SIGINT wait (blocked) while the new report is put in place."""
    sigs = {signal.SIGTERM, signal.SIGINT}
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    except (AttributeError, OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux renameat2 RENAME_EXCHANGE); False where the
    system cannot."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return rc == 0


def _publish(work: Path, out_dir: Path, res: ReportResult) -> Path | None:
    """Put the report built in `work` in place at `out_dir`; returns what is left to delete
    (the previous report), if anything."""
    if not out_dir.exists():
        os.rename(work, out_dir)
        return None
    previous = _previous_files(out_dir)
    ours = previous | {MANIFEST}
    foreign = [p for p in out_dir.iterdir() if p.name not in ours and p != work]
    if not foreign and work.parent == out_dir.parent:
        if _exchange(work, out_dir):
            return work  # it now holds the previous report
        aside = work.with_name(work.name + ".previous")
        os.rename(out_dir, aside)
        os.rename(work, out_dir)
        return aside
    # `out` holds someone else's files too: the new files go in one by one, the page last
    names = [p.name for p in res.files]
    last = [n for n in (INDEX, MANIFEST) if n in names]
    for name in [n for n in names if n not in last] + last:
        os.replace(work / name, out_dir / name)
    for name in previous - set(names):
        p = out_dir / name
        if p.is_file() and not p.is_symlink():
            p.unlink()
    return None


def _previous_files(out_dir: Path) -> set[str]:
    """The plain file names the previous report in `out_dir` wrote (its manifest says)."""
    try:
        old = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    files = old.get("files", []) if isinstance(old, dict) else []
    return {n for n in files if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")}


def _build(project: Project, stage: str, out_dir: Path, progress: Any) -> ReportResult:
    """The report of `stage`, written into the (new, empty) directory `out_dir`."""
    st = project.stage(stage)
    steps = _Steps(progress, total=4)
    res = ReportResult(out=out_dir, index=out_dir / INDEX, stage=stage, step=None)
    o = _Out(out_dir, res)
    gone = L.describe_missing_stage(project, stage)
    if gone:
        res.missing.append(gone)
    if project.is_stale(stage):
        res.notes.append(f"{stage} is stale: pdctl.toml changed since it ran; this shows that run")
    toy = project.config.target.kind in ("tms", "resid_mlp")

    steps(f"{stage}: training curves")
    sections, eval_rows = _curve_sections(project, stage, o, toy)

    steps(f"{stage}: loading checkpoints")
    if stage in ("warmup", "train"):
        try:
            dec = D.load_decomposition(project, stage)
        except (LookupError, PdctlError) as e:
            res.missing.append(f"component figures: {e}")
        else:
            res.step = dec.step
            if st.get("status") != "done":
                res.notes.append(f"component figures show {stage} checkpoint {dec.step}")
            sections.extend(_component_sections(project, dec, o, steps))
    sections.extend(_cluster_section(project, o))

    steps("index.html")
    eval_html = None
    if stage == "train":
        eval_html = _eval_section(st, eval_rows, o, toy)
    page = P.Page(
        title=f"pdctl report: {project.root.name} ({stage})",
        subtitle=_subtitle(project, stage, res.step),
        missing=res.missing,
        notes=res.notes,
        eval_html=eval_html,
        eval_title="Final evaluation" if st.get("status") == "done" else "Latest evaluation",
        config_rows=config_rows(project),
        config_text=_user_config(project),
        stages_rows=_stage_rows(project),
        sections=sections,
        harvest=harvest_line(project),  # the browser's link, when a harvest exists
    )
    res.index.write_text(P.render(page), encoding="utf-8")
    res.files.append(res.index)
    _write_manifest(project, res)
    steps("done", advance=0)
    return res


Section = tuple[str, list[P.Fig], str]  # (title, figures, extra HTML)


def _cluster_section(project: Project, o: _Out) -> list[Section]:
    """`pdctl cluster`'s clusters, from the harvest's database, when it has them."""
    from pdctl.harvest import cluster as cl
    from pdctl.harvest.run import harvest_dir

    path = harvest_dir(project) / "harvest.db"
    if not path.is_file():
        return []
    try:
        got = cl.figure_data(path)
    except PdctlError as e:
        o.res.missing.append(f"clusters: {e}")
        return []
    if got is None:
        return []
    S, names, sizes = got
    png = F.plot_clusters(o.dir / "clusters.png", S, names, sizes)
    caption = "Jaccard similarity of firing within and between the clusters (red: one cluster)"
    return [("Component clusters (pdctl cluster)", [o.fig(png, "clusters", caption)], "")]


def _curve_sections(
    project: Project, stage: str, o: _Out, toy: bool
) -> tuple[list[Section], list[dict[str, Any]]]:
    """Training curves, L0 over steps and the periodic evaluations, from the metrics log."""
    path = project.metrics_path(stage)
    rows, eval_rows = L.read_metrics(path) if path.is_file() else ([], [])
    sections: list[Section] = []
    if not rows:
        o.res.missing.append(f"training curves: no metrics in metrics/{stage}.jsonl yet")
        return sections, eval_rows
    caption = f"{stage}: loss terms, total, learning rate and gradient norm over steps"
    figs = [o.fig(F.plot_curves(o.dir / "curves.png", rows, stage), "curves", caption)]
    if any(k.startswith("l0/") for r in rows for k in r):
        l0 = F.plot_l0(o.dir / "l0.png", rows, eval_rows)
        figs.append(o.fig(l0, "l0", "L0 per site over steps"))
    sections.append(("Training", figs, ""))
    if eval_rows:
        ev = F.plot_eval_curves(o.dir / "eval_curves.png", eval_rows, toy)
        sections.append(("Evaluations over training", [o.fig(ev, "eval_curves", "")], ""))
    elif stage == "train":
        o.res.missing.append("evaluations over training: none logged yet (train.eval_every)")
    return sections, eval_rows


def toy_ci_figures(
    dec: L.Decomposition, cfg: Any, out_dir: Path, alive: Mapping[str, np.ndarray] | None
) -> list[tuple[str, Path, Path, tuple[str, int]]]:
    """Per site of a toy target: the CI matrix on one-hot inputs (`evaluate.toy_ci_matrices`),
    permuted and plotted with the data beside it. [(site, png, npz, ground-truth pattern)]."""
    mats = evaluate.toy_ci_matrices(dec.target, dec.params, dec.components, dec.ci_fns, cfg)
    patterns = evaluate.toy_patterns(dec.target, list(mats))
    out = []
    for site, m in mats.items():
        png = out_dir / f"ci_matrix_{L.site_slug(site)}.png"
        a = None if alive is None else alive[site]
        png, npz = F.plot_ci_matrix(png, m, a, site, patterns[site], cfg.decomp.ci_threshold)
        out.append((site, png, npz, patterns[site]))
    return out


def _tms_figures(dec: L.Decomposition, o: _Out, alive) -> list[P.Fig]:
    """MMCS / ML2R per site (per feature, as `evaluate.toy_eval`) and, for n_hidden = 2, the
    2-D picture of linear1."""
    weights = dec.target.site_weights(dec.params)
    values = {}
    for site, c in dec.components.items():
        per = "out" if site == "linear2" else "in"
        values[site] = evaluate.mmcs_and_ml2r(weights[site], c["V"], c["U"], per)
    o.json("mmcs_ml2r.json", {s: {"mmcs": v[0], "ml2r": v[1]} for s, v in values.items()})
    mm = F.plot_mmcs_ml2r(o.dir / "mmcs_ml2r.png", values)
    figs = [o.fig(mm, "mmcs_ml2r", "MMCS and ML2R per site (1 and 1: the target's directions)")]
    if dec.target.n_hidden == 2 and "linear1" in dec.components:
        c = dec.components["linear1"]
        a = None if alive is None else alive["linear1"]
        path = F.plot_tms_2d(
            o.dir / "tms_2d.png", np.asarray(weights["linear1"]), c["V"], c["U"], a
        )
        n = F.tms_panels(c["V"].shape[1])
        figs.append(o.fig(path, "tms_2d", "TMS: target directions vs rank-one components", n))
    return figs


def _component_sections(
    project: Project, dec: L.Decomposition, o: _Out, steps: _Steps
) -> list[Section]:
    cfg = project.config
    thr = cfg.decomp.ci_threshold
    is_lm = dec.target.output_kind == "logits"
    site_kind, n_sites = F.site_figure(list(dec.components))  # a panel per site, or per matrix
    sections: list[Section] = []

    steps("evaluation batch")
    stats, tokens = None, None
    try:
        inputs, tokens = L.eval_inputs(project, dec.target)
    except (PdctlError, ValueError, OSError) as e:
        o.res.missing.append(f"CI statistics: cannot read the evaluation batch ({e})")
    else:
        steps.grow(len(L.chunk_plan(dec, inputs)))
        tick = lambda: steps("CI on the evaluation batch")  # noqa: E731
        stats = L.ci_stats(dec, cfg, inputs, L.TOP_K if is_lm else 0, on_chunk=tick)
    alive = stats.alive if stats is not None else None

    figs: list[P.Fig] = []
    if dec.target.kind in ("tms", "resid_mlp"):
        steps.grow(1)
        steps("CI on one-hot inputs")
        for site, png, npz, (kind, k) in toy_ci_figures(dec, cfg, o.dir, alive):
            truth = "one component per feature" if kind == "identity" else f"{k} co-firing"
            caption = f"{site}: CI on one-hot inputs, permuted (ground truth: {truth})"
            figs.append(o.fig(png, "ci_matrix", caption, data=npz))
        if dec.target.kind == "tms":
            figs.extend(_tms_figures(dec, o, alive))
    norms = {
        s: np.linalg.norm(np.asarray(c["V"], np.float64), axis=0)
        * np.linalg.norm(np.asarray(c["U"], np.float64), axis=1)
        for s, c in dec.components.items()
    }
    path = F.plot_component_norms(o.dir / "component_norms.png", norms, alive)
    figs.append(o.fig(path, site_kind, "component norms per site", n_sites))
    sections.append((f"Components ({dec.stage} checkpoint {dec.step})", figs, ""))
    if stats is None:
        return sections

    steps.grow(1)
    steps("CI distributions")
    hist = F.plot_ci_histograms(o.dir / "ci_histograms.png", stats.hist, L.HIST_EDGES, thr)
    density = stats.density()
    dens = F.plot_activation_density(o.dir / "activation_density.png", density, thr, stats.n_inputs)
    l0 = stats.l0()
    o.json(
        "ci_stats.json",
        {
            s: {"n_inputs": stats.n_inputs, "alive": int(stats.alive[s].sum()), "l0": l0[s],
                "density": density[s].tolist()}
            for s in dec.components
        },
    )  # fmt: skip
    unit = "token positions" if is_lm else "inputs"
    figs = [
        o.fig(hist, site_kind, "CI values on the evaluation batch", n_sites),
        o.fig(dens, site_kind, "component activation density", n_sites),
    ]
    sections.append((f"CI on the evaluation batch ({stats.n_inputs} {unit})", figs, ""))
    if is_lm and tokens is not None:
        steps.grow(1)
        steps("top contexts")
        decode, how = D.token_decoder(project, dec.target)
        ctx = L.top_contexts(stats, tokens, decode)
        o.json("top_contexts.json", ctx)
        sections.append(
            ("Top contexts of the most active components", [], P.contexts_html(ctx, how))
        )
    return sections


def _eval_section(
    st: Mapping[str, Any], eval_rows: list[dict[str, Any]], o: _Out, toy: bool
) -> str:
    """The final evaluation of a done train stage; before that, the latest one (the loop
    records each evaluation in the state as it goes), marked as not final."""
    ev = dict(st.get("eval") or {})
    if not ev and eval_rows:
        ev = _eval_from_line(eval_rows[-1])
    done = st.get("status") == "done"
    table = (P.toy_eval_table(ev) if "ci_errors" in ev else P.lm_eval_table(ev)) if ev else ""
    if done and ev:
        o.json("eval.json", ev)
        return table
    step = eval_rows[-1]["step"] if eval_rows else None
    latest = f" (below: the latest evaluation, step {step})" if ev and step is not None else ""
    o.res.missing.append(f"final evaluation: train has not finished{latest}")
    if not ev:
        return ""
    at = f" at step {step}" if step is not None else ""
    return f"<p>Not final: the latest evaluation{at}.</p>" + table


def _eval_from_line(row: Mapping[str, Any]) -> dict[str, Any]:
    """An `eval/...` metrics line in the shape of the state's `eval` table."""
    ev: dict[str, Any] = {}
    for k, v in row.items():
        parts = k.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[1] in _PER_SITE:
            ev.setdefault(parts[1], {})[parts[2]] = v
        elif len(parts) >= 2 and parts[0] == "eval":
            ev["/".join(parts[1:])] = v
    return ev


_PER_SITE = ("ci_errors", "mmcs", "ml2r", "l0", "alive", "alive_mean")


def config_rows(project: Project) -> list[tuple[str, str]]:
    cfg = project.config
    t = cfg.target.model_dump()
    kind = t.pop("kind")
    d = cfg.decomp
    tc = cfg.train
    loss = tc.loss.model_dump()
    coeffs = [f"{k} {v:g}" for k, v in loss.items() if k in TERMS and v]
    lc = tc.loss
    if lc.merged_recon:
        coeffs.append(f"merged_recon {lc.merged_recon:g} (adv_fraction {lc.adv_fraction:g})")
    if lc.chunkwise_recon:
        per = lc.sites_per_chunk
        coeffs.append(
            f"chunkwise_recon {lc.chunkwise_recon:g} ("
            + (f"{per} sites a chunk" if per else "one chunk")
            + ")"
        )
    if lc.frequency:
        ema = lc.frequency_ema_halflife
        coeffs.append(f"frequency {lc.frequency:g}" + (f" (EMA half-life {ema:g})" if ema else ""))
    if lc.sparsity == "smooth_l0":
        g = lc.gamma_final
        p = f"smooth_l0 gamma {lc.gamma:g}" + (f" → {g:g}" if g is not None else "")
    else:
        p = f"p {lc.p:g}" + (f" → {lc.p_final:g}" if lc.p_final is not None else "")
    e = tc.eval_pgd
    pgd = (
        f"; fresh PGD: {e.n_steps} sign steps of {e.step_size:g}, {e.init} {e.scope} sources"
        if e.enabled and cfg.target.kind in ("llama_mlp", "hf")
        else ""
    )
    return [
        ("seed", str(cfg.run.seed)),
        ("target", f"{kind}: " + ", ".join(f"{k}={v}" for k, v in t.items())),
        ("sites", ", ".join(f"{s.pattern} (C={s.C})" for s in d.sites)),
        (
            "CI function",
            f"{d.ci_fn.type} hidden {list(d.ci_fn.hidden)}, sigmoid {d.sigmoid}, "
            f"sampling {d.sampling}, threshold {d.ci_threshold:g}",
        ),
        (
            "train",
            f"{tc.steps} steps, batch {tc.batch_size}, lr {tc.optim.lr:g} "
            f"{tc.optim.schedule}, eval every {tc.eval_every} on {tc.eval_batch_size}{pgd}",
        ),
        ("loss", ", ".join(coeffs) + f"; {p}, output {tc.loss.output}"),
        ("warmup", f"{cfg.warmup.steps} steps, lr {cfg.warmup.lr:g}"),
        ("pretrain", f"{cfg.pretrain.steps} steps, batch {cfg.pretrain.batch_size}"),
    ]


def _user_config(project: Project) -> str:
    try:
        return split_state(project.path.read_text(encoding="utf-8"))[0].rstrip() + "\n"
    except OSError:
        return ""


def _stage_rows(project: Project) -> list[tuple[Any, ...]]:
    rows = []
    for name in STAGES:
        st = project.stage(name)
        status = st.get("status", "pending") + (" (stale)" if project.is_stale(name) else "")
        step = f"{st.get('step', '')}" + (f"/{st['steps']}" if st.get("steps") else "")
        wall = f"{st['wall_s']:.1f}" if isinstance(st.get("wall_s"), int | float) else ""
        rows.append((name, status, step, wall, st.get("checkpoint", "")))
    return rows


def _subtitle(project: Project, stage: str, step: int | None) -> str:
    st = project.stage(stage)
    when = dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()
    at = f", checkpoint {step}" if step is not None else ""
    return (
        f"{project.root} — {stage} {st.get('status', 'pending')}{at}; "
        f"written {when} by pdctl {__version__}"
    )


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON-serialisable: {type(x)}")


def _write_manifest(project: Project, res: ReportResult) -> None:
    st = project.stage(res.stage)
    body = {
        "stage": res.stage,
        "checkpoint": res.step,
        "stage_status": st.get("status", "pending"),
        "stage_step": st.get("step"),
        "written_at": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "pdctl_version": __version__,
        "files": [p.name for p in res.files],
        "missing": res.missing,
        "notes": res.notes,
    }
    path = res.out / MANIFEST
    res.files.append(path)
    path.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
