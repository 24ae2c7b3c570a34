"""Layers as a scan (`[train] scan_layers`): the scanned forward, the grouped per-site work and
the SPD loss equal the unrolled ones, and the program stays the same size as depth grows.

Tolerances: the scanned blocks run inside a while loop, and the grouped CI functions as one
batched matmul per group, where XLA may sum in another order than in the unrolled program;
values agree to float32 reassociation (relative 1e-5 on values of order one), not bit for bit.
Mask and noise draws are the same bits (each site keeps its own `fold_in(key, i)`).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_prefix_skip import _site_data

from pdctl.config import parse_config
from pdctl.science.spd import losses as L
from pdctl.science.spd.grouped import groups, map_sites
from pdctl.science.spd.masks import stochastic_masks
from pdctl.science.spd.stacked import per_site_tree
from pdctl.science.targets.hf import HFCausalLM, read_hf_config
from pdctl.stages import train

SEQ = 8
RTOL = ATOL = 1e-5  # float32 reassociation in the loop body / batched matmuls (see above)

CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
                  intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], vocab_size=64, hidden_size=32,
                  intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=1, tie_word_embeddings=True),
    "gpt2": dict(architectures=["GPT2LMHeadModel"], vocab_size=64, n_embd=32, n_layer=4,
                 n_head=4, n_positions=16, scale_attn_by_inverse_layer_idx=True),
}  # fmt: skip


def _spec(tmp_path, cfg: dict):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return read_hf_config(tmp_path, need_weights=False)


def _targets(tmp_path, name: str, n_layers: int | None = None):
    cfg = dict(CONFIGS[name])
    if n_layers is not None:
        cfg["n_layer" if name == "gpt2" else "num_hidden_layers"] = n_layers
    unrolled = HFCausalLM(spec=_spec(tmp_path, cfg), seq_len=SEQ)
    return unrolled, dataclasses.replace(unrolled, scan_layers=True)


def _close(a, b) -> None:
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), RTOL, ATOL), a, b
    )


def _sites(target: HFCausalLM) -> list[str]:
    """Layer 0 untouched, layers 1-2 every site, layer 3 its MLP only: three scanned runs."""
    paths = target.site_paths()
    return [p for p in paths if target.layer_site(p)[0] in (1, 2) or ".3.mlp" in p]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_scanned_forward_equals_unrolled(tmp_path, name):
    unrolled, scanned = _targets(tmp_path, name)
    params = jax.jit(unrolled.init)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ), 0, 64)
    paths = _sites(unrolled)
    data = _site_data(unrolled, paths)
    assert len(scanned._runs(data, paths)) == 3  # layer 0 | layers 1-2 | layer 3

    def run(t):
        return jax.jit(
            lambda prm, x: (
                L.clean_forward(t, prm, x, paths),
                t.apply_sites(prm, x, L.masked_site, data)[0],
            )
        )(params, tokens)

    (clean_u, masked_u), (clean_s, masked_s) = run(unrolled), run(scanned)
    _close(clean_s.out, clean_u.out)
    _close(clean_s.site_inputs, clean_u.site_inputs)
    _close(masked_s, masked_u)
    # and the plain forward is still the unrolled one: scan_layers changes apply_sites only
    np.testing.assert_array_equal(
        np.asarray(jax.jit(scanned.apply)(params, tokens)),
        np.asarray(jax.jit(unrolled.apply)(params, tokens)),
    )


@pytest.mark.slow  # ~7 s: two LM steps compiled, scanned and unrolled
def test_scanned_siteless_layers_equal_unrolled(tmp_path):
    """`scan_siteless`: the layers without sites before and after one decomposed layer (here
    layers 0-1 and 3-4 of 5, the MLP of layer 2 decomposed) run as two scans; the clean
    forward (captures, the kept stream), the masked forward started from that stream and its
    gradient equal the unrolled ones. Without it those layers stay unrolled (no loop)."""
    from pdctl.science.targets.base import Residual

    unrolled, scanned = _targets(tmp_path, "llama", n_layers=5)
    suffix = dataclasses.replace(scanned, scan_siteless=True)
    params = jax.jit(unrolled.init)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ), 0, 64)
    paths = [p for p in unrolled.site_paths() if ".2.mlp." in p]
    data = _site_data(unrolled, paths)
    assert suffix._runs(data, paths) == [(0, 2), (2, 3), (3, 5)]

    def step(t):
        def f(prm, x, d):
            clean = L.clean_forward(t, prm, x, paths)
            start = Residual(2, clean.residual)

            def masked(vu):  # d with its components (V, U) as the variables
                d2 = {p: (*vu[p], *d[p][2:]) for p in d}
                return t.apply_sites(prm, x, L.masked_site, d2, start=start)[0]

            out, vjp = jax.vjp(masked, {p: d[p][:2] for p in d})
            return clean, out, vjp(jnp.ones_like(out))[0]

        return jax.jit(f)

    _close(step(suffix)(params, tokens, data), step(unrolled)(params, tokens, data))
    for t, loops in ((scanned, 0), (suffix, 2)):
        jaxpr = jax.make_jaxpr(lambda prm, x, t=t: t.apply_sites(prm, x, capture=paths))
        assert str(jaxpr(params, tokens)).count("scan[") == loops, t


@pytest.mark.slow
def test_scanned_forward_takes_stacked_units(tmp_path):
    """Units (a group key, its data stacked over its layers) give the per-site forward:
    q_proj as one unit over all 4 layers, k_proj over layers 1-2 only, so the layers run as
    [0] | [1, 2] | [3] and the q unit is sliced into each run and its captures put back
    together; down_proj per site."""
    from pdctl.science.spd.grouped import group_key, members

    unrolled, scanned = _targets(tmp_path, "llama")
    params = jax.jit(unrolled.init)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ), 0, 64)
    shapes = unrolled.site_shapes()
    rng = np.random.default_rng(0)
    C = 5
    q, k = (
        group_key("model.layers", 0, 3, "self_attn.q_proj"),
        group_key("model.layers", 1, 2, "self_attn.k_proj"),
    )
    downs = [f"model.layers.{i}.mlp.down_proj" for i in range(4)]

    def site_data(p, j):
        d_in, d_out = shapes[p]
        return (
            jnp.asarray(rng.normal(size=(d_in, C)) / d_in**0.5, jnp.float32),
            jnp.asarray(rng.normal(size=(C, d_out)) / C**0.5, jnp.float32),
            jnp.asarray(rng.uniform(size=(2, SEQ, C)), jnp.float32),
            jnp.asarray(rng.uniform(size=(2, SEQ)), jnp.float32),
            jnp.asarray(rng.uniform(size=(2, SEQ)) < 0.5 + 0.05 * j),
        )

    per_site = {}
    for j, p in enumerate([*members(q), *members(k), *downs]):
        per_site[p] = site_data(p, j)
    units = {u: _stack_sites([per_site[m] for m in members(u)]) for u in (q, k)}
    units.update({p: per_site[p] for p in downs})
    assert scanned._runs(units, (q, k)) == [(0, 1), (1, 3), (3, 4)]

    def run(t, data, capture):
        return jax.jit(
            lambda prm, x: t.apply_sites(prm, x, L.masked_site, data, capture)
        )(params, tokens)  # fmt: skip

    out_u, got_u = run(unrolled, per_site, [*members(q), *members(k)])
    out_s, got_s = run(scanned, units, (q, k))
    _close(out_s, out_u)
    for u in (q, k):
        _close(got_s[u], jnp.stack([got_u[m] for m in members(u)]))
    # the unrolled target takes units too (split into sites, captures stacked back)
    out_uu, got_uu = run(unrolled, units, (q, k))
    _close(out_uu, out_u)
    _close(got_uu, got_s)


def _stack_sites(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


@pytest.mark.slow
def test_grouped_site_work_draws_the_same_bits():
    rng = np.random.default_rng(0)
    ci = {f"s{i}": jnp.asarray(rng.uniform(size=(3, 4 if i % 2 else 6)), jnp.float32)
          for i in range(5)}  # fmt: skip
    assert groups(list(ci), ci) == [[0, 2, 4], [1, 3]]
    key = jax.random.key(3)
    for sampling in ("continuous", "binomial"):
        a = jax.jit(lambda c, s=sampling: stochastic_masks(key, c, s, True))(ci)
        b = jax.jit(lambda c, s=sampling: stochastic_masks(key, c, s, True, grouped=True))(ci)
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    out = map_sites(lambda i, c: (i, c.sum()), list(ci), ci)
    assert [int(out[p][0]) for p in ci] == list(range(5))


def _cfg(sites=None, **train):
    sites = sites or [{"pattern": "*.mlp.*", "C": 6}, {"pattern": "*attn.*", "C": 4}]
    return parse_config({
        "schema": 1,
        "target": {"kind": "hf", "path": "unused"},
        "data": {"path": "unused", "seq_len": SEQ},
        "decomp": {"sites": sites,
                   "ci_fn": {"type": "shared_mlp", "hidden": [8]}, "sampling": "binomial"},
        "train": {"batch_size": 2, "loss": {
            "faithfulness": 1.0, "importance_minimality": 1e-2, "stochastic_recon": 1.0,
            "stochastic_recon_subset": 1.0, "subset_routing": "uniform_k",
            "stochastic_recon_layerwise": 0.5, "ppgd_recon": 0.5, "ci_masked_recon": 0.3},
            **train},
    })  # fmt: skip


@pytest.mark.slow
def test_spd_loss_and_grads_scan_equal_unrolled(tmp_path):
    """Every loss term (layerwise and PPGD included), its metrics and all gradients, one
    device; tests/stages/test_hf_pipeline.py compares whole runs on the test session's 4 devices."""
    from pdctl.config import match_sites
    from pdctl.science.spd.components import init_decomposition_reference

    unrolled, scanned = _targets(tmp_path, "llama", n_layers=3)
    # the MLP sites of all layers and q_proj of two: a scanned run of 2 layers, one unrolled
    cfg = _cfg([{"pattern": "*.mlp.*", "C": 6}, {"pattern": "*.[01].*.q_proj", "C": 4}])
    params = jax.jit(unrolled.init)(jax.random.key(0))
    site_C = match_sites(cfg, unrolled.site_paths())
    sites = {p: (*unrolled.site_shapes()[p], C) for p, C in site_C.items()}
    comps, ci_fns, sources = init_decomposition_reference(
        jax.random.key(1), sites, "shared_mlp", [8], lambda C: (C + 1,)
    )
    tokens = jax.random.randint(jax.random.key(2), (2, SEQ), 0, 64)
    out = {}
    for t in (unrolled, scanned):
        fns = L.make_spd_fns(t, site_C, cfg)

        def loss(tr, src, fns=fns):
            c = fns.clean(params, tokens)
            return fns.loss(tr, params, src, c, tokens, jax.random.key(4), 0.5)

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        out[t.scan_layers] = grad({"components": comps, "ci_fns": ci_fns}, sources)
    # ... and on the stacked train state's layout (the MLP sites of all 3 layers as three
    # units, q_proj of layers 0-1 as one): the functions take the groups as they are
    stacking = train.stacking_for(cfg, scanned)
    assert len(stacking.groups) == 4, stacking.groups
    fns = L.make_spd_fns(scanned, site_C, cfg, stacking=stacking)
    assert len(fns.units) == 4

    def stacked_loss(tr, src):
        c = fns.clean(params, tokens)
        return fns.loss(tr, params, src, c, tokens, jax.random.key(4), 0.5)

    grad = jax.jit(jax.value_and_grad(stacked_loss, argnums=(0, 1), has_aux=True))
    tr = {"components": stacking.stack(comps), "ci_fns": stacking.stack(ci_fns)}
    (v_st, m_st), g_st = grad(tr, stacking.stack(sources))
    (v_u, m_u), g_u = out[False]
    (_, m_s), g_s = out[True]
    assert set(m_u) == set(m_s) == set(m_st)
    _close(m_s, m_u)
    _close(g_s, g_u)
    _close(m_st, m_u)
    _close(v_st, v_u)
    g_st = (
        {k: per_site_tree(v) for k, v in g_st[0].items()},
        per_site_tree(g_st[1]),
    )
    _close(g_st, g_u)


