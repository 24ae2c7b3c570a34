"""The session-scoped fixtures over pdctl.testing.models' tiny Hugging Face models, which
tests/conftest.py registers for every test file: a model several files use is built once per
test session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdctl.testing.models import tiny_llama

# ---- fixtures (registered by tests/conftest.py) ---------------------------------------------


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny_llama's defaults (d 32, shards of 40 KB, 200 documents), once per session.
    Shared: a test that changes the model works on a copy of it."""
    pytest.importorskip("transformers", reason="needs the parity extra")
    pytest.importorskip("tokenizers")
    return tiny_llama(tmp_path_factory.mktemp("hf"))
