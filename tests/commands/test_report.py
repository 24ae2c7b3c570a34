"""`pdctl report`: figures of a tiny TMS run (sizes, data behind the permuted CI matrix), a
hand-built perfect decomposition against a random one, index.html's links and its load in
headless Chromium, an unfinished run, the status texts, and the CLI command."""

from __future__ import annotations

import gc
import html.parser
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cli, error_lines, make_run, pdctl_argv, pdctl_env
from PIL import Image

import pdctl.cli
from pdctl.config import parse_config
from pdctl.errors import PdctlError
from pdctl.project import Project
from pdctl.report import build as report_build
from pdctl.report import build_report, eval_summary, report_line
from pdctl.report import figures as F
from pdctl.science.spd import components as comp_mod
from pdctl.science.targets import TMS
from pdctl.stages import init_weights, pretrain, train, warmup
from pdctl.stages.decomposition import Decomposition
from pdctl.testing.browser import CHROMIUM, Browser

# Building the tiny run (init-weights, pretrain, warmup, train to 10, resumed to 20) takes
# 20-40 s on a 2-core CPU, once per module; the tests that use it are marked slow.
needs_run = pytest.mark.slow
TRAIN = {"steps": 20, "batch_size": 64, "log_every": 5, "eval_every": 10, "eval_batch_size": 64}


def _stage(run: Path, module: Any, **kw: Any) -> Any:
    """One stage in-process; the lock it takes is released (one CLI call = one process)."""
    proj = Project.load(run / "pdctl.toml")
    try:
        return module.run(proj, **kw)
    finally:
        while proj._lock_depth:
            proj.release_lock()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny TMS 5-2 run (C = 4 per site) in three states: train pending, train interrupted
    at step 10 of 20, train done."""
    parent = tmp_path_factory.mktemp("report_runs")
    run = make_run(parent, "tms", "done", warmup={"steps": 10, "log_every": 5}, train=TRAIN)
    for module in (init_weights, pretrain, warmup):
        _stage(run, module)
    pending = Path(shutil.copytree(run, parent / "pending"))
    assert _stage(run, train, until=10).status == "interrupted"
    interrupted = Path(shutil.copytree(run, parent / "interrupted"))
    assert _stage(run, train, resume=True).status == "done"
    return {"pending": pending, "interrupted": interrupted, "done": run}


@pytest.fixture(scope="module")
def finished_report(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    proj = Project.load(runs["done"] / "pdctl.toml")
    return proj, build_report(proj, out=tmp_path_factory.mktemp("report") / "out")


# Pixel sizes of the tiny TMS run's figures (2 sites, C = 4, n_hidden = 2): the layout is
# fixed-size (no tight bounding box), so these only change when the layout does.
EXPECTED_PNG = {
    "curves.png": (1200, 800),
    "l0.png": (1200, 450),
    "eval_curves.png": (1200, 450),
    "ci_matrix_linear1.png": (900, 600),
    "ci_matrix_linear2.png": (900, 600),
    "mmcs_ml2r.png": (1200, 450),
    "tms_2d.png": (1200, 220),  # target, sum, 4 components: one row of 6 panels
    "component_norms.png": (1200, 300),  # two sites side by side
    "ci_histograms.png": (1200, 300),
    "activation_density.png": (1200, 300),
}


@needs_run
def test_finished_tms_run_writes_every_figure_at_its_size(finished_report) -> None:
    _, res = finished_report
    assert res.missing == [] and res.step == 20 and res.index == res.out / "index.html"
    pngs = {p.name for p in res.out.glob("*.png")}
    assert pngs == set(EXPECTED_PNG)
    assert {p.name for p in res.files} >= pngs | {"index.html", "report.json", "eval.json"}
    for name, size in EXPECTED_PNG.items():
        with Image.open(res.out / name) as im:
            assert im.format == "PNG" and im.size == size, name
            pixels = np.asarray(im.convert("L"), dtype=np.float64)
        assert pixels.std() > 5, f"{name} looks blank"


@needs_run
def test_permuted_ci_data_matches_the_final_evaluation(finished_report) -> None:
    """The .npz beside each CI matrix holds the one-hot CI of the final checkpoint: its CI-error
    count is the one the train stage's final evaluation recorded, and its alive marks are the
    eval batch's (same batch, same count)."""
    proj, res = finished_report
    ev = proj.stage("train")["eval"]
    for site in ("linear1", "linear2"):
        d = np.load(res.out / f"ci_matrix_{site}.npz")
        ci, order = d["ci"], d["order"]
        assert ci.shape == (5, 4) and sorted(order.tolist()) == [0, 1, 2, 3]
        np.testing.assert_array_equal(d["ci_permuted"], ci[:, order])
        np.testing.assert_array_equal(d["alive_permuted"], d["alive"][order])
        assert str(d["pattern"]) == "identity:5"
        assert float(d["ci_errors"]) == ev["ci_errors"][site]
        assert int(d["alive"].sum()) == ev["alive"][site]
    stats = json.loads((res.out / "ci_stats.json").read_text())
    for site in ("linear1", "linear2"):
        assert stats[site]["l0"] == pytest.approx(ev["l0"][site], rel=1e-6)
        assert stats[site]["n_inputs"] == TRAIN["eval_batch_size"]


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links += [v for k, v in attrs if k in ("src", "href") and v is not None]


