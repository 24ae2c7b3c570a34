"""A Hugging Face `tokenizers.Tokenizer` built from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, scores, token types
and special token ids as metadata. This module turns them into the tokenizer that transformers
builds for `AutoTokenizer.from_pretrained(folder, gguf_file=name)`, and the ids are meant to be
the same as transformers' on every text (tests/science/test_gguf_tokenizer.py checks them on the
real SmolLM2 file). Where transformers and llama.cpp disagree we follow transformers, and say so:

- byte-level BPE (`tokenizer.ggml.model = "gpt2"`): `tokenizer.ggml.pre` picks the split regex
  only for the names transformers maps (`_SPLITS`); every other known name gets GPT-2's regex,
  as transformers does, even where llama.cpp splits otherwise (`smollm` isolates digits there,
  so "  1" tokenizes differently; `deepseek-llm` has its own regexes).
- SentencePiece BPE (`"llama"`): a Metaspace pre-tokenizer that prefixes "▁" to the text's
  first piece only, byte fallback, and merges from the file or, when it has none, rebuilt from
  the scores. `tokenizer.ggml.add_space_prefix` is not consulted (transformers ignores it too).

Reading is a small scan of the file's metadata (memory-mapped, tensors never touched): 0.05 s
for SmolLM2's 49k tokens and merges, 0.2-0.5 s with the tokenizer built. `gguf.GGUFReader`
builds numpy views of every string of every array first and needs 2.5-4.5 s for the same file,
so it is used only when the caller already holds one and passes it in.
"""

import builtins
import dataclasses
import hashlib
import mmap
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from pdctl.errors import first_line

if TYPE_CHECKING:
    import gguf

# llama.cpp's token types (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4

# GGUF metadata value types: struct formats of the fixed-size ones, then string and array.
_SCALAR_FORMATS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_INT_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
# A metadata value's type: the scalar type, or for an array (9, element type)
GgufKind = int | tuple[int, int]
_TYPE_NAMES = {
    0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
    7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64",
}  # fmt: skip

