"""A synthetic harvest of a whole model, for `pdctl browse`'s tests and
benchmarks/harvest/browse_load.py: a llama-mlp run directory of `layers` layers x 7 matrices
(attention q / k / v / o, GLU MLP gate / up / down; C components each, C = the MLP's neurons,
`decomp.init = "nonlinearity_aligned"`) whose harvest.db holds made-up CI over the built-in
synthetic corpus (byte tokens: examples read as text), then optionally clustered (`pdctl
cluster`'s code) and labelled.

No model is trained: each component is given a feature of the text to fire on (a byte, every
byte of a word, the byte after a word, the first byte of the word after it), or none (dead);
MLP neuron c of a layer gives the same feature to component c of its gate, up and down (what
nonlinearity-aligned init starts from), each firing on it with its own probability. Components
of one feature fire together, so `pdctl cluster` groups them. How many components are alive
varies smoothly with the layer and the matrix, so the overview has something to show.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

KINDS = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")
SEQ = 64  # tokens per sequence


def _features(text: bytes) -> tuple[np.ndarray, list[str]]:
    """(positions x features bool, each feature's description) of `text`."""
    n = len(text)
    arr = np.frombuffer(text, np.uint8)
    cols, names = [], []
    for b in sorted(set(text)):
        cols.append(arr == b)
        names.append(f"the byte {chr(b)!r}")
    word_at = np.full(n, -1)
    after = np.full(n, -1)  # the byte just after a word: that word
    next_first = np.full(n, -1)  # the first byte of a word: the word before it
    vocab: dict[str, int] = {}
    prev = -1
    for m in re.finditer(rb"[A-Za-z]+", text):
        w = vocab.setdefault(m.group().decode().lower(), len(vocab))
        word_at[m.start() : m.end()] = w
        if m.end() < n:
            after[m.end()] = w
        if prev >= 0:
            next_first[m.start()] = prev
        prev = w
    for w, word in enumerate(vocab):
        cols += [word_at == w, after == w, next_first == w]
        names += [f"the word '{word}'", f"the byte after '{word}'",
                  f"the first letter of the word after '{word}'"]  # fmt: skip
    return np.stack(cols, axis=1), names


def build(
    run: Path,
    layers: int,
    C: int,
    *,
    batches: int = 2,
    batch: int = 8,
    top_k: int = 4,
    window: int = 8,
    seed: int = 0,
) -> None:
    """harvest.db of `run` (a `whole_model_run` directory): `batches` batches of `batch`
    sequences of `SEQ` bytes; `top_k` top and sampled examples per component."""
    from pdctl.harvest import db
    from pdctl.harvest.accumulate import Harvest
    from pdctl.science.data import synthetic_corpus

    rng = np.random.default_rng(seed)
    n = batches * batch * SEQ
    tokens = synthetic_corpus(seed, n).astype(np.int64)
    feats, names = _features(bytes(tokens.astype(np.uint8)))
    n_feat = feats.shape[1]
    sites = {f"layers.{i}.{k}": C for i in range(layers) for k in KINDS}
    # per component: its feature (-1: dead), the chance it fires on it, its CI there
    feature, keep, scale = {}, {}, {}
    for i in range(layers):
        depth = (i + 0.5) / layers
        neuron_feat = rng.integers(0, n_feat, C)
        neuron_alive = rng.random(C) < 0.4 + 0.55 * np.sin(np.pi * depth)
        for j, k in enumerate(KINDS):
            s = f"layers.{i}.{k}"
            if k.startswith("mlp."):
                feature[s] = np.where(neuron_alive, neuron_feat, -1)
            else:
                alive = rng.random(C) < 0.25 + 0.6 * depth * (1 - 0.1 * j)
                feature[s] = np.where(alive, rng.integers(0, n_feat, C), -1)
            keep[s] = rng.uniform(0.75, 1.0, C)
            scale[s] = rng.uniform(0.5, 1.0, C)
    # every pair counted, as a harvest of up to `--cooc-max` components does
    h = Harvest(sites, 0.1, top_k=top_k, n_samples=top_k, window=window, vocab=256,
                cooc_max=max(8192, len(sites) * C))  # fmt: skip
    for b in range(batches):
        sl = slice(b * batch * SEQ, (b + 1) * batch * SEQ)
        f = feats[sl]  # (positions, features)
        ci = {}
        for s in sites:
            on = np.where(feature[s] >= 0, f[:, np.maximum(feature[s], 0)], False)
            on &= rng.random(on.shape) < keep[s]
            val = scale[s] * rng.uniform(0.6, 1.0, on.shape)
            ci[s] = (on * val).astype(np.float32).reshape(batch, SEQ, C)
        h.add(ci, tokens[sl].reshape(batch, SEQ), start=b * batch * SEQ)
    (run / "harvest").mkdir(exist_ok=True)
    meta = {"stage": "train", "kind": "llama_mlp (synthetic CI)", "split": "eval", "step": 1,
            "vocab": 256, "run_id": "synthetic"}  # fmt: skip
    db.write(run / "harvest" / "harvest.db", h, meta)
    # which feature each component was given (what `label` says), beside the database
    said = {s: [names[i] if i >= 0 else None for i in f.tolist()] for s, f in feature.items()}
    (run / "harvest" / "synthetic-features.json").write_text(json.dumps(said))


def label(run: Path, every: int = 3) -> int:
    """Labels ("the word 'cat'") for every `every`-th component that fired, as `pdctl interp
    import` writes them; how many."""
    from pdctl.harvest import db

    path = run / "harvest" / "harvest.db"
    feature = json.loads((run / "harvest" / "synthetic-features.json").read_text())
    con = db.open_readonly(path)
    fired = set(con.execute("SELECT site, component FROM components WHERE count > 0"))
    con.close()
    labels = {}
    i = 0
    for s, names in feature.items():
        for c, name in enumerate(names):
            if name is not None and (s, c) in fired:
                if i % every == 0:
                    labels[(s, c)] = {"label": name, "source": "synthetic"}
                i += 1
    db.replace_labels(path, labels)
    return len(labels)


def whole_model_run(
    parent: Path,
    layers: int = 3,
    C: int = 8,
    *,
    name: str = "wm",
    cluster: bool = True,
    labels: bool = True,
    **kw,
) -> Path:
    """A llama-mlp run directory of `layers` layers x `KINDS` (C components a site, C = d_mlp,
    nonlinearity-aligned init) holding a synthetic harvest (`build`'s keywords), clustered and
    labelled unless told not to."""
    from pdctl.harvest import cluster as cl
    from pdctl.project import Project
    from pdctl.testing.runs import make_run

    run = make_run(
        parent,
        "llama-mlp",
        name,
        target={"n_layers": layers, "d_model": 32, "n_heads": 4, "d_mlp": C, "glu": True},
        decomp={"init": "nonlinearity_aligned",
                "sites": [{"pattern": "layers.*.attn.*", "C": C},
                          {"pattern": "layers.*.mlp.*", "C": C}]},
    )  # fmt: skip
    build(run, layers, C, **kw)
    if cluster:
        cl.cluster(Project.load(run / "pdctl.toml"))
    if labels:
        label(run)
    return run
