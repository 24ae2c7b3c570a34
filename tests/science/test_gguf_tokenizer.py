"""The tokenizer of a GGUF file (pdctl.science.gguf_tokenizer).

Fast tier: tiny GGUF files written here with `gguf.GGUFWriter` (a byte-level BPE vocabulary and
a SentencePiece-style one, both trained on a few sentences), round trips, BOS/EOS, special and
user-defined tokens, and the one-line errors. Slow tier: ids and decodes equal transformers'
`AutoTokenizer.from_pretrained(folder, gguf_file=name)`, on the real SmolLM2 GGUF (fortunes,
code, many scripts, whitespace, special tokens) and on the tiny files in every variant.
"""

import json
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pdctl.science.gguf_tokenizer import GGUFTokenizer, load_gguf_tokenizer

gguf = pytest.importorskip("gguf")

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there! the world is quiet today",
    "def f(x):\n    return x + 1\n\nprint(f(41))\n",
    "naïve café, über straße 你好世界 12345",
    "she sells sea shells by the sea shore; the shells she sells are sea shells",
] * 8

ROUND_TRIP = [
    "hello world",
    " hello  there\n\n",
    "the lazy dog sleeps\tall day",
    "naïve café 你好 🤗 مرحبا",
    "",
    " ",
    "\n\n\n",
    "trailing   ",
    "x = [1, 22, 333]  # 12345678",
]

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER = "<think>"


def _trained(pre_tokenizer, vocab_size: int, specials: list[str], byte_fallback=False):
    """A BPE vocabulary trained on CORPUS: (tokens in id order, merges as 'a b' strings)."""
    tok = Tokenizer(models.BPE(byte_fallback=byte_fallback))
    tok.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if not byte_fallback else []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet,
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges, tok


def _write(path: Path, arch: str = "llama", **fields) -> Path:
    """A GGUF with no tensors and these metadata fields (None leaves one out)."""
    writer = gguf.GGUFWriter(str(path), arch)
    adders = {
        "model": writer.add_tokenizer_model, "pre": writer.add_tokenizer_pre,
        "tokens": writer.add_token_list, "types": writer.add_token_types,
        "merges": writer.add_token_merges, "scores": writer.add_token_scores,
        "bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
        "unk": writer.add_unk_token_id, "pad": writer.add_pad_token_id,
        "add_bos": writer.add_add_bos_token, "add_eos": writer.add_add_eos_token,
    }  # fmt: skip
    for name, value in fields.items():
        if value is not None:
            adders[name](value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def byte_level_fields(*, with_endoftext: bool = True, **over) -> dict:
    """Tiny byte-level BPE (the shape of SmolLM2's file): control tokens first, a user-defined
    token last, merges, BOS/EOS ids and no add_bos flag."""
    specials = CONTROL if with_endoftext else CONTROL[1:]
    tokens, merges, _ = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), 400, specials)
    tokens = [*tokens, USER]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials) - 1) + [4]
    bos = tokens.index("<|im_start|>")
    fields = dict(model="gpt2", pre="smollm", tokens=tokens, types=types, merges=merges,
                  bos=bos, eos=bos + 1, unk=0, pad=bos + 1)  # fmt: skip
    fields.update(over)
    if fields["pad"] == -1:  # the user-defined token
        fields["pad"] = len(tokens) - 1
    return fields


def sentencepiece_fields(
    *, with_merges: bool = False, user: bool = False, names=("<unk>", "<s>", "</s>"), **over
) -> dict:
    """Tiny SentencePiece-style BPE (Llama-2's shape): <unk> <s> </s>, 256 byte tokens, then
    pieces whose scores rank the merges; merges only when asked, and a last USER_DEFINED token
    when asked."""
    specials = [*names, *(f"<0x{b:02X}>" for b in range(256))]
    tokens, merges, _ = _trained(pre_tokenizers.Metaspace(), 480, specials, byte_fallback=True)
    n_alpha = len(tokens) - len(specials) - len(merges)
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - len(specials))
    scores = [0.0] * len(specials) + [-1e6] * n_alpha + [-float(i) for i in range(len(merges))]
    if user:
        tokens, types, scores = [*tokens, USER], [*types, 4], [*scores, 0.0]
    fields = dict(model="llama", tokens=tokens, types=types, scores=scores, bos=1, eos=2, unk=0,
                  merges=merges if with_merges else None)  # fmt: skip
    return {**fields, **over}


