"""`pdctl interp export / import / score`: the Typer sub-app (wired in pdctl.cli.app with
`app.add_typer`), each command parsing its options, calling `pdctl.interp` and printing what
it did. Heavy imports stay inside the commands (`pdctl new` imports no JAX)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from pdctl.cli import base, post

app = typer.Typer(
    help="Label components with any LLM: export prompts from the harvest, import labels, score "
    "them (detection / fuzzing).",
    no_args_is_help=True,
)


def _guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """pdctl's one-line error handling (`pdctl.cli.base.guard`) around `fn`."""
    return base.guard(fn)


def _paths(ctx: typer.Context):
    """(project, harvest.db, the run's interp/ directory)."""
    proj = base.project(ctx)
    return proj, proj.root / "harvest" / "harvest.db", proj.root / "interp"


def _positive(text: str, flag: str, low: int = 1) -> int:
    """An integer option given as text (one line naming `flag` for anything else)."""
    from pdctl.errors import PdctlError

    v = post.int_flag(text, flag)
    if v < low:
        raise PdctlError(f"{flag}: must be >= {low}, got {v}")
    return v


def _out_path(p: Path | None, default: Path) -> Path:
    from pdctl.errors import PdctlError
    from pdctl.files import refuse_links

    out = default if p is None else p
    if out.is_dir():
        raise PdctlError(f"--out: {out} is a directory (give a file name)")
    if not out.parent.is_dir() and out.parent != default.parent:
        raise PdctlError(f"--out: {out.parent} is not a directory")
    refuse_links(out.parent)
    refuse_links(out)
    return out


def _client(endpoint: str, model: str | None, api_key_env: str, rpm: str, retries: str):
    from pdctl.errors import PdctlError
    from pdctl.interp import endpoint as ep

    url = ep.chat_url(endpoint)
    if not model:
        raise PdctlError("--model: required with --endpoint (the model name the server serves)")
    try:
        per_minute = float(rpm)
    except ValueError:
        per_minute = float("nan")
    if not 0 < per_minute < float("inf"):
        raise PdctlError(f"--rpm: must be a number > 0, got {rpm!r}")
    n = _positive(retries, "--retries", 0)
    return ep.Client(url, model, os.environ.get(api_key_env) or None, rpm=per_minute, retries=n)


def _progress(total: int, what: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = base.err_console
    p = Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 console=console, transient=True)  # fmt: skip
    return p, p.add_task(what, total=total)


def _say(text: str) -> None:
    base.console.print(text, markup=False)


Endpoint = Annotated[
    str | None,
    typer.Option("--endpoint", metavar="URL",
                 help="Send the prompts to this OpenAI-compatible chat-completions server "
                 "(nothing is sent without it)."),
]  # fmt: skip
Model = Annotated[str | None, typer.Option("--model", help="Model name, with --endpoint.")]
KeyEnv = Annotated[
    str,
    typer.Option("--api-key-env", metavar="NAME",
                 help="Environment variable holding the endpoint's API key (if it needs one)."),
]  # fmt: skip
Rpm = Annotated[
    str, typer.Option("--rpm", metavar="N", help="At most this many requests a minute.")
]
Retries = Annotated[
    str,
    typer.Option("--retries", metavar="N", help="Retries of a request after an error, with "
                 "backoff."),
]  # fmt: skip


