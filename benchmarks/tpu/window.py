"""A decomposition on a machine held in time-limited calls (a borrowed TPU: commands of at most
10 minutes, a machine held for 30, nothing of its state allowed off it but small files): the
same command, call after call, goes on from where the last call stopped, ends within its
`--seconds` with what it did saved, and leaves in `--pack` what a laptop needs to look at it.

    python -m benchmarks.tpu.window --run /tmp/S --seconds 540 --template smollm2-all-mlps \\
        --gguf G.gguf --text /tmp/fortunes --set train.steps=1500 --set train.eval_every=375 \\
        [--wheels .whl-tpu] [--index-url file:///opt/pypi/simple] [--install-only] \\
        [--harvest "--tokens 32768 --top-k 5 --sites ..."] [--pack $OUT]

Each call does, in order, what is not done yet and what its time still allows:
1. install: what pdctl's parts need and the machine lacks, into `--site`, which goes after the
   machine's own JAX on PYTHONPATH: from `--index-url` (a machine image's own package index,
   such as file:///opt/pypi/simple) with `--wheels` beside it, or else every wheel in
   `--wheels` as it is (a machine without network: `accel_check.sh --fetch-wheels`); then every
   module the parts import is imported once, so that a missing one is one line (exit 2) before
   the run starts, not a traceback after the training (the eighth session's harvest: no
   matplotlib);
2. new: `pdctl new` from `--template`, with `[target] path` = `--gguf`, `[data] path` = `--text`
   and each `--set TABLE.KEY=VALUE` (comments kept) and `--unset TABLE.KEY`;
3. run: `pdctl run` (every stage; `--until` N stops train at step N), sent SIGTERM
   `--stop-margin` seconds before the call's end (pdctl saves a checkpoint and exits 3: the next
   call's `pdctl run` resumes from it);
4. once train is done (or at `--until`): harvest (with `--harvest ARGS`), then cluster and
   report, each stopped the same way (a stopped harvest saves its state and goes on in the
   next call);
5. pack, always, whatever happened: `run.tgz` (pdctl.toml, metrics, every part's log), the
   harvest's database xz-compressed in parts of `--part-mib` (`harvest.db.xz.00`, ...; join them
   with `cat harvest.db.xz.* | xz -d > harvest.db`) and `report.tgz`.
The log of each part is RUN/.window/PART.log; the call's lines are printed as they come.
Standard library only: it runs before pdctl's requirements are installed.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import tomllib
from pathlib import Path

from benchmarks._harness import child_env, machine_line
from benchmarks.lm.template_ab import set_key
from benchmarks.tpu.accel_check import BENCH_DISTS, BENCH_MODULES

START = time.monotonic()
# What pdctl's parts (new, run, harvest, cluster, report) import beyond the machine's JAX, its
# numpy and scipy: pdctl's requirements by distribution (the benchmarks' and matplotlib, which
# `pdctl harvest` and `pdctl report` import), and the modules imported once first.
NEEDS = (*BENCH_DISTS, "matplotlib")
MODULES = (*BENCH_MODULES, "pdctl.cli.app", "pdctl.harvest.run", "pdctl.harvest.cluster",
           "pdctl.report.build")  # fmt: skip


def say(msg: str) -> None:
    print(f"[window {time.monotonic() - START:6.1f}s] {msg}", flush=True)


def die(msg: str) -> None:
    """A mistake in the call's arguments: one line, exit 2, nothing started or written."""
    print(f"window: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="the run directory (made if missing)")
    ap.add_argument("--seconds", type=float, required=True, help="this call's time, all of it")
    ap.add_argument("--template", default="smollm2-all-mlps")
    ap.add_argument("--gguf", type=Path, help="[target] path of a new run")
    ap.add_argument("--text", type=Path, help="[data] path of a new run")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="TABLE.KEY=VALUE")
    ap.add_argument("--unset", dest="unsets", action="append", default=[], metavar="TABLE.KEY",
                    help="a template's key to remove (back to pdctl's default)")  # fmt: skip
    ap.add_argument("--until", type=int, help="stop train at this step (pdctl run --until)")
    ap.add_argument("--harvest", help="pdctl harvest's arguments, in one string ('' for none)")
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--wheels", type=Path, help="a folder of wheels to install once")
    ap.add_argument("--index-url", help="a package index for what the machine lacks")
    ap.add_argument("--install-only", action="store_true",
                    help="install and check the imports, nothing else (a first call that "
                    "carries the wheels before the model has arrived)")  # fmt: skip
    ap.add_argument("--site", type=Path, default=Path("/tmp/pdctl-window-site"))
    ap.add_argument("--pack", type=Path, help="the folder to leave the call's small files in")
    ap.add_argument("--part-mib", type=int, default=15)
    ap.add_argument("--stop-margin", type=float, default=45.0,
                    help="seconds before the end when a part gets SIGTERM")  # fmt: skip
    a = ap.parse_args(argv)
    for s in a.sets:
        key, eq, value = s.partition("=")
        if not eq or "." not in key or not value:
            die(f"--set {s!r}: not TABLE.KEY=VALUE (e.g. train.steps=1500)")
    for s in a.unsets:
        if "." not in s or "=" in s:
            die(f"--unset {s!r}: not TABLE.KEY (e.g. train.loss.gamma_final)")
    if not (a.run / "pdctl.toml").is_file():
        for flag, path in (("--gguf", a.gguf), ("--text", a.text)):
            if path is not None and not path.exists():
                die(f"{flag}: no such file or folder {path}")
    if a.wheels is not None and not a.wheels.is_dir():
        die(f"--wheels: no folder {a.wheels}")
    if a.seconds <= a.stop_margin:
        die(f"--seconds must be above --stop-margin ({a.stop_margin:g} s)")
    return a


