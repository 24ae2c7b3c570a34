"""Imported models through the CLI: a GGUF run end to end, held-out evaluation documents, and the
checks that keep a decomposition of the model it says: the weights'
bytes hashed at init-weights, a tokenizer larger than the model refused, a forged token cache
not trusted."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, edit_config, error_lines, state

from pdctl.science import data

pytest.importorskip("transformers")
from test_gguf import tiny_model, write_gguf
from test_hf_pipeline import _run

from pdctl.testing.models import write_corpus


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    return write_gguf(tiny_model("llama"), "llama", root / "tiny.gguf")


def _gguf_run(tmp_path: Path, gguf_model: Path, **over) -> Path:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert cli("new", "g", "--template", "smollm2").exit_code == 0
    finally:
        os.chdir(cwd)
    run = tmp_path / "g"
    corpus = write_corpus(tmp_path / "c.jsonl", 200)
    small = {
        "target": {"path": str(gguf_model)},
        "data": {"path": str(corpus), "separator": "", "seq_len": 16,
                 "eval_fraction": 0.25},
        "checkpoint": {"every": 5},
        "decomp": {"sites": [{"pattern": "model.layers.1.mlp.*", "C": 8}],
                   "ci_fn": {"type": "shared_mlp", "hidden": [8]}},
        "warmup": {"steps": 4, "log_every": 2},
        "train": {"steps": 6, "batch_size": 4, "log_every": 3, "eval_every": 3,
                  "eval_batch_size": 4},
    }  # fmt: skip
    edit_config(run, {**small, **over})
    return run


@pytest.mark.slow
def test_gguf_run_end_to_end_with_held_out_eval(tmp_path, gguf_model):
    """`pdctl run` on a GGUF: imported with a content checksum, tokenized with the GGUF's own
    tokenizer, trained on the train documents, evaluated on the held-out ones; report too."""
    run = _gguf_run(tmp_path, gguf_model)
    r = cli("--project", run, "run")
    assert r.exit_code == 0, r.output
    pre = state(run, "pretrain")
    assert pre["status"] == "imported" and pre["format"] == "gguf"
    assert pre["source"] == str(gguf_model.resolve()) and len(pre["checksum"]) == 64
    assert set(pre["files"]) == {"tiny.gguf"}
    tr = state(run, "train")
    assert tr["status"] == "done" and np.isfinite(tr["eval"]["ce_ci_masked"])
    # the fresh-PGD evaluation (on by default) and the alive counts, in `status --json` ...
    r = cli("--project", run, "status", "--json")
    assert r.exit_code == 0, r.output
    ev = json.loads(r.stdout)["train"]["eval"]
    for k in ("kl_pgd", "ce_pgd", "kl_stoch_masked", "kl_unmasked"):
        assert np.isfinite(ev[k]) and ev[k] >= -1e-6, k
    assert (
        set(ev["l0"])
        == set(ev["alive"])
        == set(ev["alive_mean"])
        == {f"model.layers.1.mlp.{n}_proj" for n in ("gate", "up", "down")}
    )
    # ... and in `status` (pgd KL beside the CI-masked and stochastic ones)
    r = cli("--project", run, "status")
    assert r.exit_code == 0 and "pgd" in r.stdout, r.output
    caches = sorted((run / "cache" / "tokens").glob("tokens-*.npy"))
    assert len(caches) == 2  # the train and the eval split
    r = cli("--project", run, "report")
    assert r.exit_code == 0, r.output
    assert (run / "report" / "index.html").is_file()


def test_held_out_documents_are_whole_and_disjoint(tmp_path, gguf_model):
    """Split by document: every document lands on exactly one side, whole; the sides' streams
    together are the unsplit stream's documents; the split is the same at any seed."""
    corpus = write_corpus(tmp_path / "c.jsonl", 60)
    kw = {"tokenizer_path": gguf_model, "eval_fraction": 0.3}
    whole = data.load_corpus(corpus, tokenizer_path=gguf_model)
    train = data.load_corpus(corpus, split="train", **kw)
    held = data.load_corpus(corpus, split="eval", **kw)
    eos = data.corpus_tokenizer(gguf_model).eos_id

    def docs(stream):
        out, cur = [], []
        for t in np.asarray(stream).tolist():
            cur.append(t)
            if t == eos:
                out.append(tuple(cur))
                cur = []
        return out

    all_docs = docs(whole)
    mask = data.held_out(len(all_docs), 0.3)
    assert docs(held) == [d for d, m in zip(all_docs, mask, strict=True) if m]
    assert docs(train) == [d for d, m in zip(all_docs, mask, strict=True) if not m]
    assert 0 < len(docs(held)) < len(all_docs)


def test_separator_splits_text_files_into_documents(tmp_path, gguf_model):
    folder = tmp_path / "fortunes"
    folder.mkdir()
    (folder / "art").write_text("one fortune\n%\nanother\none\n%\n  third  \n")
    (folder / "art.dat").write_bytes(b"\x00\x01binary index")
    (folder / "art.u8").symlink_to("art")
    files = data.corpus_files(folder, plain=True)
    assert [f.name for f in files] == ["art"]
    assert list(data._documents(files, "text", "%")) == ["one fortune", "another\none", "  third  "]
    with pytest.raises(ValueError, match=r"no \.txt"):
        data.corpus_files(folder)  # without a separator, suffix-less files are not text


