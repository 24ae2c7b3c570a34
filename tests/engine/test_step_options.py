"""Options of the train step for an accelerator (issue 41 item 4), each opt-in:

- `[train.ppgd] unroll`: the PPGD warm-up ascents as straight-line code instead of a loop.
  The same operations on the same values: on CPU the step is the same bits (exact equality).
- `[precision] target_dtype`: an imported target's frozen weights stored in another dtype than
  the decomposition's. The values change only by that rounding: every forward and loss of the
  step on a bfloat16-stored target is, bit for bit, that of a float32 target holding the
  bfloat16-rounded weights (the update: to float32 rounding, see the test).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdctl.config import parse_config
from pdctl.errors import PdctlError
from pdctl.science.targets.hf import HFCausalLM, read_hf_config

SEQ = 8
LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
             intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip


def _hf(tmp_path, dtype=jnp.float32) -> HFCausalLM:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    spec = read_hf_config(tmp_path, need_weights=False)
    return HFCausalLM(spec=spec, seq_len=SEQ, param_dtype=dtype)


def _raw(precision=None, ppgd=None):
    return {
        "schema": 1,
        "target": {"kind": "hf", "path": "unused"},
        "data": {"path": "unused", "seq_len": SEQ},
        "precision": precision or {},
        "decomp": {"sites": [{"pattern": "*.2.mlp.*", "C": 6}],
                   "ci_fn": {"type": "shared_mlp", "hidden": [8]}},
        "train": {"batch_size": 4, "scan_layers": False, "loss": {
            "faithfulness": 1.0, "importance_minimality": 1e-2, "merged_recon": 1.0},
            "ppgd": {"n_warmup_steps": 2, "scope": "per_batch_per_position", **(ppgd or {})}},
    }  # fmt: skip


def _step(cfg, target, params, key=1):
    from pdctl.engine import sharding
    from pdctl.science.spd.components import init_decomposition_reference
    from pdctl.stages import train
    from pdctl.stages.decomposition import decomposed_sites, source_shape

    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    comps, ci_fns, sources = init_decomposition_reference(
        jax.random.key(key), decomposed_sites(cfg, target), "shared_mlp", [8],
        lambda C: source_shape(cfg, C),
    )  # fmt: skip
    tokens = jax.random.randint(jax.random.key(2), (4, SEQ + 1), 0, 64)
    prog = train.program(cfg, mesh, target)
    state = prog.jit_make_state()(comps, ci_fns, sources)
    return prog, jax.device_get(prog.jit(donate=False)(params, state, {"tokens": tokens}))


def test_options_default_to_todays_step():
    cfg = parse_config(_raw())
    assert cfg.precision.target_dtype is None and cfg.train.ppgd.unroll is False


def test_target_dtype_is_for_an_imported_target_only(tmp_path):
    from pdctl.stages.inputs import abstract_target, target_from_config

    raw = _raw({"target_dtype": "bfloat16"})
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    raw["target"]["path"] = str(tmp_path)
    cfg = parse_config(raw)
    target = target_from_config(cfg, need_weights=False)
    assert target.param_dtype == jnp.bfloat16
    assert {a.dtype for a in jax.tree.leaves(abstract_target(cfg, target))} == {
        jnp.dtype(jnp.bfloat16)
    }
    # the decomposition stays in param_dtype
    from pdctl.stages.decomposition import abstract_decomposition

    dec = abstract_decomposition(cfg, target)
    assert {a.dtype for a in jax.tree.leaves(dec["components"])} == {jnp.dtype(jnp.float32)}
    toy = {"schema": 1, "precision": {"target_dtype": "bfloat16"},
           "decomp": {"sites": [{"pattern": "linear1", "C": 4}]}}  # fmt: skip
    with pytest.raises(PdctlError, match=r"^precision.target_dtype: only an imported target"):
        parse_config(toy)


def test_unrolled_ppgd_warmup_has_no_loop(tmp_path):
    """The lowered step: the warm-up ascents' loop is gone with `unroll` (and there without)."""
    target = _hf(tmp_path)
    from pdctl.engine import sharding
    from pdctl.stages import train

    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    loops = {}
    for unroll in (False, True):
        cfg = parse_config(_raw(ppgd={"unroll": unroll}))
        text = train.program(cfg, mesh, target).lower().as_text()
        loops[unroll] = text.count("stablehlo.while")
    assert loops[False] >= 1 and loops[True] == loops[False] - 1