class Window:
    def __init__(self, a: argparse.Namespace):
        self.a, self.run = a, a.run.resolve()
        self.end = START + a.seconds
        self.marks = self.run / ".window"
        # this checkout first, then the machine's own path (its JAX), then the installed wheels
        self.env = child_env(PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] += os.pathsep + str(a.site)

    def left(self) -> float:
        return self.end - time.monotonic()

    def done(self, part: str) -> bool:
        return (self.marks / f"{part}.done").is_file()

    def mark(self, part: str) -> None:
        self.marks.mkdir(parents=True, exist_ok=True)
        (self.marks / f"{part}.done").write_text(
            time.strftime("%Y-%m-%d %H:%M:%S UTC\n", time.gmtime())
        )

    def state(self, name: str) -> dict:
        """What pdctl.toml's `[state.NAME]` holds ({} where it has none)."""
        try:
            raw = tomllib.loads((self.run / "pdctl.toml").read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError):
            return {}
        return raw.get("state", {}).get(name, {})

    def pdctl(self, part: str, *args: str, need: float = 30.0) -> int | None:
        """`python -m pdctl --project RUN ARGS`, its lines printed and kept in .window/PART.log,
        sent SIGTERM `--stop-margin` seconds before the call's end (killed 5 s before it); its
        exit code, or None when too little time was left to start it."""
        limit = self.left() - self.a.stop_margin
        if limit < need:
            say(f"{part}: {limit:.0f} s left before the stop margin, not started")
            return None
        self.marks.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "pdctl", "--project", str(self.run), *args]
        say(f"{part}: {' '.join(argv[1:])} (SIGTERM in {limit:.0f} s if still running)")
        with (self.marks / f"{part}.log").open("a", encoding="utf-8") as log:
            p = subprocess.Popen(argv, env=self.env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)  # fmt: skip
            copy = threading.Thread(target=_tee, args=(p.stdout, log), daemon=True)
            copy.start()
            try:
                rc = p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                say(f"{part}: SIGTERM (the call ends in {self.left():.0f} s)")
                p.send_signal(signal.SIGTERM)
                try:
                    rc = p.wait(timeout=max(1.0, self.left() - 5))
                except subprocess.TimeoutExpired:
                    say(f"{part}: still running 5 s before the end, killed")
                    p.kill()
                    rc = p.wait()
            copy.join(timeout=5)
        say(f"{part}: exit {rc}")
        return rc

    # ---- the parts ------------------------------------------------------------------------

    def install(self) -> None:
        wheels = sorted(self.a.wheels.glob("*.whl")) if self.a.wheels else []
        stamp = self.a.site / ".pdctl-window"
        pip = [sys.executable, "-m", "pip", "install", "--isolated", "-q", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(self.a.site)]  # fmt: skip
        if self.a.index_url:  # what is missing, with what it needs, from the index
            missing = self.missing()
            what = "\n".join([self.a.index_url, *missing, *(w.name for w in wheels)])
            links = ["--find-links", str(self.a.wheels)] if self.a.wheels else []
            cmd = [*pip, "--only-binary=:all:", "--index-url", self.a.index_url, *links, *missing]
        else:  # every wheel of the folder as it is
            missing = [w.name for w in wheels]
            what = "\n".join(missing)
            cmd = [*pip, "--no-index", "--no-deps", *map(str, wheels)]
        if not missing or (stamp.is_file() and stamp.read_text() == what):
            return
        say(f"install: {' '.join(missing) if self.a.index_url else f'{len(wheels)} wheels'} "
            f"into {self.a.site}")  # fmt: skip
        self.a.site.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(cmd, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
        if r.returncode != 0:
            die(f"pip could not install {' '.join(missing)} into {self.a.site} (see above)")
        stamp.write_text(what)

    def missing(self) -> list[str]:
        """pdctl's requirements among NEEDS that this Python (with `--site`) lacks."""
        r = subprocess.run([sys.executable, "-m", "benchmarks.tpu.accel_check", "deps", *NEEDS],
                           env=self.env, capture_output=True, text=True)  # fmt: skip
        if r.returncode != 0:
            die(_last_line(r.stderr, "accel_check deps failed"))
        return r.stdout.split()

    def preflight(self) -> None:
        """Every module the parts import, imported once in a child (`accel_check imports`):
        one line, exit 2, where one is missing."""
        r = subprocess.run([sys.executable, "-m", "benchmarks.tpu.accel_check", "imports",
                            *MODULES], env=self.env, capture_output=True, text=True)  # fmt: skip
        if r.returncode != 0:
            fix = "--index-url URL (the machine's package index) or --wheels DIR"
            die(f"{_last_line(r.stderr, 'an import failed')}: give {fix}")

    def new(self) -> None:
        """The run directory from the template with the keys set, checked by pdctl (`pdctl
        status` reads the config) in a folder beside it first: a bad key is one line, exit 2,
        and no run directory."""
        toml = self.run / "pdctl.toml"
        if toml.is_file():
            return
        draft = self.run.parent / f"{self.run.name}.draft"
        shutil.rmtree(draft, ignore_errors=True)
        self.run.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "pdctl", "new", draft.name, "--template", self.a.template]
        r = subprocess.run(argv, cwd=self.run.parent, env=self.env, capture_output=True, text=True)
        if r.returncode:
            die(_last_line(r.stderr, "pdctl new failed"))
        text = (draft / "pdctl.toml").read_text(encoding="utf-8")
        paths = (("target.path", self.a.gguf), ("data.path", self.a.text))
        edits = [f"{k}={json.dumps(str(v.resolve()))}" for k, v in paths if v] + self.a.sets
        try:
            for e in edits:
                key, _, value = e.partition("=")
                text = set_key(text, key.strip(), value.strip())
            for key in self.a.unsets:
                text = unset_key(text, key.strip())
        except ValueError as err:
            shutil.rmtree(draft)
            die(f"--set / --unset: {err}")
        (draft / "pdctl.toml").write_text(text, encoding="utf-8")
        argv = [sys.executable, "-m", "pdctl", "--project", str(draft), "status"]
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True)
        if r.returncode:
            shutil.rmtree(draft)
            die(_last_line(r.stderr, "the config with --set's keys is not valid"))
        draft.rename(self.run)
        say(f"new: {self.run} from {self.a.template}, {len(edits)} keys set")

    def train(self) -> bool:
        """`pdctl run` unless train is done (or at `--until`); whether it is now."""
        if not self.trained():
            self.pdctl("run", "run", *(["--until", str(self.a.until)] if self.a.until else []))
        return self.trained()

    def trained(self) -> bool:
        st = self.state("train")
        if st.get("status") == "done":
            return True
        return bool(self.a.until) and int(st.get("step") or 0) >= self.a.until

    def after(self) -> None:
        """harvest, cluster, report: each once, in order, while time is left."""
        parts: list[tuple[str, list[str], float]] = []
        if self.a.harvest is not None:
            parts += [("harvest", ["harvest", *self.a.harvest.split()], 60.0),
                      ("cluster", ["cluster"], 20.0)]  # fmt: skip
        if not self.a.no_report:
            parts.append(("report", ["report"], 30.0))
        for part, args, need in parts:
            if self.done(part):
                continue
            if self.pdctl(part, *args, need=need) != 0:
                return  # stopped (it goes on in the next call) or failed (its log says why)
            self.mark(part)

    def pack(self) -> None:
        out = self.a.pack
        if out is None or not (self.run / "pdctl.toml").is_file():
            return  # (no run: nothing to pack, nothing written)
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out / "run.tgz", "w:gz") as tar:
            for name in ("pdctl.toml", "metrics", ".window"):
                if (self.run / name).exists():
                    tar.add(self.run / name, arcname=f"{self.run.name}/{name}")
        db = self.run / "harvest" / "harvest.db"
        if self.done("harvest") and db.is_file():
            for old in out.glob("harvest.db.xz.*"):
                old.unlink()
            n = split_xz(db, out / "harvest.db.xz", self.a.part_mib << 20)
            say(f"pack: harvest.db ({db.stat().st_size / 2**20:.1f} MiB) in {n} xz parts")
        report = self.run / "report"
        if self.done("report") and report.is_dir():
            with tarfile.open(out / "report.tgz", "w:gz") as tar:
                tar.add(report, arcname=f"{self.run.name}/report")
        sizes = ", ".join(
            f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in sorted(out.iterdir())
        )
        say(f"pack: {out}: {sizes}")