def _with_plain_text_bos() -> dict:
    """A control token written as plain text, not in the byte alphabet, as BOS (DeepSeek's
    "<｜begin▁of▁sentence｜>"): transformers respells it in the vocabulary and appends it."""
    fields = byte_level_fields()
    fields["tokens"] = [*fields["tokens"], "<｜begin▁of▁sentence｜>"]
    fields["types"] = [*fields["types"], 3]
    return {**fields, "bos": len(fields["tokens"]) - 1, "add_bos": True}


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("bl") / "bl.gguf", **byte_level_fields())


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("spm") / "spm.gguf", **sentencepiece_fields())


def _summary(t: GGUFTokenizer) -> tuple:
    return t.bos_id, t.eos_id, t.vocab_size, t.digest


def _ids(t: GGUFTokenizer, text: str) -> list[int]:
    return t.tokenizer.encode(text).ids


# ---- fast tier: byte-level BPE -------------------------------------------------------------


def test_byte_level_round_trip_and_fields(byte_level):
    t = load_gguf_tokenizer(byte_level)
    tokens = byte_level_fields()["tokens"]
    assert isinstance(t.tokenizer, Tokenizer)
    assert (t.bos_id, t.eos_id) == (1, 2)
    assert t.vocab_size == len(tokens) == t.tokenizer.get_vocab_size(with_added_tokens=True)
    assert t.tokenizer.truncation is None and t.tokenizer.padding is None
    for text in ROUND_TRIP:
        ids = _ids(t, text)
        assert t.tokenizer.decode(ids) == text, text
    # The merges are used: a frequent word is one token, not its letters.
    assert len(_ids(t, "hello world")) == 2
    # No add_bos_token flag: a byte-level vocabulary gets no BOS (as transformers does).
    assert _ids(t, "hello")[0] != t.bos_id


def test_byte_level_special_tokens(byte_level):
    t = load_gguf_tokenizer(byte_level)
    vocab = t.tokenizer.get_vocab()
    start, end, user = vocab["<|im_start|>"], vocab["<|im_end|>"], vocab[USER]
    ids = _ids(t, f"<|im_start|>user\nhi {USER}ok<|im_end|>")
    assert ids[0] == start and ids[-1] == end and user in ids
    # Control tokens are special (dropped by decode's default), user-defined ones are not.
    assert t.tokenizer.decode(ids) == f"user\nhi {USER}ok"
    assert t.tokenizer.decode(ids, skip_special_tokens=False) == (
        f"<|im_start|>user\nhi {USER}ok<|im_end|>"
    )
    added = {a.content: a for a in t.tokenizer.get_added_tokens_decoder().values()}
    assert {c: added[c].special for c in [*CONTROL, USER]} == {
        **dict.fromkeys(CONTROL, True), USER: False,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("add_bos", "add_eos"), [(True, False), (False, True), (True, True), (False, False)]
)
def test_byte_level_bos_eos_flags(tmp_path, add_bos, add_eos):
    path = _write(tmp_path / "f.gguf", **byte_level_fields(add_bos=add_bos, add_eos=add_eos))
    t = load_gguf_tokenizer(path)
    plain = load_gguf_tokenizer(path).tokenizer.encode("hello", add_special_tokens=False).ids
    want = [t.bos_id] * add_bos + plain + [t.eos_id] * add_eos
    assert _ids(t, "hello") == want
    assert t.tokenizer.decode(_ids(t, "hello")) == "hello"


