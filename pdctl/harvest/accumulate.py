"""What a harvest counts: every batch's CI reduced on the device, the host merging only what
is left.

`Harvest.add` takes one batch's lower-leaky CI per site ((B, T, C) for an LM, (B, C) for a toy;
device or numpy arrays) with the tokens at those positions, and dispatches one jitted program
(`_step`) that folds the batch into an accumulator held on one device, per component of every
site (all sites side by side, C_total columns):
- firing count (CI > threshold), CI sum (fixed point, `SUM_SCALE`) and max, and a CI
  histogram (`BINS` bins on [0, 1]);
- the `top_k` largest CIs (`lax.top_k` over the batch, then merged with the running best by
  (CI desc, position asc)), each with its token window (`window` tokens either side) and the
  component's CI at every token of the window, gathered on the device;
- a uniform sample of `n_samples` firing positions: each firing event gets a priority hashed
  from (seed, position, component) (splitmix64, `priority`) and the largest are kept, so the
  sample is the same however the data is split into batches, devices or processes (a
  deterministic reservoir; selected exactly with float32 top-k passes, `_top_k_u53`);
- co-occurrence counts with every other component (the matmul of the batch's firing
  indicators, kept only when C_total <= `cooc_max`: the dense matrix is the known cost,
  8192 components are 512 MiB of int64 counts; beyond that a second pass, `CoocCounter`,
  counts it among the `cooc_max` most often firing components);
- for LMs, (token, component) firing counts over the batch's distinct tokens (an integer
  segment sum of the firing indicators by token), which the host turns into sparse counts.

Nothing waits for a batch when it is added: the host reads a batch's token counts only after
the next batch has been dispatched (`PIPELINE`), so the device is never idle on the host's
account. The results equal, bit for bit, the numpy reference (`reference.Harvest`, the
definitions): counts, maxima and the fixed-point CI sum are exact in any order; top and
sample are ordered by (value desc, position asc). The int64 / uint64 work runs with
`jax.enable_x64` inside this module only. `state()` / `load_state()` round-trip the accumulator
through a flat dict of numpy arrays (a resumable harvest saves it between batches), and
`merge_states` combines the states of harvests over disjoint positions (the processes of a
multi-process harvest) into the state of one harvest over all of them, bit for bit.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdctl.harvest import reference
from pdctl.harvest.reference import BINS, SUM_SCALE, SiteLayout, SiteStats, Top, priority

__all__ = [
    "BINS",
    "SUM_SCALE",
    "CoocCounter",
    "Harvest",
    "SiteStats",
    "Top",
    "merge_states",
    "priority",
]

PIPELINE = 1  # batches whose host-side work waits until the next one is dispatched
_NO_POS = np.iinfo(np.int64).max  # an empty slot's position, for sorting (last)
_FIELDS = ("key", "pos", "ci", "win_tok", "win_ci")


def _priority53(seed: int, pos: jax.Array, comp: jax.Array) -> jax.Array:
    """`reference.priority` on the device (uint64 wraps the same way), as the 53-bit integer
    it divides by 2**53."""
    u = jnp.uint64
    z = (pos.astype(u) * u(0x9E3779B97F4A7C15)) ^ (comp.astype(u) * u(0xBF58476D1CE4E5B9))
    z = z ^ u(seed & 0xFFFFFFFF)
    z = (z ^ (z >> u(30))) * u(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> u(27))) * u(0x94D049BB133111EB)
    z = z ^ (z >> u(31))
    return z >> u(11)


def _empty(k: int, C: int, width: int, key_dtype) -> dict[str, np.ndarray]:
    """k empty slots per component, device layout (C, k[, width])."""
    return {
        "key": np.full((C, k), -np.inf, key_dtype),
        "pos": np.full((C, k), -1, np.int64),
        "ci": np.zeros((C, k), np.float32),
        "win_tok": np.full((C, k, width), -1, np.int32),
        "win_ci": np.zeros((C, k, width), np.float32),
    }


def _top_k_u53(u: jax.Array, valid: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest of the 53-bit integers `u` (uint64, (C, n)) where `valid`, per row,
    ties by the lower index: (index (C, k), taken (C, k) bool; a row with fewer than k valid
    entries has taken False in its last slots), in no particular order.

    Exact, at float32's cost: XLA:CPU's top-k is fast for float32 only (a float64 key sorts
    whole rows, ~20x slower). `u` is split into three float32-exact digits (24, 24 and 5 bits);
    each level's `lax.top_k` keeps the entries strictly above the level's cut (certain to be
    in), and only the entries equal to the cut go on to be ranked by the next digit."""
    digits = [(u >> jnp.uint64(29)), (u >> jnp.uint64(5)) & jnp.uint64(0xFFFFFF),
              u & jnp.uint64(0x1F)]  # fmt: skip
    alive = valid
    need = jnp.full(u.shape[:-1], k, jnp.int32)
    idx_all, took_all = [], []
    for level, d in enumerate(digits):
        key = jnp.where(alive, d.astype(jnp.float32), -jnp.inf)
        v, i = jax.lax.top_k(key, k)  # sorted desc, ties by the lower index
        cut = jnp.take_along_axis(v, jnp.clip(need - 1, 0, k - 1)[..., None], axis=-1)
        if level == len(digits) - 1:
            took = (jnp.arange(k) < need[..., None]) & jnp.isfinite(v)
        else:
            took = (v > cut) & jnp.isfinite(v) & (need[..., None] > 0)
            alive = alive & (key == cut) & (need[..., None] > 0)
        need = need - jnp.sum(took, axis=-1, dtype=jnp.int32)
        idx_all.append(i)
        took_all.append(took)
    idx = jnp.concatenate(idx_all, axis=-1)
    took = jnp.concatenate(took_all, axis=-1)
    # at most k taken per row: move them to the front (stable), keep k slots
    order = jnp.argsort(~took, axis=-1, stable=True)[..., :k]
    return jnp.take_along_axis(idx, order, axis=-1), jnp.take_along_axis(took, order, axis=-1)