@app.command("export")
@_guard
def export(
    ctx: typer.Context,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Records file (default <run>/interp/components.jsonl); the "
            "trials go beside it as trials.jsonl.",
        ),
    ] = None,
    site: Annotated[
        list[str] | None,
        typer.Option("--site", metavar="SITE", help="Only this site (repeatable)."),
    ] = None,
    top: Annotated[
        str, typer.Option("--top", metavar="N", help="Top examples in the prompt.")
    ] = "10",
    sample: Annotated[
        str, typer.Option("--sample", metavar="N", help="Sampled examples in the prompt.")
    ] = "10",
    held_out: Annotated[
        str,
        typer.Option(
            "--held-out", metavar="N", help="Sampled examples kept out of the prompt, for scoring."
        ),
    ] = "6",
    n_trials: Annotated[
        str,
        typer.Option(
            "--trials", metavar="N", help="Detection and fuzzing trials per labelled component."
        ),
    ] = "1",
    seed: Annotated[str, typer.Option("--seed", metavar="N", help="Seed of the trials.")] = "0",
    silent: Annotated[
        bool, typer.Option("--all", help="Also components that never fired.")
    ] = False,
    endpoint: Endpoint = None,
    model: Model = None,
    api_key_env: KeyEnv = "OPENAI_API_KEY",
    rpm: Rpm = "60",
    retries: Retries = "5",
) -> None:
    """One JSONL record per component (statistics, marked top / sampled contexts, input-token
    PMI, output effects, a ready prompt), and detection / fuzzing trials for the labelled ones.
    With --endpoint, also asks the server for each unlabelled component's label (resumable:
    answers go to labels.jsonl beside the records) and imports them."""
    from pdctl.errors import PdctlError
    from pdctl.files import atomic_write
    from pdctl.harvest.browse import decoder
    from pdctl.interp import export as ex

    top_n = _positive(top, "--top", 0)
    sample_n = _positive(sample, "--sample", 0)
    held_n = _positive(held_out, "--held-out", 0)
    trials_n = _positive(n_trials, "--trials", 0)
    seed_n = post.int_flag(seed, "--seed")
    client = _client(endpoint, model, api_key_env, rpm, retries) if endpoint else None
    proj, path, interp_dir = _paths(ctx)
    records, trials, text, trials_text = ex.from_harvest(
        path, lambda: decoder(proj), sites=site, top=top_n, sample=sample_n, held_out=held_n,
        n_trials=trials_n, seed=seed_n, silent=silent,
    )  # fmt: skip
    out = _out_path(out, interp_dir / "components.jsonl")
    trials_path = out.with_name("trials.jsonl")
    answers = out.with_name("labels.jsonl")
    if client is not None:
        _refuse(answers)  # before anything is written
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, text)
        atomic_write(trials_path, trials_text)
    except OSError as e:
        raise PdctlError(f"interp export: cannot write {out} ({e.strerror or e})") from None
    labelled = sum(r["label"] is not None for r in records)
    _say(f"wrote {len(records)} components ({labelled} labelled) to {out} and "
         f"{len(trials)} trials to {trials_path}")  # fmt: skip
    if client is None:
        return
    from pdctl.interp import endpoint as ep
    from pdctl.interp import labels as lb

    notice = ep.repair_tail(answers)
    if notice:
        _say(notice)
    done = ep.done_keys(answers, "label")
    jobs = ex.label_jobs(records, done)
    progress, task = _progress(len(jobs), "labelling")
    try:
        with progress:
            res = ep.run(client, jobs, answers, ep.label_fields(client.model),
                         lambda: progress.advance(task))  # fmt: skip
    finally:
        client.close()
    _say(f"{res.answered} labels from {client.url} appended to {answers}"
         + (f" ({len(done)} already there)" if done else ""))  # fmt: skip
    if res.unusable:
        _say(f"{len(res.unusable)} replies held no label (e.g. {res.unusable[0]}): run the "
             "command again to ask for those again")  # fmt: skip
    if done or res.answered:
        with proj.locked():
            n, total = lb.import_labels(path, answers)
        _say(f"imported {n} labels from {answers}: {total} components labelled in {path}")


def _refuse(path: Path) -> None:
    """An answers file to append to: no symlink, and (checked without opening it, which would
    block on a FIFO) a regular file when there is one."""
    import stat

    from pdctl.errors import PdctlError
    from pdctl.files import refuse_links

    refuse_links(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise PdctlError(f"{path}: cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise PdctlError(f"{path}: is not a regular file (a FIFO, device, socket or directory); "
                         "pdctl appends answers only to a regular file (remove it)")  # fmt: skip


@app.command("import")
@_guard
def import_(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="JSONL of labels (see README: pdctl interp).")],
) -> None:
    """Read labels (and optional detection / fuzzing scores) from FILE into the harvest
    database; `pdctl browse` shows them."""
    from pdctl.interp import labels as lb

    proj, path, _ = _paths(ctx)
    with proj.locked():
        n, total = lb.import_labels(path, file)
    _say(f"imported {n} labels from {file}: {total} components labelled in {path}")


