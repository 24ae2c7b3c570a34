"""Text data: the synthetic corpus, file loading, and the resumable, process-sliced iterator."""

import json

import numpy as np
import pytest

from pdctl.science import data
from pdctl.science.data import (
    load_corpus,
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


# --- Real text tokenized with a tokenizer.json --------------------------------------------------

MULTILINGUAL = "Grüße, 世界! naïve café — ŝ"
SENTENCES = [
    "Grüße aus Köln, sagte sie leise.",
    "世界你好，我们的世界很大！",
    "A naïve café serves crème brûlée — every day.",
    "The quick brown fox jumps over the lazy dog.",
    "Ŝi estas bela, ĉu ne? Ĝi estas ĉiam tiel.",
]
EOS = "<|endoftext|>"


def _train_tokenizer(folder, vocab_size=320, template=None):
    """A byte-level BPE tokenizer.json trained on SENTENCES, with EOS and BOS special tokens and,
    when given, a post-processor template such as "<s> $A"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SENTENCES * 4, trainer)
    if template is not None:
        ids = [(t, tokenizer.token_to_id(t)) for t in (EOS, "<s>")]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=ids
        )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    pytest.importorskip("tokenizers")
    return _train_tokenizer(tmp_path_factory.mktemp("tok"))


def _encode(tok_file, text):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_file)).encode(text).ids


def _packed(tok_file, docs, eos=None):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok_file))
    eos = tokenizer.token_to_id(EOS) if eos is None else eos
    return np.array([i for d in docs for i in [*tokenizer.encode(d).ids, eos]], np.int32)


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), "utf-8")
    return path


def _write_parquet(path, column, row_group_size=2, name="text"):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({name: column, "id": list(range(len(column)))})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def test_load_corpus_without_tokenizer_reads_bytes(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"hello world\n")
    got = load_corpus(path)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, load_text(path))
    with pytest.raises(ValueError, match="seq_len=12"):
        load_corpus(path, seq_len=12)
    with pytest.raises(ValueError, match="directory corpus needs a tokenizer"):
        load_corpus(tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        load_corpus(tmp_path / "missing.txt")


@pytest.mark.parametrize("template", [None, "<s> $A"], ids=["no-template", "bos-template"])
def test_ids_match_transformers(tmp_path, template):
    """pdctl's ids are the transformers tokenizer's: same post-processor (a template's BOS is
    kept, nothing else added), and the truncation saved in the file is switched off as
    transformers does."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    file = _train_tokenizer(tmp_path / "tok", template=template)
    saved = Tokenizer.from_file(str(file))
    saved.enable_truncation(max_length=4)
    saved.save(str(file))
    want = transformers.PreTrainedTokenizerFast(tokenizer_file=str(file))(MULTILINGUAL)["input_ids"]
    assert len(want) > 8 and (want[0] == saved.token_to_id("<s>")) == (template is not None)
    corpus = tmp_path / "doc.txt"
    corpus.write_text(MULTILINGUAL, "utf-8")
    eos = saved.token_to_id(EOS)
    got = load_corpus(corpus, tokenizer_path=file)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [*want, eos])
    # The model folder works as well as the file.
    np.testing.assert_array_equal(load_corpus(corpus, tokenizer_path=file.parent), got)


def test_template_ending_in_eos_is_not_doubled(tmp_path):
    file = _train_tokenizer(tmp_path / "tok", template=f"<s> $A {EOS}")
    _write_jsonl(tmp_path / "c.jsonl", [{"text": s} for s in SENTENCES[:2]])
    got = load_corpus(tmp_path / "c.jsonl", tokenizer_path=file)
    bos, eos = (_encode(file, "")[i] for i in (0, 1))  # the template alone: <s> EOS
    assert (got == eos).sum() == 2 and (got == bos).sum() == 2 and got[-1] == eos


