"""The real Typer app: new, templates, status, --project, discovery, and one-line user errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import pdctl_process
from typer.testing import CliRunner

from pdctl.cli import app
from pdctl.project import Project
from pdctl.registry import STAGES

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = (
    "hf-lm",
    "llama-mlp",
    "resid-mlp",
    "smollm2",
    "smollm2-all",
    "smollm2-all-mlps",
    "tms",
    "tms-40-10",
    "tms-5-2-id",
)


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def _ok(runner: CliRunner, *args: str):
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def _status_json(runner: CliRunner, *args: str) -> dict:
    return json.loads(_ok(runner, *args, "status", "--json").stdout)


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("template", TEMPLATES)
def test_new_creates_the_run_from_the_template(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str
) -> None:
    monkeypatch.chdir(tmp_path)
    name = f"my_{template}.run-1"
    _ok(runner, "new", name, "--template", template)
    run = tmp_path / name
    assert sorted(p.name for p in run.iterdir()) == ["README.md", "pdctl.toml"]
    src = ROOT / "templates" / template
    assert (run / "pdctl.toml").read_bytes() == (src / "pdctl.toml").read_bytes()
    readme = (run / "README.md").read_text(encoding="utf-8")
    assert readme.splitlines()[0] == f"# {name}"
    assert "$name" not in readme
    assert readme == (src / "README.md").read_text(encoding="utf-8").replace("$name", name)

    # A new run: every stage pending, nothing stale, and `status` writes nothing.
    monkeypatch.chdir(run)
    before = _snapshot(tmp_path)
    report = _status_json(runner)
    assert list(report) == list(STAGES) == ["init_weights", "pretrain", "warmup", "train"]
    for st in report.values():
        assert st == {"status": "pending", "stale": False}
    table = _ok(runner, "status").stdout
    for stage in STAGES:
        assert stage in table
    assert table.count("pending") == len(STAGES)
    assert _snapshot(tmp_path) == before


def test_new_default_template_is_tms(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _ok(runner, "new", "r")
    want = (ROOT / "templates" / "tms" / "pdctl.toml").read_bytes()
    assert (tmp_path / "r" / "pdctl.toml").read_bytes() == want
    (tmp_path / "empty").mkdir()
    _ok(runner, "new", "empty", "-t", "resid-mlp")  # an existing empty directory is fine
    assert (tmp_path / "empty" / "pdctl.toml").is_file()


def test_templates_lists_all_three(runner: CliRunner) -> None:
    out = _ok(runner, "templates").stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert names == list(TEMPLATES)
    assert sorted(p.name for p in (ROOT / "templates").iterdir() if p.is_dir()) == names
    for line in out.splitlines():
        assert len(line.split(maxsplit=1)) == 2, "every template has a description"


def _run_with_state(parent: Path, name: str, step: int) -> Path:
    """A tms run whose pretrain state says `step`, so tests can tell runs apart."""
    from pdctl.templates import create_run

    run = create_run(name, "tms", parent)
    proj = Project.load(run / "pdctl.toml")
    proj.update_stage(
        "pretrain", status="done", step=step, fingerprint=proj.fingerprint("pretrain")
    )
    return run


def test_project_option_takes_a_directory_or_a_file(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _run_with_state(tmp_path, "run1", 11)
    _run_with_state(tmp_path, "run2", 22)
    monkeypatch.chdir(tmp_path)  # no pdctl.toml here or above
    for arg, step in [
        ("run1", 11),
        ("run2", 22),
        ("run1/pdctl.toml", 11),
        (str(tmp_path / "run2" / "pdctl.toml"), 22),
        (str(tmp_path / "run2"), 22),
    ]:
        for flag in ("--project", "-p"):
            report = _status_json(runner, flag, arg)
            assert report["pretrain"]["step"] == step, (flag, arg)
            assert report["pretrain"]["stale"] is False
            assert report["train"] == {"status": "pending", "stale": False}
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: no pdctl.toml in ")


def test_status_finds_the_run_from_a_subdirectory(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run_with_state(tmp_path, "run1", 33)
    sub = run / "metrics" / "deeper"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    assert _status_json(runner)["pretrain"]["step"] == 33
    monkeypatch.chdir(run)
    assert _status_json(runner)["pretrain"]["step"] == 33


# ---- user errors: exit 2, one line `error: <key path>: ...`, no traceback, nothing written -------

SCHEMA = "schema = 1\n"
SITES = '[decomp]\nsites = [{ pattern = "linear1", C = 4 }, { pattern = "linear1", C = 5 }]\n'

# (id, pdctl.toml content, text the one error line must contain)
BAD_CONFIGS: list[tuple[str, str | bytes, str]] = [
    ("malformed-toml", SCHEMA + "[run\nseed = 1\n", "pdctl.toml: invalid TOML"),
    ("duplicate-key", SCHEMA + "[run]\nseed = 1\nseed = 2\n", "pdctl.toml: invalid TOML"),
    ("not-utf8", SCHEMA.encode() + b'[run]\ndescription = "\xff\xfe"\n', "not UTF-8"),
    ("empty-file", "", "schema: missing"),
    ("missing-schema", "[run]\nseed = 1\n", "schema: missing"),
    ("unsupported-schema", "schema = 2\n", "schema: unsupported version 2"),
    ("schema-string", 'schema = "1"\n', "schema: must be an integer"),
    ("unknown-table", SCHEMA + "[bogus]\nx = 1\n", "bogus: unknown key"),
    ("unknown-nested-key", SCHEMA + "[train.optim]\nlrr = 0.1\n", "train.optim.lrr: unknown key"),
    ("table-as-scalar", SCHEMA + "run = 5\n", "run: "),
    ("string-for-int", SCHEMA + '[pretrain]\nsteps = "5"\n', "pretrain.steps: "),
    ("float-for-int", SCHEMA + "[pretrain]\nsteps = 5.0\n", "pretrain.steps: "),
    ("bool-for-int", SCHEMA + "[train]\nbatch_size = true\n", "train.batch_size: "),
    ("negative-steps", SCHEMA + "[train]\nsteps = -1\n", "train.steps: must be greater than 0"),
    ("zero-batch", SCHEMA + "[pretrain]\nbatch_size = 0\n", "pretrain.batch_size: must be"),
    ("lr-negative", SCHEMA + "[train.optim]\nlr = -1\n", "train.optim.lr: must be greater than 0"),
    ("lr-zero", SCHEMA + "[pretrain.optim]\nlr = 0.0\n", "pretrain.optim.lr: must be greater"),
    ("ci-optim-lr", SCHEMA + "[train.ci_optim]\nlr = -0.5\n", "train.ci_optim.lr: must be"),
    ("frac-above-1", SCHEMA + "[data]\nfeature_probability = 1.5\n", "data.feature_probability"),
    ("bad-literal", SCHEMA + '[decomp]\nsigmoid = "soft"\n', "decomp.sigmoid: "),
    ("bad-wandb-mode", SCHEMA + '[tracking]\nwandb = "on"\n', "tracking.wandb: "),
    ("unknown-target-kind", SCHEMA + '[target]\nkind = "mlp"\n', "target.kind: must be one of"),
    ("missing-target-kind", SCHEMA + "[target]\nn_features = 3\n", "target.kind: missing"),
    (
        "key-of-another-kind",
        SCHEMA + '[target]\nkind = "llama_mlp"\nn_features = 3\n',
        "target.n_features: unknown key",
    ),
    (
        "llama-heads-divide",
        SCHEMA + '[target]\nkind = "llama_mlp"\nd_model = 64\nn_heads = 5\n',
        "target: d_model (64) must be divisible by n_heads (5)",
    ),
    (
        "llama-odd-head-dim",
        SCHEMA + '[target]\nkind = "llama_mlp"\nd_model = 12\nn_heads = 4\n',
        "target: d_model / n_heads must be even",
    ),
    ("mesh-two-wildcards", SCHEMA + "[mesh]\ndata = -1\nfsdp = -1\n", "mesh: only one of"),
    ("mesh-zero", SCHEMA + "[mesh]\ndata = 0\n", "mesh: "),
    ("duplicate-site", SCHEMA + SITES, "decomp.sites.1.pattern: 'linear1' is listed twice"),
    ("site-without-C", SCHEMA + '[decomp]\nsites = [{ pattern = "a" }]\n', "decomp.sites.0.C: "),
    (
        "anneal-order",
        SCHEMA + "[train.loss]\np_anneal_start = 0.5\np_anneal_end = 0.2\n",
        "train.loss: p_anneal_end must be >= p_anneal_start",
    ),
    ("kl-needs-lm", SCHEMA + '[train.loss]\noutput = "kl"\n', "train.loss.output: "),
    (
        "state-in-the-middle",
        SCHEMA + '[state.train]\nstatus = "done"\n\n[run]\nseed = 1\n',
        "[run] comes after the [state.*] tables",
    ),
    (
        "bare-state-in-the-middle",
        SCHEMA + "[state]\n[train]\nsteps = 5\n",
        "[train] comes after the [state.*] tables",
    ),
    ("state-as-user-key", SCHEMA + "state = 1\n", "`state` is pdctl's table"),
    ("state-unknown-stage", SCHEMA + '[state.bogus]\nstatus = "done"\n', "state.bogus: unknown"),
    ("state-stage-not-table", SCHEMA + "[state]\ntrain = 5\n", "state.train: must be a table"),
    ("state-array", SCHEMA + '[[state]]\nstatus = "done"\n', "`state` must be [state.<stage>]"),
]

# (id, setup in the cwd, argv, text the one error line must contain)
BAD_COMMANDS: list[tuple[str, Callable[[Path], None], list[str], str]] = [
    ("bad-template", lambda d: None, ["new", "x", "-t", "nope"], "--template: unknown template"),
    (
        "existing-non-empty-dir",
        lambda d: (d / "x").mkdir() or (d / "x" / "keep.txt").write_text("mine"),
        ["new", "x"],
        "NAME: ",
    ),
    ("existing-file", lambda d: (d / "x").write_text("mine"), ["new", "x"], "NAME: "),
    ("name-with-slash", lambda d: None, ["new", "a/b"], "NAME: 'a/b'"),
    ("name-dotdot", lambda d: None, ["new", ".."], "NAME: '..'"),
    ("name-empty", lambda d: None, ["new", ""], "NAME: ''"),
    ("no-project", lambda d: None, ["status"], "no pdctl.toml in"),
    ("project-missing", lambda d: None, ["--project", "nope", "status"], "--project: no pdctl"),
    (
        "project-dir-without-toml",
        lambda d: (d / "empty").mkdir(),
        ["--project", "empty", "status", "--json"],
        "--project: no pdctl.toml",
    ),
]


def _assert_one_line_error(result, expected: str) -> None:
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)  # not an uncaught exception
    assert "Traceback" not in result.output
    lines = result.output.splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: "), result.output
    assert expected in lines[0], result.output
    assert result.stderr == result.output and result.stdout == ""


@pytest.mark.parametrize(
    ("content", "expected"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS]
)
@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_bad_config_is_one_line_error(
    runner: CliRunner,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    content: str | bytes,
    expected: str,
    as_json: bool,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    data = content if isinstance(content, bytes) else content.encode("utf-8")
    (run / "pdctl.toml").write_bytes(data)
    monkeypatch.chdir(run)
    before = _snapshot(tmp_path)
    result = runner.invoke(app, ["status", "--json"] if as_json else ["status"])
    _assert_one_line_error(result, expected)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("setup", "argv", "expected"), [c[1:] for c in BAD_COMMANDS], ids=[c[0] for c in BAD_COMMANDS]
)
def test_bad_command_is_one_line_error(
    runner: CliRunner,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    setup: Callable[[Path], None],
    argv: list[str],
    expected: str,
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    setup(work)
    monkeypatch.chdir(work)
    before = _snapshot(tmp_path)
    result = runner.invoke(app, argv)
    _assert_one_line_error(result, expected)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            SCHEMA + "[train.optim]\nlr = -1\n",
            "error: train.optim.lr: must be greater than 0, got -1",
        ),
        (SCHEMA + "[run\n", "error: pdctl.toml: invalid TOML"),
    ],
)
def test_bad_config_in_a_real_process(tmp_path: Path, content: str, expected: str) -> None:
    """The installed entry point, not CliRunner: stderr is one line, stdout empty, exit 2."""
    (tmp_path / "pdctl.toml").write_text(content, encoding="utf-8")
    # A narrow terminal must not wrap the error line.
    r = pdctl_process("status", cwd=tmp_path, env={"COLUMNS": "60"}, timeout=120)
    assert r.returncode == 2
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(expected), r.stderr