def _triple_in_place(path: Path) -> None:
    """Every float32 of a safetensors file times 3, header bytes and size unchanged."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    body = np.frombuffer(bytes(raw[8 + n :]), dtype=np.float32) * 3
    raw[8 + n :] = body.astype(np.float32).tobytes()
    st = path.stat()
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back, as the test


@pytest.mark.slow
def test_changed_weights_after_init_weights_are_refused(tmp_path, hf_llama):
    """Weights edited in place (same header bytes, size and mtime) after
    init-weights: warmup refuses with one line, exit 2, nothing written."""
    model = tmp_path / "model"
    import shutil

    shutil.copytree(hf_llama["model"], model)
    run = _run(tmp_path, hf_llama, target={"path": str(model)})
    assert cli("--project", run, "init-weights").exit_code == 0
    before = (run / "pdctl.toml").read_bytes()
    _triple_in_place(sorted(model.glob("*.safetensors"))[1])
    r = cli("--project", run, "warmup")
    assert r.exit_code == 2, r.output
    (line,) = error_lines(r)
    assert "changed since init-weights" in line and "its bytes" in line
    assert (run / "pdctl.toml").read_bytes() == before


def test_changed_gguf_is_refused_and_unchanged_needs_no_rehash(tmp_path, gguf_model, monkeypatch):
    """The content check: signatures equal -> no read at all; a file rewritten with other
    bytes -> refused; the same bytes at a new inode (a copy) -> accepted after one rehash."""
    from pdctl.errors import PdctlError
    from pdctl.science.targets import build_target, checksum, imported

    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_model.read_bytes())
    target = build_target("hf", path=str(path))
    recorded = imported.check(target, None)
    calls = []
    real = checksum.content_digest
    monkeypatch.setattr(checksum, "content_digest", lambda f: calls.append(1) or real(f))
    imported.verify(target, recorded)
    assert calls == []
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)  # same bytes, new inode
    imported.verify(target, recorded)
    assert calls == [1]
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF  # one byte of the last tensor
    path.write_bytes(bytes(raw))
    with pytest.raises(PdctlError, match="changed since init-weights"):
        imported.verify(target, recorded)


def test_tokenizer_larger_than_the_model_is_refused(tmp_path, gguf_model):
    """A tokenizer with more ids than the model's embedding rows, or an EOS
    outside the model's vocabulary: one line at init-weights, exit 2, nothing written."""
    model = tiny_model("llama")
    model.resize_token_embeddings(200)  # the GGUF's tokenizer keeps its 320 tokens
    small = write_gguf(model, "llama", tmp_path / "small.gguf")
    run = _gguf_run(tmp_path, small)
    before = (run / "pdctl.toml").read_bytes()
    r = cli("--project", run, "init-weights")
    assert r.exit_code == 2, r.output
    (line,) = error_lines(r)
    assert "320 ids" in line and "200" in line
    assert (run / "pdctl.toml").read_bytes() == before and not (run / "checkpoints").exists()


def test_forged_token_cache_is_not_trusted(tmp_path, gguf_model, caplog):
    """A valid int32 .npy of other (or negative) ids in place of the cache
    file is not a hit; an edit that keeps the data file's size and mtime is a miss."""
    corpus = write_corpus(tmp_path / "c.jsonl", 40)
    cache = tmp_path / "cache"
    first = np.array(data.load_corpus(corpus, tokenizer_path=gguf_model, cache_dir=cache))
    (file,) = cache.glob("tokens-*.npy")
    valid = np.full(first.shape, 7, np.int32)
    valid[-1] = first[-1]  # in range and ending with EOS: only its content gives it away
    for forged in (np.full(first.shape, -1, np.int32), valid):
        np.save(file, forged)
        again = data.load_corpus(corpus, tokenizer_path=gguf_model, cache_dir=cache)
        np.testing.assert_array_equal(again, first)
    # Same size and mtime, other text: the key hashes the bytes, so it misses.
    st = corpus.stat()
    text = corpus.read_text()
    swapped = text.replace("cat", "dog").replace("dogs", "cats")
    assert len(swapped) == len(text) and swapped != text
    corpus.write_text(swapped)
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    edited = data.load_corpus(corpus, tokenizer_path=gguf_model, cache_dir=cache)
    assert not np.array_equal(edited, first)


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("empty.jsonl", b"", "no text in 1 file"),
        ("blank.jsonl", b"\n\n   \n", "no text in 1 file"),
        ("nofield.jsonl", b'{"text": "a b"}\n{"body": "x"}\n', "nofield.jsonl:2: no field 'text'"),
        ("late.jsonl", b'{"text": "a"}\n' * 4999 + b"{oops\n", "late.jsonl:5000: not valid JSON"),
        ("latin1.txt", "caf\xe9".encode("latin-1"), "latin1.txt: not UTF-8 text"),
        ("short.txt", b"a", "need at least 17"),
    ],
)
def test_bad_text_inputs_are_one_line_naming_the_file(tmp_path, gguf_model, name, content, needle):
    """Bad text inputs: each stops with one line naming the file (and line)."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        data.load_corpus(path, tokenizer_path=gguf_model, seq_len=16, cache_dir=tmp_path / "c")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_fifo_and_device_paths_do_not_hang(tmp_path, gguf_model):
    """A FIFO or a device as the corpus is refused at once (never opened and read)."""
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(ValueError, match="no such file or directory"):
            data.load_corpus(path, tokenizer_path=gguf_model)
    folder = tmp_path / "dir"
    folder.mkdir()
    os.mkfifo(folder / "inside.txt")
    (folder / "ok.txt").write_text("the cat sat on a mat")
    assert data.load_corpus(folder, tokenizer_path=gguf_model).size > 0  # the FIFO is skipped
