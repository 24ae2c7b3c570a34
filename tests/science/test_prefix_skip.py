"""The prefix skip: when the first decomposed site sits in block L, every
masked forward equals the clean one below L, so the clean forward keeps the stream entering
block L (`losses.Clean.residual`) and every masked forward starts there.

Numerics: the skipped blocks are the same operations on the same inputs as the clean forward's,
so on CPU the values are the same bits: these tests compare with the skip off
(`prefix_layer` patched to None, the forwards run whole) by exact equality.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdctl.config import parse_config
from pdctl.science.spd import losses as L
from pdctl.science.targets import LlamaMLP
from pdctl.science.targets.base import Residual
from pdctl.science.targets.hf import HFCausalLM, read_hf_config

SEQ = 8
LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
             intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip


def _hf(tmp_path, scan: bool = False, **over) -> HFCausalLM:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **over}))
    t = HFCausalLM(spec=read_hf_config(tmp_path, need_weights=False), seq_len=SEQ)
    return dataclasses.replace(t, scan_layers=scan)


def _site_data(target, paths, seed: int = 0, C: int = 5):
    rng = np.random.default_rng(seed)
    shapes = target.site_shapes()
    data = {}
    for j, p in enumerate(paths):
        d_in, d_out = shapes[p]
        data[p] = (
            jnp.asarray(rng.normal(size=(d_in, C)) / d_in**0.5, jnp.float32),
            jnp.asarray(rng.normal(size=(C, d_out)) / C**0.5, jnp.float32),
            jnp.asarray(rng.uniform(size=(2, SEQ, C)), jnp.float32),
            jnp.asarray(rng.uniform(size=(2, SEQ)), jnp.float32),
            jnp.asarray(rng.uniform(size=(2, SEQ)) < 0.5 + 0.05 * j),
        )
    return data


def _targets(tmp_path):
    llama_mlp = LlamaMLP(vocab_size=64, d_model=16, n_layers=3, n_heads=2, d_mlp=32, seq_len=SEQ)
    return {
        "llama_mlp": (llama_mlp, ["layers.1.mlp.up", "layers.2.mlp.down", "layers.2.attn.q"]),
        "hf": (_hf(tmp_path), ["model.layers.2.mlp.up_proj", "model.layers.3.self_attn.o_proj"]),
        "hf-scan": (
            _hf(tmp_path, scan=True),
            [f"model.layers.{i}.mlp.down_proj" for i in (1, 2, 3)],
        ),
    }


@pytest.mark.parametrize(
    "name",
    # (7-9 s each on the loaded 2-core machine: the closure-based and the scanned forwards in
    # the slow tier, the unrolled hf one in every run)
    [pytest.param("llama_mlp", marks=pytest.mark.slow), "hf",
     pytest.param("hf-scan", marks=pytest.mark.slow)],
)  # fmt: skip
def test_masked_forward_from_the_clean_prefix_is_the_whole_forward(tmp_path, name):
    """The clean forward keeps the stream entering the first block with a site; a masked
    forward started there (all sites, or only a later one, as layerwise recon masks) gives the
    whole masked forward's logits bit for bit; the clean output and site inputs do not move."""
    target, paths = _targets(tmp_path)[name]
    first = min(target.layer_of(p) for p in paths)
    assert L.prefix_layer(target, paths) == first > 0
    params = jax.jit(target.init)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ), 0, 64)
    data = _site_data(target, paths)

    @jax.jit
    def run(prm, x):
        c = L.clean_forward(target, prm, x, paths)
        plain = L.clean_forward(target, prm, x, paths, prefix=False)
        out = {"clean": c, "plain": plain}
        for label, keys in (("all", paths), ("last", paths[-1:])):
            d = {p: data[p] for p in keys}
            whole, _ = target.apply_sites(prm, x, L.masked_site, d)
            skip, _ = target.apply_sites(
                prm, x, L.masked_site, d, start=Residual(first, c.residual)
            )
            out[label] = (whole, skip)
        return out

    out = run(params, tokens)
    c, plain = out["clean"], out["plain"]
    assert c.residual.ndim == 3 and c.residual.shape[:2] == (2, SEQ)  # (B, T, d_model)
    assert plain.residual is None
    np.testing.assert_array_equal(np.asarray(c.out), np.asarray(plain.out))
    for p in paths:
        np.testing.assert_array_equal(
            np.asarray(c.site_inputs[p]), np.asarray(plain.site_inputs[p])
        )
    for label in ("all", "last"):
        whole, skip = (np.asarray(a) for a in out[label])
        assert not np.allclose(whole, np.asarray(c.out))  # the masks do change the output
        np.testing.assert_array_equal(skip, whole, err_msg=label)
    # ... and a stream that is not the clean one's changes it: the start is really used
    wrong, _ = jax.jit(
        lambda prm, x, r: target.apply_sites(prm, x, L.masked_site, data, start=Residual(first, r))
    )(params, tokens, c.residual + 1.0)
    assert not np.allclose(np.asarray(wrong), np.asarray(out["all"][0]))