def _hlo_ops(n_layers: int, tmp_path) -> int:
    """Instructions of the train step's lowered program (StableHLO) for an n-layer model."""
    from pdctl.engine import sharding
    from pdctl.stages import train

    cfg = _cfg(scan_layers=True)
    # Layerwise recon is one forward per site by definition: it grows with depth either way.
    cfg = cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"loss": cfg.train.loss.model_copy(
            update={"stochastic_recon_layerwise": 0.0})})}
    )  # fmt: skip
    cfg_dir = tmp_path / f"m{n_layers}"
    cfg_dir.mkdir()
    target, _ = _targets(cfg_dir, "llama", n_layers=n_layers)
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    prog = train.program(cfg, mesh, target)
    args = (prog.frozen_abstract[0], prog.abstract_state, prog.batch_abstract)
    text = prog.jit().lower(*args).as_text()
    return sum(1 for line in text.splitlines() if " = " in line)


@pytest.mark.slow
def test_train_step_program_does_not_grow_with_depth(tmp_path):
    """The compile-time claim in a form a test can pin: the lowered train step of an 8-layer
    model has 1.06x the 2-layer one's instructions (9,495 -> 10,059; the SPD functions take
    the stacked groups as they are; before that 11,564 -> 19,310, and unrolled 12,452 ->
    45,856: one block per layer and every per-site array's optimizer, clip and guard ops).
    What still grows, ~9 operations per site, is stacking the frozen layers' weights for the
    scan and the per-site L0 metrics. Compile times are in benchmarks/startup/scan_compile.py."""
    small, deep = _hlo_ops(2, tmp_path), _hlo_ops(8, tmp_path)
    assert deep < 1.1 * small, (small, deep)


