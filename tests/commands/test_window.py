"""benchmarks/tpu/window.py, the decomposition in time-limited calls: its arguments are checked
before anything is written, the harvest's database comes back in xz parts that join to the same
bytes, and two calls on a toy (the first stopped by SIGTERM at its limit) end with everything
done and packed."""

from __future__ import annotations

import json
import lzma
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import numpy as np
import pytest

from benchmarks.tpu import window

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--seconds", "30"], "--seconds must be above --stop-margin"),
        (["--seconds", "300", "--set", "train.steps"], "not TABLE.KEY=VALUE"),
        (["--seconds", "300", "--unset", "steps"], "not TABLE.KEY"),
        (["--seconds", "300", "--gguf", "/no/such.gguf"], "--gguf: no such file"),
        (["--seconds", "300", "--wheels", "/no/such/dir"], "--wheels: no folder"),
    ],
)
def test_bad_arguments_are_one_line_exit_2_nothing_written(tmp_path, capsys, args, says):
    with pytest.raises(SystemExit) as e:
        window.main(["--run", str(tmp_path / "r"), "--pack", str(tmp_path / "out"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("window: ") and says in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_a_key_pdctl_refuses_is_one_line_and_no_run(tmp_path, capsys):
    """`pdctl new` and pdctl's own check of the keys happen in a draft folder: a bad key leaves
    neither a run directory nor a pack."""
    with pytest.raises(SystemExit) as e:
        window.main(["--run", str(tmp_path / "r"), "--seconds", "300", "--template", "tms",
                     "--set", "train.stepz=5", "--pack", str(tmp_path / "out")])  # fmt: skip
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["window: train.stepz: unknown key"], err
    assert list(tmp_path.iterdir()) == []


def test_unset_removes_one_key_of_its_table():
    text = "[a]\nx = 1  # one\ny = 2\n\n[b]\nx = 3\n"
    assert window.unset_key(text, "b.x") == "[a]\nx = 1  # one\ny = 2\n\n[b]\n"
    assert window.unset_key(text, "a.x") == "[a]\ny = 2\n\n[b]\nx = 3\n"
    with pytest.raises(ValueError, match="no z in"):
        window.unset_key(text, "a.z")


def test_xz_parts_join_to_the_same_bytes(tmp_path):
    src = tmp_path / "harvest.db"
    rng = np.random.default_rng(0)  # half noise (stays big), half zeros (compresses)
    src.write_bytes(rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes() + bytes(300_000))
    n = window.split_xz(src, tmp_path / "harvest.db.xz", 64 << 10)
    parts = sorted(tmp_path.glob("harvest.db.xz.*"))
    assert n == len(parts) >= 4 and [p.name[-2:] for p in parts] == [f"{i:02d}" for i in range(n)]
    assert all(p.stat().st_size == 64 << 10 for p in parts[:-1])
    assert lzma.decompress(b"".join(p.read_bytes() for p in parts)) == src.read_bytes()


def _wheel(folder: Path, name: str) -> Path:
    """A one-module wheel, built by hand (no build backend offline): NAME/__init__.py."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 1\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(f, text)
    return path


def test_install_from_an_index_puts_what_is_missing_on_the_site(tmp_path, monkeypatch, capsys):
    """--index-url: what pdctl's parts need and this Python lacks is installed from the index
    (here an empty one, the wheel found beside it in --wheels) into --site, once; the parts'
    modules are imported before the run starts, a missing one as one line, exit 2."""
    _wheel(tmp_path / "wheels", "pdctl_window_probe")
    (tmp_path / "index").mkdir()
    monkeypatch.setattr(window, "NEEDS", ("pdctl_window_probe",))
    monkeypatch.setattr(window, "MODULES", ("pdctl_window_probe",))
    site = tmp_path / "site"
    argv = [
        "--run",
        str(tmp_path / "r"),
        "--seconds",
        "300",
        "--site",
        str(site),
        "--index-url",
        (tmp_path / "index").as_uri(),
        "--wheels",
        str(tmp_path / "wheels"),
    ]
    w = window.Window(window._args(argv))
    assert w.missing() == ["pdctl_window_probe"]
    assert window.main([*argv, "--install-only"]) == 0  # install, check the imports, no run
    assert (site / "pdctl_window_probe" / "__init__.py").is_file()
    assert w.missing() == []  # found on the site now: the next call installs nothing
    w.preflight()
    out = capsys.readouterr().out
    assert "install: pdctl_window_probe into" in out and "imports pdctl's parts need" in out

    monkeypatch.setattr(window, "MODULES", ("pdctl_window_probe", "pdctl_window_absent"))
    with pytest.raises(SystemExit) as e:
        w.preflight()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No module named 'pdctl_window_absent'" in err[0], err
    assert "--index-url URL" in err[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # two calls of a TMS run through pdctl (~2 minutes)
def test_two_calls_stop_resume_harvest_and_pack(tmp_path):
    run = tmp_path / "S"

    def call(seconds: int, out: Path) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "benchmarks.tpu.window", "--run", str(run), "--template",
             "tms", "--seconds", str(seconds), "--stop-margin", "15", "--set",
             "train.steps=100000", "--until", "6000", "--harvest", "--tokens 1024",
             "--pack", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=seconds + 60,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout

    # the first call's 75 s end inside the run (6,000 train steps of ~10 ms after ~20 s of
    # stages on an idle machine; on a busy one the SIGTERM may land in an earlier stage)
    first = call(75, tmp_path / "out1")
    assert "run: SIGTERM" in first and "run: exit 3" in first
    state = tomllib.loads((run / "pdctl.toml").read_text()).get("state", {})
    assert state.get("train", {}).get("status") != "done"
    assert sorted(p.name for p in (tmp_path / "out1").iterdir()) == ["run.tgz"]
    # the second goes on: train to 6,000 (--until), then harvest, cluster and report
    second = call(400, tmp_path / "out2")
    assert ": resuming from its latest checkpoint" in second
    out = tmp_path / "out2"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["harvest.db.xz.00", "report.tgz", "run.tgz"], names
    db = lzma.decompress(b"".join(p.read_bytes() for p in sorted(out.glob("harvest.db.xz.*"))))
    assert db == (run / "harvest" / "harvest.db").read_bytes()
    with tarfile.open(out / "run.tgz") as tar:
        got = set(tar.getnames())
    assert {"S/pdctl.toml", "S/metrics/train.jsonl", "S/.window/run.log"} <= got
    assert {"harvest.done", "cluster.done", "report.done"} <= {
        p.name for p in (run / ".window").iterdir()
    }
    rows = [json.loads(x) for x in (run / "metrics" / "train.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in rows) == 6000
