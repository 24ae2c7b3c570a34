"""`pdctl harvest` stopped anywhere (SIGTERM, or a kill: here an exception that ends it where it
is) and run again does only what is left and writes the rows an uninterrupted harvest writes:
after the pass over the corpus, during the co-occurrence's second pass, during the output
effects, while the database is written. A harvest already complete for the same checkpoint and
options is left as it is (issue 51: on a TPU, a harvest killed once it had finished was run
again, harvested everything again and dropped the clusters)."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from helpers import cli, cli_fails, cli_ok, harvest_labels, harvest_rows, make_run

from pdctl.engine import runtime
from pdctl.harvest import db
from pdctl.harvest import run as hv

HV = ("harvest", "--tokens", "2048", "--batch-size", "256")  # a toy: 8 batches
NARROW = ("--cooc-max", "6")  # 40 components: co-occurrence by a second pass over the 8


_dump = harvest_rows


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("harvest"))
    return dst


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """test_faults' session run of the TMS template (train checkpoint 10): copy it."""
    from test_faults import done_run

    return done_run(tmp_path_factory)


@pytest.fixture(scope="module")
def whole(trained: Path, tmp_path_factory) -> dict[str, list[str]]:
    """The rows of uninterrupted harvests: {"dense": HV, "narrow": HV + NARROW}."""
    run = _copy(trained, tmp_path_factory.mktemp("whole") / "run")
    out = {}
    for name, extra in (("dense", ()), ("narrow", NARROW)):
        cli_ok("--project", run, *HV, *extra)
        out[name] = _dump(run / "harvest" / "harvest.db")
    assert any("most often firing" in r for r in out["narrow"])  # the second pass ran
    return out


class Counted:
    """Counts the batches of each pass (`Harvest.add`, `CoocCounter.add`) and the output
    effects measured; `cut(kind, n)` makes the n-th call of `kind` raise (a kill there)."""

    def __init__(self, monkeypatch) -> None:
        from pdctl.harvest import effect

        self.n = {"pass": 0, "cooc": 0, "effect": 0}
        self.at: tuple[str, int] | None = None
        real = {"pass": hv.Harvest.add, "cooc": hv.CoocCounter.add}
        real_fn = effect._effect_fn

        def counting(kind, fn):
            def call(*a, **k):
                self.n[kind] += 1
                if self.at == (kind, self.n[kind]):
                    raise RuntimeError(f"killed in {kind} {self.n[kind]}")
                return fn(*a, **k)

            return call

        monkeypatch.setattr(hv.Harvest, "add", counting("pass", real["pass"]))
        monkeypatch.setattr(hv.CoocCounter, "add", counting("cooc", real["cooc"]))
        monkeypatch.setattr(effect, "_effect_fn", lambda *a: counting("effect", real_fn(*a)))

    def reset(self) -> dict[str, int]:
        out, self.n = dict(self.n), {"pass": 0, "cooc": 0, "effect": 0}
        self.at = None
        return out


def _stop_when(monkeypatch, counted: Counted, kind: str, n: int):
    """SIGTERM (as `runtime.stop_signals` records it) once `n` calls of `kind` are done; the
    real `stop_requested`, to put back."""
    real = runtime.stop_requested
    monkeypatch.setattr(runtime, "stop_requested",
                        lambda: signal.SIGTERM if counted.n[kind] >= n else real())  # fmt: skip
    return real


def _killed(*a, **k):
    raise RuntimeError("killed")


