"""`pdctl.open`, the read-only Python API (pdctl/api.py, docs/api.md): every method against the
engine it wraps and against what the stages and the harvest recorded, the worked example of
docs/api.md run as written, bad input as one line, and a run held by a running stage opened
without waiting and without a byte written.

Fast tier: a copy of test_faults' session TMS run (every stage done), harvested and clustered.
Slow tier: a tiny llama-mlp run named run1 (the docs' example needs text, ~40 s to train), a
train stage running in another process, and a tiny imported Llama."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import cli_ok, edit_config, make_run, pdctl_env

import pdctl
from pdctl.errors import PdctlError
from pdctl.project import Project

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api.md"


def tree(root: Path) -> dict[str, tuple]:
    """Every path under `root` and `root` itself: its kind, mode, mtime (ns) and, for a file,
    a digest of its bytes. Any write (a file made, changed or made and removed again) shows."""
    out = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        out[str(p.relative_to(root))] = (p.is_dir(), st.st_mode, st.st_mtime_ns, digest)
    return out


def one_line_error(fn, *says: str) -> str:
    """`fn()` raises a PdctlError of one line holding every one of `says`."""
    with pytest.raises(PdctlError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(s in msg for s in says), msg
    return msg


# ---- the fast tier: a trained TMS run ------------------------------------------------------


@pytest.fixture(scope="module")
def tms(tmp_path_factory) -> Path:
    """test_faults' session run (every stage done; train checkpoints 5 and 10), copied,
    harvested and clustered."""
    from test_faults import done_run

    run = tmp_path_factory.mktemp("api") / "tms"
    shutil.copytree(done_run(tmp_path_factory), run, symlinks=True)
    cli_ok("--project", run, "harvest", "--tokens", "2048")
    cli_ok("--project", run, "cluster", "--min-jaccard", "0.01", "--min-count", "1")
    return run


@pytest.mark.slow  # the shared harvested TMS run costs ~15 s: the fast tier keeps its 4 minutes
def test_import_and_reading_the_records_need_no_jax(tms: Path, tmp_path: Path):
    fresh = make_run(tmp_path, "tms", "fresh")
    code = (
        "import sys, pdctl\n"
        "assert 'jax' not in sys.modules\n"
        "for path in sys.argv[1:]:\n"
        "    run = pdctl.open(path)\n"
        "    run.config, run.status\n"
        "run.metrics('train'), run.metrics('train', 'eval')\n"
        "h = run.harvest(); h.components, h.clusters\n"
        "assert 'jax' not in sys.modules, 'pdctl.open imported jax'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(fresh), str(tms)],
        env=pdctl_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow  # the shared harvested TMS run costs ~15 s: the fast tier keeps its 4 minutes
def test_config_status_and_metrics_are_the_records(tms: Path):
    from pdctl.engine.tracking import read_metrics

    run = pdctl.open(tms, tables="rows")
    project = Project.load(tms / "pdctl.toml")
    assert run.config == project.config
    assert pdctl.open(tms / "pdctl.toml").path == run.path == tms
    status = run.status
    assert list(status) == ["init_weights", "pretrain", "warmup", "train"]
    for name, st in status.items():
        assert st == {**project.stage(name), "stale": False}
    assert status["train"]["status"] == "done" and status["train"]["checkpoint"] == 10
    log, evals = read_metrics(tms / "metrics" / "train.jsonl")
    assert run.metrics("train") == log and run.metrics("train", kind="eval") == evals
    assert [r["step"] for r in run.metrics("train")] == [5, 10]
    assert all("eval/ci_errors/total" in r for r in run.metrics("train", "eval"))
    # a config edited after opening: `status` is read again, `config` is as opened
    text = (tms / "pdctl.toml").read_text()
    try:
        edit_config(tms, {"run": {"seed": 1}})
        assert run.status["train"]["stale"] and run.config == project.config
    finally:
        (tms / "pdctl.toml").write_text(text)
    assert not run.status["train"]["stale"]


@pytest.mark.slow  # the shared harvested TMS run costs ~15 s: the fast tier keeps its 4 minutes
def test_tables_are_data_frames_with_pandas(tms: Path):
    pd = pytest.importorskip("pandas")
    run = pdctl.open(tms)
    frame = run.metrics("train")
    assert isinstance(frame, pd.DataFrame)
    assert frame.to_dict("records") == pdctl.open(tms, tables="rows").metrics("train")
    assert isinstance(run.harvest().components, pd.DataFrame)


@pytest.mark.slow  # the shared harvested TMS run costs ~15 s: the fast tier keeps its 4 minutes
def test_decomposition_is_what_the_report_and_harvest_load(tms: Path):
    from pdctl.stages.decomposition import load_decomposition

    run = pdctl.open(tms)
    assert run.checkpoints("train") == [5, 10]
    dec = run.decomposition()
    want = load_decomposition(Project.load(tms / "pdctl.toml"), "train")
    assert dec.step == want.step == 10 and dec.stage == "train"
    assert list(dec.components) == list(want.components) == ["linear1", "linear2"]
    for site, comp in want.components.items():
        for k in ("V", "U"):
            np.testing.assert_array_equal(dec.components[site][k], comp[k])
    for a, b in zip(_leaves(dec.ci_fns), _leaves(want.ci_fns), strict=True):
        np.testing.assert_array_equal(a, b)
    assert dec.components["linear1"]["V"].shape == (5, 20)  # (d_in, C)
    assert dec.components["linear1"]["U"].shape == (20, 2)  # (C, d_out)
    assert run.decomposition() is dec and run.decomposition("train", 10) is dec  # kept
    older = run.decomposition(step=5)
    assert older.step == 5
    assert not np.array_equal(older.components["linear1"]["V"], dec.components["linear1"]["V"])
    assert run.decomposition("warmup").step == 5


def _leaves(tree) -> list:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow  # the shared harvested TMS run costs ~15 s: the fast tier keeps its 4 minutes
def test_the_model_against_the_engine_and_a_hand_forward(tms: Path):
    """TMS: out = relu(x W1 W2 + b), W2 = W1.T. Its forward, CI and masked forwards against
    the engine's functions and against that formula with W replaced by V U (masks 1), by
    nothing (masks 0) or by the components each scaled by a mask."""
    from pdctl.science.spd import evaluate

    run = pdctl.open(tms)
    model = run.target()
    dec = run.decomposition()
    cfg = run.config
    assert model.sites == ("linear1", "linear2") and model.C == {"linear1": 20, "linear2": 20}
    assert model.threshold == cfg.decomp.ci_threshold and not model.is_lm
    x = np.random.default_rng(0).uniform(size=(16, 5)).astype(np.float32)
    W1, b = dec.params["linear1"]["W"], dec.params["linear2"]["b"]
    relu = lambda z: np.maximum(z, 0.0)  # noqa: E731
    np.testing.assert_allclose(model.logits(x), relu(x @ W1 @ W1.T + b), rtol=1e-5, atol=1e-6)
    ci = model.ci(x)
    want, _ = evaluate.compute_ci_jit(dec.target, dec.params, dec.components, dec.ci_fns, cfg, x)
    for s in model.sites:
        assert ci[s].shape == (16, 20)
        np.testing.assert_array_equal(ci[s], np.asarray(want[s]))
    # one example in, one example out (to float32 rounding: XLA's dot differs by shape)
    np.testing.assert_allclose(model.logits(x[3]), model.logits(x)[3], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(model.ci(x[3])["linear2"], ci["linear2"][3], rtol=1e-6, atol=1e-7)
    # masks 1 with delta 1: the target exactly (tests/test_spd_math's identity)
    np.testing.assert_array_equal(model.masked_logits(x, "ones", delta=1.0), model.logits(x))
    np.testing.assert_array_equal(model.masked_logits(x, "ones", delta="ones"), model.logits(x))
    VU = {s: dec.components[s]["V"] @ dec.components[s]["U"] for s in model.sites}
    np.testing.assert_allclose(
        model.masked_logits(x, "ones"),
        relu(x @ VU["linear1"] @ VU["linear2"] + b),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_array_equal(model.masked_logits(x, "zero"), np.broadcast_to(relu(b), x.shape))
    # a site left out keeps the target's weights; a mask scales each component's output
    np.testing.assert_allclose(
        model.masked_logits(x, {"linear1": "ones"}),
        relu(x @ VU["linear1"] @ W1.T + b),
        rtol=1e-5,
        atol=1e-6,
    )
    m = np.random.default_rng(1).uniform(size=(16, 20)).astype(np.float32)

    def site(s, h, mask):
        V, U = dec.components[s]["V"], dec.components[s]["U"]
        return ((h @ V) * mask) @ U

    hand = relu(site("linear2", site("linear1", x, m), ci["linear2"]) + b)
    got = model.masked_logits(x, {"linear1": m, "linear2": "ci"})
    np.testing.assert_allclose(got, hand, rtol=1e-5, atol=1e-6)
    # "ci" is the CI given as arrays; a (C,) mask is the same at every example
    np.testing.assert_array_equal(model.masked_logits(x, "ci"), model.masked_logits(x, ci))
    one = (np.arange(20) % 3 == 0).astype(np.float32)
    np.testing.assert_array_equal(
        model.masked_logits(x, {"linear1": one}),
        model.masked_logits(x, {"linear1": np.tile(one, (16, 1))}),
    )
    # delta per example, with W - V U: (x V * (m - d)) U + d x W
    d = np.linspace(0, 1, 16, dtype=np.float32)
    h1 = x @ VU["linear1"] * (1 - d[:, None]) + d[:, None] * (x @ W1)
    np.testing.assert_allclose(
        model.masked_logits(x, {"linear1": "ones"}, delta=d),
        relu(h1 @ W1.T + b),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.slow  # the shared harvested TMS run costs ~15 s: the fast tier keeps its 4 minutes
def test_the_harvest_tables_are_harvest_db(tms: Path):
    import sqlite3

    run = pdctl.open(tms, tables="rows")
    h = run.harvest()
    assert h.meta["stage"] == "train" and h.meta["step"] == 10 and h.meta["n_positions"] == 2048
    from pdctl.api import JSON_COLUMNS

    con = sqlite3.connect(f"file:{tms / 'harvest' / 'harvest.db'}?mode=ro", uri=True)
    try:
        for name in ("sites", "components", "examples", "cooc", "toy_features", "clusters"):
            cur = con.execute(f"SELECT * FROM {name} ORDER BY rowid")
            columns = [d[0] for d in cur.description]
            decoded = JSON_COLUMNS.get(name, ())
            want = [
                {c: json.loads(v) if c in decoded else v for c, v in zip(columns, r, strict=True)}
                for r in cur
            ]
            assert h.table(name) == want and len(want) > 0, name
    finally:
        con.close()
    assert [r["site"] for r in h.sites] == ["linear1", "linear2"]
    ex = h.examples[0]
    assert isinstance(ex["tokens"], list) and isinstance(ex["cis"], list)
    assert isinstance(h.components[0]["hist"], list)
    assert h.clusters == h.table("clusters") and h.labels == []
    assert h.attributions == {"inputs": [], "sources": [], "examples": []}
    # the harvest's CI of each one-hot feature (toy_features) is the model's CI of it
    model = run.target()
    ci = model.ci(0.75 * np.eye(5, dtype=np.float32))
    for r in h.table("toy_features"):
        assert r["ci"] == pytest.approx(
            float(ci[r["site"]][r["feature"], r["component"]]), rel=1e-6, abs=1e-7
        )


@pytest.mark.slow  # the shared harvested TMS run costs ~15 s: the fast tier keeps its 4 minutes
def test_a_newest_checkpoint_that_goes_while_it_is_read_is_read_again(tms: Path, monkeypatch):
    """A running stage keeps `checkpoint.keep` checkpoints: the newest one, listed, can go
    before it is read. Then the newest is listed and read again; a step asked for is not."""
    from pdctl.stages import decomposition as D

    run = pdctl.open(tms)
    listed = [[5, 10], [5]]
    monkeypatch.setattr(
        run, "checkpoints", lambda stage: listed.pop(0) if len(listed) > 1 else listed[0]
    )
    real, calls = D.load_decomposition, []

    def going(project, stage, step=None):
        calls.append(step)
        if step == 10:
            raise LookupError("train checkpoint 10 is unreadable (No such file or directory)")
        return real(project, stage, step)

    monkeypatch.setattr(D, "load_decomposition", going)
    assert run.decomposition().step == 5 and calls == [10, 5]
    one_line_error(lambda: run.decomposition(step=10), "checkpoint 10 is unreadable")
    assert calls == [10, 5, 10]


@pytest.mark.slow  # the shared harvested TMS run costs ~15 s: the fast tier keeps its 4 minutes
def test_bad_input_is_one_line_naming_the_fix(tms: Path, tmp_path: Path):
    fresh = pdctl.open(make_run(tmp_path, "tms", "fresh"))
    one_line_error(lambda: pdctl.open(tmp_path / "nothing"), "no pdctl.toml", "pdctl new")
    one_line_error(lambda: pdctl.open(tms, tables="xml"), "tables", "rows")
    one_line_error(lambda: fresh.metrics("train"), "train has not run yet", "pdctl train")
    one_line_error(lambda: fresh.metrics("init_weights"), "pdctl init-weights")
    one_line_error(lambda: fresh.decomposition(), "train has no checkpoint", "pdctl train")
    one_line_error(lambda: fresh.target("warmup"), "warmup has no checkpoint", "pdctl warmup")
    one_line_error(lambda: fresh.harvest(), "no harvest yet", "pdctl harvest")
    run = pdctl.open(tms)
    one_line_error(lambda: run.metrics("trian"), "'trian'", "init_weights, pretrain, warmup")
    one_line_error(lambda: run.metrics("train", "evals"), "log, eval")
    one_line_error(lambda: run.decomposition("pretrain"), "no", "train, warmup")
    one_line_error(lambda: run.decomposition(step=7), "no checkpoint 7", "5, 10")
    one_line_error(lambda: run.decomposition(step="10"), "integer")
    model = run.target()
    x = np.ones((2, 5), np.float32)
    one_line_error(
        lambda: model.masked_logits(x, {"linear3": "ci"}), "'linear3'", "linear1, linear2"
    )
    one_line_error(lambda: model.masked_logits(x, "half"), "'half'", "ci, zero, ones")
    one_line_error(lambda: model.masked_logits(x, {"linear1": np.ones(4)}), "(4,)", "(2, 20)")
    one_line_error(lambda: model.masked_logits(x, {}), "no site", "linear1")
    one_line_error(lambda: model.masked_logits(x, 1.0), "'ci', 'zero', 'ones'")
    one_line_error(
        lambda: model.masked_logits(x, {"linear1": "ci"}, delta={"linear2": 1}),
        "'linear2' is not masked",
    )
    one_line_error(lambda: model.masked_logits(x, "ci", delta=np.ones(3)), "(3,)", "(2,)")
    one_line_error(lambda: model.logits(np.ones((2, 4))), "(5,)")
    one_line_error(lambda: model.tokenize("cat"), "feature vectors")
    one_line_error(lambda: model.decode([1]), "no tokens")
    one_line_error(lambda: run.harvest().table("sqlite_master"), "'sqlite_master'", "components")


@pytest.mark.slow  # the shared harvested TMS run costs ~15 s: the fast tier keeps its 4 minutes
def test_a_run_held_by_a_running_stage_opens_at_once_and_is_never_written(tms: Path, tmp_path):
    """A process holds the run directory's lock as a running stage does (`Project.locked`, the
    state saying running): every method answers while it holds it, nothing in the directory
    changes (no file made, changed or removed: mtimes and bytes), and the lock stays that
    process's; once it lets go, a stage can take the lock while the API's objects live on."""
    run_dir = tmp_path / "r"
    shutil.copytree(tms, run_dir, symlinks=True)
    holder = (
        "import sys\n"
        "from pathlib import Path\n"
        "from pdctl.project import Project\n"
        "p = Project.load(Path(sys.argv[1]) / 'pdctl.toml')\n"
        "p.acquire_lock()\n"
        "p.update_stage('train', status='running')\n"
        "print('held', flush=True)\n"
        "sys.stdin.readline()\n"
        "p.release_lock()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", holder, str(run_dir)],
        env=pdctl_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "held"
        before = tree(run_dir)
        run = pdctl.open(run_dir, tables="rows")
        assert run.status["train"]["status"] == "running"
        assert len(run.metrics("train")) == 2 and run.checkpoints("train") == [5, 10]
        model = run.target()
        x = np.eye(5, dtype=np.float32)
        model.masked_logits(x, "ci", delta=0.5)
        run.decomposition(step=5)
        h = run.harvest()
        assert len(h.components) == 40 and len(h.examples) > 0 and len(h.clusters) > 0
        assert tree(run_dir) == before
        assert not Project.load(run_dir / "pdctl.toml").lock_is_free()  # still the holder's
    finally:
        child.communicate("\n", timeout=60)
    assert child.returncode == 0
    stage = Project.load(run_dir / "pdctl.toml")
    stage.acquire_lock()  # what the next stage does: free, though `run` and `model` live
    stage.release_lock()
    assert model.ci(x)["linear1"].shape == (5, 20)


@pytest.mark.slow  # a pdctl train process: ~20 s
def test_a_run_is_read_while_its_train_stage_runs_and_saves(tms: Path, tmp_path: Path):
    """A real `pdctl train` in another process, saving a checkpoint every 20 steps and keeping
    two: the API reads its newest complete checkpoint again and again while saves are in
    flight and old ones go, and the stage, never held up, stops cleanly on SIGTERM (exit 3)."""
    import signal
    import time

    from helpers import pdctl_argv

    run_dir = tmp_path / "r"
    shutil.copytree(tms, run_dir, symlinks=True)
    edit_config(
        run_dir,
        {
            "train": {"steps": 10**6, "log_every": 100, "eval_every": 10**6},
            "checkpoint": {"every": 20, "keep": 2},
        },
    )
    child = subprocess.Popen(
        pdctl_argv("train", "--fresh", project=run_dir),
        env=pdctl_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run = pdctl.open(run_dir)
        deadline = time.monotonic() + 240
        while run.status["train"].get("checkpoint", 0) < 60:
            assert child.poll() is None and time.monotonic() < deadline, child.stdout.read()
            time.sleep(0.2)
        steps = []
        x = np.eye(5, dtype=np.float32)
        for _ in range(6):
            model = run.target()
            steps.append(model.step)
            assert model.ci(x)["linear1"].shape == (5, 20)
            time.sleep(0.3)
        assert child.poll() is None  # still training
        assert steps == sorted(steps) and steps[-1] > steps[0] >= 60, steps
    finally:
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=120)
    assert child.returncode == 3, out[-3000:]
    assert pdctl.open(run_dir).status["train"]["status"] == "interrupted"


# ---- the slow tier: a tiny byte-level LM, the docs' example ---------------------------------


@pytest.fixture(scope="module")
def run1(tmp_path_factory) -> Path:
    """A tiny llama-mlp run named run1 (as docs/api.md names it): every stage done (train
    with an evaluation at its last step, 4), harvested and clustered."""
    run = make_run(
        tmp_path_factory.mktemp("api-lm"),
        "llama-mlp",
        "run1",
        pretrain={"steps": 2, "log_every": 1},
        warmup={"steps": 2, "log_every": 1},
        train={
            "steps": 4,
            "log_every": 1,
            "eval_every": 4,
            "batch_size": 8,
            "eval_batch_size": 8,
            # the terms and the evaluation these tests do not read: less to compile
            "eval_pgd": {"enabled": False},
            "loss": {"ppgd_recon": 0.0, "stochastic_recon_layerwise": 0.0},
        },
    )
    cli_ok("--project", run, "run")
    cli_ok("--project", run, "harvest", "--tokens", "256", "--effects", "4", "--top-k", "4")
    cli_ok("--project", run, "cluster", "--min-jaccard", "0.01", "--min-count", "1")
    return run


def doc_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", DOC.read_text(encoding="utf-8"), re.S | re.M)


@pytest.mark.slow  # trains run1: ~40 s
def test_the_docs_worked_example_runs_as_written(run1: Path, monkeypatch, capsys):
    blocks = doc_blocks()
    assert len(blocks) == 2
    before = tree(run1)
    monkeypatch.chdir(run1.parent)
    ns: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC}:block{i + 1}", "exec"), ns)
    out = capsys.readouterr().out
    assert out.startswith("done 4\n<pdctl llama_mlp target, train checkpoint 4:"), out
    model, t, tokens = ns["model"], ns["t"], ns["tokens"]
    assert bytes(tokens[: t + 1].tolist()) == b"The cat"
    # components fired, and switching them off moved the prediction after "cat"
    assert sum(len(c) for c in ns["fired"].values()) > 0
    assert np.abs(ns["change"]).max() > 1e-4
    np.testing.assert_array_equal(ns["before"], model.masked_logits(tokens, "ci"))
    assert tree(run1) == before


@pytest.mark.slow  # trains run1 (shared with the docs' test): ~40 s
def test_an_lm_model_reproduces_the_train_evaluation_and_the_harvest(run1: Path):
    """On train's evaluation batch the model's masked forwards give the KL the evaluation at
    that checkpoint logged (ci_masked: masks "ci"; unmasked: "ones"; zero_masked: "zero") and
    the target's CE; its CI at the harvest's top examples is the CI the harvest stored."""
    import jax

    from pdctl.engine import sharding
    from pdctl.report.load import eval_inputs
    from pdctl.stages.env import StageEnv, corpus_tokens

    run = pdctl.open(run1, tables="rows")
    model = run.target()
    assert model.is_lm and model.vocab_size == 256 and model.step == 4
    assert model.tokenize("é!").tolist() == [0xC3, 0xA9, 0x21]
    assert model.decode(model.tokenize("The cat")) == "The cat"
    project = Project.load(run1 / "pdctl.toml")
    x, tokens = eval_inputs(project, model.decomposition.target)
    (logged,) = run.metrics("train", kind="eval")
    assert logged["step"] == 4
    clean = model.logits(x)
    assert clean.shape == (*x.shape, 256)

    def log_softmax(z):
        return z - np.logaddexp.reduce(z.astype(np.float64), axis=-1, keepdims=True)

    def kl(z):
        p = log_softmax(clean)
        return float(np.mean(np.sum(np.exp(p) * (p - log_softmax(z)), axis=-1)))

    labels = tokens[:, 1:]
    ce = -np.take_along_axis(log_softmax(clean), labels[..., None], -1).mean()
    assert ce == pytest.approx(logged["eval/ce_target"], rel=1e-5)
    for masks, name in (("ci", "ci_masked"), ("ones", "unmasked"), ("zero", "zero_masked")):
        got = kl(model.masked_logits(x, masks))
        assert got == pytest.approx(logged[f"eval/kl_{name}"], rel=1e-3, abs=1e-7), name
    np.testing.assert_allclose(model.masked_logits(x, "ones", delta=1.0), clean, atol=1e-5)
    # the harvest's top examples: position = window * T + t over the eval split's windows
    T = run.config.data.seq_len
    env = StageEnv(
        project, "train", sharding.make_mesh(1, 1, jax.devices()[:1]), model.decomposition.target
    )
    stream = np.asarray(corpus_tokens(env, "eval"))
    windows = stream[: (256 // T) * T].reshape(-1, T)
    h = run.harvest()
    tops = [r for r in h.examples if r["kind"] == "top"]
    assert tops
    ci = model.ci(windows)
    for r in tops:
        w, t = divmod(r["position"], T)
        assert r["ci"] == pytest.approx(
            float(ci[r["site"]][w, t, r["component"]]), rel=1e-5, abs=1e-6
        )
    assert len(h.effects) > 0 and len(h.clusters) > 0
    one_line_error(lambda: model.logits(np.array([1.5, 2.0])), "integer token ids", "tokenize")
    one_line_error(lambda: model.logits(np.array([300])), "[0, 256)")
    one_line_error(
        lambda: model.masked_logits(windows[0], {model.sites[0]: np.ones((3, 8))}),
        "(3, 8)",
        f"({T}, 8)",
    )


def test_the_doc_has_the_example_this_file_runs():
    """The fast tier's check that docs/api.md still holds the two blocks the slow tier runs,
    each compiling (the slow test runs them against a trained run)."""
    blocks = doc_blocks()
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        compile(block, f"{DOC}:block{i + 1}", "exec")
    text = DOC.read_text(encoding="utf-8")
    assert "pdctl new run1 --template llama-mlp" in text and 'pdctl.open("run1")' in text


@pytest.mark.slow  # a tiny imported Llama through its stages: ~1 minute
def test_an_imported_model_tokenizes_with_its_tokenizer(tmp_path: Path, hf_llama):
    """An hf target: `tokenize` is the model's tokenizer.json (as the corpus is encoded), the
    CI covers every site (attention's and the MLP's of one block), and masks 1 with delta 1
    give the target's logits."""
    from tokenizers import Tokenizer

    run_dir = make_run(
        tmp_path,
        "hf-lm",
        "x",
        tiny=False,
        target={"path": str(hf_llama["model"])},
        data={"path": str(hf_llama["corpus"]), "seq_len": 16},
        decomp={
            "sites": [{"pattern": "model.layers.1.*", "C": 4}],
            "ci_fn": {"type": "shared_mlp", "hidden": [8]},
        },
        warmup={"steps": 2, "log_every": 1},
        train={
            "steps": 2,
            "batch_size": 4,
            "log_every": 1,
            "eval_every": 2,
            "eval_batch_size": 4,
            "eval_pgd": {"enabled": False},
            "loss": {"ppgd_recon": 0.0, "stochastic_recon_layerwise": 0.0},
        },
    )
    cli_ok("--project", run_dir, "run")
    model = pdctl.open(run_dir).target()
    assert model.kind == "hf" and len(model.sites) == 7
    text = "the cat sat on a mat"
    own = Tokenizer.from_file(str(hf_llama["model"] / "tokenizer.json")).encode(text).ids
    tokens = model.tokenize(text)
    assert tokens.tolist() == own and model.decode(tokens) == text
    logits = model.logits(tokens)
    assert logits.shape == (len(own), model.vocab_size)
    ci = model.ci(tokens)
    assert {s: c.shape for s, c in ci.items()} == {s: (len(own), model.C[s]) for s in model.sites}
    np.testing.assert_allclose(model.masked_logits(tokens, "ones", delta=1.0), logits, atol=1e-5)
    one_line_error(lambda: model.logits(np.array([model.vocab_size])), f"[0, {model.vocab_size})")