@needs_run
def test_index_html_references_only_files_that_exist(finished_report) -> None:
    _, res = finished_report
    parser = _Links()
    parser.feed(res.index.read_text(encoding="utf-8"))
    assert parser.links
    for link in parser.links:
        assert ":" not in link and not link.startswith(("/", "#")) and "/" not in link, link
        assert (res.out / link).is_file(), link
    written = {p.name for p in res.out.iterdir() if p.suffix in (".png", ".npz")}
    assert written <= set(parser.links)  # and every figure and its data is on the page


# ---- headless Chromium -----------------------------------------------------------------------


def need_chromium() -> None:
    """Skip the test where chromium is not installed, or fail it where PDCTL_REQUIRE_CHROMIUM
    says it must run (CI)."""
    if CHROMIUM is None:
        if os.environ.get("PDCTL_REQUIRE_CHROMIUM"):
            pytest.fail("PDCTL_REQUIRE_CHROMIUM is set but no chromium is installed")
        pytest.skip(
            "chromium is not installed (Debian: apt-get install chromium); .ci/run installs it"
        )


@needs_run
def test_index_html_loads_in_headless_chromium_without_errors(finished_report, tmp_path) -> None:
    need_chromium()
    _, res = finished_report
    broken = tmp_path / "broken.html"  # the check must see what it is there to catch
    broken.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>x</title></head><body>'
        '<img src="missing.png" alt="x"><script>console.error("boom"); undefined_fn();</script>'
        "</body></html>"
    )
    browser = Browser(tmp_path / "profile")
    try:
        errors, bad_images, _ = browser.load(broken.as_uri())
        assert bad_images == ["missing.png"]
        assert any("boom" in e for e in errors) and any("exception" in e for e in errors), errors
        errors, bad_images, n_images = browser.load(res.index.as_uri())
    finally:
        browser.close()
    assert errors == [] and bad_images == []
    assert n_images == len(EXPECTED_PNG)


# ---- the permuted CI matrix of a hand-built perfect decomposition vs a random one -----------


def _ci_mlp(w0: float, b0: float, w1: float, b1: float, C: int) -> dict:
    """C identical `mlp` CI functions 1 -> 1 -> 1: z(h) = w1 * gelu(w0 * h + b0) + b1."""
    return {
        "0": {"W": jnp.full((C, 1, 1), w0), "b": jnp.full((C, 1), b0)},
        "1": {"W": jnp.full((C, 1, 1), w1), "b": jnp.full((C, 1), b1)},
    }


C_HAND = 8
PERM = np.array([6, 2, 7, 0, 4])  # feature f lives in component PERM[f]; 1, 3, 5 are dead


