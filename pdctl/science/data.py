"""Text data for the LM targets: a seeded synthetic corpus, byte files, real text tokenized with
a Hugging Face `tokenizer.json`, and a resumable grain pipeline of (seq_len + 1)-token windows
split across processes.

Host side only (numpy + grain): batches are numpy arrays that the training loop puts on devices.
"""

import bisect
import dataclasses
import hashlib
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grain
import numpy as np

from pdctl.errors import first_line
from pdctl.files import atomic_output

log = logging.getLogger(__name__)

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


# Real text: documents in .txt / .jsonl / .parquet files, tokenized with a Hugging Face
# tokenizer.json and packed into one int32 stream with an EOS token after every document.

CORPUS_SUFFIXES = (".txt", ".jsonl", ".parquet")
# Tried in order when neither the caller nor the files beside tokenizer.json name an EOS token:
# the end-of-document tokens of GPT-2 and Qwen, Llama 1-2 and Mistral, Llama 3, Gemma, ChatML.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")
# One encode_batch call gets this many documents or characters, whichever comes first: enough to
# keep the tokenizer's threads busy, little enough that the Python id lists stay small.
_ENCODE_DOCS = 1024
_ENCODE_CHARS = 8 << 20
_PARQUET_ROWS = 4096  # rows per record batch read from a parquet file: bounds the text in memory
_CACHE_VERSION = 2  # part of the cache key: bump it when the packing rule below changes
_SPLIT_SEED = 20_240_611  # the held-out documents' draw: fixed, so every run splits alike
SPLITS = ("train", "eval")


def corpus_files(path: str | Path, plain: bool = False) -> list[Path]:
    """The corpus files at `path`: the file itself (a .txt, .jsonl or .parquet), or every such
    file under the directory, at any depth, in path order. With `plain` (a document separator
    is set), files without a suffix are text files too (Unix fortune files are). Other files,
    symlinks inside a directory, and anything under a hidden name (a part starting with ".")
    are ignored; finding none is a ValueError."""
    path = Path(path).expanduser()
    suffixes = (*CORPUS_SUFFIXES, "") if plain else CORPUS_SUFFIXES
    if path.is_file():
        if path.suffix.lower() not in suffixes:
            raise ValueError(f"{path}: not a .txt, .jsonl or .parquet file")
        return [path]
    if not path.is_dir():
        raise ValueError(f"{path}: no such file or directory")
    files = [
        p
        for p in path.rglob("*")
        if p.suffix.lower() in suffixes
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
        and p.is_file()
        and not (plain and p.is_symlink())
    ]
    if not files:
        raise ValueError(f"{path}: no .txt, .jsonl or .parquet files in this directory")
    return sorted(files, key=lambda p: p.relative_to(path).parts)


def _txt_documents(file: Path, separator: str = "") -> Iterator[str]:
    """A text file as one document, or with `separator` split at every line that holds only
    the separator (fortune files: `%`)."""
    try:
        text = file.read_bytes().decode("utf-8-sig")  # a leading byte-order mark is not text
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text (bad byte at offset {e.start})") from None
    if not separator:
        yield text
        return
    line = re.compile(rf"^[ \t]*{re.escape(separator)}[ \t]*\r?$\n?", re.MULTILINE)
    for doc in line.split(text):
        yield doc.strip("\r\n")


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "an array" if isinstance(value, list) else "an object"


