"""`pdctl harvest`: the accumulator against hand-computed values on CI known in closed form,
independence from how the data is split into batches (what makes 1 vs N devices and an
interrupted-then-resumed harvest give the same database), and the command on a toy run."""

from __future__ import annotations

import contextlib
import math
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, cli_fails, cli_ok, harvest_labels, harvest_rows, make_run, state

from pdctl.harvest import db
from pdctl.harvest import run as hv
from pdctl.harvest.accumulate import BINS, SUM_SCALE, Harvest

VOCAB = 6
TOKENS = np.array([[0, 1, 2, 0, 3, 4], [4, 0, 0, 1, 5, 2]], np.int32)  # (B, T)


def closed_form_ci(tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Site "a": component c fires (CI 1) exactly on token c (c = 0, 1, 2), else CI 0.
    Site "b": component 0 has CI 0.5 on tokens 0 and 3, component 1 CI 0.05 (below the
    threshold) everywhere."""
    a = np.stack([(tokens == c).astype(np.float32) for c in range(3)], axis=-1)
    b0 = np.where((tokens == 0) | (tokens == 3), 0.5, 0.0).astype(np.float32)
    b = np.stack([b0, np.full(tokens.shape, 0.05, np.float32)], axis=-1)
    return {"a": a, "b": b}


def _harvest(rows_per_batch: int, top_k: int = 3) -> Harvest:
    h = Harvest({"a": 3, "b": 2}, 0.1, top_k=top_k, n_samples=2, window=1, vocab=VOCAB)
    T = TOKENS.shape[1]
    for lo in range(0, TOKENS.shape[0], rows_per_batch):
        tok = TOKENS[lo : lo + rows_per_batch]
        h.add(closed_form_ci(tok), tok, start=lo * T)
    return h


def test_counts_cooccurrence_and_pmi_equal_the_hand_computed_values():
    h = _harvest(2)
    N = 12
    assert h.n_positions == N
    # token 0 appears 4 times, 1 twice, 2 twice, 3 once: a_c fires on token c
    np.testing.assert_array_equal(h.stats["a"].count, [4, 2, 2])
    np.testing.assert_array_equal(h.stats["b"].count, [5, 0])
    np.testing.assert_array_equal(h.stats["a"].ci_max, [1, 1, 1])
    # CI sums in units of 2**-24: five 0.5, twelve float32(0.05) * 2**24 = 838860.81 -> 838861
    assert h.stats["b"].ci_sum.tolist() == [5 * SUM_SCALE // 2, 12 * 838861]
    # histogram: b1's twelve 0.05 are in bin 1 of 20, b0's five 0.5 in bin 10
    assert h.stats["b"].hist[1].tolist() == [0] + [12] + [0] * (BINS - 2)
    assert h.stats["b"].hist[0, 10] == 5 and h.stats["b"].hist[0, 0] == 7
    # co-occurrence: a0 (token 0) and b0 (tokens 0, 3) fire together 4 times
    assert h.cooc[0, 3] == 4 and h.cooc[3, 0] == 4 and h.cooc[1, 3] == 0
    rows = {(a, b): r for a, b, *r in h.cooc_rows()}
    count, precision, recall, jaccard, pmi = rows[(0, 3)]
    assert (count, precision, recall, jaccard) == (4, 1.0, 4 / 5, 4 / 5)
    assert pmi == pytest.approx(math.log(4 * N / (4 * 5)))
    assert (1, 3) not in rows and (4, 0) not in rows  # b1 never fires
    # tokens: b0 fires on token 0 (4x) and 3 (1x); PMI = ln(p(tok | fire) / p(tok))
    tok = {(c, t, kind): (n, p) for c, t, n, p, kind in h.token_rows()}
    assert tok[(3, 0, "count")] == (4, pytest.approx(math.log((4 / 5) / (4 / 12))))
    assert tok[(3, 3, "count")] == (1, pytest.approx(math.log((1 / 5) / (1 / 12))))
    assert tok[(0, 0, "count")][0] == 4 and (0, 1, "count") not in tok
    # top examples of a0: CI 1 at positions 0, 3, 7 (ties by position), windows of +-1 token
    top = h.stats["a"].top
    assert top.pos[:, 0].tolist() == [0, 3, 7]
    assert top.win_tok[:, 0].tolist() == [[-1, 0, 1], [2, 0, 3], [4, 0, 0]]
    assert top.win_ci[1, 0].tolist() == [0.0, 1.0, 0.0]
    # the sample keeps firing positions only (a1 fires at 1 and 9: both)
    assert sorted(h.stats["a"].sample.pos[:, 1].tolist()) == [1, 9]
    assert set(h.stats["a"].sample.pos[:, 0].tolist()) <= {0, 3, 7, 8}


def test_the_result_does_not_depend_on_how_the_data_is_split(tmp_path: Path):
    """One batch of 2 sequences, or 2 batches of 1: the same state bit for bit, and the same
    database (1 vs N devices, 1 vs N processes and a resumed harvest all come down to this)."""
    a, b = _harvest(2), _harvest(1)
    sa, sb = a.state(), b.state()
    assert set(sa) == set(sb)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    # a state saved mid-way and loaded into a fresh accumulator goes on identically
    c = Harvest({"a": 3, "b": 2}, 0.1, top_k=3, n_samples=2, window=1, vocab=VOCAB)
    c.add(closed_form_ci(TOKENS[:1]), TOKENS[:1], start=0)
    d = Harvest({"a": 3, "b": 2}, 0.1, top_k=3, n_samples=2, window=1, vocab=VOCAB)
    d.load_state(c.state())
    d.add(closed_form_ci(TOKENS[1:]), TOKENS[1:], start=6)
    for k, v in d.state().items():
        np.testing.assert_array_equal(v, sa[k], err_msg=k)
    dumps = []
    for name, h in (("a", a), ("b", b)):
        path = tmp_path / f"{name}.db"
        db.write(path, h, {"stage": "train"})
        con = db.open_readonly(path)
        dumps.append([r for r in con.iterdump() if "INSERT" in r])
        con.close()
    assert dumps[0] == dumps[1]


def test_database_layout_and_refusals(tmp_path: Path):
    path = tmp_path / "h.db"
    db.write(path, _harvest(2), {"stage": "train"})
    con = db.open_readonly(path)
    sites = con.execute("SELECT site, C, offset, alive FROM sites ORDER BY idx").fetchall()
    assert sites == [("a", 3, 0, 3), ("b", 2, 3, 1)]
    ex = con.execute(
        "SELECT position, tokens FROM examples WHERE site='a' AND component=0 AND kind='top' "
        "ORDER BY rank"
    ).fetchall()
    assert ex == [(0, "[-1, 0, 1]"), (3, "[2, 0, 3]"), (7, "[4, 0, 0]")]
    by_token = con.execute("SELECT DISTINCT site, component FROM tokens WHERE token = 2 "
                           "AND kind = 'count' ORDER BY site, component").fetchall()  # fmt: skip
    assert by_token == [("a", 2)]  # "which components fire on this token"
    # no WAL: the file is never written in place, and readers open it immutable
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    con.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.db"]  # nothing beside it
    other = sqlite3.connect(tmp_path / "old.db")
    other.execute("CREATE TABLE meta (key TEXT, value TEXT)")
    other.execute("INSERT INTO meta VALUES ('schema_version', '0')")
    other.commit()
    other.close()
    from pdctl.errors import PdctlError

    with pytest.raises(PdctlError, match="schema version 0, this pdctl reads 1"):
        db.open_readonly(tmp_path / "old.db")


def _random_ci(rng, shape, C):
    """CI full of ties (0, 1 and a few repeated values) and some values just above the
    threshold: the cases where the order (value desc, position asc) decides."""
    levels = np.array([0.0, 0.0, 0.0, 0.05, 0.1, 0.10000001, 0.25, 0.5, 1.0, 1.0], np.float32)
    ci = levels[rng.integers(0, levels.size, (*shape, C))]
    noisy = rng.random((*shape, C)) < 0.3
    return np.where(noisy, rng.random((*shape, C)).astype(np.float32), ci)


@pytest.mark.slow
@pytest.mark.parametrize("lm, skip", [(True, 0), (True, 2), (False, 0)],
                         ids=["lm", "lm-skip-first-2", "toy"])  # fmt: skip
def test_the_device_accumulator_equals_the_numpy_reference_bit_for_bit(tmp_path: Path, lm, skip):
    """The jitted accumulator against the host reference it replaced (`reference.Harvest`,
    batch by batch in numpy): random CI with many ties, batches of 1, 3 and 7 sequences (the
    last one padded, as `pdctl harvest` pads it), k = 1 and 4, an LM's sequences whole or
    without their first 2 positions: the same database, row for row."""
    from pdctl.harvest import reference

    rng = np.random.default_rng(1)
    sites = {"a": 5, "b": 3, "c": 1}
    n_seq, T, vocab = 13, 6, 7
    tokens = rng.integers(0, vocab, (n_seq, T)).astype(np.int32)
    ci = {s: _random_ci(rng, (n_seq, T) if lm else (n_seq * T,), C) for s, C in sites.items()}
    if not lm:
        n_seq, T = n_seq * T, 1
    for k in (1, 4):
        opts = dict(top_k=k, n_samples=k, window=2, vocab=vocab if lm else None, seed=3,
                    skip_first=skip)  # fmt: skip
        ref = reference.Harvest(sites, 0.1, **opts)
        ref.add({s: v[:n_seq] for s, v in ci.items()}, tokens if lm else None, start=0)
        want = _db_rows(tmp_path / f"ref{k}.db", ref)
        for B in (1, 3, 7):
            h = Harvest(sites, 0.1, **opts)
            for lo in range(0, n_seq, B):
                hi = min(n_seq, lo + B)
                pad = lo + B - hi
                x = {s: np.concatenate([v[lo:hi], np.zeros((pad, *v.shape[1:]), v.dtype)])
                     for s, v in ci.items()}  # fmt: skip
                tok = None
                if lm:
                    tok = np.concatenate([tokens[lo:hi], np.zeros((pad, T), np.int32)])
                h.add(x, tok, start=lo * T, valid=hi - lo)
            assert h.n_positions == ref.n_positions == n_seq * (T - skip)
            got = _db_rows(tmp_path / f"new{k}-{B}.db", h)
            assert got == want, (k, B)
            # the single-batch reference sums CI in one pass; the accumulator per batch
            np.testing.assert_array_equal(h.stats["a"].count, ref.stats["a"].count)
            np.testing.assert_array_equal(h.stats["a"].hist, ref.stats["a"].hist)
            np.testing.assert_array_equal(h.stats["b"].ci_max, ref.stats["b"].ci_max)
            if lm:
                np.testing.assert_array_equal(h.token_keys, ref.token_keys)
                np.testing.assert_array_equal(h.token_counts, ref.token_counts)


def _db_rows(path: Path, h) -> list[str]:
    db.write(path, h, {"stage": "train"})
    con = db.open_readonly(path)
    try:
        return [r for r in con.iterdump() if "INSERT" in r]
    finally:
        con.close()


def test_the_histogram_by_compares_equals_the_scatter(monkeypatch):
    """A TPU's accumulator counts the CI histogram by a compare per bin (its compiler takes
    minutes over the scatter-add): the same integers as the scatter, every statistic equal,
    with padded rows and each sequence's first positions left out."""
    from pdctl.harvest import accumulate

    rng = np.random.default_rng(4)
    sites = {"a": 5, "b": 3}
    tokens = rng.integers(0, 7, (9, 6)).astype(np.int32)
    ci = {s: _random_ci(rng, (9, 6), C) for s, C in sites.items()}
    states = {}
    for how in ("scatter", "compare"):
        monkeypatch.setattr(accumulate, "hist_method", lambda device, how=how: how)
        h = Harvest(sites, 0.1, top_k=3, n_samples=3, window=2, vocab=7, skip_first=1)
        for lo in range(0, 9, 4):
            x = {s: np.concatenate([v[lo : lo + 4], np.zeros((max(0, lo + 4 - 9), 6, v.shape[2]),
                                   np.float32)]) for s, v in ci.items()}  # fmt: skip
            tok = np.concatenate([tokens[lo : lo + 4], np.zeros((max(0, lo + 4 - 9), 6), np.int32)])
            h.add(x, tok, start=lo * 6, valid=min(4, 9 - lo))
        states[how] = h.state()
    assert states["scatter"].keys() == states["compare"].keys()
    for k, v in states["scatter"].items():
        np.testing.assert_array_equal(v, states["compare"][k], err_msg=k)
    assert states["scatter"]["hist"].sum() == 9 * 5 * (5 + 3)  # kept positions x components


