"""An imported (not pdctl-trained) target's files, in one place: where its weights and tokenizer
are, what init-weights checks and records, how later stages verify and read them.

Two formats: a Hugging Face directory (config.json + safetensors + tokenizer.json, read by
`hf.load`) and a GGUF file (metadata, tensors and tokenizer in one file, read by `gguf`). Stages,
the data pipeline and the report ask this module, never the formats directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdctl.errors import PdctlError
from pdctl.science.targets import checksum
from pdctl.science.targets.gguf import SUFFIX
from pdctl.science.targets.hf import HFCausalLM


def is_gguf(target: HFCausalLM) -> bool:
    return Path(target.spec.config_path).suffix.lower() == SUFFIX


def source(target: HFCausalLM) -> Path:
    """The GGUF file, or the Hugging Face model directory."""
    p = Path(target.spec.config_path)
    return p if is_gguf(target) else p.parent


def tokenizer_path(target: HFCausalLM) -> Path:
    """What `data.load_corpus` tokenizes with: the GGUF file (its tokenizer.ggml.* metadata)
    or the directory's tokenizer.json."""
    return source(target) if is_gguf(target) else source(target) / "tokenizer.json"


def weight_files(target: HFCausalLM) -> list[Path]:
    """Every file the weights are read from (for the content checksum)."""
    if is_gguf(target):
        return [source(target)]
    from pdctl.science.targets.hf.load import INDEX, read_index

    index = read_index(source(target))
    files = sorted({s.file for s in index.tensors.values()})
    extra = index.source / INDEX
    return [extra, *files] if extra.is_file() else files


def check(target: HFCausalLM, eos_id: int | None) -> dict[str, Any]:
    """Check an imported target before anything is written: every tensor's name, shape and
    type against the config (headers / metadata only), the tokenizer (there, readable, its
    vocabulary within the model's embedding, the EOS id a token of it), then hash every byte
    of the weights once. Returns {"source", "format", "checksum", "checksum_of", "files",
    "eos_id"} for `[state.pretrain]`."""
    from pdctl.science import data

    if is_gguf(target):
        from pdctl.science.targets.gguf import check_gguf

        check_gguf(source(target), target)
    else:
        from pdctl.science.targets.hf.load import check_checkpoint

        check_checkpoint(source(target), target)
        if not tokenizer_path(target).is_file():
            raise PdctlError(
                f"target.path: no tokenizer.json in {source(target)}; pdctl tokenizes [data] "
                "with the model's own tokenizer (download it with the model)"
            )
    try:
        tok = data.corpus_tokenizer(tokenizer_path(target), eos_id)
    except ValueError as e:
        raise PdctlError(f"target.path: {e}") from None
    vocab = target.spec.vocab_size
    if tok.vocab_size > vocab:
        raise PdctlError(
            f"target.path: the tokenizer ({tok.where}) has {tok.vocab_size} ids but the model "
            f"embeds only {vocab}; is it the model's own tokenizer?"
        )
    if not 0 <= tok.eos_id < vocab:
        key = "data.eos_id" if eos_id is not None else "target.path"
        raise PdctlError(f"{key}: EOS id {tok.eos_id} is outside the model's {vocab} ids")
    files = weight_files(target)
    return {
        "source": str(source(target)),
        "format": "gguf" if is_gguf(target) else "safetensors",
        **checksum.record(files, source(target).parent if is_gguf(target) else source(target)),
        "eos_id": tok.eos_id,
    }


def verify(target: HFCausalLM, recorded: dict[str, Any]) -> None:
    """Refuse to go on when the model's files are not the bytes init-weights recorded."""
    where = source(target)
    files = weight_files(target)
    root = where.parent if is_gguf(target) else where
    if "files" not in recorded:  # a run made before content checksums: its header checksum
        from pdctl.science.targets.hf.load import read_index

        if is_gguf(target) or read_index(where).checksum == recorded.get("checksum"):
            return
        changed = "its headers"
    elif checksum.unchanged(files, root, recorded):
        return
    else:
        changed = "its bytes"
    raise PdctlError(
        f"target.path: the model in {where} changed since init-weights read it ({changed} "
        f"differ from checksum {str(recorded.get('checksum'))[:12]}); put it back, or rerun "
        "`pdctl init-weights` to decompose the new one"
    )


def load(target: HFCausalLM, shardings: Any, dtype: Any = None) -> Any:
    """The target's parameters, each leaf placed with its sharding (each process reads only
    what its devices hold)."""
    if is_gguf(target):
        from pdctl.science.targets.gguf import load_gguf_params

        params, _ = load_gguf_params(source(target), target, shardings, dtype)
    else:
        from pdctl.science.targets.hf.load import load_hf_params

        params, _ = load_hf_params(source(target), target, shardings, dtype)
    return params
