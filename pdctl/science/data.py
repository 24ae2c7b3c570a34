"""Text data for the LM target: a seeded synthetic corpus, byte files, and a resumable grain
pipeline of (seq_len + 1)-token windows split across processes.

Host side only (numpy + grain): batches are numpy arrays that the training loop puts on devices.
"""

import bisect
import json
from pathlib import Path
from typing import Any

import grain
import numpy as np

# The synthetic grammar. Nouns and verbs come in singular/plural pairs so that a model has an
# agreement to learn between a subject and its verb several bytes later; word lists are drawn
# with Zipf-like weights so that frequent and rare words both occur.
_NAMES = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Ivy", "Jo", "Kai"]
_DETS = ["the", "a", "this", "that", "every", "my", "our", "your"]
_PLURAL_DETS = ["the", "some", "these", "those", "many", "few", "my", "our"]
_ADJS = ["small", "red", "old", "quiet", "bright", "cold", "tall", "green", "slow", "happy"]
_NOUNS = [
    ("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("tree", "trees"), ("river", "rivers"),
    ("house", "houses"), ("child", "children"), ("stone", "stones"), ("ship", "ships"),
    ("cloud", "clouds"), ("king", "kings"), ("box", "boxes"),
]  # fmt: skip
_TRANSITIVE = [
    ("sees", "see"), ("finds", "find"), ("likes", "like"), ("moves", "move"), ("paints", "paint"),
    ("follows", "follow"), ("carries", "carry"), ("watches", "watch"),
]  # fmt: skip
_INTRANSITIVE = [
    ("sleeps", "sleep"), ("runs", "run"), ("sings", "sing"), ("waits", "wait"),
    ("falls", "fall"), ("shines", "shine"),
]  # fmt: skip
_ADVERBS = ["slowly", "quickly", "again", "today", "softly", "often"]
_PREPS = ["near", "under", "behind", "over", "beside", "past"]
_CONJ = ["and", "but", "so", "while", "because"]


class _Grammar:
    """Samples paragraphs. Word choices bisect precomputed cumulative Zipf weights with one
    uniform draw each: a per-word `Generator.choice(p=...)` call costs far more than the word."""

    def __init__(self, seed: int):
        self._rng = np.random.default_rng(seed)
        self._cum: dict[int, list[float]] = {}

    def _index(self, n: int) -> int:
        if n not in self._cum:
            weights = 1.0 / np.arange(1, n + 1)
            self._cum[n] = list(np.cumsum(weights) / weights.sum())
        return min(bisect.bisect_right(self._cum[n], self._rng.random()), n - 1)

    def pick(self, items: list) -> Any:
        return items[self._index(len(items))]

    def chance(self, p: float) -> bool:
        return self._rng.random() < p

    def noun_phrase(self) -> tuple[str, bool]:
        """A subject/object phrase and whether it is plural."""
        if self.chance(0.2):
            return self.pick(_NAMES), False
        plural = self.chance(0.35)
        words = [self.pick(_PLURAL_DETS if plural else _DETS)]
        u = self._rng.random()
        words += [self.pick(_ADJS) for _ in range(0 if u < 0.55 else 1 if u < 0.9 else 2)]
        words.append(self.pick(_NOUNS)[int(plural)])
        return " ".join(words), plural

    def clause(self) -> str:
        subject, plural = self.noun_phrase()
        if self.chance(0.6):
            words = [subject, self.pick(_TRANSITIVE)[int(plural)], self.noun_phrase()[0]]
        else:
            words = [subject, self.pick(_INTRANSITIVE)[int(plural)]]
        if self.chance(0.3):
            words.append(self.pick(_ADVERBS))
        if self.chance(0.3):
            words += [self.pick(_PREPS), self.noun_phrase()[0]]
        return " ".join(words)

    def sentence(self) -> str:
        text = self.clause()
        if self.chance(0.25):
            text += ", " + self.pick(_CONJ) + " " + self.clause()
        u = self._rng.random()
        end = "." if u < 0.8 else "!" if u < 0.9 else "?"
        return text[0].upper() + text[1:] + end

    def paragraph(self) -> str:
        n = 1 + self._index(5)
        return " ".join(self.sentence() for _ in range(n)) + ("\n\n" if self.chance(0.2) else "\n")


def synthetic_corpus(seed: int, n_bytes: int) -> np.ndarray:
    """`n_bytes` of ASCII text (uint8) from a small probabilistic grammar, deterministic in `seed`.

    Sentences of determiners, adjectives, nouns and number-agreeing verbs, with clauses joined
    by conjunctions, sentence punctuation, and paragraphs separated by newlines: enough structure
    for a small byte-level LM to learn well below the unigram entropy.
    """
    grammar = _Grammar(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        parts.append(grammar.paragraph())
        size += len(parts[-1])
    return np.frombuffer("".join(parts).encode("ascii"), dtype=np.uint8)[:n_bytes].copy()


def load_text(path: str | Path, seq_len: int | None = None) -> np.ndarray:
    """The bytes of the file at `path` as uint8 tokens.

    Raises ValueError when the file cannot fill one window of `seq_len + 1` tokens (or is empty
    when no `seq_len` is given), so the caller can report it as a user error.
    """
    tokens = np.fromfile(Path(path), dtype=np.uint8)
    need = 1 if seq_len is None else seq_len + 1
    if tokens.size < need:
        raise ValueError(
            f"{path}: {tokens.size} bytes of text, need at least {need}"
            + ("" if seq_len is None else f" (one sequence of seq_len={seq_len} plus 1)")
        )
    return tokens


class _LocalWindows:
    """Global batch of window indices -> this process's slice of the windows, as a batch dict.

    Every process shuffles and batches the same cheap index stream, so the global batch is the
    same everywhere; each then reads only its own `batch_size // process_count` windows.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, start: int, stop: int):
        n_windows = tokens.size // (seq_len + 1)
        self._windows = tokens[: n_windows * (seq_len + 1)].reshape(n_windows, seq_len + 1)
        self._start, self._stop = start, stop

    def __call__(self, index_batch: np.ndarray) -> dict[str, np.ndarray]:
        local = index_batch[self._start : self._stop]
        return {"tokens": self._windows[local].astype(np.int32)}


def make_text_dataset(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """An infinite MapDataset of batches {"tokens": int32 (batch_size // process_count,
    seq_len + 1)}: non-overlapping windows, shuffled afresh each epoch from `seed`.

    Batches run straight across epoch boundaries (repeat before batch), so no window is dropped
    and the stream is a pure function of (tokens, seq_len, batch_size, seed).
    """
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
    if batch_size % process_count:
        raise ValueError(f"batch_size {batch_size} is not divisible by {process_count} processes")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    n_windows = np.asarray(tokens).size // (seq_len + 1)
    if n_windows < 1:
        raise ValueError(
            f"{np.asarray(tokens).size} tokens cannot fill one sequence of {seq_len + 1} tokens"
        )
    local = batch_size // process_count
    fetch = _LocalWindows(
        np.asarray(tokens), seq_len, process_index * local, (process_index + 1) * local
    )
    return (
        grain.MapDataset.range(n_windows)
        .shuffle(seed=seed)
        .repeat()
        .batch(batch_size, batch_fn=np.asarray)
        .map(fetch)
    )


def make_text_iterator(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    prefetch: int = 8,
) -> grain.DatasetIterator:
    """An iterator over `make_text_dataset(...)` with `get_state()` / `set_state()`.

    The state is a small dict of ints (JSON-serialisable; see `state_to_json`); setting it on a
    fresh iterator built with the same arguments continues with exactly the next unseen batch.
    `prefetch` batches are prepared ahead on background threads.
    """
    ds = make_text_dataset(tokens, seq_len, batch_size, seed, process_index, process_count)
    read_options = grain.ReadOptions(num_threads=min(prefetch, 4), prefetch_buffer_size=prefetch)
    return iter(ds.to_iter_dataset(read_options))


def state_to_json(state: dict[str, Any]) -> str:
    return json.dumps(state, sort_keys=True)


def state_from_json(text: str) -> dict[str, Any]:
    return json.loads(text)