@pytest.mark.slow
def test_the_fixed_point_sum_is_exact_in_any_order():
    """CI sums are int64 multiples of 2**-24 (`SUM_SCALE`): equal bits to the reference in
    any batching, within half a unit per value of the float64 sum."""
    from pdctl.harvest import reference

    rng = np.random.default_rng(2)
    ci = {"a": (rng.random((64, 16, 4)) ** 9).astype(np.float32)}
    tok = np.zeros((64, 16), np.int32)
    ref = reference.Harvest({"a": 4}, 0.5, vocab=1)
    h = Harvest({"a": 4}, 0.5, vocab=1)
    for lo in range(0, 64, 16):
        ref.add({"a": ci["a"][lo : lo + 16]}, tok[lo : lo + 16], start=lo * 16)
        h.add({"a": ci["a"][lo : lo + 16]}, tok[lo : lo + 16], start=lo * 16)
    np.testing.assert_array_equal(h.stats["a"].ci_sum, ref.stats["a"].ci_sum)
    whole = Harvest({"a": 4}, 0.5, vocab=1)
    whole.add(ci, tok, start=0)
    np.testing.assert_array_equal(whole.stats["a"].ci_sum, h.stats["a"].ci_sum)
    exact = ci["a"].astype(np.float64).sum((0, 1))
    assert np.all(np.abs(h.stats["a"].ci_sum / SUM_SCALE - exact) <= 64 * 16 / 2 / SUM_SCALE)


@pytest.mark.parametrize("lm", [True, False], ids=["lm", "toy"])
def test_merged_parts_equal_one_harvest_bit_for_bit(lm):
    """What a multi-process harvest does: parts over disjoint positions (here 3, of uneven
    size and out of order) merged with `merge_states` give the state of one harvest that saw
    every batch, and a fresh accumulator loaded with it goes on identically."""
    from pdctl.harvest.accumulate import merge_states

    rng = np.random.default_rng(5)
    sites, V, B, T = {"x": 5, "y": 3}, 11, 4, 6
    shape = (B, T) if lm else (B * T,)
    batches = []
    for i in range(6):
        ci = {s: _random_ci(rng, shape, C) for s, C in sites.items()}
        tok = rng.integers(0, V, (B, T)).astype(np.int32) if lm else None
        batches.append((ci, tok, i * B * T))

    def run(which) -> Harvest:
        h = Harvest(sites, 0.1, top_k=4, n_samples=3, window=2, vocab=V if lm else None, seed=9)
        for i in which:
            h.add(*batches[i])
        return h

    whole = run(range(6)).state()
    merged = merge_states([run([4, 5]).state(), run([0]).state(), run([1, 2, 3]).state()])
    assert set(merged) == set(whole)
    for k in whole:
        np.testing.assert_array_equal(merged[k], whole[k], err_msg=k)
        assert merged[k].dtype == whole[k].dtype, k
    h = run([])
    h.load_state(merged)
    np.testing.assert_array_equal(h.stats["x"].top.pos, run(range(6)).stats["x"].top.pos)


