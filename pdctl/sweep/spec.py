"""A sweep: one template, a base of `--set` overrides, a grid of config values and N seeds,
expanded into ordinary run directories.

`NAME/sweep.toml` records the base config and the axes; `NAME/runs/<member>/pdctl.toml` is each
member's complete config (the template's tables with the base overrides, its grid point and its
`[run] seed` written in), so any member opens, resumes, reports and exports alone with the usual
commands. The sweep file is read only to know which members there are and what varied.
"""

from __future__ import annotations

import itertools
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from pdctl.config import parse_config
from pdctl.errors import PdctlError
from pdctl.files import refuse_links
from pdctl.project import PROJECT_FILE, Project

SWEEP_FILE = "sweep.toml"
SWEEP_SCHEMA = 1
SEED_KEY = "run.seed"
MAX_MEMBERS = 10_000  # seeds x grid points: each member is a run directory of its own
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MEMBER = re.compile(r"[A-Za-z0-9._-]{1,255}")


def parse_value(text: str) -> Any:
    """A command-line value as TOML reads it (`1e-4`, `true`, `[16]`), else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _assignment(text: str, flag: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or not value.strip():
        raise PdctlError(f"{flag}: {text!r} is not KEY=VALUE (e.g. {flag} train.steps=2000)")
    return key, value.strip()


def parse_sets(items: list[str]) -> dict[str, Any]:
    return {k: parse_value(v) for k, v in (_assignment(t, "--set") for t in items)}


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    grid: dict[str, list[Any]] = {}
    for text in items:
        key, values = _assignment(text, "--grid")
        if key == SEED_KEY:
            raise PdctlError("--grid: run.seed is the seed axis; use --seeds N")
        if key in grid:
            raise PdctlError(f"--grid: {key} given twice; list its values once (K=V1,V2)")
        vals = [parse_value(v.strip()) for v in values.split(",") if v.strip()]
        if len(set(map(repr, vals))) != len(vals):
            raise PdctlError(f"--grid: {key} lists a value twice")
        grid[key] = vals
    return grid


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise PdctlError(f"{dotted}: {part} is a value, not a table")
        node = child
    node[last] = value


def get_dotted(raw: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _fmt(value: Any) -> str:
    return value if isinstance(value, str) else tomli_w.dumps({"v": value})[4:].strip()


@dataclass(frozen=True)
class Member:
    name: str
    seed: int
    point: dict[str, Any] = field(default_factory=dict)  # this member's grid values

    def values(self) -> dict[str, Any]:
        return {**self.point, SEED_KEY: self.seed}


@dataclass
class Sweep:
    root: Path
    template: str
    base: dict[str, Any]  # the member config before its grid point and seed
    sets: dict[str, Any]
    grid: dict[str, list[Any]]
    seeds: list[int]
    members: list[Member]

    @property
    def name(self) -> str:
        return self.root.name

    def run_dir(self, member: Member) -> Path:
        """`runs/<member>`: refused (one line) when it or `runs/` is a symlink, which would
        send a member's writes outside the sweep."""
        refuse_links(self.root / "runs")
        refuse_links(self.root / "runs" / member.name)
        return self.root / "runs" / member.name

    def project(self, member: Member) -> Project:
        return Project.load(self.run_dir(member) / PROJECT_FILE)

    def point_label(self, member: Member) -> str:
        return ", ".join(f"{k}={_fmt(v)}" for k, v in member.point.items()) or "(base)"

    @classmethod
    def load(cls, root: Path) -> Sweep:
        path = root / SWEEP_FILE
        if not path.is_file():
            raise PdctlError(
                f"sweep: no {SWEEP_FILE} in {root}; create one with `pdctl sweep new NAME`"
            )
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
            if raw.get("schema") != SWEEP_SCHEMA:
                raise PdctlError(f"{path}: schema must be {SWEEP_SCHEMA}")
            members = [
                Member(m["name"], int(m["seed"]), dict(m.get("point", {}))) for m in raw["members"]
            ]
            _check_member_names(path, members)
            return cls(
                root=root,
                template=raw["template"],
                base=raw["base"],
                sets=dict(raw.get("set", {})),
                grid={k: list(v) for k, v in raw.get("grid", {}).items()},
                seeds=[int(s) for s in raw["seeds"]],
                members=members,
            )
        except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
            raise PdctlError(f"{path}: not a sweep file pdctl wrote ({e})") from None

    def dump(self) -> str:
        head = (
            f"# pdctl sweep {self.name}: template {self.template!r}, {len(self.seeds)} seeds"
            f"{', grid ' + ' x '.join(self.grid) if self.grid else ''}; the members are\n"
            "# ordinary run directories under runs/ (`pdctl sweep run` runs them)\n"
        )
        body = {
            "schema": SWEEP_SCHEMA,
            "template": self.template,
            "seeds": self.seeds,
            "set": self.sets,
            "grid": self.grid,
            "members": [{"name": m.name, "seed": m.seed, "point": m.point} for m in self.members],
            "base": self.base,
        }
        return head + tomli_w.dumps(body)


