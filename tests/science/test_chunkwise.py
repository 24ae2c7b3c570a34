"""Chunkwise subset reconstruction (`[train.loss] chunkwise_recon`, `sites_per_chunk`):
goodfire-ai/param-decomp's `ChunkwiseSubsetReconLoss`. The step's sites are cut into
consecutive chunks; per sample and chunk one forward in which only that chunk's sites are
masked (routed among them), started from the clean stream at the chunk's first block; the term
is the mean over those forwards.

Numerics: a forward started from the clean stream at block L runs the same operations on the
same inputs as the whole forward from block L on, and the blocks below are the clean forward's,
so on CPU the unrolled values are the same bits (as tests/science/test_prefix_skip.py finds for the
prefix). The scanned layout runs its blocks inside a loop and its grouped per-site work as
batched matmuls, where XLA may sum in another order: there values agree to float32
reassociation (relative 1e-5), as in tests/science/test_scan.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cli, make_run
from test_resume import metric_lines

from pdctl.config import match_sites, parse_config
from pdctl.science.spd import losses as L
from pdctl.science.spd.components import init_decomposition_reference
from pdctl.science.spd.grouped import group_key
from pdctl.science.spd.masks import routing_masks, stochastic_masks
from pdctl.science.spd.stacked import per_site_tree
from pdctl.science.targets.hf import HFCausalLM, read_hf_config
from pdctl.stages import train

SEQ = 8
RTOL = ATOL = 1e-5  # scanned vs unrolled: float32 reassociation (module doc)
LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
             intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip
# the MLP sites of layers 1-3: 9 sites, first block 1 (a prefix to skip); in chunks of 4:
# [1.gate 1.up 1.down 2.gate] [2.up 2.down 3.gate 3.up] [3.down], two of them starting
# inside a layer, the last one shorter
SITES = [{"pattern": "*.[123].mlp.*", "C": 5}]
PER_CHUNK = 4


def _targets(tmp_path) -> tuple[HFCausalLM, HFCausalLM]:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    unrolled = HFCausalLM(spec=read_hf_config(tmp_path, need_weights=False), seq_len=SEQ)
    return unrolled, dataclasses.replace(unrolled, scan_layers=True)


def _cfg(samples: int = 2, sites=None, train=None, **loss):
    return parse_config({
        "schema": 1,
        "target": {"kind": "hf", "path": "unused"},
        "data": {"path": "unused", "seq_len": SEQ},
        "decomp": {"sites": sites or SITES, "ci_fn": {"type": "shared_mlp", "hidden": [8]},
                   "n_mask_samples": samples},
        "train": {"batch_size": 2, **(train or {}), "loss": {
            "faithfulness": 0.0, "importance_minimality": 1e-2, "stochastic_recon": 0.0,
            "stochastic_recon_layerwise": 0.0, "output": "kl", **loss}},
    })  # fmt: skip


def _setup(target, cfg):
    params = jax.jit(target.init)(jax.random.key(0))
    site_C = match_sites(cfg, target.site_paths())
    sites = {p: (*target.site_shapes()[p], C) for p, C in site_C.items()}
    comps, ci_fns, sources = init_decomposition_reference(
        jax.random.key(1), sites, "shared_mlp", [8], lambda C: (C + 1,)
    )
    tokens = jax.random.randint(jax.random.key(2), (2, SEQ), 0, 64)
    return params, site_C, comps, ci_fns, sources, tokens


def _recon(target, params, comps, x, paths, starts=(), out_kind="kl"):
    """A Recon as the step builds it (no shared inner products) and ci_lower: random, with
    exact zeros and ones among them."""
    c = L.clean_forward(target, params, x, paths, starts=starts)
    w = target.site_weights(params)
    recon = L.Recon(
        target, params, {p: w[p] for p in paths}, comps, x, c.out, True, out_kind, False,
        tuple(paths), None, c.residual, c.starts,
    )  # fmt: skip
    rng = np.random.default_rng(5)
    lead = x.shape if out_kind == "kl" else x.shape[:1]
    ci = {p: jnp.asarray(np.clip(rng.uniform(-0.3, 1.3, (*lead, 5)), 0, 1), jnp.float32)
          for p in paths}  # fmt: skip
    return recon, ci


@functools.cache
def _toy():
    """A 2-layer ResidMLP (no blocks to start from: its forwards run whole), 4 sites, its
    components drawn in NumPy (no per-site init compiles)."""
    from pdctl.science.targets import ResidMLP

    target = ResidMLP(n_features=8, d_embed=16, d_mlp=4, n_layers=2)
    params = target.init(jax.random.key(0))
    paths = target.site_paths()
    rng = np.random.default_rng(1)
    comps = {}
    for p in paths:
        d_in, d_out = target.site_shapes()[p]
        comps[p] = {
            "V": jnp.asarray(rng.normal(size=(d_in, 5)) / d_in**0.5, jnp.float32),
            "U": jnp.asarray(rng.normal(size=(5, d_out)) / 5**0.5, jnp.float32),
        }
    x = jnp.asarray(rng.uniform(-1, 1, (16, 8)), jnp.float32)
    return target, params, paths, comps, x


def test_chunks_and_their_views():
    paths = [f"l.{i}.{n}" for i in range(3) for n in ("a", "b", "c")]
    assert L.site_chunks(paths, None) == (tuple(paths),)
    assert L.site_chunks(paths, 100) == (tuple(paths),)
    assert L.site_chunks(paths, 4) == (tuple(paths[:4]), tuple(paths[4:8]), (paths[8],))
    assert L.site_chunks(paths, 3) == tuple(tuple(paths[i : i + 3]) for i in (0, 3, 6))
    with pytest.raises(ValueError, match="positive"):
        L.site_chunks(paths, 0)
    # a stacked unit is cut where the chunks cut it; a single member becomes its plain site
    a, b = group_key("l", 0, 2, "a"), group_key("l", 0, 2, "b")
    tree = {a: jnp.arange(3.0)[:, None] * jnp.ones((3, 2)), b: {"V": jnp.arange(3.0)},
            "l.0.c": jnp.ones(2), "l.1.c": jnp.ones(2), "l.2.c": jnp.ones(2)}  # fmt: skip
    views = L.chunk_views(tree, L.site_chunks(paths, 4))
    # chunks: [0.a 0.b 0.c 1.a] [1.b 1.c 2.a 2.b] [2.c]
    assert [list(v) for v in views] == [
        ["l.0-1.a", "l.0.b", "l.0.c"],
        ["l.2.a", "l.1-2.b", "l.1.c"],
        ["l.2.c"],
    ]
    np.testing.assert_array_equal(views[0]["l.0-1.a"], [[0, 0], [1, 1]])
    np.testing.assert_array_equal(views[1]["l.2.a"], [2, 2])
    np.testing.assert_array_equal(views[1]["l.1-2.b"]["V"], [1, 2])
    # one chunk of everything: the tree as it is
    assert L.chunk_views(tree, L.site_chunks(paths, None))[0] == tree


def _one_chunk_vs_subset(target, params, comps, x, paths, starts, out_kind):
    """(subset term, chunkwise term with one chunk) on the same key: value and gradients
    with uniform_k routing over 2 samples, the value with static_p over 1; one program."""
    key = jax.random.key(7)
    chunks = L.site_chunks(paths, None)

    def both(comps, routing, n):
        recon, ci = _recon(target, params, comps, x, paths, starts, out_kind)
        subset = L.stochastic_recon_loss(recon, ci, key, n, "continuous", routing, 0.3)
        chunked = L.chunkwise_recon_loss(recon, ci, key, n, "continuous", chunks, routing, 0.3)
        return subset, chunked

    @jax.jit
    def run(comps):
        grads = [
            jax.value_and_grad(lambda c, i=i: both(c, "uniform_k", 2)[i])(comps) for i in (0, 1)
        ]
        return grads, both(comps, "static_p", 1)

    (want, got), (want_p, got_p) = run(comps)
    assert float(want[0]) > 0 and float(want_p) > 0
    jax.tree.map(np.testing.assert_array_equal, got, want)
    np.testing.assert_array_equal(got_p, want_p)


@pytest.mark.slow  # 4 s on 2 cores: over the fast tier's ~2.5 s (README)
def test_one_chunk_is_the_subset_term():
    """(1) One chunk holding every site (sites_per_chunk unset, or at least the number of
    sites: `test_chunks_and_their_views`) is `stochastic_recon_subset` on the same key: the
    same draws, forwards and mean, so the same bits, value and gradients, under both routings.
    A toy here; `..._from_the_prefix` below on a language model whose forwards start at a
    block."""
    target, params, paths, comps, x = _toy()
    _one_chunk_vs_subset(target, params, comps, x, paths, (), "mse")


@pytest.mark.slow  # a 4-layer LM's recon forwards and gradients: 24 s on the loaded 2 cores
def test_one_chunk_is_the_subset_term_from_the_prefix(tmp_path):
    target, _ = _targets(tmp_path)
    params, site_C, comps, _, _, tokens = _setup(target, _cfg())
    _one_chunk_vs_subset(target, params, comps, tokens, list(site_C), [1], "kl")


def _by_hand(target, params, comps, ci, x, paths, key, n_samples, chunks, out_kind="kl"):
    """The term from its definition, every forward whole from the input: per sample s,
    (k_mask, k_route) = split(fold_in(key, s)); every site's masks from one draw of k_mask
    (site i: its fold i); chunk c routed uniform_k among its own sites with k_route (c = 0)
    or fold_in(k_route, c); only the chunk's sites masked; D; the mean."""
    total, routed = 0.0, []
    lead = next(iter(ci.values())).shape[:-1]
    clean = target.apply(params, x)
    for s in range(n_samples):
        k_mask, k_route = jax.random.split(jax.random.fold_in(key, s))
        masks, dmasks = stochastic_masks(k_mask, ci, "continuous", True, order=paths)
        for c, sites in enumerate(chunks):
            k_c = k_route if c == 0 else jax.random.fold_in(k_route, c)
            routes = routing_masks(k_c, sites, lead, "uniform_k")
            routed.append(routes)
            out = L.masked_forward(
                target, params, comps, x, {p: masks[p] for p in sites},
                {p: dmasks[p] for p in sites}, routes,
            )  # fmt: skip
            total = total + L.output_distance(out_kind, out, clean)
    return total / (n_samples * len(chunks)), routed