def test_restricted_cooccurrence_equals_the_dense_matrix_on_its_components():
    """Beyond `cooc_max` components the second pass (`CoocCounter`) counts co-occurrence among
    the chosen ones: the dense matrix's rows and columns for them, and the same database rows
    for every pair both keep."""
    from pdctl.harvest.accumulate import CoocCounter

    dense = _harvest(2)
    index = np.array([0, 3, 4])  # a0, b0, b1 (global)
    counter = CoocCounter({"a": 3, "b": 2}, index, 0.1)
    for lo in range(0, TOKENS.shape[0]):  # other batches than `dense` saw
        tok = TOKENS[lo : lo + 1]
        counter.add(closed_form_ci(tok), valid=1)
    np.testing.assert_array_equal(counter.counts, dense.cooc[np.ix_(index, index)])
    narrow = Harvest({"a": 3, "b": 2}, 0.1, top_k=3, n_samples=2, window=1, vocab=VOCAB,
                     cooc_max=2)  # fmt: skip
    narrow.add(closed_form_ci(TOKENS), TOKENS, start=0)
    assert narrow.cooc is None  # 5 components > 2: skipped by the first pass
    narrow.set_cooc(index, counter.counts)
    rows = {(a, b): r for a, b, *r in narrow.cooc_rows()}
    assert set(rows) == {(0, 3), (3, 0)}  # b1 never fires
    want = {(a, b): r for a, b, *r in dense.cooc_rows()}
    assert rows[(0, 3)] == want[(0, 3)] and rows[(3, 0)] == want[(3, 0)]


def test_exact_top_k_of_53_bit_priorities_with_ties():
    """The sample's selection (`_top_k_u53`): the k largest by (value desc, index asc) even
    when values share their high digits (what the three float32 levels resolve)."""
    import jax

    from pdctl.harvest.accumulate import _top_k_u53

    rng = np.random.default_rng(3)
    base = np.uint64(1) << np.uint64(52)
    # few distinct high digits, few distinct middle digits, low digits 0..31: every level ties
    hi = rng.integers(0, 3, (6, 200)).astype(np.uint64) << np.uint64(29)
    mid = rng.integers(0, 3, (6, 200)).astype(np.uint64) << np.uint64(5)
    lo = rng.integers(0, 4, (6, 200)).astype(np.uint64)
    u = base - np.uint64(1) - hi - mid - lo
    valid = rng.random((6, 200)) < 0.9
    valid[5, 3:] = False  # a row with fewer valid entries than k
    for k in (1, 5, 17):
        with jax.enable_x64(True):
            idx, took = (np.asarray(a) for a in jax.jit(_top_k_u53, static_argnums=2)(
                u, valid, k))  # fmt: skip
        for r in range(6):
            cols = np.nonzero(valid[r])[0]
            want = cols[np.lexsort((cols, -(u[r, cols] - u[r].min()).astype(np.int64)))][:k]
            got = idx[r][took[r]]
            got = got[np.lexsort((got, -(u[r, got] - u[r].min()).astype(np.int64)))]
            np.testing.assert_array_equal(got, want, err_msg=f"k={k} row {r}")


@pytest.fixture(scope="module")
def tms_trained(tmp_path_factory) -> Path:
    run = make_run(tmp_path_factory.mktemp("hv"), "tms", "t", tiny=False,
                   pretrain={"steps": 60, "batch_size": 64, "log_every": 20},
                   warmup={"steps": 4, "log_every": 2},
                   train={"steps": 20, "batch_size": 64, "log_every": 10,
                          "eval_every": 20})  # fmt: skip
    assert cli("--project", run, "run").exit_code == 0
    return run


@pytest.fixture(scope="module")
def tms_done(tmp_path_factory) -> Path:
    """For the fast tests: a copy of test_faults' session run of the TMS template (every stage
    done, train checkpoints 5 and 10), which test_faults and test_resume share, so that the
    fast tier trains one TMS run where it trained two; any trained toy decomposition serves
    these tests (the slow ones keep `tms_trained`)."""
    import shutil

    from test_faults import done_run

    run = tmp_path_factory.mktemp("hv-done") / "t"
    shutil.copytree(done_run(tmp_path_factory), run, symlinks=True)
    return run


_dump = harvest_rows