def test_corpora_pack_documents_with_eos_between(tmp_path, tok_file, monkeypatch):
    # Small encode and parquet batches, so documents cross both kinds of batch boundary.
    monkeypatch.setattr(data, "_ENCODE_DOCS", 2)
    monkeypatch.setattr(data, "_PARQUET_ROWS", 3)
    (tmp_path / "a.txt").write_text(SENTENCES[0] + "\n\n" + SENTENCES[1], "utf-8")
    txt = load_corpus(tmp_path / "a.txt", tokenizer_path=tok_file)
    np.testing.assert_array_equal(txt, _packed(tok_file, [SENTENCES[0] + "\n\n" + SENTENCES[1]]))

    # Blank lines and empty documents are skipped; other fields are ignored.
    lines = [{"text": s, "n": i} for i, s in enumerate(SENTENCES)] + [{"text": ""}]
    jsonl = _write_jsonl(tmp_path / "b.jsonl", lines)
    jsonl.write_text(jsonl.read_text("utf-8").replace("\n", "\n\n", 1), "utf-8")
    got = load_corpus(jsonl, tokenizer_path=tok_file)
    np.testing.assert_array_equal(got, _packed(tok_file, SENTENCES))
    body = _write_jsonl(tmp_path / "f" / "x.jsonl", [{"body": SENTENCES[3]}])
    other = load_corpus(body, tokenizer_path=tok_file, text_field="body")
    np.testing.assert_array_equal(other, _packed(tok_file, [SENTENCES[3]]))

    parquet = _write_parquet(tmp_path / "c.parquet", SENTENCES[::-1] * 2)
    got = load_corpus(parquet, tokenizer_path=tok_file)
    np.testing.assert_array_equal(got, _packed(tok_file, SENTENCES[::-1] * 2))

    # A directory: recursive, in path order, other extensions and hidden names ignored.
    root = tmp_path / "dir"
    (root / "b" / "c").mkdir(parents=True)
    (root / "b" / "c" / "one.txt").write_text(SENTENCES[4], "utf-8")
    _write_jsonl(root / "a.jsonl", [{"text": SENTENCES[0]}, {"text": SENTENCES[1]}])
    _write_parquet(root / "b" / "two.parquet", SENTENCES[2:4])
    (root / "README.md").write_text("not a corpus file", "utf-8")
    (root / ".hidden.txt").write_text("skipped", "utf-8")
    (root / "b" / "ignored.json").write_text("{}", "utf-8")
    found = [p.relative_to(root).as_posix() for p in data.corpus_files(root)]
    assert found == ["a.jsonl", "b/c/one.txt", "b/two.parquet"]
    got = load_corpus(root, tokenizer_path=tok_file)
    in_order = [SENTENCES[i] for i in (0, 1, 4, 2, 3)]
    np.testing.assert_array_equal(got, _packed(tok_file, in_order))
    # An explicit eos_id wins over the tokenizer's own.
    explicit = load_corpus(root, tokenizer_path=tok_file, eos_id=7)
    np.testing.assert_array_equal(explicit, _packed(tok_file, in_order, eos=7))


def test_eos_lookup(tmp_path, tok_file):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok_file))
    eos, bos = tokenizer.token_to_id(EOS), tokenizer.token_to_id("<s>")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tok_file.read_bytes())
    assert data.find_eos_id(folder) == eos  # a known name in the vocabulary
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [bos, eos]}))
    assert data.find_eos_id(folder) == bos
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS}))
    assert data.find_eos_id(folder) == eos
    config = {"eos_token": {"__type": "AddedToken", "content": "<s>"}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert data.find_eos_id(folder / "tokenizer.json") == bos
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="'<nope>' is not in"):
        data.find_eos_id(folder)
    (folder / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: not valid JSON"):
        data.find_eos_id(folder)

    # No EOS anywhere: a tokenizer without special tokens and no config beside it.
    bare = tmp_path / "bare"
    bare.mkdir()
    tokenizer = Tokenizer.from_file(str(tok_file))
    vocab = {t: i for t, i in tokenizer.get_vocab().items() if t not in (EOS, "<s>")}
    from tokenizers import models

    Tokenizer(models.WordLevel(vocab, unk_token=None)).save(str(bare / "tokenizer.json"))
    (bare / "a.txt").write_text("x", "utf-8")
    with pytest.raises(ValueError, match=r"no EOS token found.*give eos_id"):
        load_corpus(bare / "a.txt", tokenizer_path=bare)
    with pytest.raises(ValueError, match="eos_id 10000 is not a token id"):
        load_corpus(bare / "a.txt", tokenizer_path=bare, eos_id=10_000)


def _bad_parquet_null(tmp):
    return _write_parquet(tmp / "bad.parquet", ["ok", "fine", None])


def _bad_parquet_type(tmp):
    return _write_parquet(tmp / "bad.parquet", [1, 2])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda t: _write_jsonl(t / "bad.jsonl", [{"text": "a"}, {"txt": "b"}]),
         r"bad\.jsonl:2: no field 'text'"),
        (lambda t: _write_jsonl(t / "bad.jsonl", [{"text": "a"}, {"text": "b"}, {"text": 3}]),
         r"bad\.jsonl:3: field 'text' is a number, expected a string"),
        (lambda t: _write_jsonl(t / "bad.jsonl", [{"text": None}]),
         r"bad\.jsonl:1: field 'text' is null"),
        (lambda t: _write_jsonl(t / "bad.jsonl", [["text"]]),
         r"bad\.jsonl:1: expected an object with field 'text', got an array"),
        (lambda t: (t / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n') and t / "bad.jsonl",
         r"bad\.jsonl:2: not valid JSON"),
        (lambda t: (t / "bad.txt").write_bytes(b"ok \xff") and t / "bad.txt",
         r"bad\.txt: not UTF-8 text \(bad byte at offset 3\)"),
        (_bad_parquet_null, r"bad\.parquet: row 2 \(from 0\): 'text' is null"),
        (_bad_parquet_type, r"bad\.parquet: column 'text' has type int64, expected strings"),
        (lambda t: _write_parquet(t / "bad.parquet", ["a"], name="body"),
         r"bad\.parquet: no column 'text' \(columns: body, id\)"),
        (lambda t: (t / "bad.parquet").write_bytes(b"not parquet") and t / "bad.parquet",
         r"bad\.parquet: cannot read parquet"),
        (lambda t: (t / "empty").mkdir() or t / "empty", r"empty: no \.txt, \.jsonl or \.parquet"),
        (lambda t: (t / "d").mkdir() or ((t / "d" / "x.csv").write_text("a") and t / "d"),
         r"d: no \.txt, \.jsonl or \.parquet files"),
        (lambda t: (t / "x.csv").write_text("a") and t / "x.csv", r"x\.csv: not a \.txt"),
        (lambda t: t / "missing", r"missing: no such file or directory"),
        (lambda t: (t / "e.jsonl").write_text("\n") and t / "e.jsonl", r"e\.jsonl: no text in 1"),
    ],
    ids=["jsonl-field", "jsonl-number", "jsonl-null", "jsonl-array", "jsonl-json", "txt-utf8",
         "parquet-null", "parquet-type", "parquet-column", "parquet-file", "empty-dir",
         "dir-no-corpus", "suffix", "missing", "no-text"],
)  # fmt: skip
def test_bad_corpora_name_the_file_and_line(tmp_path, tok_file, make, match):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=match) as info:
        load_corpus(path, tokenizer_path=tok_file)
    assert "\n" not in str(info.value)