@pytest.mark.slow  # 3 s on 2 cores: over the fast tier's ~2.5 s (README)
def test_chunk_forwards_mask_only_their_sites():
    """(2, a toy) The term equals its definition: per chunk a forward with only that chunk's
    sites masked, routed among them (the one-site chunk at every example), the mean."""
    target, params, paths, comps, x = _toy()
    chunks = L.site_chunks(paths, 3)
    assert [len(c) for c in chunks] == [3, 1]
    key = jax.random.key(11)

    @jax.jit
    def run(params, comps, x):
        recon, ci = _recon(target, params, comps, x, paths, (), "mse")
        got = L.chunkwise_recon_loss(recon, ci, key, 2, "continuous", chunks)
        return got, *_by_hand(target, params, comps, ci, x, paths, key, 2, chunks, "mse")

    got, want, routed = run(params, comps, x)
    assert float(want) > 0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert all(bool(np.all(np.asarray(r[chunks[1][0]]))) for r in routed[1::2])
    n = sum(np.asarray(r, np.int32) for r in routed[0].values())  # 1 to 3 of the first chunk's
    assert n.min() >= 1 and n.max() <= 3 and n.max() > n.min()


@pytest.mark.slow  # 18 forwards of a 4-layer LM in one program: 13 s on the loaded 2 cores
def test_each_chunk_forward_from_its_block_is_the_whole_forward(tmp_path):
    """(2) The term equals its definition computed with whole forwards (each from the
    embedding, only that chunk's sites masked, the same masks and routes): each chunk's
    forward started from the clean stream at its first block is the whole one, bit for bit.
    The clean forward keeps the stream at blocks 2 and 3 (chunks 1 and 2 start inside layers
    2 and 3) beside the prefix at 1; routing is among a chunk's own sites (the one-site chunk
    is masked at every position)."""
    target, _ = _targets(tmp_path)
    params, site_C, comps, _, _, tokens = _setup(target, _cfg())
    paths = list(site_C)
    chunks = L.site_chunks(paths, PER_CHUNK)
    assert [len(c) for c in chunks] == [4, 4, 1]
    assert [target.layer_of(c[0]) for c in chunks] == [1, 2, 3]
    key = jax.random.key(11)

    @jax.jit
    def run(params, comps, tokens):
        recon, ci = _recon(target, params, comps, tokens, paths, starts=[1, 2, 3])
        got = L.chunkwise_recon_loss(recon, ci, key, 2, "continuous", chunks)
        # without the kept streams every forward starts at the prefix instead
        prefix = dataclasses.replace(recon, starts=None)
        got_prefix = L.chunkwise_recon_loss(prefix, ci, key, 2, "continuous", chunks)
        want, routed = _by_hand(target, params, comps, ci, tokens, paths, key, 2, chunks)
        return got, got_prefix, want, routed, recon.starts

    got, got_prefix, want, routed, starts = run(params, comps, tokens)
    assert float(want) > 0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_prefix), np.asarray(want))
    assert set(starts) == {1, 2, 3}
    assert not np.allclose(np.asarray(starts[2]), np.asarray(starts[1]))
    for routes in routed[2::3]:  # the last chunk: one site, k = 1 always
        assert bool(np.all(np.asarray(routes[chunks[2][0]])))
    for routes in routed[0::3]:  # a four-site chunk: 1 to 4 of its sites at each position
        n = sum(np.asarray(r, np.int32) for r in routes.values())
        assert n.min() >= 1 and n.max() <= 4 and n.max() > n.min()