@pytest.mark.slow
def test_harvest_of_a_toy_run_and_an_interrupted_one_resumes(tms_trained: Path, monkeypatch):
    # beyond --cooc-max components a second pass counts co-occurrence among the most often
    # firing ones: the same rows as the dense matrix for the pairs both keep
    args = ("--project", tms_trained, "harvest", "--tokens", "2048", "--batch-size", "256")
    assert cli(*args, "--cooc-max", "6").exit_code == 0
    path = tms_trained / "harvest" / "harvest.db"
    con = db.open_readonly(path)
    narrow = {r[:4]: r[4:] for r in con.execute("SELECT * FROM cooc")}
    says = con.execute("SELECT value FROM meta WHERE key = 'cooc'").fetchone()[0]
    con.close()
    assert "among the 6 most often firing of 40 components" in says, says
    assert narrow and len({(s, c) for s, c, *_ in narrow}) <= 6

    r = cli(*args)
    assert r.exit_code == 0, r.output
    full = _dump(path)
    con = db.open_readonly(path)
    dense = {r[:4]: r[4:] for r in con.execute("SELECT * FROM cooc")}
    assert con.execute("SELECT value FROM meta WHERE key = 'cooc'").fetchone()[0] == '"dense"'
    con.close()
    both = set(narrow) & set(dense)
    assert both and all(narrow[k] == dense[k] for k in both)
    con = db.open_readonly(path)
    n = con.execute("SELECT value FROM meta WHERE key='n_positions'").fetchone()[0]
    assert n == "2048"
    C = con.execute("SELECT C FROM sites WHERE site='linear1'").fetchone()[0]
    n_comp = con.execute("SELECT count(*) FROM components WHERE site='linear1'").fetchone()[0]
    assert n_comp == C
    n_feat = con.execute("SELECT count(DISTINCT feature) FROM toy_features").fetchone()[0]
    assert n_feat == 5  # TMS 5-2: CI of each one-hot feature
    con.close()
    assert not (tms_trained / "harvest" / "partial.npz").exists()
    st = cli("--project", tms_trained, "status")
    text = " ".join(st.output.split())  # rich wraps long lines
    assert "harvest: " in text and "train checkpoint 20, 2048 positions" in text, text
    from pdctl.harvest.run import harvest_line
    from pdctl.report import page as P

    html = P.render(P.Page("t", "s", harvest=harvest_line(_project(tms_trained))))
    assert '<p id="harvest">' in html and 'href="http://127.0.0.1:8765/"' in html

    # a crash after batch 5 of 8 (saves every 2 batches here): the rerun goes on from 4
    monkeypatch.setattr(hv, "SAVE_EVERY", 2)
    real = hv.Harvest.add
    calls = {"n": 0}

    def crash_after_five(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("killed")
        return real(self, *a, **k)

    path.unlink()
    monkeypatch.setattr(hv.Harvest, "add", crash_after_five)
    with pytest.raises(RuntimeError):
        hv.harvest(_project(tms_trained), n_tokens=2048, batch_size=256)
    assert (tms_trained / "harvest" / "partial.npz").exists() and not path.exists()
    monkeypatch.setattr(hv.Harvest, "add", real)
    res = hv.harvest(_project(tms_trained), n_tokens=2048, batch_size=256)
    assert res.resumed_from == 4
    assert _dump(path) == full


def test_sigterm_saves_the_state_exits_3_and_the_rerun_ends_the_same(tms_done: Path, monkeypatch):
    """A real SIGTERM to this process during batch 3 of 8 (`runtime.stop_signals` is in place
    while `pdctl harvest` runs): exit 3, one line saying how to go on, the state after batch 3
    saved; the rerun goes on from there and writes the database an uninterrupted harvest
    writes."""
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    path = tms_done / "harvest" / "harvest.db"
    args = ("--project", tms_done, "harvest", "--tokens", "2048", "--batch-size", "256")
    assert cli(*args).exit_code == 0
    full = _dump(path)
    path.unlink()
    real = hv.Harvest.add
    calls = {"n": 0}

    def term_in_batch_three(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *a, **k)

    monkeypatch.setattr(hv.Harvest, "add", term_in_batch_three)
    line = cli_fails(3, *args)
    assert line == (
        "error: harvest: stopped by SIGTERM after batch 3 of 8; the work so far is saved: run "
        "`pdctl harvest` again with the same options to go on"
    ), line
    assert (tms_done / "harvest" / "partial.npz").exists() and not path.exists()
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back
    monkeypatch.setattr(hv.Harvest, "add", real)
    r = cli(*args)
    assert r.exit_code == 0 and "went on from batch 3" in r.output, r.output
    assert _dump(path) == full


def _project(run: Path):
    from pdctl.project import Project

    return Project.load(run / "pdctl.toml")


def test_bad_input_is_one_line(tms_done: Path, tmp_path: Path):
    assert "--tokens: must be >= 1" in cli_fails(2, "--project", tms_done, "harvest",
                                                 "--tokens", "0")  # fmt: skip
    line = cli_fails(2, "--project", tms_done, "harvest", "--batch-size", "3")
    assert "--batch-size: 3 is not divisible by the 4 devices" in line
    assert "has no decomposition" in cli_fails(2, "--project", tms_done, "harvest",
                                               "--stage", "pretrain")  # fmt: skip
    fresh = make_run(tmp_path, "tms", "fresh")
    line = cli_fails(2, "--project", fresh, "harvest")
    assert line == "error: harvest: pretrain has no checkpoint (run `pdctl pretrain`)", line
    assert not (fresh / "harvest" / "harvest.db").exists()


def test_a_harvest_of_some_sites_holds_their_rows_of_a_harvest_of_all(tms_done, tmp_path: Path):
    """`--sites`: only the matching sites are harvested (a whole model's harvest cut to the
    layers one wants to read), and each of their components' statistics and examples are the
    rows a harvest of every site gives them (nothing of a component depends on the other
    sites); run again with the same patterns, it is complete; a harvest of every site is
    another harvest. A pattern that matches nothing: one line, nothing written."""
    import shutil

    run = tmp_path / "t"
    shutil.copytree(tms_done, run, symlinks=True, ignore=shutil.ignore_patterns("harvest"))
    hv_ = ("--project", run, "harvest", "--tokens", "1024", "--batch-size", "256")
    path = run / "harvest" / "harvest.db"
    line = cli_fails(2, *hv_, "--sites", "linear1,lin*9")
    assert line == "error: --sites: no site matches 'lin*9' (the sites: linear1, linear2)", line
    assert not path.exists()
    cli_ok(*hv_)
    every = _dump(path)
    r = cli_ok(*hv_, "--sites", "linear2")
    assert r.stdout.startswith("harvested 1024 positions"), r.stdout
    some = _dump(path)

    def rows(dump: list[str], table: str, site: str) -> list[str]:
        return [x for x in dump if x.startswith(f'INSERT INTO "{table}"') and f"'{site}'" in x]

    for table in ("components", "examples"):
        assert rows(some, table, "linear2") == rows(every, table, "linear2") != [], table
        assert rows(some, table, "linear1") == [], table
    with db.open_readonly(path) as con:
        assert [s for (s,) in con.execute("SELECT site FROM sites")] == ["linear2"]
    assert db.read_meta(path)["options"]["sites"] == ["linear2"]
    r = cli_ok(*hv_, "--sites", "linear2")
    assert "already complete" in r.stdout, r.stdout
    r = cli_ok(*hv_)
    assert r.stdout.startswith("harvested 1024 positions"), r.stdout
    assert _dump(path) == every


# ---- pdctl browse ------------------------------------------------------------------------------


@contextlib.contextmanager
def _serving(run: Path, wrap=None):
    """The app over `run`'s harvest.db (passed through `wrap`, if given), served by uvicorn on a
    free port in a thread: its base url."""
    import socket
    import threading
    import time

    import uvicorn

    from pdctl.harvest.browse import make_app

    # the server is handed the bound socket: a port found free and closed again could be taken
    # by another test process's server before this one binds it, and the browser would then
    # talk to that one (a run without clusters, say)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = make_app(_project(run))
    server = uvicorn.Server(uvicorn.Config(app if wrap is None else wrap(app), host="127.0.0.1",
                                           port=port, log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert server.started, "the browse server did not start within 20 s"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _closed_form_run(tmp_path: Path) -> Path:
    """A tms run directory holding the closed-form harvest (tokens shown as ids)."""
    run = make_run(tmp_path, "tms", "r")
    (run / "harvest").mkdir()
    db.write(
        run / "harvest" / "harvest.db",
        _harvest(2),
        {"stage": "train", "kind": "lm-test", "split": "eval", "step": 1, "vocab": VOCAB},
    )
    return run


@pytest.fixture
def served(tmp_path: Path):
    """The app over the closed-form harvest, in a tms run directory (tokens shown as ids),
    served by uvicorn on a free port in a thread: (base url, run directory)."""
    run = _closed_form_run(tmp_path)
    (tmp_path / "secret.txt").write_text("outside")
    with _serving(run) as base:
        yield base, run


def _get(url: str) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_browse_api_is_read_only_over_the_run(served):
    import json

    base, run = served
    status, body = _get(f"{base}/api/component/a/0")
    assert status == 200
    comp = json.loads(body)
    assert comp["count"] == 4 and [e["position"] for e in comp["top"]] == [0, 3, 7]
    assert [(r["other_site"], r["other_component"]) for r in comp["cooc"]] == [("b", 0)]
    assert json.loads(_get(f"{base}/api/search?q=%232")[1])["rows"][0]["component"] == 2
    assert _get(f"{base}/api/component/nope/0")[0] == 404
    assert _get(f"{base}/api/components?sort=drop")[0] == 400  # no SQL from the query string
    assert _get(f"{base}/files/pdctl.toml")[0] == 200
    for outside in ("%2e%2e/secret.txt", "..%2fsecret.txt", "%2Fetc%2Fpasswd"):
        assert _get(f"{base}/files/{outside}")[0] in (403, 404), outside
    assert _get(f"{base}/files/%2e%2e/secret.txt")[0] == 403
    (run / "link").symlink_to(run.parent / "secret.txt")
    assert _get(f"{base}/files/link")[0] == 403


@pytest.mark.slow
def test_browse_in_headless_chromium(served, tmp_path: Path):

    from test_report import need_chromium

    from pdctl.testing.browser import Browser

    need_chromium()
    base, _ = served
    broken = tmp_path / "broken.html"  # the control: the check sees what it is there to catch
    broken.write_text("<!DOCTYPE html><html><body><script>undefined_fn();</script></body></html>")
    browser = Browser(tmp_path / "profile")

    def js(expr: str):
        return browser.js(expr, await_promise=True)

    def wait_ready(route: str) -> None:
        import time

        deadline = time.monotonic() + 20
        while js("document.body.dataset.ready") != route:
            assert time.monotonic() < deadline, (route, js("document.body.innerHTML"))
            time.sleep(0.1)

    try:
        errors, _, _ = browser.load(broken.as_uri())
        assert any("exception" in e for e in errors), errors
        errors, _, _ = browser.load(f"{base}/")
        wait_ready("#/")
        assert errors == [], errors
        assert js("document.querySelectorAll('a.site').length") == 2
        js("document.querySelector('a.site').click()")
        wait_ready("#/site/a")
        js("document.querySelector('a.component').click()")  # the most frequent: a #0
        wait_ready("#/c/a/0")
        assert js("document.getElementById('component-title').textContent") == "a #0"
        assert js("document.querySelectorAll('.ex').length") >= 3
        js("document.getElementById('q').value = '#2';"
           "document.getElementById('search').requestSubmit()")  # fmt: skip
        wait_ready("#/search/%232")
        links = js("Array.from(document.querySelectorAll('#results a.component'))"
                   ".map(a => a.textContent)")  # fmt: skip
        assert links == ["a #2"], links
        page_errors = [m for m in browser.seen if m.get("method") == "Runtime.exceptionThrown"]
        assert page_errors == []
    finally:
        browser.close()


def test_browse_bad_input_is_one_line(tmp_path: Path, served):
    fresh = make_run(tmp_path, "tms", "fresh")
    line = cli_fails(2, "--project", fresh, "browse")
    assert "no harvest here (run `pdctl harvest` first)" in line
    base, run = served
    port = int(base.rsplit(":", 1)[1])
    line = cli_fails(2, "--project", run, "browse", "--port", str(port))  # the fixture's
    assert f"--port: cannot listen on 127.0.0.1:{port}" in line


@pytest.mark.slow  # six pdctl processes, ~30 s
def test_one_vs_four_devices_sigkill_and_sigterm_give_the_same_database(
    tms_trained: Path, tmp_path
):
    import shutil
    import signal
    import subprocess
    import time

    from helpers import pdctl_argv, pdctl_env, pdctl_process

    # 256 batches (512 before): a save every 8 (`SAVE_EVERY`), so the kill and the stop land
    # after the first save with 248 batches still to go, and each rerun goes on from a saved
    # batch
    args = ("harvest", "--tokens", "65536", "--batch-size", "256")
    path = tms_trained / "harvest" / "harvest.db"

    def dump() -> list[str]:
        return [r for r in _dump(path) if "'devices'" not in r]

    dumps = {}
    for n in (1, 4):
        r = pdctl_process(*args, project=tms_trained, devices=n)
        assert r.returncode == 0, r.stderr
        dumps[n] = dump()
        shutil.copy(path, tmp_path / f"{n}.db")
    assert dumps[1] == dumps[4]
    path.unlink()
    proc = subprocess.Popen(pdctl_argv(*args, project=tms_trained), env=pdctl_env(4),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    partial = tms_trained / "harvest" / "partial.npz"
    deadline = time.monotonic() + 120
    while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the harvest ended before it could be killed"
    assert not path.exists()
    r = pdctl_process(*args, project=tms_trained, devices=4)
    assert r.returncode == 0 and "went on from batch" in r.stdout, (r.stdout, r.stderr)
    assert dump() == dumps[4]

    # SIGTERM: the process saves its state, exits 3 with one line; the rerun ends the same
    path.unlink()
    proc = subprocess.Popen(pdctl_argv(*args, project=tms_trained), env=pdctl_env(4),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, (proc.returncode, out, err[-2000:])
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "harvest: stopped by SIGTERM after batch" in lines[0], err[-2000:]
    assert "`pdctl harvest` again with the same options" in lines[0]
    assert "Traceback" not in err and partial.exists() and not path.exists()
    r = pdctl_process(*args, project=tms_trained, devices=4)
    assert r.returncode == 0 and "went on from batch" in r.stdout, (r.stdout, r.stderr)
    assert dump() == dumps[4]


@pytest.mark.slow  # three pdctl processes, ~30 s
def test_one_vs_two_processes_give_the_same_database(tms_trained: Path):
    """Two processes of one jax.distributed job each harvest half of the batches on their own
    devices and merge the parts: the database one process writes, bit for bit."""
    from helpers import pdctl_process, pdctl_processes

    args = ("harvest", "--tokens", "16384", "--batch-size", "256")
    path = tms_trained / "harvest" / "harvest.db"

    def dump() -> list[str]:
        skip = ("'devices'", "'processes'")
        return [r for r in _dump(path) if not any(k in r for k in skip)]

    r = pdctl_process(*args, project=tms_trained, devices=2)
    assert r.returncode == 0, r.stderr
    one = dump()
    path.unlink()
    outs = pdctl_processes(2, *args, project=tms_trained, devices=1)
    assert [rc for rc, _ in outs] == [0, 0], outs
    assert all("harvested 16384 positions in 64 batches by 2 processes" in o for _, o in outs)
    assert dump() == one
    assert not list(path.parent.glob("partial*")) and not list(path.parent.glob("effects*"))
    # the co-occurrence's second pass (beyond --cooc-max), shared out the same way
    r = pdctl_process(*args, "--cooc-max", "6", project=tms_trained, devices=2)
    assert r.returncode == 0, r.stderr
    one = dump()
    outs = pdctl_processes(2, *args, "--cooc-max", "6", project=tms_trained, devices=1)
    assert [rc for rc, _ in outs] == [0, 0], outs
    assert dump() == one and any("most often firing" in row for row in one)
    assert not list(path.parent.glob("cooc-*"))


# ---- hostile run directories (items as test_hostile.py numbers them), the lock, bad input,
# forged partial state ---------------------------------------------------------------------------


def _tree(root: Path) -> dict[str, object]:
    """Every path under `root` (links not followed) and its bytes or link target."""
    import os

    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        else:
            out[rel] = p.read_bytes() if p.is_file() else None
    return out


@pytest.fixture
def trained_copy(tmp_path_factory, tmp_path: Path) -> Path:
    """A copy of test_faults' session run (see `tms_done`): train checkpoints 5 and 10."""
    import shutil

    from test_faults import done_run

    run = tmp_path / "run"
    shutil.copytree(done_run(tmp_path_factory), run, symlinks=True,
                    ignore=shutil.ignore_patterns("harvest"))  # fmt: skip
    return run


HV = ("harvest", "--tokens", "2048", "--batch-size", "256")  # 8 batches


@pytest.mark.parametrize(
    "name", ["harvest", "harvest/partial.npz.tmp", "harvest/harvest.db.tmp", "harvest/partial.npz"]
)
def test_a_symlink_in_harvest_is_refused(trained_copy: Path, tmp_path: Path, name: str):
    # item 3: a harvest/ that links outside got harvest.db written there, and a
    # harvest/partial.npz.tmp link had the file it points to overwritten
    run = trained_copy
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"mine")
    (run / "harvest").mkdir(exist_ok=name != "harvest")
    if name == "harvest":
        (run / "harvest").rmdir()
        (run / "harvest").symlink_to(outside, target_is_directory=True)
    else:
        (run / name).symlink_to(outside / "precious")
    before, there = _tree(run), _tree(outside)
    line = cli_fails(2, "--project", run, *HV)
    assert f"{run / name}: is a symlink" in line, line
    assert _tree(outside) == there and _tree(run) == before


def test_harvest_holds_the_run_directory_lock(trained_copy: Path, monkeypatch):
    # item 10: a harvest ran while `train --fresh` replaced its checkpoint
    from pdctl.errors import PdctlError

    run = trained_copy
    other = _project(run)  # another pdctl: a stage running
    other.acquire_lock()
    try:
        line = cli_fails(2, "--project", run, *HV)
        assert f"{run} is in use by another pdctl process" in line, line
        assert not (run / "harvest").exists()
    finally:
        other.release_lock()
    refused = []

    def on_batch(done: int, total: int) -> None:  # a stage starting while the harvest runs
        try:
            _project(run).acquire_lock()
        except PdctlError as e:
            refused.append(str(e))

    hv.harvest(_project(run), n_tokens=2048, batch_size=256, on_batch=on_batch)
    assert len(refused) == 8 and "in use by another pdctl process" in refused[0], refused
    assert _project(run).lock_is_free()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tokens", "abc"], "--tokens: must be an integer, got 'abc'"),
        (["--tokens", "2.5"], "--tokens: must be an integer, got '2.5'"),
        (["--batch-size", "x"], "--batch-size: must be an integer, got 'x'"),
        (["--top-k", "1e9"], "--top-k: must be in [1, 1000], got 1000000000"),
        (["--top-k", "0"], "--top-k: must be in [1, 1000], got 0"),
        (["--effects", "-1"], "--effects: must be >= 0, got -1"),
        (["--cooc-max", "nan"], "--cooc-max: must be an integer, got 'nan'"),
        (["--skip-first", "-1"], "--skip-first: must be >= 0, got -1"),
        (["--skip-first", "1"], "--skip-first: a toy's inputs are not sequences (LMs only)"),
    ],
)
def test_bad_harvest_flags_are_one_line_at_once(trained_copy: Path, args, says):
    import time

    t0 = time.monotonic()
    line = cli_fails(2, "--project", trained_copy, "harvest", *args)
    assert line == f"error: {says}", line
    assert time.monotonic() - t0 < 2
    assert not (trained_copy / "harvest").exists()


def _stopped_after(run: Path, monkeypatch, batches: int) -> None:
    """A harvest (HV) stopped by SIGTERM after `batches` batches: harvest/partial.npz saved."""
    import signal

    from pdctl.engine import runtime
    from pdctl.engine.loop import Interrupted

    seen = []
    real = runtime.stop_requested
    monkeypatch.setattr(
        runtime, "stop_requested", lambda: signal.SIGTERM if len(seen) >= batches else real()
    )
    with pytest.raises(Interrupted):
        hv.harvest(_project(run), n_tokens=2048, batch_size=256,
                   on_batch=lambda d, t: seen.append(d))  # fmt: skip
    monkeypatch.setattr(runtime, "stop_requested", real)


def _forge(path: Path, checksum: bool, **arrays) -> None:
    z = {k: np.asarray(v) for k, v in arrays.items() if k != "_sum"}
    if checksum:  # a forger who knows the format
        z["_sum"] = np.asarray(hv._checksum(z))
    else:
        z["_sum"] = np.asarray("0" * 64)
    with open(path, "wb") as f:
        np.savez(f, **z)


def test_a_forged_partial_harvest_is_not_trusted(trained_copy: Path, monkeypatch):
    # item 11: a negative `_next` gave a traceback, inflated counts were trusted
    run = trained_copy
    partial = run / "harvest" / "partial.npz"
    _stopped_after(run, monkeypatch, 3)  # saved after batch 4 of 8
    z = dict(np.load(partial))
    key = str(z["_key"])

    def read():
        positions = lambda nxt: min(2048, nxt * 256)  # noqa: E731  (toy: one position a row)
        return hv._read_partial(partial, key, 0, 8, positions)

    assert read()[1] == 4  # the true one
    forged = [
        ({"_next": -5}, True),
        ({"_next": 99}, True),
        ({"count": z["count"] + 10_000}, True),  # more firings than positions
        ({"n_positions": z["n_positions"] * 2}, True),  # more than the batches done cover
        ({"count": z["count"] + 1}, False),  # an edit without the checksum
    ]
    for edit, checksum in forged:
        _forge(partial, checksum, **{**z, **edit})
        assert (hv._read_keyed(partial, key) is not None) == checksum, edit  # well formed
        assert read() is None, edit
    _forge(partial, True, **{**z, "_next": -5})
    r = cli("--project", run, *HV)
    assert r.exit_code == 0, (r.output, r.exception)
    assert "went on from" not in r.output  # started over


def test_a_full_disk_during_harvest_is_one_line(trained_copy: Path, monkeypatch):
    # item 11: ENOSPC gave a traceback and left partial.npz.tmp behind
    import errno

    run = trained_copy
    monkeypatch.setattr(hv, "SAVE_EVERY", 2)
    real_savez = np.savez

    def full(f, **arrays):
        f.write(b"PK\x03\x04 half an archive")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full)
    line = cli_fails(2, "--project", run, *HV)
    assert line.startswith(f"error: harvest: cannot write {run / 'harvest' / 'partial.npz'} "
                           "(No space left on device)"), line  # fmt: skip
    assert sorted(p.name for p in (run / "harvest").iterdir()) == []
    monkeypatch.setattr(np, "savez", real_savez)

    def full_db(*args, **kwargs):
        (run / "harvest" / "harvest.db.tmp").write_bytes(b"SQLite format 3\x00 half")
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(db, "_write", full_db)
    line = cli_fails(2, "--project", run, *HV)
    assert "harvest: cannot write" in line and "database or disk is full" in line, line
    assert sorted(p.name for p in (run / "harvest").iterdir()) == ["partial.npz"]  # kept


# ---- a re-harvest: what later commands added to harvest.db ----------------------------------

SOME_LABELS = [  # what a labeller might write, scores included
    {"site": "linear1", "component": 0, "label": "feature ⟨0⟩ — \"zero\"", "reasoning": "a\nb",
     "confidence": 0.1, "detection": 1 / 3, "source": "me"},
    {"key": "linear2:1", "label": "feature 1", "fuzzing": 0.7000000000000001},
    {"site": "linear1", "component": 3, "label": "feature 3", "reasoning": ""},
]  # fmt: skip


def _label(run: Path, tmp_path: Path) -> dict:
    """SOME_LABELS imported into the run's harvest.db: its labels."""
    import json

    f = tmp_path / "mine.jsonl"
    f.write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in SOME_LABELS), "utf-8")
    cli_ok("--project", run, "interp", "import", f)
    return harvest_labels(run)