def test_byte_level_pre_tokenizer_follows_pre(tmp_path):
    """`tokenizer.ggml.pre` picks the split: Llama-3's groups digits by three, Qwen2's splits
    every digit, GPT-2's (also SmolLM's, as in transformers) keeps a run of digits whole."""
    pieces = {}
    for pre in ["llama-bpe", "qwen2", "gpt2", "smollm", "deepseek-llm", None]:
        path = _write(tmp_path / f"{pre}.gguf", **byte_level_fields(pre=pre))
        split = load_gguf_tokenizer(path).tokenizer.pre_tokenizer.pre_tokenize_str("ab 12345")
        pieces[pre] = [p for p, _ in split]
    assert pieces["llama-bpe"] == ["ab", "Ġ", "123", "45"]
    assert pieces["qwen2"] == ["ab", "Ġ", "1", "2", "3", "4", "5"]
    for pre in ["gpt2", "smollm", "deepseek-llm", None]:
        assert pieces[pre] == ["ab", "Ġ12345"], pre


def test_reader_and_scan_agree(byte_level, sentencepiece):
    for path in (byte_level, sentencepiece):
        scanned = load_gguf_tokenizer(path)
        read = load_gguf_tokenizer(path, reader=gguf.GGUFReader(str(path)))
        assert _summary(read) == _summary(scanned) == _summary(load_gguf_tokenizer(str(path)))
        assert len(scanned.digest) == 64


def test_digest_is_a_content_key(tmp_path, byte_level):
    other = _write(tmp_path / "o.gguf", **byte_level_fields(add_bos=True))
    assert load_gguf_tokenizer(other).digest != load_gguf_tokenizer(byte_level).digest


# ---- fast tier: SentencePiece BPE ----------------------------------------------------------


def test_sentencepiece_round_trip_bos_and_byte_fallback(sentencepiece):
    t = load_gguf_tokenizer(sentencepiece)
    assert (t.bos_id, t.eos_id) == (1, 2)
    for text in ["hello world", "the quick brown fox", "naïve 🤗 Ωmega", "a  b\n\nc"]:
        ids = _ids(t, text)
        assert ids[0] == t.bos_id  # no add_bos_token flag: SentencePiece gets BOS
        assert t.tokenizer.decode(ids) == text, text
    # Byte fallback: a character the vocabulary lacks becomes its UTF-8 bytes.
    ids = t.tokenizer.encode("🤗", add_special_tokens=False).ids
    assert t.tokenizer.decode(ids[-4:], skip_special_tokens=False) == "🤗"
    pieces = [t.tokenizer.id_to_token(i) for i in ids[-4:]]
    assert pieces == ["<0xF0>", "<0x9F>", "<0xA4>", "<0x97>"]
    # "<s>" in text is the BOS token, matched whole.
    assert _ids(t, "<s>hi")[:2] == [1, 1]


def test_sentencepiece_merges_from_scores_match_training(tmp_path):
    """Without a merge list, the merges rebuilt from the scores segment text as the trained
    BPE does, and a file that lists the merges gives the same ids."""
    _, _, trained = _trained(
        pre_tokenizers.Metaspace(), 480,
        ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))], byte_fallback=True,
    )  # fmt: skip
    from_scores = load_gguf_tokenizer(_write(tmp_path / "s.gguf", **sentencepiece_fields()))
    listed = load_gguf_tokenizer(
        _write(tmp_path / "m.gguf", **sentencepiece_fields(with_merges=True))
    )
    for text in CORPUS[:5]:
        want = trained.encode(text).ids
        assert _ids(from_scores, text)[1:] == want, text
        assert _ids(listed, text)[1:] == want, text
    assert len(_ids(from_scores, "the sea shells")) < len("the sea shells")


def test_sentencepiece_add_bos_false(tmp_path):
    t = load_gguf_tokenizer(_write(tmp_path / "f.gguf", **sentencepiece_fields(add_bos=False)))
    assert _ids(t, "hello")[0] != t.bos_id


# ---- fast tier: refusals -------------------------------------------------------------------