def hist_method(device: Any) -> str:
    """How `_step` counts the CI histogram on `device`: by compares on a TPU, whose compiler
    takes minutes over the integer scatter-add of every (position, component) into its bin
    (XLA:TPU for v5e, 13,824 components x 4,096 positions: 127.9 s against 34.8 s, most of a
    whole-model harvest's 182 s first batch on the chip; `benchmarks/tpu/harvest_compile.py
    --accumulate`), and by the scatter elsewhere (on a CPU the compares cost 4.7-6.4x more)."""
    return "compare" if getattr(device, "platform", "cpu") == "tpu" else "scatter"


@lru_cache(maxsize=16)
def _step(
    C: int, k_top: int, k_sample: int, window: int, threshold: float, seed: int,
    lm: bool, cooc: bool, skip: int = 0, hist_by: str = "scatter",
):  # fmt: skip
    """The jitted per-batch program: (state, CI per site (B, T, C) | (B, C), tokens (B, T) |
    None, start, valid, component numbers (C_total,)) -> (state, token counts (n, C_total)
    int32 | None, distinct tokens (n,) | None). `valid`: the batch's first rows that count (the
    last batch is padded); `skip`: each row's first positions that do not count (an LM's);
    the component numbers key the sample's priorities. `hist_by`: how the CI histogram is
    counted, "scatter" (one integer scatter-add) or "compare" (a compare and sum per bin), the
    same integers either way (`hist_method`)."""
    width = 2 * window + 1

    def candidates(val, idx, flat, tok, pos, T, k):
        """This batch's best per component, `val` / `idx` (C, k_here) (its key and row; an
        empty slot has key -inf), as (C, k) key / pos / ci and the (C, k, width) windows."""
        k_here = val.shape[1]
        full = jnp.isfinite(val)
        ci = jnp.take_along_axis(flat.T, idx, axis=1)
        out = {
            "key": val,
            "pos": jnp.where(full, pos[idx], -1),
            "ci": jnp.where(full, ci, 0.0),
        }
        if tok is None:
            out["win_tok"] = jnp.full((C, k_here, width), -1, jnp.int32)
            out["win_ci"] = jnp.zeros((C, k_here, width), jnp.float32)
        else:
            b, t = idx // T, idx % T
            tt = t[..., None] + jnp.arange(-window, window + 1)  # (C, k, width)
            inside = (tt >= 0) & (tt < T) & full[..., None]
            rows = b[..., None] * T + jnp.clip(tt, 0, T - 1)
            out["win_tok"] = jnp.where(inside, tok[rows], -1).astype(jnp.int32)
            got = jnp.take_along_axis(flat.T, rows.reshape(C, -1), axis=1).reshape(rows.shape)
            out["win_ci"] = jnp.where(inside, got, 0.0)
        if k_here < k:  # fewer positions than slots: pad with empty ones
            pad = {f: jnp.asarray(v) for f, v in _empty(k - k_here, C, width, val.dtype).items()}
            out = {f: jnp.concatenate([out[f], pad[f].astype(out[f].dtype)], axis=1) for f in out}
        return out

    def merge(run, new, k):
        """The k best of both by (key desc, position asc); empty slots last."""
        cat = {f: jnp.concatenate([run[f], new[f].astype(run[f].dtype)], axis=1) for f in run}
        pos_key = jnp.where(cat["pos"] < 0, _NO_POS, cat["pos"])
        iota = jnp.broadcast_to(jnp.arange(cat["pos"].shape[1]), cat["pos"].shape)
        order = jax.lax.sort((-cat["key"], pos_key, iota), dimension=1, num_keys=2)[2][:, :k]
        out = {}
        for f, v in cat.items():
            idx = order if v.ndim == 2 else order[..., None]
            out[f] = jnp.take_along_axis(v, idx, axis=1)
        return out

    def step(state, cis, tok, start, valid, comp):
        ci = cis[0] if len(cis) == 1 else jnp.concatenate(cis, axis=-1)
        B = ci.shape[0]
        T = ci.shape[1] if lm else 1
        n = B * T
        flat = ci.reshape(n, C).astype(jnp.float32)
        ok = jnp.repeat(jnp.arange(B) < valid, T) & (jnp.arange(n) % T >= skip)  # (n,)
        pos = start + jnp.arange(n, dtype=jnp.int64)
        fired = (flat > threshold) & ok[:, None]
        new = dict(state)
        new["count"] = state["count"] + jnp.sum(fired, axis=0, dtype=jnp.int64)
        # fixed point (`SUM_SCALE`): flat * 2**24 and its rounding are exact in float32, and
        # integer sums do not depend on the order: any split of the data gives the same bits
        fixed = jnp.round(flat * jnp.float32(SUM_SCALE)).astype(jnp.int64)
        new["ci_sum"] = state["ci_sum"] + jnp.sum(jnp.where(ok[:, None], fixed, 0), axis=0)
        masked = jnp.where(ok[:, None], flat, -jnp.inf)
        new["ci_max"] = jnp.maximum(state["ci_max"], jnp.max(masked, axis=0))
        bins = jnp.clip((flat * BINS).astype(jnp.int32), 0, BINS - 1)
        if hist_by == "compare":
            okb = jnp.where(ok[:, None], bins, -1)
            hist = jnp.stack([jnp.sum(okb == b, axis=0, dtype=jnp.int32) for b in range(BINS)],
                             axis=1)  # fmt: skip
        else:
            cell = (jnp.arange(C, dtype=jnp.int32)[None, :] * BINS + bins).reshape(-1)
            ones = jnp.broadcast_to(ok[:, None], (n, C)).astype(jnp.int32).reshape(-1)
            hist = jnp.zeros(C * BINS, jnp.int32).at[cell].add(ones)  # integer: any order
        new["hist"] = state["hist"] + hist.reshape(C, BINS).astype(jnp.int64)
        tok_flat = None if tok is None else tok.reshape(n).astype(jnp.int32)
        key = jnp.where(masked == 0, 0.0, masked)  # -0.0 and 0.0 tie, as in numpy's sorts
        val, idx = jax.lax.top_k(key.T, min(k_top, n))  # ties: the lower index (= position)
        top = candidates(val, idx, flat, tok_flat, pos, T, k_top)
        new["top"] = merge(state["top"], top, k_top)
        u53 = _priority53(seed, pos[None, :], comp[:, None])  # (C, n)
        idx, took = _top_k_u53(u53, fired.T, min(k_sample, n))
        prio = jnp.take_along_axis(u53, idx, axis=1).astype(jnp.float64) / float(2**53)
        sample = candidates(jnp.where(took, prio, -jnp.inf), idx, flat, tok_flat, pos, T, k_sample)
        new["sample"] = merge(state["sample"], sample, k_sample)
        F = fired.astype(jnp.float32)
        if cooc:  # exact: every count of one batch is an integer below 2**24
            hi = jax.lax.Precision.HIGHEST
            new["cooc"] = state["cooc"] + jnp.dot(F.T, F, precision=hi).astype(jnp.int64)
        if tok_flat is None:
            return new, None, None
        uniq, inv = jnp.unique(tok_flat, size=n, fill_value=-1, return_inverse=True)
        # (distinct token, component) firing counts: one integer scatter-add per position
        counts = jax.ops.segment_sum(fired.astype(jnp.int32), inv.reshape(n), num_segments=n)
        return new, counts, uniq

    return jax.jit(step, donate_argnums=0)