def _tables(path: Path) -> set[str]:
    con = db.open_readonly(path)
    try:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        con.close()


def _lines(r) -> list[str]:
    """The harvest's stdout: its `harvested ...` line (which rich may wrap), then each line
    saying what it kept (one line each, never wrapped)."""
    out = r.stdout.splitlines()
    said = [i for i, line in enumerate(out) if line.startswith(("kept ", "did not keep ",
                                                               "dropped "))]  # fmt: skip
    first = said[0] if said else len(out)
    assert said == list(range(first, len(out))), out
    return [" ".join(" ".join(out[:first]).split()), *out[first:]]


def test_a_reharvest_of_the_same_checkpoint_keeps_the_labels_and_drops_what_is_derived(
    trained_copy: Path, tmp_path: Path
):
    """Labels (the user's) are carried into the new database, row for row, in the same write;
    the clusters and attributions (computed from the old statistics) are dropped, and one line
    names each kind with the command that makes it again, with its options."""
    import json

    from pdctl.harvest import attributions

    run, path = trained_copy, trained_copy / "harvest" / "harvest.db"
    r = cli_ok("--project", run, *HV)
    assert len(_lines(r)) == 1 and _lines(r)[0].startswith("harvested 2048 positions"), r.stdout
    fresh = _dump(path)
    labels = _label(run, tmp_path)
    assert len(labels) == 3
    cli_ok("--project", run, "cluster", "--min-jaccard", "0.25")

    def attr(dst: sqlite3.Connection) -> None:  # a toy has none: stand-in rows
        dst.executescript(attributions.SCHEMA)
        dst.execute("INSERT INTO attr_inputs VALUES ('linear1', 0, 0, 0.5)")
        dst.executemany("INSERT INTO attr_meta VALUES (?, ?)",
                        [("components", json.dumps(7)), ("top", json.dumps(3))])  # fmt: skip

    db.amend(path, attr, "test")
    con = db.open_readonly(path)
    want = con.execute("SELECT * FROM labels ORDER BY rowid").fetchall()
    con.close()

    r = cli_ok("--project", run, *HV, "--fresh")  # the same options: --fresh harvests again
    lines = _lines(r)
    assert len(lines) == 3, lines
    assert lines[1] == (
        "kept the 3 labels of the harvest.db it replaces (the same decomposition: train "
        f"checkpoint 10 of run {state(run, 'train')['run_id']})"
    ), lines
    assert lines[2] == (
        "dropped the clusters and attributions of the harvest.db it replaces (computed from its "
        "statistics): run `pdctl cluster --min-jaccard 0.25 --min-count 1 --max-components "
        "8192` and `pdctl attributions --components 7 --top 3` again"
    ), lines
    con = db.open_readonly(path)
    assert con.execute("SELECT * FROM labels ORDER BY rowid").fetchall() == want
    con.close()
    assert harvest_labels(run) == labels
    assert _tables(path) == {*db.HARVEST_TABLES, "labels"}  # no clusters, no attr_*
    # everything else is what a harvest into an empty directory writes
    assert [x for x in _dump(path) if 'INSERT INTO "labels"' not in x] == fresh
    assert sorted(p.name for p in (run / "harvest").iterdir()) == ["harvest.db"]  # no file

    r = cli_ok("--project", run, *HV, "--fresh")  # again: still kept, nothing derived to drop
    assert len(_lines(r)) == 2 and _lines(r)[1].startswith("kept the 3 labels"), r.stdout
    assert harvest_labels(run) == labels


