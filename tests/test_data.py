"""Text data: the synthetic corpus, file loading, and the resumable, process-sliced iterator."""

import json

import numpy as np
import pytest

from pdctl.science.data import (
    load_text,
    make_text_iterator,
    state_from_json,
    state_to_json,
    synthetic_corpus,
)

SEQ_LEN = 7  # windows of 8 tokens


def _tokens(n_windows: int) -> np.ndarray:
    # Token value = its position, so a window's first token names the window.
    return np.arange(n_windows * (SEQ_LEN + 1) + 3, dtype=np.int32)


def _take(it, n: int) -> list[np.ndarray]:
    return [next(it)["tokens"] for _ in range(n)]


def test_synthetic_corpus_is_seeded_text():
    a, b, c = synthetic_corpus(0, 20_000), synthetic_corpus(0, 20_000), synthetic_corpus(1, 20_000)
    assert a.dtype == np.uint8 and a.shape == (20_000,)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    text = a.tobytes().decode("ascii")
    assert set(text) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,!?\n")
    assert text.count("\n") > 50 and text.count(".") > 200
    # Structure to learn: far fewer distinct bytes than 256 and skewed frequencies.
    counts = np.bincount(a, minlength=256)
    probs = counts[counts > 0] / a.size
    assert (counts > 0).sum() < 64 and -(probs * np.log2(probs)).sum() < 5.0
    np.testing.assert_array_equal(synthetic_corpus(0, 1000), a[:1000])


def test_load_text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"hello world\n")
    np.testing.assert_array_equal(load_text(path), np.frombuffer(b"hello world\n", np.uint8))
    assert load_text(path, seq_len=11).dtype == np.uint8
    with pytest.raises(ValueError, match="seq_len=12"):
        load_text(path, seq_len=12)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="0 bytes"):
        load_text(tmp_path / "empty.txt")


def test_iterator_yields_shuffled_non_overlapping_windows():
    tokens = _tokens(10)
    it = make_text_iterator(tokens, SEQ_LEN, batch_size=4, seed=0)
    batches = _take(it, 5)  # 20 windows: two full epochs of 10
    for b in batches:
        assert b.shape == (4, SEQ_LEN + 1) and b.dtype == np.int32
    rows = np.concatenate(batches)
    starts = rows[:, 0]
    assert np.all(starts % (SEQ_LEN + 1) == 0)
    np.testing.assert_array_equal(rows, starts[:, None] + np.arange(SEQ_LEN + 1))
    epoch1, epoch2 = sorted(starts[:10]), sorted(starts[10:])
    assert epoch1 == epoch2 == list(range(0, 10 * (SEQ_LEN + 1), SEQ_LEN + 1))
    assert list(starts[:10]) != epoch1  # shuffled
    assert list(starts[:10]) != list(starts[10:])  # reshuffled each epoch
    other = make_text_iterator(tokens, SEQ_LEN, batch_size=4, seed=1)
    assert not np.array_equal(np.concatenate(_take(other, 5)), rows)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 6])
def test_resume_continues_with_the_next_batch(k):
    """Batches of 4 over 10 windows: epochs end inside batches 3 and 5 (k=2 and k=3 resume
    right around the first boundary)."""
    tokens = _tokens(10)
    expected = _take(make_text_iterator(tokens, SEQ_LEN, 4, seed=5), k + 4)
    it = make_text_iterator(tokens, SEQ_LEN, 4, seed=5)
    _take(it, k)
    saved = state_to_json(it.get_state())
    json.loads(saved)  # plain JSON
    _take(it, 2)  # the original iterator moves on; the saved state must not
    resumed = make_text_iterator(tokens, SEQ_LEN, 4, seed=5)
    resumed.set_state(state_from_json(saved))
    for want, got in zip(expected[k:], _take(resumed, 4), strict=True):
        np.testing.assert_array_equal(got, want)


def test_process_slices_partition_the_global_batch():
    tokens = _tokens(13)
    whole = _take(make_text_iterator(tokens, SEQ_LEN, 6, seed=3), 5)
    parts = [_take(make_text_iterator(tokens, SEQ_LEN, 6, seed=3, process_index=i,
                                      process_count=3), 5) for i in range(3)]  # fmt: skip
    for step, global_batch in enumerate(whole):
        slices = [p[step] for p in parts]
        assert all(s.shape == (2, SEQ_LEN + 1) for s in slices)
        np.testing.assert_array_equal(np.concatenate(slices), global_batch)
    # Resuming a process slice lands on that slice's next batch too.
    it = make_text_iterator(tokens, SEQ_LEN, 6, seed=3, process_index=1, process_count=3)
    _take(it, 2)
    resumed = make_text_iterator(tokens, SEQ_LEN, 6, seed=3, process_index=1, process_count=3)
    resumed.set_state(state_from_json(state_to_json(it.get_state())))
    np.testing.assert_array_equal(next(resumed)["tokens"], parts[1][2])


def test_iterator_rejects_bad_arguments():
    tokens = _tokens(3)
    with pytest.raises(ValueError, match="divisible"):
        make_text_iterator(tokens, SEQ_LEN, 5, seed=0, process_count=2)
    with pytest.raises(ValueError, match="process_index"):
        make_text_iterator(tokens, SEQ_LEN, 4, seed=0, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="one sequence"):
        make_text_iterator(tokens[:SEQ_LEN], SEQ_LEN, 4, seed=0)
    with pytest.raises(ValueError, match="seed"):
        make_text_iterator(tokens, SEQ_LEN, 4, seed=-1)


def test_corpus_feeds_the_iterator():
    corpus = synthetic_corpus(0, 5_000)
    batch = next(make_text_iterator(corpus, 64, 8, seed=0))["tokens"]
    assert batch.shape == (8, 65) and batch.dtype == np.int32
    assert batch.min() >= 0 and batch.max() < 128