def _loss_and_grads(target, cfg, stacking=None, setup=None):
    params, site_C, comps, ci_fns, sources, x = setup or _setup(target, cfg)
    fns = L.make_spd_fns(target, site_C, cfg, stacking=stacking)
    tr = {"components": comps, "ci_fns": ci_fns}
    if stacking is not None:
        tr = {k: stacking.stack(v) for k, v in tr.items()}
        sources = stacking.stack(sources)

    def loss(tr, src):
        c = fns.clean(params, x)
        return fns.loss(tr, params, src, c, x, jax.random.key(4), 0.5)

    (value, metrics), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        tr, sources
    )
    if stacking is not None:
        grads = ({k: per_site_tree(v) for k, v in grads[0].items()}, per_site_tree(grads[1]))
    return value, metrics, grads


@pytest.mark.slow  # three loss-and-gradient compiles of a 4-layer LM: 75 s (loaded 2 cores)
def test_scanned_and_unrolled_give_the_same_term_and_gradients(tmp_path):
    """(3) The loss with the term on, on the unrolled target, the scanned one with per-site
    state, and the scanned one on the stacked state (each MLP site one unit over layers 1-3,
    cut by the chunks into a two-layer unit and a site, or three sites): the same values and
    gradients to float32 reassociation. The merged term rides along (its own draws)."""
    cfg = _cfg(1, chunkwise_recon=1.0, sites_per_chunk=PER_CHUNK, merged_recon=0.5)
    unrolled, scanned = _targets(tmp_path)
    v_u, m_u, g_u = _loss_and_grads(unrolled, cfg)
    v_s, m_s, g_s = _loss_and_grads(scanned, cfg)
    stacking = train.stacking_for(cfg, scanned)
    assert len(stacking.groups) == 3, stacking.groups
    v_st, m_st, g_st = _loss_and_grads(scanned, cfg, stacking)
    assert float(m_u["chunkwise_recon"]) > 0
    for v, m, g in ((v_s, m_s, g_s), (v_st, m_st, g_st)):
        assert set(m) == set(m_u)
        np.testing.assert_allclose(v, v_u, RTOL, ATOL)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, RTOL, ATOL), m, m_u)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, RTOL, ATOL), g, g_u)
    # the chunks' gradients reach every site's components
    assert all(float(jnp.abs(g["U"]).max()) > 0 for g in g_u[0]["components"].values())