def test_a_harvest_after_more_training_saves_the_labels_beside_it(
    trained_copy: Path, tmp_path: Path
):
    """Another checkpoint is another decomposition: its components are not the labelled ones,
    so the labels are not carried; they are saved beside the database first, in a file that
    `pdctl interp import` reads back, and one line says where and why."""
    run, path = trained_copy, trained_copy / "harvest" / "harvest.db"
    cli_ok("--project", run, "train", "--fresh", "--until", "5")
    rid = state(run, "train")["run_id"]
    cli_ok("--project", run, *HV)
    labels = _label(run, tmp_path)
    cli_ok("--project", run, "train", "--resume")
    assert state(run, "train")["checkpoint"] == 10
    r = cli_ok("--project", run, *HV)
    saved = run / "harvest" / f"labels-train-5-{rid}.jsonl"
    assert _lines(r)[1:] == [
        f"did not keep the 3 labels of the harvest.db it replaces: they describe train "
        f"checkpoint 5 of run {rid}, this harvest train checkpoint 10 of run {rid}; saved to "
        f"{saved} (`pdctl interp import` reads it)"
    ], r.stdout
    assert "labels" not in _tables(path)
    cli_ok("--project", run, "interp", "import", saved)
    assert harvest_labels(run) == labels  # every row and field, back