def test_no_prefix_without_blocks_or_from_block_0(tmp_path):
    """Nothing to skip: a target without blocks (TMS, ResidMLP, whose `apply_sites` take no
    `residual`), or a first site in block 0."""
    from pdctl.science.targets import TMS, ResidMLP

    assert L.prefix_layer(TMS(n_features=5, n_hidden=2), ["linear1"]) is None
    resid = ResidMLP(n_features=8, d_embed=16, d_mlp=4, n_layers=2)
    params = resid.init(jax.random.key(0))
    c = L.clean_forward(resid, params, jnp.ones((2, 8)), ["layers.1.mlp_in"])
    assert c.residual is None and set(c.site_inputs) == {"layers.1.mlp_in"}
    target = _hf(tmp_path)
    assert (
        L.prefix_layer(target, ["model.layers.0.mlp.up_proj", "model.layers.3.mlp.up_proj"]) is None
    )
    assert L.prefix_layer(target, ["model.layers.3.mlp.up_proj"]) == 3


def _cfg(**train):
    return parse_config({
        "schema": 1,
        "target": {"kind": "hf", "path": "unused"},
        "data": {"path": "unused", "seq_len": SEQ},
        "decomp": {"sites": [{"pattern": "*.[23].mlp.*", "C": 6}],
                   "ci_fn": {"type": "shared_mlp", "hidden": [8]}},
        "train": {"batch_size": 4, "loss": {
            "faithfulness": 1.0, "importance_minimality": 1e-2, "stochastic_recon": 1.0,
            "ppgd_recon": 0.5},
            "ppgd": {"n_warmup_steps": 1}, **train},
    })  # fmt: skip


@pytest.mark.slow  # two train-step compiles: 50 s on the loaded 2-core machine (load 7)
def test_train_step_with_the_prefix_skip_equals_it_without(tmp_path, monkeypatch):
    """The whole train step (stochastic and PPGD terms, the PPGD warm-up ascent, 2 accumulated
    micro-batches whose clean streams are split like the site inputs), with the sites in
    layers 2-3 of 4: metrics and the new state equal the step without the skip, bit for bit.
    (The scanned forward from a prefix: `test_masked_forward_from_the_clean_prefix_...`.)"""
    from pdctl.engine import sharding
    from pdctl.science.spd.components import init_decomposition_reference
    from pdctl.stages import train
    from pdctl.stages.decomposition import decomposed_sites, source_shape

    target = _hf(tmp_path, num_hidden_layers=4)
    cfg = _cfg(scan_layers=False, grad_accum_steps=2)
    params = jax.jit(target.init)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (4, SEQ + 1), 0, 64)
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    comps, ci_fns, sources = init_decomposition_reference(
        jax.random.key(1), decomposed_sites(cfg, target), "shared_mlp", [8],
        lambda C: source_shape(cfg, C),
    )  # fmt: skip
    out = {}
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(L, "prefix_layer", lambda target, paths: None)
        prog = train.program(cfg, mesh, target)
        state = prog.jit_make_state()(comps, ci_fns, sources)
        out[skip] = jax.device_get(prog.jit(donate=False)(params, state, {"tokens": tokens}))
    jax.tree.map(np.testing.assert_array_equal, out[True], out[False])
    assert np.isfinite(out[True][1]["ppgd_recon"])