def unset_key(text: str, dotted: str) -> str:
    """`text` (a pdctl.toml) without the line of `section.key` (ValueError where it has none)."""
    section, key = dotted.rsplit(".", 1)
    lines, table, hit = text.split("\n"), None, None
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("[") and not s.startswith("[["):
            table = s.strip("[]").strip()
        elif table == section and s.split("=", 1)[0].strip() == key and "=" in s:
            hit = i
            break
    if hit is None:
        raise ValueError(f"no {key} in [{section}] to unset")
    return "\n".join(lines[:hit] + lines[hit + 1 :])


def _last_line(text: str, default: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1].removeprefix("error: ") if lines else default


def _tee(stream, log) -> None:
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        log.write(line)
        log.flush()


def split_xz(src: Path, prefix: Path, part_bytes: int) -> int:
    """`src` xz-compressed into prefix.00, prefix.01, ... of at most `part_bytes` each; how many."""
    n, out = 0, None
    comp = lzma.LZMACompressor(preset=3)

    def write(data: bytes) -> None:
        nonlocal n, out
        while data:
            if out is None or out.tell() >= part_bytes:
                if out is not None:
                    out.close()
                out = open(f"{prefix}.{n:02d}", "wb")  # noqa: SIM115 (closed above / below)
                n += 1
            k = part_bytes - out.tell()
            out.write(data[:k])
            data = data[k:]

    with src.open("rb") as f:
        while chunk := f.read(1 << 22):
            write(comp.compress(chunk))
    write(comp.flush())
    if out is not None:
        out.close()
    return n


def main(argv: list[str] | None = None) -> int:
    global START
    START = time.monotonic()  # the call's time counts from here (also when called in process)
    a = _args(argv)
    print(machine_line(), flush=True)
    w = Window(a)
    if a.install_only:
        w.install()
        w.preflight()
        say("installed; the imports pdctl's parts need all work")
        return 0
    try:
        w.install()
        w.preflight()
        w.new()
        if w.train():
            w.after()
    finally:
        w.pack()
    parts = [p for p in ("harvest", "cluster", "report") if w.done(p)]
    st = w.state("train")
    train = f"{st['status']} at step {st.get('step')}" if st else "not started"
    say(f"train {train}; done: {', '.join(parts) or 'nothing after'}; "
        f"{w.left():.0f} s of the call left")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