def _refusal(path: Path) -> str:
    with pytest.raises(ValueError) as info:
        load_gguf_tokenizer(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    return message


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", "gemma4"])
def test_unsupported_model_is_one_line(tmp_path, model):
    path = _write(tmp_path / "f.gguf", **byte_level_fields(model=model))
    message = _refusal(path)
    assert repr(model) in message and "'gpt2'" in message and "'llama'" in message


def test_missing_or_malformed_metadata_is_one_line(tmp_path):
    bare = _write(tmp_path / "bare.gguf")
    assert "no tokenizer metadata" in _refusal(bare) and "'gpt2'" in _refusal(bare)

    no_tokens = _write(tmp_path / "nt.gguf", **byte_level_fields(tokens=None, types=None))
    assert "tokenizer.ggml.tokens" in _refusal(no_tokens)

    no_merges = _write(tmp_path / "nm.gguf", **byte_level_fields(merges=None))
    assert "tokenizer.ggml.merges" in _refusal(no_merges)

    no_scores = _write(tmp_path / "ns.gguf", **sentencepiece_fields(scores=None))
    assert "tokenizer.ggml.scores" in _refusal(no_scores)

    bad_bos = _write(tmp_path / "bb.gguf", **byte_level_fields(bos=10_000))
    assert "tokenizer.ggml.bos_token_id is 10000" in _refusal(bad_bos)

    bad_pre = _write(tmp_path / "bp.gguf", **byte_level_fields(pre="no-such-pre"))
    assert "'no-such-pre'" in _refusal(bad_pre) and "llama-bpe" in _refusal(bad_pre)

    bad_merge = _write(tmp_path / "bm.gguf", **byte_level_fields(merges=["h e", "zz qq"]))
    assert "'zz qq'" in _refusal(bad_merge)

    gemma = _write(tmp_path / "g.gguf", arch="gemma2", **sentencepiece_fields())
    assert "'gemma2'" in _refusal(gemma)

    writer = gguf.GGUFWriter(str(tmp_path / "wt.gguf"), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_string("tokenizer.ggml.tokens", "not an array")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    message = _refusal(tmp_path / "wt.gguf")
    assert "tokenizer.ggml.tokens is string" in message and "array of strings" in message


def test_not_a_gguf_is_one_line(tmp_path, byte_level):
    text = tmp_path / "x.gguf"
    text.write_text("hello\nworld\n")
    assert "not a GGUF file" in _refusal(text)
    empty = tmp_path / "e.gguf"
    empty.write_bytes(b"")
    _refusal(empty)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(byte_level.read_bytes()[:3000])
    assert "truncated" in _refusal(cut)
    with pytest.raises(ValueError, match="no such GGUF file"):
        load_gguf_tokenizer(tmp_path / "missing.gguf")


# ---- slow tier: equal to transformers ------------------------------------------------------

CODE = [
    "def main(argv):\n    for i, x in enumerate(argv):\n\tif x:\n\t\tprint(i, x)\n    return 0\n",
    "class A:\n    def __init__(self):\n        self.x = {'a': 1, \"b\": [2, 3]}\n",
    '{"name": "pdctl", "version": "0.1.0", "deps": ["jax>=0.7", "optax"], "n": 12.5e-3}',
    "#!/usr/bin/env bash\nset -euo pipefail\n"
    "for f in *.txt; do wc -l \"$f\" | awk '{print $1}'; done\n",
    "if (x != y && z <= 10) { return a->b[i++] ?? null; } // C-ish ~ `code`",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
]
MULTILINGUAL = [
    "中文测试：你好，世界！机器学习很有趣。",
    "日本語のテキスト、カタカナとひらがな。東京は大きい。",
    "النص العربي يكتب من اليمين إلى اليسار.",
    "Русский текст: съешь же ещё этих мягких французских булок.",
    "हिन्दी पाठ: नमस्ते दुनिया।",
    "Ça va? Crème brûlée, naïve façade, Ærøskøbing, Łódź, ß, ñ, ü.",
    "emoji 🤗🎉👍🏽 and flags 🇫🇷 and ZWJ 👨‍👩‍👧",
    "12345678 3.14159 1,000,000 0x1F 2024-01-01 ١٢٣ 一二三",
    "한국어 텍스트와 ελληνικά και עברית",
]
WHITESPACE = [
    "   leading spaces", "\n\n\n", "trailing spaces   ", "\t\ttabs\t", " ", "", "a\r\nb\rc",
    "two  spaces   three    four", "\u00a0nbsp\u2003em space", "line\n \n  \n   end",
    "  1  22   333", "\x00nul\x7f\x1b[0m", "zero\u200bwidth", "x" * 300 + " " * 50,
]  # fmt: skip
SPECIAL = [
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "<|endoftext|>", "x<|im_start|>y", " <|im_end|> ", "<|im_start|><|im_start|>",
    "<repo_name>pdctl<file_sep>a.py\n<jupyter_code>print(1)", "<|im_start", "<|IM_START|>",
]  # fmt: skip


def _transformers(path: Path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _assert_same(mine: GGUFTokenizer, theirs, texts: list[str]) -> None:
    want = theirs(texts)["input_ids"]
    got = [e.ids for e in mine.tokenizer.encode_batch(texts)]
    bad = [(text, w, g) for text, w, g in zip(texts, want, got, strict=True) if w != g]
    assert not bad, f"{len(bad)} of {len(texts)} differ, first: {bad[0]}"
    for text, ids in zip(texts, got, strict=True):
        assert mine.tokenizer.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
        assert mine.tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


@pytest.fixture(scope="module")
def real():
    from real_model import smollm2_gguf

    path = smollm2_gguf()
    start = time.perf_counter()
    mine = load_gguf_tokenizer(path)
    seconds = time.perf_counter() - start
    return path, mine, seconds, _transformers(path)


@pytest.mark.slow
def test_real_gguf_ids_equal_transformers(real):
    from real_model import fortunes

    _, mine, _, theirs = real
    docs = fortunes()
    sample = docs[:: max(1, len(docs) // 1000)]
    assert len(sample) >= 200
    _assert_same(mine, theirs, sample)
    _assert_same(mine, theirs, CODE + MULTILINGUAL + WHITESPACE + SPECIAL)
    # Special tokens inside running text.
    mixed = [d[:200] + s + d[-200:] for d, s in zip(sample, SPECIAL * 50, strict=False)]
    _assert_same(mine, theirs, mixed)


@pytest.mark.slow
def test_real_gguf_tokenizer_equals_transformers_backend(real):
    path, mine, seconds, theirs = real
    assert (mine.bos_id, mine.eos_id) == (theirs.bos_token_id, theirs.eos_token_id) == (1, 2)
    assert mine.vocab_size == len(theirs) == 49152
    assert json.loads(mine.tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert seconds < 2.0, f"loading the tokenizer took {seconds:.2f} s"
    assert load_gguf_tokenizer(path, reader=gguf.GGUFReader(str(path))).digest == mine.digest


TINY = {
    "byte-level smollm": byte_level_fields(),
    "byte-level llama-bpe, add_bos": byte_level_fields(pre="llama-bpe", add_bos=True),
    "byte-level qwen2, add_eos": byte_level_fields(pre="qwen2", add_eos=True),
    "byte-level gpt-4o": byte_level_fields(pre="gpt-4o"),
    "byte-level, no pre": byte_level_fields(pre=None),
    "byte-level, no <|endoftext|>": byte_level_fields(with_endoftext=False, unk=None),
    "byte-level, pad is user-defined": byte_level_fields(pad=-1),
    "sentencepiece from scores": sentencepiece_fields(),
    "sentencepiece with merges, add_eos": sentencepiece_fields(with_merges=True, add_eos=True),
    "byte-level, pad is a plain token": byte_level_fields(pad=40),
    "byte-level, plain-text control BOS": _with_plain_text_bos(),
    "sentencepiece, add_bos false": sentencepiece_fields(add_bos=False),
    "sentencepiece, user-defined token": sentencepiece_fields(user=True),
    "sentencepiece, other special names": sentencepiece_fields(names=["<UNK>", "<|b|>", "<|e|>"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", [*TINY, "phi3 sentencepiece"])
def test_tiny_gguf_equals_transformers(tmp_path, name):
    arch = "phi3" if name.startswith("phi3") else "llama"
    fields = TINY.get(name) or sentencepiece_fields()
    path = _write(tmp_path / "t.gguf", arch=arch, **fields)
    mine, theirs = load_gguf_tokenizer(path), _transformers(path)
    assert (mine.bos_id, mine.eos_id, mine.vocab_size) == (
        theirs.bos_token_id, theirs.eos_token_id, len(theirs)
    )  # fmt: skip
    assert json.loads(mine.tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    _assert_same(mine, theirs, CORPUS[:5] + ROUND_TRIP + SPECIAL + MULTILINGUAL[:3] + [USER])
