"""Hugging Face causal LMs (Llama, Qwen2, Qwen3, GPT-2) as pdctl targets, read from a local
directory.

| module     | what                                                                          |
|------------|-------------------------------------------------------------------------------|
| `spec.py`  | `config.json` -> `HfSpec` (everything the forward needs, checked, hashable)    |
| `model.py` | `HFCausalLM`: the forward (unrolled or scanned over layers) over HF-named params |
| `load.py`  | safetensors checkpoints read straight into sharded arrays (imported lazily)    |
"""

from pdctl.science.targets.hf.model import HFCausalLM, Tensor
from pdctl.science.targets.hf.spec import (
    GPT2,
    LLAMA,
    QWEN2,
    QWEN3,
    SUPPORTED,
    WEIGHTS_HELP,
    HfSpec,
    config_value,
    gpt2_spec,
    has_weights,
    llama_spec,
    read_hf_config,
)

__all__ = [
    "GPT2",
    "LLAMA",
    "QWEN2",
    "QWEN3",
    "SUPPORTED",
    "WEIGHTS_HELP",
    "HFCausalLM",
    "HfSpec",
    "Tensor",
    "config_value",
    "gpt2_spec",
    "has_weights",
    "llama_spec",
    "read_hf_config",
]
