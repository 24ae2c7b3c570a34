"""Models to decompose: toy TMS, toy residual MLP, a small Llama-style LM and imported Hugging
Face / GGUF causal LMs (`hf`), the LMs sharing `lm.LMTarget`."""

from collections.abc import Callable
from typing import Any

from pdctl.science.targets.base import Params, Target
from pdctl.science.targets.hf import HFCausalLM, read_hf_config
from pdctl.science.targets.llama_mlp import LlamaMLP
from pdctl.science.targets.lm import LMTarget
from pdctl.science.targets.resid_mlp import ResidMLP
from pdctl.science.targets.tms import TMS


def _hf(*, path: str, need_weights: bool = True, **kwargs: Any) -> HFCausalLM:
    """An imported model: its architecture and sizes come from `path`, a Hugging Face model
    directory (config.json) or a GGUF file (or a directory holding exactly one).
    `need_weights=False` accepts a directory with only its config.json (shapes for
    `inspect-sharding`; nothing is loaded)."""
    from pdctl.science.targets.gguf import find_gguf, gguf_spec

    gguf = find_gguf(path)
    if gguf is not None:
        return HFCausalLM(spec=gguf_spec(gguf), **kwargs)
    return HFCausalLM(spec=read_hf_config(path, need_weights=need_weights), **kwargs)


TARGETS: dict[str, Callable[..., Target]] = {
    "tms": TMS,
    "resid_mlp": ResidMLP,
    "llama_mlp": LlamaMLP,
    "hf": _hf,
}


def build_target(kind: str, **kwargs: Any) -> Target:
    """The target of `kind` with the given hyperparameters (unknown names raise TypeError)."""
    try:
        cls = TARGETS[kind]
    except KeyError:
        raise ValueError(
            f"unknown target kind {kind!r}; expected one of {sorted(TARGETS)}"
        ) from None
    return cls(**kwargs)


__all__ = [
    "TARGETS",
    "TMS",
    "HFCausalLM",
    "LMTarget",
    "LlamaMLP",
    "Params",
    "ResidMLP",
    "Target",
    "build_target",
]
