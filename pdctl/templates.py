"""Run-directory templates: `templates/<name>/pdctl.toml` + `README.md`.

They live at the repository root and ship inside the wheel as `pdctl/templates`.
"""

from __future__ import annotations

import os
import re
import string
from importlib import resources
from pathlib import Path

from pdctl.errors import PdctlError
from pdctl.project import PROJECT_FILE, Project

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def templates_root() -> Path:
    packaged = Path(str(resources.files("pdctl"))) / "templates"
    if packaged.is_dir():
        return packaged
    # Source checkout / editable install: the repository's templates/ next to the package.
    return Path(__file__).resolve().parent.parent / "templates"


def available() -> dict[str, str]:
    """{template name: one-line description} (the first comment line of its pdctl.toml)."""
    out = {}
    for d in sorted(templates_root().iterdir()):
        f = d / PROJECT_FILE
        if f.is_file():
            first = f.read_text(encoding="utf-8").splitlines()[0]
            out[d.name] = first.lstrip("# ").strip()
    return out


def _name_max(parent: Path) -> int:
    """The longest file name (in bytes) the file system of `parent` takes; 255 when it cannot
    say (as on Linux, macOS and Windows file systems alike)."""
    try:
        return int(os.pathconf(parent, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


def create_run(name: str, template: str, parent: Path) -> Path:
    """Scaffold `parent/name/` from a template; refuses anything that could lose data."""
    names = available()
    if template not in names:
        raise PdctlError(
            f"--template: unknown template {template!r} (choose from {', '.join(names)})"
        )
    if not _NAME.match(name) or name in (".", ".."):
        raise PdctlError(
            f"NAME: {name!r} is not a plain directory name (letters, digits, '.', '_', '-'; no '/')"
        )
    limit = _name_max(parent)
    if len(name.encode("utf-8")) > limit:
        raise PdctlError(
            f"NAME: {len(name)} characters is too long for a directory name here "
            f"(at most {limit}); pick a shorter one"
        )
    run = parent / name
    try:
        if run.is_symlink() and not run.exists():
            raise PdctlError(
                f"NAME: {run} is a symlink to {os.readlink(run)}, which does not exist; "
                "create its target or pick another name"
            )
        if run.exists() and (not run.is_dir() or any(run.iterdir())):
            raise PdctlError(f"NAME: {run} already exists and is not empty; pick another name")
    except OSError as e:  # a path too long for the system, a directory we may not list
        raise PdctlError(f"NAME: cannot create {run} ({e.strerror or e})") from None
    src = templates_root() / template
    # Bytes, not text: the run's pdctl.toml is the template byte for byte (no locale, no newline
    # translation).
    toml_bytes = (src / PROJECT_FILE).read_bytes()
    readme_template = string.Template((src / "README.md").read_text(encoding="utf-8"))
    readme = readme_template.safe_substitute(name=name)
    Project.from_text(run / PROJECT_FILE, toml_bytes.decode("utf-8"))  # a template must be valid
    try:
        run.mkdir(parents=True, exist_ok=True)
        (run / PROJECT_FILE).write_bytes(toml_bytes)
        (run / "README.md").write_text(readme, encoding="utf-8")
    except OSError as e:
        raise PdctlError(f"NAME: cannot create {run} ({e.strerror or e})") from None
    return run