class Harvest(SiteLayout):
    """The accumulator (see the module's docstring; `c_total`, `cooc_kept`, `offsets` from
    `SiteLayout`). `device`: where the state lives and the
    reduction runs (default: the first device); a batch's CI, sharded over the mesh, is
    copied there (asynchronously). One device, not the mesh: on CPU, the devices share the
    host's cores, and the reduction split over them cost more (collectives, and the top-k
    work repeated per device) than on one, which keeps the others' cores for the next batch's
    forward."""

    def __init__(
        self,
        sites: dict[str, int],
        threshold: float,
        top_k: int = 20,
        n_samples: int = 20,
        window: int = 8,
        vocab: int | None = None,
        cooc_max: int = 8192,
        seed: int = 0,
        device: Any = None,
        numbered_from: Mapping[str, int] | None = None,
        skip_first: int = 0,
    ) -> None:
        self.sites = dict(sites)
        self.skip_first = int(skip_first)  # an LM's first positions of each row: not counted
        self.threshold = float(threshold)
        self.top_k, self.n_samples, self.window = top_k, n_samples, window
        self.vocab, self.cooc_max, self.seed = vocab, cooc_max, seed
        self._device = device if device is not None else jax.local_devices()[0]
        self.n_positions = 0
        self.corpus_counts = None if vocab is None else np.zeros(vocab, np.int64)
        self.token_keys = None if vocab is None else np.zeros(0, np.int64)
        self.token_counts = None if vocab is None else np.zeros(0, np.int64)
        self._pending_tokens: list[tuple[np.ndarray, np.ndarray]] = []
        self._inflight: deque = deque()
        self._host: dict[str, np.ndarray] | None = None  # the state as numpy, when read
        self._cooc_index: np.ndarray | None = None  # a restricted co-occurrence (`set_cooc`)
        self._cooc_sub: np.ndarray | None = None
        self._dev = self._put(self._initial())
        # each component's number in the sample's priority: its global index, or, for a
        # harvest of some of the decomposition's sites, its index among all of them
        # (`numbered_from`: each site's component 0), so that its sample is the one a harvest
        # of every site draws
        first = self.offsets() if numbered_from is None else dict(numbered_from)
        comp = np.concatenate([np.arange(C, dtype=np.int64) + first[s]
                               for s, C in self.sites.items()])  # fmt: skip
        with jax.enable_x64(True):
            self._comp = jax.device_put(comp, self._device)

    # ---- adding batches ---------------------------------------------------------------------

    def _initial(self) -> dict[str, Any]:
        C, w = self.c_total, 2 * self.window + 1
        state: dict[str, Any] = {
            "count": np.zeros(C, np.int64),
            "ci_sum": np.zeros(C, np.int64),
            "ci_max": np.zeros(C, np.float32),
            "hist": np.zeros((C, BINS), np.int64),
            "top": _empty(self.top_k, C, w, np.float32),
            "sample": _empty(self.n_samples, C, w, np.float64),
        }
        if self.cooc_kept:
            state["cooc"] = np.zeros((C, C), np.int64)
        return state

    def _put(self, state: dict[str, Any]) -> Any:
        with jax.enable_x64(True):
            # committed, so that every step sees the same kind of argument (one compile)
            return jax.device_put(state, self._device)

    def add(
        self,
        ci: Mapping[str, Any],
        tokens: np.ndarray | None,
        start: int,
        valid: int | None = None,
    ) -> None:
        """One batch: `ci[s]` (B, T, C) for an LM (positions start + b * T + t), (B, C) for a
        toy (positions start + b); `tokens` (B, T) for an LM (the inputs at those positions),
        None for a toy. Only the first `valid` rows count (default: all). Returns at once:
        the work is dispatched, not waited for."""
        lm = tokens is not None
        arrays = tuple(ci[s] for s in self.sites)
        arrays = jax.device_put(arrays, self._device)  # a sharded batch's CI comes over
        B = arrays[0].shape[0]
        valid = B if valid is None else int(valid)
        T = arrays[0].shape[1] if lm else 1
        skip = self.skip_first if lm else 0
        fn = _step(self.c_total, self.top_k, self.n_samples, self.window, self.threshold,
                   self.seed, lm, self.cooc_kept, skip, hist_method(self._device))  # fmt: skip
        with jax.enable_x64(True):
            tok = None if tokens is None else jnp.asarray(np.asarray(tokens, np.int32))
            start_ = np.int64(start)
            self._dev, counts, uniq = fn(
                self._dev, arrays, tok, start_, np.int32(valid), self._comp
            )
        self._host = None
        self.n_positions += valid * (T - skip)
        if lm:
            assert self.vocab is not None and self.corpus_counts is not None  # set for an LM
            kept = np.asarray(tokens)[:valid, skip:].reshape(-1)
            self.corpus_counts += np.bincount(kept, minlength=self.vocab)[: self.vocab]
            self._inflight.append((counts, uniq))
            while len(self._inflight) > PIPELINE:
                self._take_tokens(*self._inflight.popleft())

    def _take_tokens(self, counts: Any, uniq: Any) -> None:
        """One batch's (token, component) counts (n, C_total) over its distinct tokens."""
        assert self.vocab is not None  # only an LM's batches have token counts
        counts, uniq = np.asarray(counts), np.asarray(uniq)
        j, comp = np.nonzero(counts)
        keys = comp.astype(np.int64) * self.vocab + uniq[j].astype(np.int64)
        self._pending_tokens.append((keys, counts[j, comp].astype(np.int64)))
        if sum(k.size for k, _ in self._pending_tokens) > 1 << 22:
            self._merge_tokens()

    def _merge_tokens(self) -> None:
        if not self._pending_tokens:
            return
        pk = np.concatenate([k for k, _ in self._pending_tokens])
        pc = np.concatenate([c for _, c in self._pending_tokens])
        self._pending_tokens = []
        uk, inv = np.unique(pk, return_inverse=True)
        uc = np.bincount(inv, weights=pc, minlength=uk.size).astype(np.int64)
        # into the running (sorted, distinct) keys in one linear pass: no sort of everything
        assert self.token_keys is not None and self.token_counts is not None  # an LM's
        keys, counts = self.token_keys, self.token_counts.copy()
        at = np.searchsorted(keys, uk)
        hit = at < keys.size
        hit[hit] = keys[at[hit]] == uk[hit]
        counts[at[hit]] += uc[hit]
        self.token_keys = np.insert(keys, at[~hit], uk[~hit])
        self.token_counts = np.insert(counts, at[~hit], uc[~hit])

    def sync(self) -> None:
        """Wait for every batch added so far and fold its token counts in."""
        while self._inflight:
            self._take_tokens(*self._inflight.popleft())
        self._merge_tokens()

    def _state_host(self) -> dict[str, Any]:
        self.sync()
        if self._host is None:
            # copies: the device buffers are donated to the next batch's step
            self._host = jax.tree.map(np.array, self._dev)
        return self._host

    # ---- what was counted (numpy, the reference's layout) ---------------------------------

    @property
    def stats(self) -> dict[str, SiteStats]:
        st = self._state_host()
        out = {}
        for s, o in self.offsets().items():
            sl = slice(o, o + self.sites[s])

            def top(which: str, sl: slice = sl) -> Top:
                d = st[which]
                return Top(*(np.moveaxis(d[f][sl], 0, 1) for f in _FIELDS))

            out[s] = SiteStats(st["count"][sl], st["ci_sum"][sl], st["ci_max"][sl],
                               st["hist"][sl], top("top"), top("sample"))  # fmt: skip
        return out

    @property
    def cooc(self) -> np.ndarray | None:
        if self._cooc_sub is not None:
            return self._cooc_sub
        return self._state_host().get("cooc")

    @property
    def cooc_index(self) -> np.ndarray | None:
        """The global components the co-occurrence matrix covers when a restricted pass
        (`CoocCounter`) made it; None: all of them (or none, when skipped)."""
        return self._cooc_index

    def set_cooc(self, index: np.ndarray, counts: np.ndarray) -> None:
        """The co-occurrence of components `index` (ascending global indices), counted by a
        second pass over the same positions, for a harvest whose dense matrix was skipped."""
        self._cooc_index = np.asarray(index, np.int64)
        self._cooc_sub = np.asarray(counts, np.int64)

    cooc_rows = reference.Harvest.cooc_rows
    token_rows = reference.Harvest.token_rows

    # ---- state ------------------------------------------------------------------------------

    def state(self) -> dict[str, np.ndarray]:
        st = self._state_host()
        out: dict[str, np.ndarray] = {"n_positions": np.asarray(self.n_positions)}
        for name in ("count", "ci_sum", "ci_max", "hist", "cooc"):
            if name in st:
                out[name] = st[name]
        for which in ("top", "sample"):
            for f in _FIELDS:
                out[f"{which}.{f}"] = st[which][f]
        for name in ("token_keys", "token_counts", "corpus_counts"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Go on from `state()`; a state of another shape raises (and changes nothing)."""
        self.sync()
        dev = self._initial()

        def like(a: Any, want: np.ndarray) -> np.ndarray:
            a = np.asarray(a)
            if a.shape != want.shape:
                raise ValueError(f"state shape {a.shape}, expected {want.shape}")
            return a.astype(want.dtype)

        for name in ("count", "ci_sum", "ci_max", "hist", "cooc"):
            if name in dev:
                dev[name] = like(state[name], dev[name])
        for which in ("top", "sample"):
            for f in _FIELDS:
                dev[which][f] = like(state[f"{which}.{f}"], dev[which][f])
        names = ("token_keys", "token_counts", "corpus_counts")
        tokens = {n: np.asarray(state[n], np.int64) for n in names if n in state}
        if (self.vocab is not None) != ("corpus_counts" in tokens):
            raise ValueError("state of another kind of harvest (LM / toy)")
        self._dev = self._put(dev)
        self.n_positions = int(state["n_positions"])
        for name, a in tokens.items():
            setattr(self, name, a)
        self._host = None


@lru_cache(maxsize=8)
def _cooc_step(k: int, threshold: float, skip: int = 0):
    """(counts (k, k) int64, CI per site, index (k,), valid) -> counts + this batch's
    co-occurrence of the components `index` (global columns of the sites side by side), each
    row's first `skip` positions left out (`Harvest.skip_first`)."""

    def step(counts, cis, index, valid):
        ci = cis[0] if len(cis) == 1 else jnp.concatenate(cis, axis=-1)
        flat = ci.reshape(-1, ci.shape[-1]).astype(jnp.float32)
        T = flat.shape[0] // ci.shape[0]
        ok = jnp.repeat(jnp.arange(ci.shape[0]) < valid, T)
        ok = ok & (jnp.arange(flat.shape[0]) % T >= skip)
        F = ((jnp.take(flat, index, axis=1) > threshold) & ok[:, None]).astype(jnp.float32)
        hi = jax.lax.Precision.HIGHEST  # exact: every count of one batch is below 2**24
        return counts + jnp.dot(F.T, F, precision=hi).astype(jnp.int64)

    return jax.jit(step, donate_argnums=0)


class CoocCounter:
    """Co-occurrence counts of a chosen set of components (global indices, ascending; at most
    `cooc_max` of them) over batches of CI, as `Harvest` counts them: the second pass of a
    harvest whose dense C_total x C_total matrix was skipped."""

    def __init__(self, sites: dict[str, int], index: np.ndarray, threshold: float,
                 device: Any = None, skip_first: int = 0) -> None:  # fmt: skip
        self.sites = dict(sites)
        self.skip_first = int(skip_first)  # as the first pass's (an LM's CI; 0 for a toy)
        self.index = np.asarray(index, np.int64)
        self.threshold = float(threshold)
        self._device = device if device is not None else jax.local_devices()[0]
        k = self.index.size
        with jax.enable_x64(True):
            self._counts = jax.device_put(np.zeros((k, k), np.int64), self._device)
            self._index = jax.device_put(self.index.astype(np.int32), self._device)

    def add(self, ci: Mapping[str, Any], valid: int) -> None:
        arrays = jax.device_put(tuple(ci[s] for s in self.sites), self._device)
        lm = np.ndim(next(iter(ci.values()))) == 3
        fn = _cooc_step(self.index.size, self.threshold, self.skip_first if lm else 0)
        with jax.enable_x64(True):
            self._counts = fn(self._counts, arrays, self._index, np.int32(valid))

    @property
    def counts(self) -> np.ndarray:
        return np.array(self._counts)

    def load(self, counts: np.ndarray) -> None:
        """Go on from `counts` (those of an interrupted pass over the same components)."""
        k = self.index.size
        counts = np.asarray(counts)
        if counts.shape != (k, k):
            raise ValueError(f"counts of shape {counts.shape}, expected {(k, k)}")
        with jax.enable_x64(True):
            self._counts = jax.device_put(counts.astype(np.int64), self._device)


def merge_states(states: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One `Harvest.state()` from the states of harvests over disjoint positions (same sites,
    options and seed): counts, histograms, co-occurrence, token counts and the fixed-point CI
    sum add up, maxima take the maximum, top and sample keep the best of the union. Equal, bit
    for bit, to the state of one harvest that added every part's batches."""
    if not states:
        raise ValueError("no states to merge")
    first = states[0]
    out: dict[str, np.ndarray] = {}
    for name in ("n_positions", "count", "ci_sum", "hist", "cooc", "corpus_counts"):
        if name in first:
            out[name] = np.sum([np.asarray(s[name]) for s in states], axis=0).astype(
                np.asarray(first[name]).dtype
            )
    out["ci_max"] = np.maximum.reduce([np.asarray(s["ci_max"]) for s in states])
    for which in ("top", "sample"):
        # the reference's merge (k, C layout): the best of both by (key desc, position asc)
        tops = [Top(*(np.moveaxis(np.asarray(s[f"{which}.{f}"]), 1, 0) for f in _FIELDS))
                for s in states]  # fmt: skip
        best = functools.reduce(Top.merge, tops)
        for f, v in zip(_FIELDS, best.fields(), strict=True):
            out[f"{which}.{f}"] = np.moveaxis(v, 0, 1)
    if "token_keys" in first:
        keys = np.concatenate([np.asarray(s["token_keys"], np.int64) for s in states])
        counts = np.concatenate([np.asarray(s["token_counts"], np.int64) for s in states])
        uk, inv = np.unique(keys, return_inverse=True)
        out["token_keys"] = uk
        out["token_counts"] = np.bincount(inv, weights=counts, minlength=uk.size).astype(np.int64)
    return out