@pytest.mark.slow  # two train steps lowered (4 and 8 layers, no compile): 6 s
def test_scanned_program_does_not_grow_with_depth(tmp_path):
    """On a scanned target the sites after a chunk pass through its forwards as plain sites,
    so the layers above the chunk run as one scan: with the sites in 2 chunks (every
    projection decomposed) the lowered train step of an 8-layer model has 1.03x the 4-layer
    one's instructions (7,591 -> 7,807, as the subset term's 5,762 -> 5,946; with the layers
    above a chunk unrolled, as the scanned forward runs layers without sites: 7,722 -> 8,460,
    1.10x, and growing with depth times chunks)."""
    from test_scan import _targets as scan_targets

    from pdctl.engine import sharding

    def ops(n_layers: int) -> int:
        cfg = _cfg(
            1, [{"pattern": "*", "C": 4}], {"scan_layers": True},
            chunkwise_recon=1.0, sites_per_chunk=7 * n_layers // 2,
        )  # fmt: skip
        d = tmp_path / f"m{n_layers}"
        d.mkdir()
        target = scan_targets(d, "llama", n_layers=n_layers)[1]
        mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
        prog = train.program(cfg, mesh, target)
        args = (prog.frozen_abstract[0], prog.abstract_state, prog.batch_abstract)
        text = prog.jit().lower(*args).as_text()
        return sum(1 for line in text.splitlines() if " = " in line)

    small, deep = ops(4), ops(8)
    assert deep < 1.06 * small, (small, deep)