def test_bad_tokenizer_paths(tmp_path, tok_file):
    (tmp_path / "a.txt").write_text("hello", "utf-8")
    with pytest.raises(ValueError, match=r"nowhere: no such tokenizer\.json or model folder"):
        load_corpus(tmp_path / "a.txt", tokenizer_path=tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"model/tokenizer\.json: no such file"):
        (tmp_path / "model").mkdir()
        load_corpus(tmp_path / "a.txt", tokenizer_path=tmp_path / "model")
    (tmp_path / "tokenizer.json").write_text("{}", "utf-8")
    with pytest.raises(ValueError, match=r"not a readable tokenizer\.json") as info:
        load_corpus(tmp_path / "a.txt", tokenizer_path=tmp_path)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"a\.txt: \d+ tokens of text, need at least 1001"):
        load_corpus(tmp_path / "a.txt", tokenizer_path=tok_file, seq_len=1000)


def _numbered_corpus(tmp_path, n_docs=40):
    """Documents of a sentence's start and six numbers found nowhere else: every 16-token window
    holds a whole number, so no two windows are equal and a window's tokens name it."""
    docs = [
        SENTENCES[i % len(SENTENCES)][:12]
        + " "
        + " ".join(str(1000 + 10 * i + j) for j in range(6))
        for i in range(n_docs)
    ]
    return _write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])


TOK_SEQ_LEN = 15  # windows of 16 tokens over about 1650 tokens: about 100 windows


@pytest.mark.parametrize("k", [2, 11])
def test_tokenized_corpus_resumes_mid_epoch(tmp_path, tok_file, k):
    """Batches of 8 over about 100 windows: k=2 resumes early in the first epoch, k=11 just
    before the epoch ends inside one of the next batches."""
    path = _numbered_corpus(tmp_path)
    tokens = load_corpus(path, tokenizer_path=tok_file, seq_len=TOK_SEQ_LEN)
    n_windows, batch = tokens.size // (TOK_SEQ_LEN + 1), 8
    assert k * batch < n_windows and (k == 2 or n_windows < (k + 4) * batch)
    expected = _take(make_text_iterator(tokens, TOK_SEQ_LEN, batch, seed=2), k + 4)
    it = make_text_iterator(tokens, TOK_SEQ_LEN, batch, seed=2)
    _take(it, k)
    saved = state_to_json(it.get_state())
    _take(it, 3)
    resumed = make_text_iterator(tokens, TOK_SEQ_LEN, batch, seed=2)
    resumed.set_state(state_from_json(saved))
    for want, got in zip(expected[k:], _take(resumed, 4), strict=True):
        assert got.dtype == np.int32 and got.shape == (batch, TOK_SEQ_LEN + 1)
        np.testing.assert_array_equal(got, want)


