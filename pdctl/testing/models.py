"""The tiny Hugging Face models (and the corpus they read) that pdctl's tests and benchmarks
run on, built in one place: a random Llama saved with transformers, a byte-level BPE tokenizer
trained on a few words, a jsonl corpus of those words.

The builders are deterministic (torch seed 0, numpy seed 0): the same bytes on every call. The
heavy imports (transformers, torch, tokenizers: the `parity` extra) happen inside them, so
importing this module costs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# the corpus's words; the tokenizers are trained on them too
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "from",
         "old", "trees", "near", "rivers"]  # fmt: skip


def bpe_tokenizer(model_dir: Path, vocab_size: int = 96) -> int:
    """model_dir/tokenizer.json, a byte-level BPE trained on WORDS with an `<|endoftext|>`
    token (named EOS in tokenizer_config.json); returns its vocabulary size, added tokens
    included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return tok.get_vocab_size(with_added_tokens=True)


def write_corpus(path: Path, docs: int, rng: np.random.Generator | None = None) -> Path:
    """A jsonl corpus of `docs` documents of 12 random WORDS each, drawn from `rng`
    (numpy seed 0 when not given)."""
    rng = np.random.default_rng(0) if rng is None else rng
    with path.open("w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS, size=12))}) + "\n")
    return path


def tiny_llama(
    root: Path,
    *,
    name: str = "tiny-llama",
    hidden: int = 32,
    intermediate: int = 64,
    max_shard_size: str | None = "40KB",
    docs: int = 200,
) -> dict[str, Path]:
    """A random 2-layer Llama (4 heads, 2 key/value heads, untied embeddings) saved with
    transformers as root/name (in shards of `max_shard_size`; None: one file), with
    bpe_tokenizer's tokenizer, and root/corpus.jsonl of `docs` documents.
    Returns {"model", "corpus", "root"}. Needs transformers and torch."""
    import torch
    import transformers

    model_dir = root / name
    model_dir.mkdir(parents=True, exist_ok=True)
    n_vocab = bpe_tokenizer(model_dir)
    config = transformers.LlamaConfig(
        vocab_size=n_vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir, **kwargs)
    corpus = write_corpus(root / "corpus.jsonl", docs)
    return {"model": model_dir, "corpus": corpus, "root": root}


def rendezvous_llama(root: Path) -> dict[str, Path]:
    """tiny_llama at d 64 (MLP 128), in one file, with a 400-document corpus: the model
    tests/engine/test_rendezvous.py times under load."""
    return tiny_llama(root, name="model", hidden=64, intermediate=128, max_shard_size=None,
                      docs=400)  # fmt: skip