@app.command("score")
@_guard
def score(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="trials.jsonl (from export), predictions filled.")],
    save: Annotated[
        bool, typer.Option("--save/--no-save", help="Store the scores in the harvest database.")
    ] = True,
    endpoint: Endpoint = None,
    model: Model = None,
    api_key_env: KeyEnv = "OPENAI_API_KEY",
    rpm: Rpm = "60",
    retries: Retries = "5",
) -> None:
    """Detection and fuzzing scores of the labels from the trials' yes / no predictions
    (filled by any LLM; or, with --endpoint, asked here, resumably, into
    FILE's .answers.jsonl), printed and stored with the labels."""
    from contextlib import closing

    from rich.table import Table

    from pdctl.errors import PdctlError
    from pdctl.harvest import db
    from pdctl.interp import labels as lb
    from pdctl.interp import score as sc

    client = _client(endpoint, model, api_key_env, rpm, retries) if endpoint else None
    proj, path, _ = _paths(ctx)
    with closing(db.open_readonly(path)) as con:
        known = lb.sites(con)
    sc.parse(file, known, answers=None)  # refuse a bad file before asking anything
    answers = file.with_name(file.stem + ".answers.jsonl")
    if client is not None:
        from pdctl.interp import endpoint as ep

        _refuse(answers)
        notice = ep.repair_tail(answers)
        if notice:
            _say(notice)
        done = ep.done_keys(answers, "predictions")
        todo = [obj for _, obj in lb.read_jsonl(file)
                if obj.get("predictions") is None and sc.trial_id(obj) not in done]  # fmt: skip
        for o in todo:
            if not isinstance(o.get("prompt"), str):
                raise PdctlError(f"{file}: trial {sc.trial_id(o)}: prompt: missing (export "
                                 "the trials again)")  # fmt: skip
        jobs = [(sc.trial_id(o), o["prompt"], o | {"key": sc.trial_id(o)}) for o in todo]
        progress, task = _progress(len(jobs), "asking for predictions")
        try:
            with progress:
                got = ep.run(client, jobs, answers, ep.prediction_fields,
                             lambda: progress.advance(task))  # fmt: skip
        finally:
            client.close()
        _say(f"{got.answered} trials answered by {client.url}, appended to {answers}")
        if got.unusable:
            _say(f"{len(got.unusable)} replies held no usable predictions: run the command "
                 "again to ask for those again")  # fmt: skip
    trials, skipped = sc.parse(file, known, answers)
    if not trials:
        raise PdctlError(f"{file}: no trial has its predictions filled in ({skipped} without)")
    res = sc.compute(trials)
    with closing(db.open_readonly(path)) as con:
        labels = db.read_labels(con)
    for (s, c), label in res.labels.items():
        have = labels.get((s, c), {}).get("label")
        if have != label:
            raise PdctlError(
                f"{file}: {s}:{c}: the trials were made for label {label!r}, the database "
                f"holds {have!r} (export the trials again)"
            )
    t = Table(title=f"label scores ({len(trials)} trials)")
    for col in ("component", "label", "detection", "fuzzing"):
        t.add_column(col, overflow="fold")
    for s, c in res.labels:
        d, f = res.detection.get((s, c)), res.fuzzing.get((s, c))
        t.add_row(f"{s}:{c}", res.labels[(s, c)], "" if d is None else f"{d:.3f}",
                  "" if f is None else f"{f:.3f}")  # fmt: skip
    base.console.print(t)
    for task, vals in (("detection", res.detection), ("fuzzing", res.fuzzing)):
        if vals:
            _say(f"mean {task}: {sum(vals.values()) / len(vals):.3f} over {len(vals)} components")
    if skipped:
        _say(f"{skipped} trials without predictions were skipped")
    if save:
        merged = {k: dict(v) for k, v in labels.items()}
        for key in res.labels:
            for task, vals in (("detection", res.detection), ("fuzzing", res.fuzzing)):
                if key in vals:
                    merged[key][task] = vals[key]
        with proj.locked():
            db.replace_labels(path, merged)
        _say(f"stored the scores of {len(res.labels)} components in {path}")