@pytest.mark.slow  # two train-step compiles (~30 s on the loaded 2-core machine)
def test_unrolled_ppgd_warmup_is_the_same_step(tmp_path):
    target = _hf(tmp_path)
    params = jax.jit(target.init)(jax.random.key(0))
    out = {}
    for unroll in (False, True):
        cfg = parse_config(_raw(ppgd={"unroll": unroll}))
        out[unroll] = _step(cfg, target, params)[1]
    jax.tree.map(np.testing.assert_array_equal, out[False], out[True])
    assert np.isfinite(out[True][1]["merged_recon"])


@pytest.mark.slow  # ~7 s: two train steps compiled
def test_bfloat16_target_computes_in_the_compute_dtype(tmp_path):
    """Every forward of a target stored apart (`compute_dtype` set, as target_from_config sets
    it with `target_dtype`) casts its weights on entry: the evaluation's, harvest's and
    report's forwards compute as the train step does, not in bfloat16. Its logits are those
    of the float32 target holding the rounded weights, bit for bit."""
    from pdctl.science.spd.losses import clean_forward

    t32 = _hf(tmp_path)
    t16 = dataclasses.replace(t32, param_dtype=jnp.bfloat16, compute_dtype=jnp.float32)
    params = jax.jit(t32.init)(jax.random.key(0))
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    rounded = jax.tree.map(lambda a: a.astype(jnp.float32), p16)
    x = jax.random.randint(jax.random.key(1), (2, SEQ), 0, 64)
    paths = ["model.layers.1.mlp.up_proj"]
    for fn in (
        lambda t, p: t.apply(p, x),
        lambda t, p: clean_forward(t, p, x, paths),
        lambda t, p: dataclasses.replace(t, scan_layers=True).apply_sites(p, x)[0],
    ):
        a = jax.jit(functools.partial(fn, t16))(p16)
        b = jax.jit(functools.partial(fn, t32))(rounded)
        jax.tree.map(np.testing.assert_array_equal, a, b)
        assert {l.dtype for l in jax.tree.leaves(a)} == {jnp.dtype(jnp.float32)}
    # unset (every config without target_dtype): the weights compute as stored
    assert t32.compute_dtype is None
    plain16 = dataclasses.replace(t32, param_dtype=jnp.bfloat16)
    h = jax.jit(lambda p: plain16.apply(p, x))(p16)
    assert not np.array_equal(
        np.asarray(h), np.asarray(jax.jit(lambda p: t32.apply(p, x))(rounded))
    )


@pytest.mark.slow  # two train-step compiles (~30 s on the loaded 2-core machine)
def test_bfloat16_target_is_the_rounded_float32_target(tmp_path):
    """The step on the bfloat16-stored target (as `target_dtype = "bfloat16"` loads it) equals
    the step on a float32 target holding the same rounded values: faithfulness, every forward
    and the new state, bit for bit; only the storage differs."""
    t32 = _hf(tmp_path)
    t16 = dataclasses.replace(t32, param_dtype=jnp.dtype(jnp.bfloat16))
    params = jax.jit(t32.init)(jax.random.key(0))
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    rounded = jax.tree.map(lambda a: a.astype(jnp.float32), p16)
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(rounded), strict=True)
    assert not all(np.array_equal(a, b) for a, b in pairs)
    cfg32 = parse_config(_raw())
    cfg16 = parse_config(_raw({"target_dtype": "bfloat16"}))
    prog16, (state16, m16) = _step(cfg16, t16, p16)
    assert {a.dtype for a in jax.tree.leaves(prog16.frozen_abstract)} == {jnp.dtype(jnp.bfloat16)}
    _, (state32, m32) = _step(cfg32, t32, rounded)
    # every forward and loss term (faithfulness included) is the same bits ...
    jax.tree.map(np.testing.assert_array_equal, m16, m32)
    assert m16["faithfulness"] > 0

    # ... and the update agrees to float32 rounding: XLA:CPU forms a backward product whose
    # operand is the in-program cast with another dot kernel (a different summation order)
    def close(a, b):
        scale = float(np.max(np.abs(b))) if np.size(b) else 0.0
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale)

    jax.tree.map(close, state16, state32)