def _tms_decomposition(perfect: bool) -> tuple[Decomposition, Any]:
    """TMS 5-2 (tied) whose W1 is a unit pentagon, decomposed into C = 8 components.

    perfect: linear1 V[f, PERM[f]] = 1, U[PERM[f]] = W1[f], the other three components zero,
    so V U = W1 and h_c = 0.75 on the active feature's component, 0 elsewhere; CI
    z = 4 gelu(h) - 0.5 gives 1 and 0. linear2 is tied (V2 = U1.T, U2 = V1.T): h_c = 0.75
    W1[i] . W1[f(c)] in {0.75, 0.232, -0.607, 0}; z = gelu(10 h - 5) - 0.2 is > 1 only at
    0.75. Both sites: the identity on the matched columns, zeros elsewhere.
    random: normal V, U and CI-function weights."""
    target = TMS(n_features=5, n_hidden=2)
    angles = 2 * np.pi * np.arange(5) / 5
    W1 = np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    params = {"linear1": {"W": jnp.asarray(W1)}, "linear2": {"b": jnp.zeros(5)}}
    rng = np.random.default_rng(0)
    if perfect:
        V = np.zeros((5, C_HAND), np.float32)
        U = np.zeros((C_HAND, 2), np.float32)
        V[np.arange(5), PERM] = 1.0
        U[PERM] = W1
        ci_fns = {
            "linear1": _ci_mlp(1.0, 0.0, 4.0, -0.5, C_HAND),
            "linear2": _ci_mlp(10.0, -5.0, 1.0, -0.2, C_HAND),
        }
    else:
        V = rng.normal(size=(5, C_HAND)).astype(np.float32) / np.sqrt(5)
        U = rng.normal(size=(C_HAND, 2)).astype(np.float32) / np.sqrt(C_HAND)
        ci_fns = {
            s: {
                "0": {"W": jnp.asarray(rng.normal(size=(C_HAND, 1, 1)), jnp.float32),
                      "b": jnp.asarray(rng.normal(size=(C_HAND, 1)), jnp.float32)},
                "1": {"W": jnp.asarray(rng.normal(size=(C_HAND, 1, 1)), jnp.float32),
                      "b": jnp.asarray(rng.normal(size=(C_HAND, 1)), jnp.float32)},
            }
            for s in ("linear1", "linear2")
        }  # fmt: skip
    site_C = {"linear1": C_HAND, "linear2": C_HAND}
    free = {"linear1": {"V": jnp.asarray(V), "U": jnp.asarray(U)}}
    ties = comp_mod.component_ties(target.tied_sites(), site_C)
    comps = comp_mod.expand_tied(free, ties, ("linear1", "linear2"))
    cfg = parse_config(
        {
            "schema": 1,
            "target": {"kind": "tms"},
            "decomp": {
                "sites": [{"pattern": "linear*", "C": C_HAND}],
                "ci_fn": {"type": "mlp", "hidden": [1]},
            },
        }
    )
    return Decomposition(target, params, comps, ci_fns, "train", 0, site_C), cfg


def test_permuted_ci_is_the_identity_for_a_perfect_decomposition_and_not_for_a_random_one(
    tmp_path: Path,
) -> None:
    for perfect in (True, False):
        dec, cfg = _tms_decomposition(perfect)
        out = tmp_path / ("perfect" if perfect else "random")
        out.mkdir()
        written = report_build.toy_ci_figures(dec, cfg, out, alive=None)
        assert [w[0] for w in written] == ["linear1", "linear2"]
        for site, png, npz, pattern in written:
            assert pattern == ("identity", 5) and png.is_file()
            d = np.load(npz)
            lead, rest = d["ci_permuted"][:, :5], d["ci_permuted"][:, 5:]
            if perfect:
                np.testing.assert_allclose(lead, np.eye(5), atol=1e-6, err_msg=site)
                np.testing.assert_allclose(rest, 0.0, atol=1e-6, err_msg=site)
                np.testing.assert_array_equal(d["order"][:5], PERM)  # feature f -> PERM[f]
                assert float(d["ci_errors"]) == 0
                # unpermuted, the same matrix is far from the identity: the permutation did it
                assert np.abs(d["ci"][:, :5] - np.eye(5)).max() == 1.0
            else:
                assert np.abs(lead - np.eye(5)).max() > 0.5, (site, lead)
                assert float(d["ci_errors"]) > 0


def test_permute_ci_dense_pattern_sorts_columns_by_total_ci() -> None:
    ci = np.array([[0.0, 1.0, 0.2, 1.0], [0.0, 1.0, 0.0, 0.9]])
    permuted, order, matched = F.permute_ci(ci, ("dense", 2))
    assert order.tolist() == [1, 3, 2, 0] and matched == 2
    np.testing.assert_array_equal(permuted, ci[:, order])


# ---- an unfinished run -----------------------------------------------------------------------