def _jsonl_documents(file: Path, field: str) -> Iterator[str]:
    # Binary lines split on b"\n" only, so line numbers match an editor's; blank lines are skipped.
    with open(file, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            if number == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")
            if not line.strip():
                continue
            where = f"{file}:{number}"
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise ValueError(f"{where}: not valid JSON ({first_line(e)})") from None
            if not isinstance(record, dict):
                kind = _json_kind(record)
                raise ValueError(f"{where}: expected an object with field {field!r}, got {kind}")
            if field not in record:
                raise ValueError(f"{where}: no field {field!r}")
            text = record[field]
            if not isinstance(text, str):
                raise ValueError(
                    f"{where}: field {field!r} is {_json_kind(text)}, expected a string"
                )
            yield text


def _parquet_documents(file: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(file)
        schema = reader.schema_arrow
        if field not in schema.names:
            raise ValueError(f"{file}: no column {field!r} (columns: {', '.join(schema.names)})")
        kind = schema.field(field).type
        is_view = getattr(pa.types, "is_string_view", lambda _: False)
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)):
            raise ValueError(f"{file}: column {field!r} has type {kind}, expected strings")
        row = 0
        # Record batches stream through the row groups, so memory holds one batch of text.
        for batch in reader.iter_batches(batch_size=_PARQUET_ROWS, columns=[field]):
            for text in batch.column(0).to_pylist():
                if text is None:
                    where = f"{file}: row {row} (from 0)"
                    raise ValueError(f"{where}: {field!r} is null, expected a string")
                yield text
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{file}: cannot read parquet ({first_line(e)})") from None


def _documents(files: list[Path], field: str, separator: str = "") -> Iterator[str]:
    for file in files:
        suffix = file.suffix.lower()
        if suffix in (".txt", ""):
            yield from _txt_documents(file, separator)
        elif suffix == ".jsonl":
            yield from _jsonl_documents(file, field)
        else:
            yield from _parquet_documents(file, field)


def _tokenizer_file(tokenizer_path: str | Path) -> Path:
    file = Path(tokenizer_path).expanduser()
    if not file.exists():
        raise ValueError(f"{file}: no such tokenizer.json or model folder")
    if file.is_dir():
        file = file / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"{file}: no such file")
    return file


def _is_gguf(file: Path) -> bool:
    return file.suffix.lower() == ".gguf"


def _load_tokenizer(file: Path):
    if _is_gguf(file):
        from pdctl.science.gguf_tokenizer import load_gguf_tokenizer

        tokenizer = load_gguf_tokenizer(file).tokenizer
    else:
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{file}: not a readable tokenizer.json ({first_line(e)})") from None
    # A tokenizer.json saved with truncation or padding on would cut or pad every document;
    # transformers switches both off for a plain `tokenizer(text)` call, and so do we.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


@dataclasses.dataclass(frozen=True)
class CorpusTokenizer:
    """The tokenizer a corpus is encoded with, the id put after every document, and a digest
    of the tokenizer's content (the token cache's key)."""

    tokenizer: Any
    eos_id: int
    vocab_size: int  # with added tokens
    digest: str
    where: str  # the tokenizer.json or GGUF file, for messages


def corpus_tokenizer(tokenizer_path: str | Path, eos_id: int | None = None) -> CorpusTokenizer:
    """A tokenizer.json (or the model folder holding one) or a GGUF file's tokenizer, with its
    EOS id: `eos_id` if given (checked to be one of its ids), else `find_eos_id`'s."""
    file = _tokenizer_file(tokenizer_path)
    if _is_gguf(file):
        from pdctl.science.gguf_tokenizer import load_gguf_tokenizer

        gguf = load_gguf_tokenizer(file)
        tokenizer = gguf.tokenizer
        tokenizer.no_truncation()
        tokenizer.no_padding()
        digest = gguf.digest
        if eos_id is None:
            if gguf.eos_id is None:
                raise ValueError(f"{file}: no tokenizer.ggml.eos_token_id; give eos_id explicitly")
            eos_id = gguf.eos_id
    else:
        tokenizer = _load_tokenizer(file)
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        if eos_id is None:
            eos_id = _find_eos_id(file, tokenizer)
    eos_id = _checked_eos(eos_id, tokenizer, str(file))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    return CorpusTokenizer(tokenizer, eos_id, size, digest, str(file))


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_bytes())
    except ValueError as e:
        raise ValueError(f"{file}: not valid JSON ({first_line(e)})") from None
    return value if isinstance(value, dict) else {}


def _checked_eos(eos_id: int, tokenizer, where: str) -> int:
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if (
        isinstance(eos_id, bool)
        or not isinstance(eos_id, int | np.integer)
        or not (0 <= eos_id < size)
    ):
        raise ValueError(
            f"{where}: eos_id {eos_id!r} is not a token id of a {size}-token vocabulary"
        )
    return int(eos_id)