@pytest.mark.parametrize(
    ("where", "extra", "left"),
    [
        # a kill once the pass is done (in the toy's CI matrices, before the database): the
        # rerun runs no batch
        ("after the pass", (), {"pass": 0, "cooc": 0}),
        # a kill while the database is written (second pass done): only the write again
        ("writing the database", NARROW, {"pass": 0, "cooc": 0}),
        # a kill in batch 4 of the second pass (saved every 2 batches here): batches 2..7
        ("second pass", NARROW, {"pass": 0, "cooc": 6}),
        # SIGTERM after batch 5 of the second pass: batches 5..7
        ("second pass, SIGTERM", NARROW, {"pass": 0, "cooc": 3}),
    ],
)
def test_a_harvest_cut_anywhere_does_only_what_is_left_and_writes_the_same_rows(
    trained: Path, whole, tmp_path: Path, monkeypatch, where: str, extra: tuple, left: dict
):
    from pdctl.science.spd import evaluate

    run = _copy(trained, tmp_path / "run")
    path = run / "harvest" / "harvest.db"
    monkeypatch.setattr(hv, "SAVE_EVERY", 2)
    counted = Counted(monkeypatch)
    if where == "after the pass":
        real = evaluate.toy_ci_matrices
        monkeypatch.setattr(evaluate, "toy_ci_matrices", _killed)
        assert isinstance(cli("--project", run, *HV, *extra).exception, RuntimeError)
        monkeypatch.setattr(evaluate, "toy_ci_matrices", real)
    elif where == "writing the database":
        real = db._write

        def half_written(tmp, *a, **k):
            Path(tmp).write_bytes(b"SQLite format 3\x00 half")
            _killed()

        monkeypatch.setattr(db, "_write", half_written)
        assert isinstance(cli("--project", run, *HV, *extra).exception, RuntimeError)
        monkeypatch.setattr(db, "_write", real)
    elif where == "second pass":
        counted.at = ("cooc", 4)
        assert isinstance(cli("--project", run, *HV, *extra).exception, RuntimeError)
    else:
        real = _stop_when(monkeypatch, counted, "cooc", 5)
        line = cli_fails(3, "--project", run, *HV, *extra)
        assert line == (
            "error: harvest: stopped by SIGTERM after batch 5 of 8 of the co-occurrence pass "
            "(the first pass is done); the work so far is saved: run `pdctl harvest` again "
            "with the same options to go on"
        ), line
        monkeypatch.setattr(runtime, "stop_requested", real)
    assert not path.exists()
    counted.reset()
    r = cli_ok("--project", run, *HV, *extra)
    assert "went on from batch 8" in r.stdout, r.stdout
    assert {k: v for k, v in counted.reset().items() if k != "effect"} == left
    assert _dump(path) == whole["narrow" if extra else "dense"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["harvest.db"]  # nothing left over


def test_a_complete_harvest_run_again_changes_nothing(
    trained: Path, whole, tmp_path: Path, monkeypatch
):
    """The TPU report: a harvest that had finished, run again with the same options, harvested
    everything again and dropped the clusters. Now one line says it is complete, and nothing
    is read (not the checkpoint) or written; `--fresh` harvests again."""
    from pdctl.stages import decomposition

    run = _copy(trained, tmp_path / "run")
    path = run / "harvest" / "harvest.db"
    cli_ok("--project", run, *HV)
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"site": "linear1", "component": 0, "label": "zero"}) + "\n")
    cli_ok("--project", run, "interp", "import", mine)
    cli_ok("--project", run, "cluster", "--min-jaccard", "0.25")
    labels = harvest_labels(run)

    def files() -> dict[str, tuple[int, bytes]]:
        return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in path.parent.iterdir()}

    before = files()
    real = decomposition.load_decomposition
    monkeypatch.setattr(decomposition, "load_decomposition", _killed)
    r = cli_ok("--project", run, *HV)
    assert r.stdout.splitlines() == [
        f"harvest: already complete for train checkpoint 10 with the same options: {path}; "
        "nothing to do (`pdctl harvest --fresh` harvests again)"
    ], r.stdout
    assert files() == before
    # bad input: one line, nothing written
    line = cli_fails(2, "--project", run, *HV, "--fresh", "--top-k", "0")
    assert line == "error: --top-k: must be in [1, 1000], got 0", line
    assert files() == before
    monkeypatch.setattr(decomposition, "load_decomposition", real)
    r = cli_ok("--project", run, *HV, "--fresh")
    assert r.stdout.startswith("harvested 2048 positions in 8 batches"), r.stdout
    assert "dropped the clusters" in r.stdout, r.stdout
    assert harvest_labels(run) == labels
    assert [x for x in _dump(path) if 'INSERT INTO "labels"' not in x] == whole["dense"]


@pytest.mark.slow  # a tiny Llama through its stages; three harvests, three attributions: ~25 s
def test_an_lm_harvest_or_attributions_stopped_midway_do_only_the_rest(tmp_path: Path, monkeypatch):
    """SIGTERM after the pass over the corpus, while the output effects are measured: the rerun
    runs no batch, measures only the effects not measured yet, and writes the rows of an
    uninterrupted harvest. Likewise `pdctl attributions` stopped between components."""
    run = make_run(tmp_path, "llama-mlp", "lm", pretrain={"steps": 2, "log_every": 1},
                   warmup={"steps": 2, "log_every": 1})  # fmt: skip
    for stage in ("init-weights", "pretrain", "warmup"):
        cli_ok("--project", run, stage)
    args = ("--project", run, "harvest", "--stage", "warmup", "--tokens", "256", "--top-k", "4",
            "--effects", "6")  # fmt: skip
    path = run / "harvest" / "harvest.db"
    cli_ok(*args)
    want = _dump(path)
    con = db.open_readonly(path)
    assert con.execute("SELECT count(DISTINCT site || component) FROM effects").fetchone()[0] == 6
    con.close()
    path.unlink()
    counted = Counted(monkeypatch)
    real = _stop_when(monkeypatch, counted, "effect", 2)
    line = cli_fails(3, *args)
    assert line.startswith("error: harvest: stopped by SIGTERM during the output effects (2 of 6 "
                           "measured; the pass over the corpus is done)"), line  # fmt: skip
    monkeypatch.setattr(runtime, "stop_requested", real)
    counted.reset()
    cli_ok(*args)
    assert counted.reset() == {"pass": 0, "cooc": 0, "effect": 4}
    assert _dump(path) == want
    assert sorted(p.name for p in path.parent.iterdir()) == ["harvest.db"]

    # `pdctl attributions` stopped after 2 of 5 components: the rerun attributes the other 3
    # and writes the tables an uninterrupted run writes
    from pdctl.harvest import attributions as A

    attr = ("--project", run, "attributions", "--components", "5", "--top", "3")
    cli_ok(*attr)
    want = _dump(path)
    assert any(r.startswith('INSERT INTO "attr_inputs"') for r in want)
    calls = []
    real_attribute = A.attribute
    monkeypatch.setattr(A, "attribute", lambda *a: calls.append(a[5:7]) or real_attribute(*a))
    monkeypatch.setattr(runtime, "stop_requested",
                        lambda: signal.SIGTERM if len(calls) >= 2 else real())  # fmt: skip
    line = cli_fails(3, *attr)
    assert line == (
        "error: attributions: stopped by SIGTERM after 2 of 5 components; those are saved: run "
        "`pdctl attributions` again with the same options to go on"
    ), line
    monkeypatch.setattr(runtime, "stop_requested", real)
    first, calls[:] = list(calls), []
    cli_ok(*attr)
    assert len(calls) == 3 and not set(calls) & set(first), (first, calls)
    assert _dump(path) == want
    assert sorted(p.name for p in path.parent.iterdir()) == ["harvest.db"]