@needs_run
def test_report_on_an_interrupted_train_stage_plots_what_exists(runs, tmp_path) -> None:
    proj = Project.load(runs["interrupted"] / "pdctl.toml")
    res = build_report(proj, out=tmp_path / "r")
    assert res.step == 10  # the components come from the latest checkpoint
    assert "train is interrupted at step 10 of 20: continue it with `pdctl resume`" in res.missing
    assert (
        "final evaluation: train has not finished (below: the latest evaluation, step 10)"
        in res.missing
    )
    for name in ("curves.png", "l0.png", "ci_matrix_linear1.png", "activation_density.png"):
        assert (res.out / name).is_file(), name
    assert not (res.out / "eval.json").exists()
    page = res.index.read_text(encoding="utf-8")
    assert "Not in this report" in page and "train is interrupted at step 10 of 20" in page
    assert "Not final: the latest evaluation at step 10." in page


@needs_run
def test_report_on_a_pending_train_stage_says_what_is_missing(runs, tmp_path) -> None:
    proj = Project.load(runs["pending"] / "pdctl.toml")
    before = sorted(p.relative_to(proj.root) for p in proj.root.rglob("*"))
    res = build_report(proj, out=tmp_path / "r")
    assert res.step is None and list(res.out.glob("*.png")) == []
    assert res.missing[0] == "train is pending: run `pdctl train`"
    assert any(m.startswith("training curves: no metrics") for m in res.missing)
    assert any(m.startswith("component figures: train has no checkpoint") for m in res.missing)
    assert res.index.is_file()
    after = sorted(p.relative_to(proj.root) for p in proj.root.rglob("*"))
    assert after == before  # a report elsewhere writes nothing into the run directory


@needs_run
def test_report_of_the_warmup_stage_and_bad_arguments(runs, tmp_path) -> None:
    proj = Project.load(runs["done"] / "pdctl.toml")
    res = build_report(proj, stage="warmup", out=tmp_path / "w")
    assert res.missing == [] and res.step == 10
    assert (res.out / "ci_matrix_linear1.png").is_file() and not (res.out / "eval.json").exists()
    with pytest.raises(PdctlError, match=r"^--stage: 'init_weights' has no report"):
        build_report(proj, stage="init_weights", out=tmp_path / "x")
    (tmp_path / "file").write_text("")
    with pytest.raises(PdctlError, match="exists and is not a directory"):
        build_report(proj, out=tmp_path / "file")


@needs_run
# orbax's failed read leaves tensorstore callbacks that later post to its closed event loop
# ("Event loop is closed", reported by pytest as unraisable): let them land here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_unreadable_checkpoint_is_listed_not_a_crash(runs) -> None:
    run = Path(shutil.copytree(runs["interrupted"], runs["interrupted"].parent / "broken"))
    item = run / "checkpoints" / "train" / "10" / "decomposition"
    for p in item.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
    res = build_report(Project.load(run / "pdctl.toml"), out=run.parent / "broken-report")
    assert any(
        m.startswith("component figures: train checkpoint 10 is unreadable (") for m in res.missing
    ), res.missing
    assert (res.out / "curves.png").is_file() and res.index.is_file()
    time.sleep(1.0)
    gc.collect()


@needs_run
def test_a_new_report_replaces_the_previous_ones_files_only(runs, tmp_path) -> None:
    proj = Project.load(runs["done"] / "pdctl.toml")
    out = tmp_path / "r"
    build_report(proj, out=out)
    (out / "notes.txt").write_text("mine")
    assert (out / "ci_matrix_linear1.npz").is_file()
    res = build_report(proj, stage="pretrain", out=out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["notes.txt", *(p.name for p in res.files)]
    )
    assert not (out / "ci_matrix_linear1.npz").exists()


# ---- texts for `pdctl status` ----------------------------------------------------------------


