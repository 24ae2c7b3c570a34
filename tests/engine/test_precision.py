"""The precision policy by operation (`pdctl.engine.precision`), read off the lowered programs:
the faithfulness term's dots carry HIGHEST precision in the train and warmup steps (forward and
backward) whatever `[precision]` says; `[precision] matmul` sets every other dot; "default"
leaves the program as it was."""

from __future__ import annotations

import re
import tomllib

import jax
import pytest
from helpers import TINY, merge

from pdctl.config import parse_config
from pdctl.engine import sharding
from pdctl.engine.precision import Policy
from pdctl.errors import PdctlError
from pdctl.stages import train, warmup
from pdctl.stages.inputs import target_from_config
from pdctl.templates import templates_root

DOT = re.compile(r"stablehlo\.dot_general.*?precision = \[(\w+), (\w+)\].*?loc\((#loc\d+)\)")
LOC = re.compile(r"^(#loc\d+) = loc\((.*)\)$", re.M)


def _cfg(template: str, precision: dict | None = None):
    raw = tomllib.loads((templates_root() / template / "pdctl.toml").read_text())
    raw = merge(raw, TINY.get(template, {}))
    raw["mesh"] = {"data": 1, "fsdp": 1}
    # the toy templates train without the term (their warmup fits V U): switch it on
    raw = merge(raw, {"precision": precision or {}, "train": {"loss": {"faithfulness": 1.0}}})
    return parse_config(raw)


def _dots(stage_module, cfg) -> list[tuple[str, str]]:
    """(precision, location text) of every dot_general of the stage's lowered step."""
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    prog = stage_module.program(cfg, mesh, target_from_config(cfg))
    text = prog.lower().as_text(debug_info=True)
    locs = dict(LOC.findall(text))

    def resolve(ref: str, depth: int = 0) -> str:
        # a location may name others (#loc12 = loc(callsite(#loc3 at #loc4)) / fused[...])
        body = locs.get(ref, ref)
        if depth > 8:
            return body
        return re.sub(r"#loc\d+", lambda m: resolve(m.group(0), depth + 1), body)

    return [(a, resolve(ref)) for a, b, ref in DOT.findall(text) if a == b]


@pytest.mark.parametrize("template", ["llama-mlp", "tms"])
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_faithfulness_dots_are_highest(template: str, compute: str) -> None:
    cfg = _cfg(template, {"compute_dtype": compute})
    for module in (train, warmup):
        dots = _dots(module, cfg)
        faith = [p for p, where in dots if "faithfulness" in where]
        # forward V @ U per site and its two cotangent products in the backward
        assert len(faith) >= 3, (module.__name__, dots)
        assert set(faith) == {"HIGHEST"}, (module.__name__, faith)
        if module is train:
            others = {p for p, where in dots if "faithfulness" not in where}
            assert others == {"DEFAULT"}, others


def test_matmul_key_sets_the_other_dots() -> None:
    dots = _dots(train, _cfg("llama-mlp", {"matmul": "high"}))
    assert {p for p, w in dots if "faithfulness" in w} == {"HIGHEST"}
    assert {p for p, w in dots if "faithfulness" not in w} == {"HIGH"}


def test_default_leaves_the_program_unchanged() -> None:
    """`matmul = "default"` wraps nothing: the lowered step is the plain step's, so a CPU's
    numerics cannot move."""
    cfg = _cfg("llama-mlp")
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    prog = train.program(cfg, mesh, target_from_config(cfg))
    assert prog.policy.scoped(prog.step) is prog.step
    assert Policy.from_config(cfg.precision).eval_matmul == "highest"


def test_output_dtype_is_gone_but_old_configs_load() -> None:
    assert "output_dtype" not in _cfg("tms", {"output_dtype": "float32"}).precision.model_dump()
    with pytest.raises(PdctlError, match="precision: `output_dtype` is gone"):
        _cfg("tms", {"output_dtype": "bfloat16"})


@pytest.mark.slow  # ~25 s: a train step compiled and run
def test_faithfulness_compares_stored_values_under_bf16_compute() -> None:
    """With compute_dtype = bfloat16 the step's faithfulness is the float32 value of the stored
    V, U and W, not of their bf16 casts (which alone differ from W by ~1e-6 per element)."""
    import numpy as np

    from pdctl.science.spd.losses import faithfulness_loss
    from pdctl.stages.init_weights import init_decomposition
    from pdctl.stages.inputs import STREAM_DECOMP, STREAM_TARGET, stream_key

    cfg = _cfg("llama-mlp", {"compute_dtype": "bfloat16"})
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    target = target_from_config(cfg)
    prog = train.program(cfg, mesh, target)
    params = jax.jit(target.init, out_shardings=prog.frozen_shardings[0])(
        stream_key(cfg, STREAM_TARGET)
    )
    dec, _ = init_decomposition(cfg, target, mesh, stream_key(cfg, STREAM_DECOMP))
    state = prog.jit_make_state()(dec["components"], dec["ci_fns"], dec["sources"])
    comps = jax.device_get(dec["components"])
    weights = target.site_weights(params)
    expected = float(faithfulness_loss({p: weights[p] for p in comps}, comps))
    batch_size = cfg.train.batch_size
    tokens = np.zeros((batch_size, cfg.data.seq_len + 1), np.int32)
    batch = {"tokens": jax.device_put(tokens, prog.batch_shardings["tokens"])}
    _, metrics = prog.jit(donate=False)(params, state, batch)
    assert float(metrics["faithfulness"]) == pytest.approx(expected, rel=1e-6)
    rounded = jax.tree.map(lambda a: a.astype("bfloat16"), comps)
    w16 = {p: weights[p].astype("bfloat16") for p in comps}
    assert abs(float(faithfulness_loss(w16, rounded)) - expected) > 1e-4 * expected


@pytest.mark.parametrize(
    ("platforms", "accelerator"), [("cpu", False), ("tpu,cpu", True), ("cuda", True), ("", False)]
)
def test_cpu_devices_only_where_the_cpu_is_the_backend(
    monkeypatch: pytest.MonkeyPatch, platforms: str, accelerator: bool
) -> None:
    """`runtime.configure_devices` makes one CPU device per core only where the CPU is JAX's
    backend: on a TPU VM it had added 13 CPU devices beside the chip."""
    from pdctl.engine import runtime

    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    # this machine has no TPU runtime or GPU plugin: with JAX_PLATFORMS unset, the CPU
    assert runtime.accelerator_host() is accelerator