def _find_eos_id(file: Path, tokenizer) -> int:
    folder = file.parent
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        token = _read_json(folder / name).get("eos_token")
        if isinstance(token, dict):  # a serialised AddedToken
            token = token.get("content")
        if isinstance(token, str) and token:
            eos_id = tokenizer.token_to_id(token)
            if eos_id is None:
                raise ValueError(f"{folder / name}: eos_token {token!r} is not in {file}")
            return eos_id
    for name in ("generation_config.json", "config.json"):
        eos_id = _read_json(folder / name).get("eos_token_id")
        if isinstance(eos_id, list) and eos_id:  # several stop tokens: the first is the EOS
            eos_id = eos_id[0]
        if isinstance(eos_id, int) and not isinstance(eos_id, bool):
            return _checked_eos(eos_id, tokenizer, str(folder / name))
    for token in _EOS_CANDIDATES:
        eos_id = tokenizer.token_to_id(token)
        if eos_id is not None:
            return eos_id
    raise ValueError(
        f"{file}: no EOS token found (no eos_token beside it, none of "
        f"{' '.join(_EOS_CANDIDATES)} in its vocabulary); give eos_id explicitly"
    )


def find_eos_id(tokenizer_path: str | Path) -> int:
    """The id that `load_corpus` puts after every document when no `eos_id` is given.

    `tokenizer_path` is a tokenizer.json or the folder holding it. Looked up in order: `eos_token`
    in tokenizer_config.json, then in special_tokens_map.json, then `eos_token_id` in
    generation_config.json, then in config.json (the first of a list), all beside the
    tokenizer.json; failing those, the first of <|endoftext|>, </s>, <|end_of_text|>, <eos>,
    <|im_end|>, <|eot_id|> in the vocabulary. None found is a ValueError.
    """
    return corpus_tokenizer(tokenizer_path).eos_id


def _encode(tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    ids: list[int] = []
    # add_special_tokens=True applies the tokenizer's own post-processor, as transformers'
    # `tokenizer(text)` does: a template that adds BOS keeps adding it, one without adds nothing.
    for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=True):
        doc = encoding.ids
        ids.extend(doc)
        if not doc or doc[-1] != eos_id:  # a template that already ends documents with EOS
            ids.append(eos_id)
    return np.array(ids, dtype=np.int32)


def held_out(n: int, fraction: float) -> np.ndarray:
    """Which of the first `n` documents are held out for evaluation at `fraction`: a fixed
    seeded draw per document index, so the split is the same for every run, seed and process,
    and a corpus that grows keeps its earlier documents on the same side."""
    return np.random.default_rng(_SPLIT_SEED).random(n) < fraction


def _tokenize(
    files: list[Path],
    tokenizer,
    field: str,
    eos_id: int,
    split: tuple[str, float] | None = None,
    separator: str = "",
) -> tuple[list, int]:
    """The packed stream in chunks, and how many documents it holds. With `split` = (side,
    fraction), only the documents `held_out` puts on that side ("eval" or "train")."""
    chunks: list[np.ndarray | None] = []
    batch: list[str] = []
    chars = n_docs = 0
    rng = np.random.default_rng(_SPLIT_SEED)
    for text in _documents(files, field, separator):
        # One draw per document, empty ones included, so indices match `held_out`.
        if split is not None and (rng.random() < split[1]) != (split[0] == "eval"):
            continue
        if not text:
            continue
        batch.append(text)
        chars += len(text)
        n_docs += 1
        if len(batch) >= _ENCODE_DOCS or chars >= _ENCODE_CHARS:
            chunks.append(_encode(tokenizer, batch, eos_id))
            batch, chars = [], 0
    if batch:
        chunks.append(_encode(tokenizer, batch, eos_id))
    return chunks, n_docs


def _fill(out: np.ndarray, chunks: list) -> None:
    """Copy the chunks into `out` one after another, dropping each once copied, so the stream
    is held about once rather than twice."""
    offset = 0
    for i, chunk in enumerate(chunks):
        out[offset : offset + chunk.size] = chunk
        offset += chunk.size
        chunks[i] = None