def _toy_cfg(**loss):
    return parse_config({
        "schema": 1,
        "target": {"kind": "resid_mlp", "n_features": 8, "d_embed": 16, "d_mlp": 4,
                   "n_layers": 2},
        "decomp": {"sites": [{"pattern": "layers.*", "C": 5}],
                   "ci_fn": {"type": "shared_mlp", "hidden": [4]}, "n_mask_samples": 1},
        "train": {"batch_size": 16, "loss": {
            "faithfulness": 0.0, "importance_minimality": 1e-2, "stochastic_recon": 0.0,
            "stochastic_recon_layerwise": 0.0, "merged_recon": 0.5,
            "stochastic_recon_subset": 1.0, **loss}},
    })  # fmt: skip


@pytest.mark.slow  # 4 s on 2 cores: over the fast tier's ~2.5 s (README)
def test_off_by_default_and_the_other_terms_keep_their_draws(monkeypatch):
    """(4) With chunkwise_recon = 0 (the default) the term is never computed and the clean
    forward keeps no chunk streams, whatever sites_per_chunk says: the loss traces to the
    very program it did (`test_default_step_is_unchanged`: a whole LM train
    step, bit for bit). Switched on, every other term (the merged and the subset one) keeps
    its value bit for bit: the term draws from its own fold of the key, after every earlier
    fold (`losses.LATE_TERMS`)."""
    from pdctl.science.spd.components import init_ci_fn

    target, params, paths, comps, x = _toy()
    shapes = target.site_shapes()
    ci_fns = {p: init_ci_fn(jax.random.key(3), "shared_mlp", shapes[p][0], 5, [4]) for p in paths}
    sources = {p: jnp.full((6,), 0.3, jnp.float32) for p in paths}
    site_C = dict.fromkeys(paths, 5)
    tr = {"components": comps, "ci_fns": ci_fns}
    assert _toy_cfg().train.loss.chunkwise_recon == 0.0
    assert _toy_cfg().train.loss.sites_per_chunk is None
    assert L._term_fold("chunkwise_recon") == L._POOL_KEY + 1

    def loss_of(cfg):
        fns = L.make_spd_fns(target, site_C, cfg)

        def loss(tr, src):
            c = fns.clean(params, x)
            if cfg.train.loss.chunkwise_recon == 0:  # (a toy keeps none anyway: no blocks)
                assert c.starts is None
            return fns.loss(tr, params, src, c, x, jax.random.key(4), 0.5)

        return loss

    def program(cfg):
        return str(jax.make_jaxpr(loss_of(cfg))(tr, sources))

    before = program(_toy_cfg())

    def refuse(*a, **k):
        raise AssertionError("chunkwise recon computed while off")

    with monkeypatch.context() as m:
        m.setattr(L, "chunkwise_recon_loss", refuse)
        assert program(_toy_cfg(sites_per_chunk=2)) == before
    off, on = jax.jit(
        lambda tr, src: (
            loss_of(_toy_cfg())(tr, src),
            loss_of(_toy_cfg(chunkwise_recon=2.0, sites_per_chunk=3))(tr, src),
        )
    )(tr, sources)
    assert "chunkwise_recon" not in off[1] and float(on[1]["chunkwise_recon"]) > 0
    for term in ("merged_recon", "stochastic_recon_subset", "importance_minimality"):
        np.testing.assert_array_equal(on[1][term], off[1][term])
    # (the total sums the terms in another order)
    np.testing.assert_allclose(on[0], off[0] + 2.0 * on[1]["chunkwise_recon"], rtol=1e-6)