def _old_db(tmp_path: Path, meta: dict, labels: dict | None = None) -> Path:
    """The closed-form harvest (sites a: 3, b: 2) at tmp_path/harvest/harvest.db, from the
    host reference accumulator (no compile)."""
    from pdctl.harvest import reference

    path = tmp_path / "harvest" / "harvest.db"
    path.parent.mkdir(exist_ok=True)
    h = reference.Harvest({"a": 3, "b": 2}, 0.1, top_k=3, n_samples=2, window=1, vocab=VOCAB)
    h.add(closed_form_ci(TOKENS), TOKENS, start=0)
    db.write(path, h, meta)
    if labels:
        db.replace_labels(path, labels)
    return path


LAB = {("a", 0): {"label": "zero", "reasoning": None, "confidence": 0.5, "detection": None,
                  "fuzzing": None, "source": "me"},
       ("a", 2): {"label": "two", "reasoning": "r", "confidence": None, "detection": 0.25,
                  "fuzzing": 1.0, "source": None}}  # fmt: skip
SAME = {"run_id": "r1", "stage": "train", "step": 5}


def test_what_a_harvest_keeps_of_a_closed_form_database(tmp_path: Path):
    from pdctl.harvest import keep

    path = tmp_path / "harvest" / "harvest.db"
    assert keep.keep(path, SAME, {"a": 3, "b": 2}) == keep.Kept({}, [])  # nothing there
    _old_db(tmp_path, SAME)
    assert keep.keep(path, SAME, {"a": 3, "b": 2}) == keep.Kept({}, [])  # nothing added to it
    _old_db(tmp_path, SAME, LAB)
    got = keep.keep(path, SAME, {"a": 3, "b": 2})
    assert got.labels == LAB and got.lines[0].startswith("kept the 2 labels")
    # a component the new harvest lacks: the others are carried, all of them saved
    got = keep.keep(path, SAME, {"a": 2, "b": 2})
    assert got.labels == {("a", 0): LAB[("a", 0)]}
    saved = path.parent / "labels-train-5-r1.jsonl"
    assert got.lines == [
        f"kept 1 of the 2 labels of the harvest.db it replaces; 1 name components this harvest "
        f"does not have: all 2 saved to {saved}"
    ]
    from pdctl.interp import labels as lb

    assert lb.parse(saved, {"a": 3, "b": 2}) == LAB  # what `pdctl interp import` reads
    # an unknown run is another run; a name taken by other labels is not overwritten
    _old_db(tmp_path, {**SAME, "run_id": None}, {("b", 1): LAB[("a", 0)]})
    none = path.parent / "labels-train-5-None.jsonl"
    none.write_text("mine\n")
    got = keep.keep(path, SAME, {"a": 3, "b": 2})
    assert got.labels == {} and "did not keep the 1 labels" in got.lines[0], got.lines
    assert none.read_text() == "mine\n"
    assert lb.parse(none.with_name("labels-train-5-None-2.jsonl"), {"a": 3, "b": 2}) == {
        ("b", 1): LAB[("a", 0)]
    }
    # saving the same labels again (a harvest that failed after saving them) reuses the file
    keep.keep(path, SAME, {"a": 3, "b": 2})
    assert not none.with_name("labels-train-5-None-3.jsonl").exists()
    # the old database's meta in the file's name: only letters, digits, _ and .
    _old_db(tmp_path, {**SAME, "stage": "../../x"}, LAB)
    assert "did not keep the 2 labels" in keep.keep(path, SAME, {"a": 3, "b": 2}).lines[0]
    assert (path.parent / "labels-.._.._x-5-r1.jsonl").is_file()


PAYLOAD = "<img src=x onerror=\"document.title='pwned'\">"


def _hostile(run: Path) -> None:
    """Values a hostile harvest.db could hold, in columns declared INTEGER and in meta."""
    import json

    con = sqlite3.connect(run / "harvest" / "harvest.db")
    con.execute("UPDATE sites SET C = ? WHERE site = 'a'", (PAYLOAD,))
    con.execute("UPDATE meta SET value = ? WHERE key IN ('step', 'kind')", (json.dumps(PAYLOAD),))
    con.execute("UPDATE components SET count = ? WHERE site = 'a'", (PAYLOAD,))
    con.execute("UPDATE cooc SET count = ? WHERE site = 'a'", (PAYLOAD,))
    con.commit()
    con.close()


@pytest.mark.slow  # headless Chromium: ~6 s
def test_browse_escapes_a_hostile_database_in_headless_chromium(tmp_path: Path):
    # item 4: an <img onerror> in sites.C, meta.step or components.count ran on #/
    import time

    from test_report import need_chromium

    from pdctl.testing.browser import Browser

    need_chromium()
    run = _closed_form_run(tmp_path)
    _hostile(run)
    browser = Browser(tmp_path / "profile")

    js = browser.js

    try:
        with _serving(run) as base:
            browser.load(f"{base}/", settle_s=0.1)
            for route in ("#/", "#/site/a", "#/c/a/0"):
                js(f"location.hash = '{route}'")  # a hash change: no new load event
                deadline = time.monotonic() + 20
                while js("document.body.dataset.ready") != route:
                    assert time.monotonic() < deadline, (route, js("document.body.innerHTML"))
                    time.sleep(0.05)
                time.sleep(0.2)  # an <img src=x> would have failed to load by now
                assert js("document.querySelectorAll('main img').length") == 0, route
                assert js("document.title") == "pdctl browse", route  # no script ran
                assert PAYLOAD in js("document.getElementById('main').textContent"), route
    finally:
        browser.close()