def test_two_processes_split_the_tokenized_global_batch(tmp_path, tok_file):
    tokens = load_corpus(_numbered_corpus(tmp_path), tokenizer_path=tok_file)
    width = TOK_SEQ_LEN + 1
    windows = tokens[: tokens.size // width * width].reshape(-1, width)
    index = {row.tobytes(): i for i, row in enumerate(windows)}
    assert len(index) == len(windows)  # distinct windows, so a row names its window
    whole = _take(make_text_iterator(tokens, TOK_SEQ_LEN, 8, seed=4), 3)
    parts = [
        _take(
            make_text_iterator(tokens, TOK_SEQ_LEN, 8, seed=4, process_index=i, process_count=2), 3
        )
        for i in range(2)
    ]
    seen: set[int] = set()
    for step, global_batch in enumerate(whole):
        a, b = parts[0][step], parts[1][step]
        assert a.shape == b.shape == (4, width)
        np.testing.assert_array_equal(np.concatenate([a, b]), global_batch)
        ids_a, ids_b = {index[r.tobytes()] for r in a}, {index[r.tobytes()] for r in b}
        assert len(ids_a) == len(ids_b) == 4 and not ids_a & ids_b and not (ids_a | ids_b) & seen
        seen |= ids_a | ids_b


def test_token_cache_hit_and_invalidation(tmp_path, tok_file, monkeypatch):
    corpus = _numbered_corpus(tmp_path, n_docs=10)
    cache = tmp_path / "cache"
    first = load_corpus(corpus, tokenizer_path=tok_file, cache_dir=cache)
    np.testing.assert_array_equal(first, load_corpus(corpus, tokenizer_path=tok_file))
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 1 and files[0].startswith("tokens-") and files[0].endswith(".npy")

    calls = []
    tokenize = data._tokenize
    monkeypatch.setattr(data, "_tokenize", lambda *a: calls.append(1) or tokenize(*a))
    again = load_corpus(corpus, tokenizer_path=tok_file, cache_dir=cache)
    assert not calls  # a hit: nothing tokenized
    assert again.dtype == np.int32 and not again.flags.writeable  # a read-only memory map
    np.testing.assert_array_equal(again, first)
    next(make_text_iterator(again, SEQ_LEN, 4, seed=0))  # the memory map feeds the iterator

    # Another tokenizer.json (same path), another field or EOS, an edited file: all miss.
    other_tok = tmp_path / "tok2" / "tokenizer.json"
    other_tok.parent.mkdir()
    other_tok.write_bytes(tok_file.read_bytes())
    load_corpus(corpus, tokenizer_path=other_tok, cache_dir=cache)
    assert len(calls) == 0  # same bytes, same key: the tokenizer's path is not part of it
    _train_tokenizer(other_tok.parent, vocab_size=290)
    retrained = load_corpus(corpus, tokenizer_path=other_tok, cache_dir=cache)
    assert len(calls) == 1 and retrained.size > first.size
    load_corpus(corpus, tokenizer_path=tok_file, cache_dir=cache, eos_id=3)
    assert len(calls) == 2
    with corpus.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps({"text": "one more"}) + "\n")
    longer = load_corpus(corpus, tokenizer_path=tok_file, cache_dir=cache)
    assert len(calls) == 3 and longer.size > first.size
    assert len(list(cache.iterdir())) == 4 and not list(cache.glob(".*"))

    # A damaged cache file is ignored and rewritten.
    # (`longer` maps that very file: copy it before damaging the file in place.)
    longer = np.array(longer)
    target = next(p for p in cache.iterdir() if np.array_equal(np.load(p), longer))
    target.write_bytes(b"garbage")
    rewritten = load_corpus(corpus, tokenizer_path=tok_file, cache_dir=cache)
    np.testing.assert_array_equal(rewritten, longer)
    assert len(calls) == 4


def test_token_cache_write_is_atomic(tmp_path, tok_file, monkeypatch):
    corpus = _numbered_corpus(tmp_path, n_docs=5)

    def crash(out, chunks):
        out[:3] = 1
        raise OSError("disk full")

    monkeypatch.setattr(data, "_fill", crash)
    with pytest.raises(OSError, match="disk full"):
        load_corpus(corpus, tokenizer_path=tok_file, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # no partial file, no temp left behind