def _cache_key(
    files: list[Path],
    tok: CorpusTokenizer,
    field: str,
    split: tuple[str, float] | None,
    separator: str = "",
) -> str:
    """The token cache's key: the corpus files' bytes (hashed, not their sizes and mtimes: an
    edit that keeps both still misses), the tokenizer's content, the field, EOS and split."""
    import tokenizers

    from pdctl.science.targets.checksum import content_digest

    key = {
        "version": _CACHE_VERSION,
        "tokenizers": tokenizers.__version__,
        "tokenizer_sha256": tok.digest,
        "text_field": field,
        "eos_id": tok.eos_id,
        "split": list(split) if split else None,
        "separator": separator,
        "files": [str(f.resolve()) for f in files],
        "content": content_digest(files),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _read_cache(file: Path, vocab_size: int, eos_id: int) -> np.ndarray | None:
    """The cached stream, or None when it is missing or not what this key writes: a cache
    file is checked, not trusted (ids inside the vocabulary, the stream ending with EOS)."""
    try:
        tokens = np.load(file, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable token cache %s (%s)", file, first_line(e))
        return None
    if tokens.dtype != np.int32 or tokens.ndim != 1 or tokens.size == 0:
        log.warning("ignoring token cache %s: %s %s", file, tokens.dtype, tokens.shape)
        return None
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size or int(tokens[-1]) != eos_id:
        msg = "ignoring token cache %s: ids in [%d, %d] for a %d-token vocabulary, last %d"
        log.warning(msg + " (EOS %d)", file, lo, hi, vocab_size, int(tokens[-1]), eos_id)
        return None
    return np.asarray(tokens)


def _starts_right(
    tokens: np.ndarray,
    files: list[Path],
    tok: CorpusTokenizer,
    field: str,
    cut: tuple[str, float] | None,
    separator: str,
    n_docs: int = 2,
) -> bool:
    """Whether a cached stream begins with the first `n_docs` documents of the corpus encoded
    afresh: a spot check that a cache file found under the right key holds these documents'
    ids (a file put there by hand with other ids fails it), for the price of encoding two."""
    first: list[str] = []
    rng = np.random.default_rng(_SPLIT_SEED)
    for text in _documents(files, field, separator):
        if cut is not None and (rng.random() < cut[1]) != (cut[0] == "eval"):
            continue
        if text:
            first.append(text)
        if len(first) == n_docs:
            break
    expected = _encode(tok.tokenizer, first, tok.eos_id)
    return bool(np.array_equal(tokens[: expected.size], expected))


def _write_cache(file: Path, chunks: list, n_tokens: int) -> None:
    """Write the stream as a .npy under a temporary name, fsync, then rename: a reader sees
    the whole file or none, and concurrent writers of the same key just replace each other."""
    file.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(file, suffix=".npy") as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int32, shape=(n_tokens,))
        _fill(out, chunks)
        out.flush()
        del out


def _check_length(
    tokens: np.ndarray, path: Path, seq_len: int | None, cut: tuple[str, float] | None = None
) -> np.ndarray:
    need = 1 if seq_len is None else seq_len + 1
    if tokens.size < need:
        side = "" if cut is None else f" in its {cut[0]} split (eval_fraction {cut[1]})"
        raise ValueError(
            f"{path}: {tokens.size} tokens of text{side}, need at least {need}"
            + ("" if seq_len is None else f" (one sequence of seq_len={seq_len} plus 1)")
        )
    return tokens


def load_corpus(
    path: str | Path,
    *,
    tokenizer_path: str | Path | None = None,
    text_field: str = "text",
    eos_id: int | None = None,
    cache_dir: str | Path | None = None,
    seq_len: int | None = None,
    split: str | None = None,
    eval_fraction: float = 0.0,
    separator: str = "",
) -> np.ndarray:
    """The token stream of the corpus at `path`, for `make_text_iterator`.

    Without `tokenizer_path`: the bytes of the file at `path` as uint8, exactly `load_text`.

    With `tokenizer_path` (a tokenizer.json, the model folder holding one, or a GGUF file):
    int32 ids of every document of `corpus_files(path)` in order, each followed by `eos_id`
    (default `find_eos_id(tokenizer_path)`). A .txt file is one document (UTF-8); a .jsonl file
    has one document per line in its string field `text_field` (blank lines skipped); a
    .parquet file one per row of its string column `text_field`. Empty documents are skipped.
    Each document is encoded on its own with the tokenizer's post-processor (special tokens
    only where its own template adds them, e.g. a Llama BOS), giving the ids of transformers'
    `PreTrainedTokenizerFast(tokenizer_file=...)(text)["input_ids"]`; EOS is not doubled after
    a document whose encoding already ends with it.

    With `split` ("train" or "eval") and `eval_fraction` > 0, only the documents on that side
    of `held_out(n, eval_fraction)`: whole documents, never cut, the same for every run.
    With `separator`, text files (and suffix-less files) hold many documents, split at each line
    holding only the separator.

    With `cache_dir`, the stream is kept there as `tokens-<key>.npy`, the key hashing the files'
    bytes, the tokenizer's content, `text_field`, the EOS id, the split and the tokenizers
    version; a hit (or a fresh write) comes back as a read-only memory map, after its ids are
    checked against the vocabulary.

    Every problem with the user's files is a one-line ValueError naming the file (and line or
    row), including fewer than `seq_len + 1` tokens when `seq_len` is given.
    """
    path = Path(path).expanduser()
    if tokenizer_path is None:
        if path.is_dir():
            raise ValueError(f"{path}: a directory corpus needs a tokenizer (bytes: one file)")
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
        return load_text(path, seq_len)
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    cut = (split, float(eval_fraction)) if split is not None and eval_fraction > 0 else None
    files = corpus_files(path, plain=bool(separator))
    tok = corpus_tokenizer(tokenizer_path, eos_id)
    cache = None
    if cache_dir is not None:
        # Keyed before reading, so a file edited while it is tokenized misses next time.
        key = _cache_key(files, tok, text_field, cut, separator)
        cache = Path(cache_dir).expanduser() / f"tokens-{key}.npy"
        tokens = _read_cache(cache, tok.vocab_size, tok.eos_id)
        if tokens is not None and not _starts_right(tokens, files, tok, text_field, cut, separator):
            log.warning("ignoring token cache %s: it does not start with the corpus", cache)
            tokens = None
        if tokens is not None:
            log.info("token cache hit: %s (%d tokens)", cache, tokens.size)
            return _check_length(tokens, path, seq_len, cut)
    start = time.perf_counter()
    chunks, n_docs = _tokenize(files, tok.tokenizer, text_field, tok.eos_id, cut, separator)
    n_tokens = sum(chunk.size for chunk in chunks)
    if n_tokens == 0:
        side = "" if cut is None else f" on the {cut[0]} side of eval_fraction {cut[1]}"
        raise ValueError(f"{path}: no text in {len(files)} file(s){side}")
    if cache is not None:
        _write_cache(cache, chunks, n_tokens)
        tokens = np.asarray(np.load(cache, mmap_mode="r"))
    else:
        tokens = np.empty(n_tokens, dtype=np.int32)
        _fill(tokens, chunks)
    seconds = time.perf_counter() - start
    where = "" if cache is None else f", cached as {cache}"
    msg = "tokenized %d documents in %d files: %d tokens in %.1f s%s"
    log.info(msg, n_docs, len(files), n_tokens, seconds, where)
    return _check_length(tokens, path, seq_len, cut)


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
    return iter(
        make_text_iter_dataset(
            tokens, seq_len, batch_size, seed, process_index, process_count, prefetch
        )
    )


def make_text_iter_dataset(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    prefetch: int = 8,
) -> grain.IterDataset:
    """`make_text_dataset(...)` as an IterDataset whose batches are prepared `prefetch` ahead
    on background threads."""
    ds = make_text_dataset(tokens, seq_len, batch_size, seed, process_index, process_count)
    read_options = grain.ReadOptions(num_threads=min(prefetch, 4), prefetch_buffer_size=prefetch)
    return ds.to_iter_dataset(read_options)


def state_to_json(state: dict[str, Any]) -> str:
    return json.dumps(state, sort_keys=True)


def state_from_json(text: str) -> dict[str, Any]:
    return json.loads(text)