@pytest.mark.slow  # two 2-layer train steps with 2 micro-batches each (compiles dominate)
def test_grad_accumulation_with_stacked_units_equals_unrolled(tmp_path):
    """`grad_accum_steps` > 1 splits a stacked unit's captured inputs on their batch axis,
    behind the layers: (L, B, ...) -> (k, L, B/k, ...). (It split the layer axis and failed at
    trace time.) The scanned step equals the unrolled one, the PPGD warm-up ascent on
    per-batch sources included."""
    from pdctl.engine import sharding
    from pdctl.science.spd.components import init_decomposition_reference
    from pdctl.stages.decomposition import decomposed_sites, source_shape

    unrolled, _ = _targets(tmp_path, "llama", n_layers=2)
    params = jax.jit(unrolled.init)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (4, SEQ + 1), 0, 64)
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    out = {}
    # an MLP unit (up_proj, whose sources are checked below) and an attention unit (q_proj)
    # stacked over both layers: 4 sites, 14 before (every loss term compiles per site; the
    # other sites are more units of the same two kinds)
    sites = [{"pattern": "*.mlp.up_proj", "C": 6}, {"pattern": "*.q_proj", "C": 4}]
    for scan in (False, True):
        cfg = _cfg(sites, scan_layers=scan, grad_accum_steps=2)
        tc = cfg.train
        ppgd = tc.ppgd.model_copy(update={"scope": "per_batch_per_position", "n_warmup_steps": 1})
        cfg = cfg.model_copy(
            update={"train": tc.model_copy(update={"batch_size": 4, "ppgd": ppgd})}
        )
        comps, ci_fns, sources = init_decomposition_reference(
            jax.random.key(1), decomposed_sites(cfg, unrolled), "shared_mlp", [8],
            lambda C, cfg=cfg: source_shape(cfg, C),
        )  # fmt: skip
        prog = train.program(cfg, mesh, unrolled)
        state = prog.jit_make_state()(comps, ci_fns, sources)
        new, m = prog.jit(donate=False)(params, state, {"tokens": tokens})
        out[scan] = (train.unstack_state(new), m)
    (s_u, m_u), (s_s, m_s) = out[False], out[True]
    assert not np.array_equal(s_u["sources"]["model.layers.0.mlp.up_proj"],
                              sources["model.layers.0.mlp.up_proj"])  # fmt: skip
    _close(m_s, m_u)
    _close(s_s["trainable"], s_u["trainable"])
    _close(s_s["sources"], s_u["sources"])
