"""The config values a sweep may vary inside ONE program: numbers that only enter the step's
arithmetic (loss coefficients, learning rates, p, beta, the feature probability), never its
shapes or its structure.

Members whose configs differ only in these keys (and their seed) form one group. Within a
group, a key whose value is the same for every member stays a Python constant, exactly as in
`pdctl run`; a key whose values differ becomes a traced float32 scalar per member: the stacked
step takes the members' values as one more argument split over the member axis, and each
member's step is built from the config with its own values in place (`substitute`). Code that
reads one of these keys therefore works on a tracer as well as on a float
(`pdctl.science.arrays.is_traced`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from pdctl.science.spd.losses import ADVERSARIAL_TERMS, TERMS
from pdctl.sweep.spec import get_dotted

_TERMS = tuple(t for t in TERMS if t not in ADVERSARIAL_TERMS)
TRACED: tuple[str, ...] = (
    "data.feature_probability",
    "pretrain.optim.lr",
    "pretrain.optim.weight_decay",
    "pretrain.optim.final_lr_frac",
    "warmup.lr",
    "warmup.weight_decay",
    "train.optim.lr",
    "train.optim.weight_decay",
    "train.optim.final_lr_frac",
    "train.loss.p",
    "train.loss.p_final",
    "train.loss.beta",
    *(f"train.loss.{t}" for t in _TERMS),
)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def signature(raw_cfg: dict[str, Any]) -> str:
    """What members must share to run as one program: the config without the seed and without
    the numeric values of the traced keys (a key that is not a number, e.g. `p_final = None`,
    stays in the signature: it changes the program's structure)."""
    cfg = copy.deepcopy(raw_cfg)
    cfg.get("run", {}).pop("seed", None)
    for key in TRACED:
        parent, last = key.rsplit(".", 1)
        node = get_dotted(cfg, parent)
        if isinstance(node, dict) and _number(node.get(last)):
            node[last] = "<traced>"
    return json.dumps(cfg, sort_keys=True, default=str)


def varied(raw_cfgs: Iterable[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """{key: float32 values per member} for the traced keys whose values differ among the
    members of one group (their signatures are equal)."""
    raws = list(raw_cfgs)
    out = {}
    for key in TRACED:
        vals = [get_dotted(r, key) for r in raws]
        if all(_number(v) for v in vals) and len(set(vals)) > 1:
            out[key] = np.asarray(vals, np.float32)
    return out


def substitute(cfg: Any, values: Mapping[str, Any]) -> Any:
    """The (pydantic) config with `values` ({dotted key: value}, tracers allowed) in place,
    without validation: the copies are made with `model_copy(update=...)` along each path."""
    for key, value in values.items():
        cfg = _put(cfg, key.split("."), value)
    return cfg


def _put(model: Any, parts: list[str], value: Any) -> Any:
    head, *rest = parts
    if not rest:
        return model.model_copy(update={head: value})
    return model.model_copy(update={head: _put(getattr(model, head), rest, value)})