def test_eval_summary() -> None:
    toy = {
        "eval": {
            "ci_errors": {"linear1": 0.0, "linear2": 2.0, "total": 2.0},
            "mmcs": {"linear1": 0.99991, "linear2": 0.9993},
            "l0": {"linear1": 1.0, "linear2": 1.25},
        }
    }
    assert eval_summary(toy) == "CI errors 2, min MMCS 0.999, L0 1.00/1.25"
    nan = {"eval": {"ci_errors": {"total": float("nan")}}}
    assert eval_summary(nan) == "CI errors nan"
    lm = {
        "eval": {
            "ce_target": 2.0,
            "ce_ci_masked": 2.5,
            "kl_ci_masked": 0.04,
            "kl_stoch_masked": 0.1,
        }
    }
    assert eval_summary(lm) == "CE 2.500 (target 2.000), KL ci 0.04 stoch 0.1"
    lm["eval"].update(kl_pgd=0.35, l0={"a": 40.0, "b": 42.5})  # fresh PGD, L0 per site
    assert (
        eval_summary(lm) == "CE 2.500 (target 2.000), KL ci 0.04 stoch 0.1 pgd 0.35, L0 mean 41.2"
    )
    assert eval_summary({}) == "" and eval_summary({"status": "done"}) == ""


def test_lm_eval_table_puts_the_fresh_pgd_first_and_the_eval_curves_draw_it(tmp_path) -> None:
    """The LM evaluation table: the fresh-PGD masking's row first (when evaluated), then the
    reference's maskings; per-site L0 / alive / alive_mean below. The eval-curves figure takes
    eval lines with the pgd keys (over steps)."""
    from pdctl.report import page as P

    ev = {
        "ce_target": 2.0,
        "ce_pgd": 3.0,
        "kl_pgd": 0.4,
        "ce_ci_masked": 2.1,
        "kl_ci_masked": 0.05,
        "l0": {"s": 3.5},
        "alive": {"s": 9.0},
        "alive_mean": {"s": 7.0},
    }
    rows = P.lm_eval_rows(ev)
    assert [r[0] for r in rows[:3]] == ["target", "pgd", "ci_masked"]
    assert rows[1][1:3] == [3.0, 0.4]
    html = P.lm_eval_table(ev)
    assert "mean CI &gt; 1e-06" in html and "<td>s</td>" in html
    assert [r[0] for r in P.lm_eval_rows({"ce_target": 2.0})][:2] == ["target", "ci_masked"]
    lines = [{"step": s, "eval/kl_pgd": 0.5 / s, "eval/kl_stoch_masked": 0.1 / s,
              "eval/ce_pgd": 3.0, "eval/ce_target": 2.0} for s in (10, 20)]  # fmt: skip
    png = F.plot_eval_curves(tmp_path / "eval_curves.png", lines, toy=False)
    assert Image.open(png).size[0] > 0


@needs_run
def test_report_line_points_at_the_default_report_and_notices_when_it_is_old(runs) -> None:
    run = Path(shutil.copytree(runs["interrupted"], runs["interrupted"].parent / "line"))
    proj = Project.load(run / "pdctl.toml")
    assert report_line(proj) is None
    res = build_report(proj)
    assert res.out == run / "report"
    line = report_line(proj)
    assert line is not None and line.startswith(f"report: {run / 'report' / 'index.html'}")
    assert "(train checkpoint 10," in line and "out of date" not in line
    proj.state["train"]["step"] = 15  # the stage moved on after the report was written
    assert "out of date" in report_line(proj)


# ---- the CLI (these need `pdctl report` and the status column wired into pdctl/cli.py) -------


@needs_run
def test_cli_report_on_an_unfinished_run_exits_0_and_says_what_is_missing(runs) -> None:
    run = Path(shutil.copytree(runs["interrupted"], runs["interrupted"].parent / "cli"))
    result = cli("--project", run, "report")
    assert result.exit_code == 0, result.output
    assert "train is interrupted at step 10 of 20" in result.stdout
    assert "final evaluation" in result.stdout
    assert (run / "report" / "index.html").is_file()
    out = run.parent / "cli-out"
    result = cli("--project", run, "report", "--stage", "warmup", "--out", out)
    assert result.exit_code == 0, result.output
    assert (out / "index.html").is_file() and (out / "ci_matrix_linear1.png").is_file()


def test_cli_report_on_a_directory_that_is_not_a_run_is_one_line_exit_2(tmp_path) -> None:
    result = cli("--project", tmp_path, "report")
    assert result.exit_code == 2, result.output
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "pdctl.toml" in lines[0]
    assert list(tmp_path.iterdir()) == []


@needs_run
def test_cli_report_with_an_unknown_stage_is_one_line_exit_2(runs) -> None:
    result = cli("--project", runs["done"], "report", "--stage", "init_weights")
    assert result.exit_code == 2, result.output
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: --stage:"), lines