@pytest.mark.slow  # two LM train-step compiles: 31 s on the loaded 2 cores
def test_default_step_is_unchanged(tmp_path):
    """(4, the whole step) With the term off a train step of a 4-layer LM (the merged term,
    2 micro-batches) is the same program whatever sites_per_chunk says, and its clean forward
    keeps no chunk streams: new state and metrics bit for bit."""
    from pdctl.engine import sharding

    target, _ = _targets(tmp_path)
    params = jax.jit(target.init)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (4, SEQ + 1), 0, 64)
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    out = {}
    for per_chunk in (None, 2):
        loss = {"merged_recon": 0.5} | ({} if per_chunk is None else {"sites_per_chunk": 2})
        cfg = _cfg(train={"batch_size": 4, "grad_accum_steps": 2}, **loss)
        site_C = match_sites(cfg, target.site_paths())
        assert L.make_spd_fns(target, site_C, cfg).clean(params, tokens[:, :-1]).starts is None
        sites = {p: (*target.site_shapes()[p], C) for p, C in site_C.items()}
        comps, ci_fns, sources = init_decomposition_reference(
            jax.random.key(1), sites, "shared_mlp", [8], lambda C: (C + 1,)
        )
        prog = train.program(cfg, mesh, target)
        state = prog.jit_make_state()(comps, ci_fns, sources)
        args = (prog.frozen_abstract[0], prog.abstract_state, prog.batch_abstract)
        text = prog.jit().lower(*args).as_text()
        out[per_chunk] = (
            text,
            jax.device_get(prog.jit(donate=False)(params, state, {"tokens": tokens})),
        )
    assert out[None][0] == out[2][0]
    jax.tree.map(np.testing.assert_array_equal, out[None][1], out[2][1])


def test_config_keys():
    lc = _cfg(chunkwise_recon=2.0, sites_per_chunk=56).train.loss
    assert (lc.chunkwise_recon, lc.sites_per_chunk) == (2.0, 56)
    for bad in ({"sites_per_chunk": 0}, {"sites_per_chunk": -3}, {"chunkwise_recon": -1.0}):
        with pytest.raises(Exception, match=r"sites_per_chunk|chunkwise_recon"):
            _cfg(**bad)


@pytest.mark.slow  # a tiny LM's whole pipeline (pretrain, warmup, train): 60-110 s, loaded
def test_tiny_lm_trains_with_chunkwise_recon(tmp_path):
    """(5) `pdctl run` on a 2-layer byte-level Llama with the term on, 4 sites in chunks of 3
    (the second chunk starts at block 1), with the merged term, 2 accumulated micro-batches
    and rematerialised blocks: every logged loss finite, the term among them."""
    run = make_run(
        tmp_path,
        "llama-mlp",
        target={"n_layers": 2},
        warmup={"steps": 2, "log_every": 1},
        train={
            "steps": 3, "batch_size": 8, "grad_accum_steps": 2, "log_every": 1,
            "eval_every": 3, "eval_batch_size": 8, "remat": "full",
            "loss": {"chunkwise_recon": 1.0, "sites_per_chunk": 3, "stochastic_recon": 0.0,
                     "stochastic_recon_layerwise": 0.0, "ppgd_recon": 0.0,
                     "merged_recon": 0.5, "subset_routing": "uniform_k"},
        },
    )  # fmt: skip
    result = cli("--project", run, "run")
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    lines = [m for m in metric_lines(run, "train") if "chunkwise_recon" in m]
    assert len(lines) == 3, metric_lines(run, "train")
    for m in lines:
        assert all(np.isfinite(m[k]) for k in ("loss", "chunkwise_recon", "merged_recon"))
        assert m["chunkwise_recon"] > 0