def _api_tour(base: str) -> None:
    for path in ("/", "/static/app.js", "/api/overview", "/api/components?site=a",
                 "/api/component/a/0", "/api/search?q=%232", "/api/search?q=x",
                 "/api/like/a/0"):  # fmt: skip
        assert _get(base + path)[0] == 200, path


def test_browse_writes_nothing_in_the_run_directory(tmp_path: Path):
    # item 5: harvest.db-wal / -shm were left after a few requests, and when
    # refusing a bad port or host. A database written WAL (by pdctl before this) is the case.
    from helpers import free_port

    run = _closed_form_run(tmp_path)
    con = sqlite3.connect(run / "harvest" / "harvest.db")
    assert con.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    con.close()
    before = _tree(run)
    with _serving(run) as base:
        _api_tour(base)
        port = int(base.rsplit(":", 1)[1])
        cli_fails(2, "--project", run, "browse", "--port", str(port))
    cli_fails(2, "--project", run, "browse", "--host", "no such host", "--port", str(free_port()))
    assert _tree(run) == before


@pytest.mark.slow  # a pdctl browse process (imports JAX for the token decoder): ~6 s
def test_browse_serves_a_read_only_run_directory(tmp_path: Path):
    # item 6: a run directory the user cannot write was not served
    import os
    import shutil
    import subprocess
    import time

    from helpers import free_port, pdctl_argv, pdctl_env

    run = _closed_form_run(tmp_path)
    con = sqlite3.connect(run / "harvest" / "harvest.db")
    con.execute("PRAGMA journal_mode=WAL")  # the harder case: SQLite wants a -shm beside it
    con.close()
    before = _tree(run)
    port = free_port()
    cmd = pdctl_argv("browse", "--port", port, project=run)
    if os.geteuid() != 0:
        run.chmod(0o555)
        (run / "harvest").chmod(0o555)
    elif shutil.which("unshare"):  # root ignores modes: a read-only bind mount
        script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
        cmd = ["unshare", "-m", "sh", "-c", script, str(run), *cmd]
    else:
        pytest.skip("root without unshare: cannot make a read-only directory")
    proc = subprocess.Popen(cmd, env=pdctl_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, _ = _get(f"http://127.0.0.1:{port}/api/overview")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    _, err = proc.communicate(timeout=10)
                    if "mount:" in err or "unshare:" in err:
                        pytest.skip(f"no private read-only mount here: {err.strip()[:200]}")
                    pytest.fail(f"browse did not serve (exit {proc.returncode}): {err}")
                time.sleep(0.2)
        assert status == 200
        _api_tour(f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(10)
        if os.geteuid() != 0:
            (run / "harvest").chmod(0o755)
            run.chmod(0o755)
    assert _tree(run) == before


def test_browse_answers_hostile_queries_and_databases_with_a_4xx_at_once(tmp_path: Path):
    # item 13: a huge offset gave a 500, a database of `meta` only 500s, and
    # meta.vocab = 2e9 held the server in /api/search for > 15 s
    import json
    import time

    run = _closed_form_run(tmp_path)
    path = run / "harvest" / "harvest.db"
    with _serving(run) as base:
        for query, code in [("/api/components?offset=99999999999999999999", 400),
                            ("/api/components?offset=-1", 400),
                            ("/api/component/a/99999999999999999999", 400),
                            ("/api/like/a/99999999999999999999", 400),
                            ("/api/search?q=%2399999999999999999999999", 200)]:  # fmt: skip
            status, body = _get(base + query)
            assert status == code, (query, status, body)
            assert "detail" in json.loads(body) if code != 200 else True
        con = sqlite3.connect(path)
        con.execute("UPDATE meta SET value = '2e9' WHERE key = 'vocab'")
        con.commit()
        t0 = time.monotonic()
        status, body = _get(base + "/api/search?q=x")
        assert status == 422 and b"meta.vocab" in body, body
        assert time.monotonic() - t0 < 1
        con.execute("UPDATE meta SET value = 'not json' WHERE key = 'stage'")
        con.commit()
        assert _get(base + "/api/overview")[0] == 422
        for table in db.TABLES[1:]:  # a database holding only meta, swapped in while serving
            con.execute(f"DROP TABLE {table}")
        con.commit()
        con.close()
        for query in ("/api/overview", "/api/components", "/api/component/a/0",
                      "/api/search?q=%232", "/api/like/a/0"):  # fmt: skip
            status, body = _get(base + query)
            assert status == 422 and b"no table" in body, (query, status, body)
    line = cli_fails(2, "--project", run, "browse")  # and refused up front
    assert f"{path}: not a pdctl harvest database (no table components, " in line, line


def test_browse_host_that_is_not_an_address_is_one_line(tmp_path: Path):
    from helpers import free_port

    run = _closed_form_run(tmp_path)
    port = free_port()
    line = cli_fails(2, "--project", run, "browse", "--host", "not a host", "--port", str(port))
    assert line.startswith("error: --host: 'not a host' is not an address to listen on"), line
    line = cli_fails(2, "--project", run, "browse", "--host", "192.0.2.1", "--port", str(port))
    assert line.startswith("error: --host: '192.0.2.1' is not an address of this machine"), line


@pytest.mark.slow  # a tiny Llama through its stages, four harvests: ~20 s
def test_an_lm_harvest_leaves_out_each_sequences_first_position(tmp_path: Path):
    """Sequences are cut from the joined corpus, so a sequence's first token has no context
    (and on SmolLM2 most components' highest CI was there): by default a harvest leaves each
    sequence's first position out of every statistic and example, `--skip-first N` sets how
    many (0: all), and the option is part of what makes two harvests the same."""
    run = make_run(tmp_path, "llama-mlp", "lm", pretrain={"steps": 2, "log_every": 1},
                   warmup={"steps": 2, "log_every": 1})  # fmt: skip
    for stage in ("init-weights", "pretrain", "warmup"):
        cli_ok("--project", run, stage)
    import tomllib

    T = tomllib.loads((run / "pdctl.toml").read_text())["data"]["seq_len"]
    args = ("--project", run, "harvest", "--stage", "warmup", "--tokens", str(8 * T),
            "--top-k", "4", "--effects", "0")  # fmt: skip
    path = run / "harvest" / "harvest.db"

    def read() -> tuple[dict, list[int]]:
        meta = db.read_meta(path)
        con = db.open_readonly(path)
        pos = [r[0] for r in con.execute("SELECT position FROM examples")]
        con.close()
        return meta, pos

    out = cli_ok(*args).stdout
    meta, pos = read()
    assert out.startswith(f"harvested {8 * (T - 1)} positions"), out
    assert meta["n_positions"] == 8 * (T - 1) and meta["options"]["skip_first"] == 1
    assert pos and all(p % T != 0 for p in pos)
    assert "already complete" in cli_ok(*args).stdout  # the same options: nothing to do
    out = cli_ok(*args, "--skip-first", "0").stdout  # another harvest: all positions
    meta, pos = read()
    assert out.startswith(f"harvested {8 * T} positions"), out
    assert meta["options"]["skip_first"] == 0 and any(p % T == 0 for p in pos)
    cli_ok(*args, "--skip-first", "3")
    meta, pos = read()
    assert meta["n_positions"] == 8 * (T - 3) and all(p % T >= 3 for p in pos)
    # attributions find each example's sequence among the 8 harvested (positions b * T + t)
    cli_ok("--project", run, "attributions", "--components", "2", "--top", "2")
    line = cli_fails(2, *args, "--skip-first", str(T))
    assert line == (f"error: --skip-first: {T} leaves nothing of a sequence of {T} tokens "
                    "(data.seq_len)"), line  # fmt: skip