@needs_run
def test_cli_status_shows_the_final_eval_and_the_report_line(
    runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = Path(shutil.copytree(runs["done"], runs["done"].parent / "status"))
    assert cli("--project", run, "report").exit_code == 0
    monkeypatch.setattr(pdctl.cli.console, "width", 400)  # one table row per line
    result = cli("--project", run, "status")
    assert result.exit_code == 0, result.output
    proj = Project.load(run / "pdctl.toml")
    assert eval_summary(proj.stage("train")) in result.stdout
    assert f"report: {run / 'report' / 'index.html'}" in result.stdout


@pytest.mark.slow
def test_figures_leave_matplotlib_global_state_alone(tmp_path) -> None:
    """Drawing a figure neither imports pyplot nor switches the process-wide backend."""
    code = (
        "import sys, matplotlib; b = matplotlib.get_backend(); from pathlib import Path;"
        "from pdctl.report import figures as F;"
        f"F.plot_curves(Path({str(tmp_path / 'c.png')!r}), [{{'step': 1, 'loss': 1.0}}], 'x');"
        "print('matplotlib.pyplot' in sys.modules, matplotlib.get_backend() == b)"
    )
    env = {**os.environ, "MPLBACKEND": "svg"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
    with Image.open(tmp_path / "c.png") as im:
        assert im.size == F.size_of("curves")


def test_the_config_table_names_every_loss_term_the_step_uses(tmp_path: Path) -> None:
    """The report's loss row lists the LM recipe's terms (merged reconstruction, the frequency
    term, the smooth-L0 penalty's gamma anneal) as well as the classic ones."""
    rows = dict(
        report_build.config_rows(
            Project.load(make_run(tmp_path, "smollm2", tiny=False) / "pdctl.toml")
        )
    )
    loss = rows["loss"]
    for part in (
        "faithfulness",
        "merged_recon 1 (adv_fraction 0.5)",
        "frequency 1e-05 (EMA half-life 200)",
        "smooth_l0 gamma 1 → 0.01",
        "output kl",
    ):
        assert part in loss, loss
    toy = dict(report_build.config_rows(Project.load(make_run(tmp_path, "tms") / "pdctl.toml")))
    assert "; p 1, output mse" in toy["loss"] and "smooth_l0" not in toy["loss"]


def test_the_config_table_names_the_chunkwise_term(tmp_path: Path) -> None:
    """The anchor's whole-model term (`chunkwise_recon`, a LATE_TERMS member) is in the loss
    row with its chunking, as the other recipe terms are."""
    toml = make_run(tmp_path, "smollm2", tiny=False) / "pdctl.toml"
    text = toml.read_text()
    toml.write_text(text.replace("[train.loss]\n", "[train.loss]\nchunkwise_recon = 2.0\n", 1))
    loss = dict(report_build.config_rows(Project.load(toml)))["loss"]
    assert "chunkwise_recon 2 (one chunk)" in loss, loss


def test_a_whole_models_l0_is_drawn_against_the_layer(tmp_path: Path, monkeypatch) -> None:
    """90 sites (3 matrices x 30 layers, as smollm2-all-mlps): one panel per matrix with L0
    against the layer, one line per evaluation, instead of 180 legend entries over the plot;
    the figure keeps its size. A few sites, or sites in no layer, keep the lines over steps."""
    from PIL import Image

    from pdctl.report import figures as F

    kinds = ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj")
    sites = [f"model.layers.{i}.{k}" for i in range(30) for k in kinds]
    by = F._by_layer(sites)
    assert by is not None and sorted(by) == list(kinds)
    assert by["mlp.up_proj"][7] == "model.layers.7.mlp.up_proj" and len(by["mlp.up_proj"]) == 30
    assert F._by_layer(["linear1", "linear2"]) is None
    assert F._by_layer([f"model.layers.0.m{j}" for j in range(8)]) is None  # 8 kinds

    rows = [{"step": s, **{f"l0/{x}": 100.0 + s for x in sites}} for s in (10, 20)]
    evals = [{"step": s, **{f"eval/l0/{x}": 90.0 + s for x in sites}} for s in (10, 20)]
    out = F.plot_l0(tmp_path / "l0.png", rows, evals)
    assert Image.open(out).size == F.size_of("l0")

    drawn: list = []
    save = F._save
    monkeypatch.setattr(F, "_save", lambda fig, path: drawn.append(fig) or save(fig, path))
    F.plot_l0(tmp_path / "l0b.png", rows, evals)
    axes = drawn[0].axes
    assert [ax.get_title() for ax in axes] == list(kinds)
    for ax in axes:  # one line per evaluation, over the 30 layers, at the eval batch's L0
        assert [list(line.get_ydata()) for line in ax.get_lines()] == [[100.0] * 30, [110.0] * 30]
        assert list(axes[0].get_lines()[0].get_xdata()) == list(range(30))
    F.plot_l0(tmp_path / "l0c.png", rows[:1], [])  # no evaluations: the training rows
    assert [list(x.get_ydata()) for x in drawn[1].axes[0].get_lines()] == [[110.0] * 30]
    few = [{"step": 1, "l0/model.layers.0.mlp.up_proj": 3.0}]
    F.plot_l0(tmp_path / "l0d.png", few, [])  # one site: L0 over steps, as before
    assert len(drawn[2].axes) == 1 and drawn[2].axes[0].get_xlabel() == "step"


@needs_run
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='libtpu not installed (".[tpu-aot]")'
)
def test_with_libtpu_but_no_tpu_nothing_says_anything_of_libtpu(runs, tmp_path: Path) -> None:
    """`pdctl report`, `pdctl export` and `pdctl.open(run).decomposition()` start JAX as the
    stages do: where libtpu is installed without TPU chips (the tpu-aot extra on a CPU
    machine, as in CI), on the CPU alone, so libtpu's initialization errors
    (TPU_WORKER_HOSTNAMES, InitGoogle) are not printed."""
    run = Path(shutil.copytree(runs["done"], tmp_path / "r"))
    env = pdctl_env(1)
    env.pop("JAX_PLATFORMS", None)  # as a user's shell has it
    api = f"import pdctl; print(pdctl.open({str(run)!r}).decomposition().step)"
    for argv, said in (
        (pdctl_argv("report", project=run), "wrote "),
        (pdctl_argv("export", "-o", tmp_path / "x.npz", project=run), "arrays to"),
        ([sys.executable, "-c", api], "20"),
    ):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (argv, proc.stderr[-3000:])
        assert said in proc.stdout, (argv, proc.stdout)
        for noise in ("TPU_WORKER", "InitGoogle", "libtpu", "E0000"):
            assert noise not in proc.stderr, (argv, proc.stderr[-3000:])


def test_a_whole_models_per_site_figures_have_a_panel_per_matrix(tmp_path: Path, monkeypatch):
    """Component norms, CI histograms and activation density of 90 sites: one panel per matrix
    kind with one line per layer (a colour bar for the layer) at the size `site_figure` says,
    which the page states, where a panel per site made 1200 x 13500 pixels; two sites keep a
    panel each."""
    from pdctl.report import figures as F

    kinds = ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj")
    sites = [f"model.layers.{i}.{k}" for i in range(30) for k in kinds]
    assert F.site_figure(sites) == ("by_layer", 3) and F.site_figure(sites[:2]) == ("per_site", 2)
    rng = np.random.default_rng(0)
    values = {s: rng.random(16) for s in sites}
    drawn: list = []
    save = F._save
    monkeypatch.setattr(F, "_save", lambda fig, path: drawn.append(fig) or save(fig, path))
    outs = [
        F.plot_component_norms(tmp_path / "n.png", values, None),
        F.plot_ci_histograms(
            tmp_path / "h.png", {s: np.arange(1, 5) for s in sites}, np.linspace(0, 1, 5), 0.1
        ),
        F.plot_activation_density(tmp_path / "d.png", values, 0.0, 64),
    ]
    for out, fig in zip(outs, drawn, strict=True):
        assert Image.open(out).size == F.size_of(*F.site_figure(sites)) == (1200, 450)
        panels = [ax for ax in fig.axes if ax.get_title() in kinds]
        assert [ax.get_title() for ax in panels] == list(kinds), out
        for ax in panels:  # a line (or stairs) per layer
            assert len(ax.get_lines()) + len(ax.patches) >= 30, out
        assert any(ax.get_ylabel() == "layer" for ax in fig.axes), out  # the colour bar
    F.plot_component_norms(tmp_path / "two.png", {s: values[s] for s in sites[:2]}, None)
    assert Image.open(tmp_path / "two.png").size == F.size_of("per_site", 2)