def _check_member_names(path: Path, members: list[Member]) -> None:
    """Each member is a plain directory name inside `runs/` (a sweep file may come from someone
    else: `../../x` or `/x` would run a stage outside the sweep), and names are distinct."""
    seen = set()
    for m in members:
        name = m.name
        if not isinstance(name, str) or not _MEMBER.fullmatch(name) or name in (".", ".."):
            raise PdctlError(
                f"{path}: member name {name!r} is not a plain directory name inside runs/ "
                "(letters, digits, '.', '_', '-')"
            )
        if name in seen:
            raise PdctlError(f"{path}: member name {name!r} appears twice")
        seen.add(name)


def short_keys(keys: list[str]) -> dict[str, str]:
    """{dotted key: its shortest dotted suffix that no other key ends with}: `train.optim.lr`
    and `warmup.lr` -> `optim.lr`, `warmup.lr`; a lone `train.loss.p` -> `p`."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            tail = parts[-n:]
            if not any(o != key and o.split(".")[-n:] == tail for o in keys):
                break
        out[key] = ".".join(tail)
    return out


def member_name(point: dict[str, Any], seed: int) -> str:
    short = short_keys(list(point))
    parts = [f"{short[k]}-{_fmt(v)}" for k, v in point.items()]
    return _UNSAFE.sub("_", "_".join([*parts, f"seed{seed}"]))


def create_sweep(
    name: str,
    template: str,
    seeds: int,
    grid: dict[str, list[Any]],
    sets: dict[str, Any],
    parent: Path,
) -> Sweep:
    """Write `parent/name/sweep.toml` and one run directory per (grid point, seed); validates
    every member's config first, so that nothing is written for a bad key or value."""
    import tempfile

    from pdctl.templates import create_run

    if seeds < 1:
        raise PdctlError(f"--seeds: must be at least 1 (got {seeds})")
    if any(not v for v in grid.values()):
        raise PdctlError("--grid: every key needs at least one value (K=V1,V2)")
    points = math.prod(len(v) for v in grid.values())
    if seeds * points > MAX_MEMBERS:  # before anything is expanded or written
        flag = "--seeds" if seeds > MAX_MEMBERS or points == 1 else "--seeds/--grid"
        raise PdctlError(
            f"{flag}: {seeds} seeds x {points} grid points is {seeds * points} members; a sweep "
            f"holds at most {MAX_MEMBERS} (each is a run directory)"
        )
    root = parent / name
    with tempfile.TemporaryDirectory() as tmp:  # the template's config (create_run checks name)
        run = create_run(name, template, Path(tmp))
        raw = tomllib.loads((run / PROJECT_FILE).read_text(encoding="utf-8"))
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise PdctlError(f"NAME: {root} already exists and is not empty; pick another name")
    base = dict(raw)
    for key, value in sets.items():
        if key == SEED_KEY:
            raise PdctlError("--set: run.seed is the seed axis; use --seeds N")
        set_dotted(base, key, value)
    first_seed = int(get_dotted(base, SEED_KEY, 0))
    seed_list = [first_seed + i for i in range(seeds)]
    members, configs = [], {}
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values, strict=True))
        for seed in seed_list:
            m = Member(member_name(point, seed), seed, point)
            cfg = _member_config(base, m)
            _validate(cfg, m)
            members.append(m)
            configs[m.name] = cfg
    if len(configs) != len(members):
        raise PdctlError("--grid: two grid points give the same member name; use distinct values")
    _check_sweepable(configs[members[0].name])
    sweep = Sweep(root, template, base, sets, grid, seed_list, members)
    try:
        (root / "runs").mkdir(parents=True, exist_ok=True)
        for m in members:
            d = sweep.run_dir(m)
            d.mkdir()
            head = (
                f"# member {m.name} of sweep {name} (template {template!r}); "
                f"{sweep.point_label(m)}, seed {m.seed}\n"
            )
            (d / PROJECT_FILE).write_text(head + tomli_w.dumps(configs[m.name]), encoding="utf-8")
        (root / SWEEP_FILE).write_text(sweep.dump(), encoding="utf-8")
    except OSError as e:
        raise PdctlError(f"NAME: cannot create {root} ({e.strerror or e})") from None
    return sweep


def _member_config(base: dict[str, Any], m: Member) -> dict[str, Any]:
    import copy

    cfg = copy.deepcopy(base)
    for key, value in m.values().items():
        set_dotted(cfg, key, value)
    return cfg


def _validate(raw: dict[str, Any], m: Member) -> None:
    try:
        parse_config(raw)
    except PdctlError as e:
        raise PdctlError(f"sweep member {m.name}: {e}") from None


def _check_sweepable(raw: dict[str, Any]) -> None:
    kind = get_dotted(raw, "target.kind")
    if kind not in ("tms", "resid_mlp"):
        raise PdctlError(
            f"--template: sweeps run toy targets (tms, resid_mlp); target.kind {kind!r} reads a "
            "text corpus, which a sweep does not stack yet: run its seeds with `pdctl run`"
        )