_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}
# Architectures whose SentencePiece vocabulary transformers builds another way than Llama's.
_UNSUPPORTED_SPM_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`, the ones transformers maps (integrations/
# gguf/gguf_tokenizer_mapping.py, which takes them from llama.cpp's llama-vocab.cpp).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"],
        _LLAMA3,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2),
    "qwen35": _QWEN35,
    "tekken": _TEKKEN,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O),
}  # fmt: skip
# The other `tokenizer.ggml.pre` values llama.cpp writes for byte-level vocabularies: transformers
# splits all of them with GPT-2's regex, and so do we. A name in neither list is refused rather
# than guessed at.
_GPT2_REGEX_PRES = frozenset([
    "default", "gpt2", "gpt-2", "smollm", "starcoder", "refact", "command-r", "codeshell",
    "exaone", "exaone4", "minerva", "deepseek-llm", "deepseek-coder", "deepseek-v3", "falcon",
    "mpt", "olmo", "jais", "jais-2", "stablelm2", "bloom", "gpt3-finnish", "poro-chat", "viking",
    "chatglm-bpe", "chatglm4", "chameleon", "tekken-old", "bailingmoe", "bailingmoe2",
    "llada-moe", "seed-coder", "hunyuan", "hunyuan-dense", "grok-2", "kimi-k2", "superbpe",
    "trillion", "a.x-4.0", "granite-docling", "afmoe", "solar-open", "glm4", "gpt-oss",
])  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GGUFTokenizer:
    """A GGUF file's tokenizer. `tokenizer` has truncation and padding off, and its
    post-processor adds BOS (and EOS) exactly where transformers' tokenizer for the same file
    does on `tokenizer(text)`. `vocab_size` counts added tokens; `digest` is the sha256 of
    `tokenizer.to_str()`, a content key for caches."""

    tokenizer: tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    vocab_size: int
    digest: str


def load_gguf_tokenizer(
    path: str | os.PathLike, reader: "gguf.GGUFReader | None" = None
) -> GGUFTokenizer:
    """The tokenizer described by the GGUF file at `path` (its metadata, read from `reader` when
    one is given). Raises a one-line ValueError naming the file for a file that is not a GGUF,
    has no or malformed tokenizer metadata, or describes a tokenizer not supported here."""
    path = Path(path)
    fields = _reader_fields(reader, path) if reader is not None else _scan_fields(path)
    meta = _Metadata(fields, path)
    model = meta.string("tokenizer.ggml.model")
    if model is None:
        raise meta.error(f"no tokenizer metadata (no tokenizer.ggml.model); {_supported()}")
    if model not in _MODELS:
        raise meta.error(f"tokenizer.ggml.model is {model!r}; {_supported()}")
    architecture = meta.string("general.architecture")
    if model == "llama" and architecture in _UNSUPPORTED_SPM_ARCHITECTURES:
        raise meta.error(
            f"a SentencePiece vocabulary of architecture {architecture!r} (Gemma's, built "
            f"differently); {_supported()} for other architectures"
        )
    tokens = meta.strings("tokenizer.ggml.tokens", required=True)
    if not tokens:
        raise meta.error("tokenizer.ggml.tokens is empty")
    types = meta.ints("tokenizer.ggml.token_type")
    if types is not None and len(types) != len(tokens):
        raise meta.error(
            f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    specials = {
        name: meta.token_id(f"tokenizer.ggml.{key}", len(tokens))
        for name, key in (
            ("bos", "bos_token_id"), ("eos", "eos_token_id"),
            ("unk", "unknown_token_id"), ("pad", "padding_token_id"),
        )
    }  # fmt: skip

    if model == "gpt2":
        tokenizer = _byte_level(meta, tokens, types)
        add_bos_default = False
    else:
        tokenizer = _sentencepiece(meta, tokens, phi3=architecture == "phi3")
        # Old files have no flag; llama.cpp adds BOS to such a vocabulary, and so does transformers.
        add_bos_default = True

    # transformers then makes those of the file's BOS/EOS/UNK/PAD tokens that are not added
    # tokens yet special added tokens (appended when the vocabulary spells them otherwise; a
    # USER_DEFINED one stays unspecial), and looks their ids up by their text.
    named = {name: tokens[i] if i is not None else None for name, i in specials.items()}
    added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    tokenizer.add_special_tokens([
        _added(text, special=True) for text in dict.fromkeys(named.values())
        if text is not None and text not in added
    ])  # fmt: skip
    bos_id = tokenizer.token_to_id(named["bos"]) if named["bos"] is not None else None
    eos_id = tokenizer.token_to_id(named["eos"]) if named["eos"] is not None else None
    add_bos = meta.bool("tokenizer.ggml.add_bos_token", add_bos_default) and bos_id is not None
    add_eos = meta.bool("tokenizer.ggml.add_eos_token", False) and eos_id is not None
    tokenizer.post_processor = _template(
        named["bos"] if add_bos else None, bos_id, named["eos"] if add_eos else None, eos_id, meta
    )
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return GGUFTokenizer(
        tokenizer=tokenizer,
        bos_id=bos_id,
        eos_id=eos_id,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        digest=hashlib.sha256(tokenizer.to_str().encode()).hexdigest(),
    )


def _supported() -> str:
    return "supported: tokenizer.ggml.model " + ", ".join(
        f"{name!r} ({kind})" for name, kind in _MODELS.items()
    )


def _added(text: str, special: bool) -> AddedToken:
    return AddedToken(text, single_word=False, lstrip=False, rstrip=False, normalized=False,
                      special=special)  # fmt: skip


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: every byte as a printable character (the printable Latin-1 bytes
    as themselves, the rest shifted to U+0100 onwards)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    for n, b in enumerate(shifted):
        chars[b] = chr(256 + n)
    return chars


def _merges(meta: "_Metadata", vocab: dict[str, int]) -> list[tuple[str, str]] | None:
    merges = meta.strings("tokenizer.ggml.merges")
    if merges is None:
        return None
    pairs = []
    for i, merge in enumerate(merges):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise meta.error(f"tokenizer.ggml.merges[{i}] is {merge!r}, not two tokens")
        if pair[0] not in vocab or pair[1] not in vocab:
            raise meta.error(f"tokenizer.ggml.merges[{i}] is {merge!r}, not in the vocabulary")
        pairs.append((pair[0], pair[1]))
    return pairs


def _byte_level(meta: "_Metadata", tokens: list[str], types: list[int] | None):
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())
    # A token the file writes as plain text rather than in the byte alphabet (an added token
    # like "<｜begin▁of▁sentence｜>") is respelled byte by byte, as transformers does.
    vocab = {
        token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode()): i
        for i, token in enumerate(tokens)
    }
    merges = _merges(meta, vocab)
    if merges is None:
        raise meta.error("a byte-level BPE vocabulary without tokenizer.ggml.merges")
    pre = meta.string("tokenizer.ggml.pre") or "default"
    if pre not in _SPLITS and pre not in _GPT2_REGEX_PRES:
        raise meta.error(
            f"tokenizer.ggml.pre is {pre!r}, a split this module does not know; supported: "
            + ", ".join(sorted(_SPLITS.keys() | _GPT2_REGEX_PRES))
        )
    bpe = models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
        end_of_word_suffix="", fuse_unk=False,
    )  # fmt: skip
    tokenizer = tokenizers.Tokenizer(bpe)
    if pre in _SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # transformers' GPT-2 tokenizer brings "<|endoftext|>" as its default special tokens, so it
    # is a special added token whatever the file says (appended if the vocabulary lacks it).
    tokenizer.add_special_tokens([_added("<|endoftext|>", special=True)])
    # A control token spelled outside the byte alphabet is taken for a llama.cpp mislabel and
    # left out, as transformers leaves it out.
    _add_typed_tokens(tokenizer, tokens, types, keep=lambda token: set(token) <= spelled)
    return tokenizer


def _sentencepiece(meta: "_Metadata", tokens: list[str], phi3: bool):
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = _merges(meta, vocab)
    if merges is None:
        scores = meta.floats("tokenizer.ggml.scores")
        if scores is None:
            raise meta.error(
                "a SentencePiece vocabulary with neither tokenizer.ggml.merges nor "
                "tokenizer.ggml.scores"
            )
        if len(scores) != len(tokens):
            raise meta.error(
                f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
            )
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    if phi3:
        # Phi-3 prefixes and replaces spaces in a normalizer, so "  hi" keeps both spaces.
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first", split=False
        )
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0),
    ])  # fmt: skip
    # transformers' Llama tokenizer brings these three as its default special tokens.
    tokenizer.add_special_tokens([_added(t, special=True) for t in ("<s>", "</s>", "<unk>")])
    _add_typed_tokens(tokenizer, tokens, meta.ints("tokenizer.ggml.token_type"), keep=None)
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE keeps no merge list: every split of a token into two tokens is a
    merge, ranked by the merged token's score (best first; ties by the halves' lengths, longest
    first, then by file order). The same order transformers' `generate_merges` gives."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in scores.items():
        splits = [
            (token[:k], token[k:]) for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]  # fmt: skip
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((score, len(left), len(right), left, right) for left, right in splits)
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)  # stable: ties keep order
    return [(left, right) for *_, left, right in ranked]


def _add_typed_tokens(tokenizer, tokens, types, keep) -> None:
    """The file's CONTROL tokens become special added tokens and its USER_DEFINED tokens plain
    added tokens (matched whole in text, like llama.cpp does), both unnormalized."""
    if types is None:
        return
    control = [
        _added(token, special=True) for token, kind in zip(tokens, types, strict=True)
        if kind == _CONTROL and (keep is None or keep(token))
    ]  # fmt: skip
    if control:
        tokenizer.add_special_tokens(control)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    user = [
        _added(token, special=False) for token, kind in zip(tokens, types, strict=True)
        if kind == _USER_DEFINED and token in vocab
    ]  # fmt: skip
    if user:
        tokenizer.add_tokens(user)


def _template(bos: str | None, bos_id, eos: str | None, eos_id, meta: "_Metadata"):
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = (
        single
        + " "
        + " ".join([*([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    )
    special = [*([(bos, bos_id)] if bos else []), *([(eos, eos_id)] if eos and eos != bos else [])]
    try:
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    except Exception as e:  # the Rust side raises a bare Exception
        raise meta.error(f"BOS/EOS tokens {bos!r}/{eos!r} make no template ({e})") from None


class _Metadata:
    """Typed access to the metadata fields, with one-line errors naming the file."""

    def __init__(self, fields: dict[str, tuple[GgufKind, Any]], path: Path):
        self._fields = fields
        self.path = path

    def error(self, what: str) -> ValueError:
        return ValueError(" ".join(f"{self.path}: {what}".split()))

    def _get(self, key: str, want: str, ok) -> Any:
        if key not in self._fields:
            return None
        kind, value = self._fields[key]
        if not ok(kind, value):
            raise self.error(f"{key} is {_describe(kind, value)}, expected {want}")
        return value

    def string(self, key: str) -> str | None:
        return self._get(key, "a string", lambda kind, _: kind == _STRING)

    def bool(self, key: str, default: bool) -> bool:
        value = self._get(key, "a bool", lambda kind, _: kind in (7, *_INT_TYPES))
        return default if value is None else bool(value)

    def token_id(self, key: str, n_tokens: int) -> int | None:
        value = self._get(key, "an integer", lambda kind, _: kind in _INT_TYPES)
        if value is not None and not 0 <= value < n_tokens:
            raise self.error(f"{key} is {value}, not an id of the {n_tokens} tokens")
        return value

    def strings(self, key: str, required: builtins.bool = False) -> list[str] | None:
        value = self._get(key, "an array of strings", lambda kind, _: kind == (_ARRAY, _STRING))
        if value is None and required:
            raise self.error(f"no {key} (the vocabulary) in the tokenizer metadata")
        return value

    def ints(self, key: str) -> list[int] | None:
        ok = {(_ARRAY, t) for t in _INT_TYPES}
        return self._get(key, "an array of integers", lambda kind, _: kind in ok)

    def floats(self, key: str) -> list[float] | None:
        ok = {(_ARRAY, t) for t in (6, 12, *_INT_TYPES)}
        return self._get(key, "an array of numbers", lambda kind, _: kind in ok)


def _describe(kind, value) -> str:
    if isinstance(kind, tuple):
        return f"an array of {' of '.join(_TYPE_NAMES.get(k, str(k)) for k in kind[1:])}"
    shown = repr(value)
    return f"{_TYPE_NAMES.get(kind, kind)} {shown[:60]}"


def _wanted(key: str) -> bool:
    return key.startswith("tokenizer.ggml.") or key == "general.architecture"


def _scan_fields(path: Path) -> dict[str, tuple[GgufKind, Any]]:
    """The tokenizer fields of a GGUF file (and general.architecture) as {key: (type, value)},
    where type is the value type, or for an array the tuple (9, element type)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _GGUFScan(blob, path).fields()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such GGUF file") from None
    except (OSError, ValueError) as e:
        if isinstance(e, ValueError) and str(e).startswith(f"{path}: "):
            raise
        raise ValueError(f"{path}: not a readable GGUF file ({first_line(e)})") from None


class _GGUFScan:
    """Walks a GGUF header: magic, version, counts, then the key/value pairs. Values of keys
    that are not wanted are stepped over without being decoded. After `fields()`, `end` is
    the byte where the tensor infos start and `n_tensors` their count
    (`science.targets.gguf.GGUFIndex` reads on from there)."""

    def __init__(self, blob: Any, path: Path, wanted: Any = None):
        self.blob, self.path, self.size = blob, path, len(blob)
        self.wanted = wanted or _wanted
        self.end, self.n_tensors = 0, 0

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {what}")

    def fields(self) -> dict[str, tuple[GgufKind, Any]]:
        if self.size < 24 or self.blob[:4] != b"GGUF":
            raise self.fail(f"not a GGUF file (starts with {bytes(self.blob[:4])!r}, not b'GGUF')")
        for order in "<>":
            (version,) = struct.unpack_from(order + "I", self.blob, 4)
            if version in (2, 3):
                break
        else:
            raise self.fail(f"GGUF version {version}; supported: versions 2 and 3")
        self.order = order
        self.u64 = struct.Struct(order + "Q").unpack_from
        self.u32 = struct.Struct(order + "I").unpack_from
        (self.n_tensors,) = self.u64(self.blob, 8)
        (n_kv,) = self.u64(self.blob, 16)
        pos, fields = 24, {}
        kind: GgufKind
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (kind,) = self._u32(pos)
            keep = self.wanted(key)
            if kind == _ARRAY:
                (element,) = self._u32(pos + 4)
                value, pos = self._array(pos + 4, keep)
                kind = (_ARRAY, element)
            else:
                value, pos = self._value(pos + 4, kind, keep)
            if keep:
                fields[key] = (kind, value)
        self.end = pos
        return fields

    def _u32(self, pos: int) -> tuple[int]:
        self._need(pos, 4)
        return self.u32(self.blob, pos)

    def _need(self, pos: int, n: int) -> None:
        if pos + n > self.size:
            raise self.fail(f"truncated GGUF metadata (needs byte {pos + n} of {self.size})")

    def _string(self, pos: int) -> tuple[str, int]:
        self._need(pos, 8)
        (n,) = self.u64(self.blob, pos)
        self._need(pos + 8, n)
        try:
            return self.blob[pos + 8 : pos + 8 + n].decode(), pos + 8 + n
        except UnicodeDecodeError as e:
            raise self.fail(f"a metadata string at byte {pos} is not UTF-8 ({e})") from None

    def _value(self, pos: int, kind: int, keep: bool) -> tuple[Any, int]:
        if kind == _STRING:
            if keep:
                return self._string(pos)
            self._need(pos, 8)
            return None, pos + 8 + self.u64(self.blob, pos)[0]
        if kind == _ARRAY:
            return self._array(pos, keep)
        if kind not in _SCALAR_FORMATS:
            raise self.fail(f"metadata value of unknown type {kind} at byte {pos}")
        fmt = self.order + _SCALAR_FORMATS[kind]
        size = struct.calcsize(fmt)
        self._need(pos, size)
        return struct.unpack_from(fmt, self.blob, pos)[0], pos + size

    def _array(self, pos: int, keep: bool) -> tuple[list | None, int]:
        (element,) = self._u32(pos)
        self._need(pos + 4, 8)
        (count,) = self.u64(self.blob, pos + 4)
        pos += 12
        if element in _SCALAR_FORMATS:
            fmt = f"{self.order}{count}{_SCALAR_FORMATS[element]}"
            size = struct.calcsize(self.order + _SCALAR_FORMATS[element]) * count
            self._need(pos, size)
            return (list(struct.unpack_from(fmt, self.blob, pos)) if keep else None), pos + size
        if element == _STRING:
            self._need(pos, 8 * count)  # every string takes at least its length
            if not keep:
                for _ in range(count):
                    self._need(pos, 8)
                    pos += 8 + self.u64(self.blob, pos)[0]
                return None, pos
            values = []
            for _ in range(count):
                value, pos = self._string(pos)
                values.append(value)
            return values, pos
        values = []
        for _ in range(count):
            value, pos = self._value(pos, element, keep)
            values.append(value)
        return (values if keep else None), pos


def _reader_fields(reader, path: Path) -> dict[str, tuple[GgufKind, Any]]:
    """The same fields as `_scan_fields`, from a `gguf.GGUFReader` the caller already holds."""
    fields: dict[str, tuple[GgufKind, Any]] = {}
    for key, field in reader.fields.items():
        if not _wanted(key):
            continue
        types = [int(t) for t in field.types]
        if not types:
            raise ValueError(f"{path}: {key} has no value type")
        try:
            value = field.contents()
        except Exception as e:
            raise ValueError(f"{path}: {key} is unreadable ({first_line(e)})") from None
        if types[0] == _ARRAY:
            fields[key] = ((_ARRAY, types[1] if len(types) > 1 else _STRING), list(value))
        else:
            fields[key] = (types[0], value)
    return fields
