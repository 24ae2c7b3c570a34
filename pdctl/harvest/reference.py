"""The harvest's counting as plain numpy on the host, one batch at a time: the reference that
the jitted accumulator (`accumulate.Harvest`) is tested against, bit for bit, and the
definition of what every statistic means.

`Harvest.add` takes one batch's lower-leaky CI per site ((N, C) per site, N positions: every
token of every sequence for an LM, every input for a toy) with the tokens around each position,
and updates, per component of every site:
- firing count (CI > threshold), CI sum and max, and a CI histogram (`BINS` bins on [0, 1]).
  The sum is fixed point: each CI rounded to a multiple of 1 / `SUM_SCALE` (2**-24, float32's
  resolution at 1), summed as int64, so it does not depend on the order of the additions (how
  the data is split into batches, devices or processes) and holds 2**39 positions;
- the `top_k` largest CIs, each with its token window (`window` tokens either side) and the
  component's CI at every token of the window;
- a uniform sample of `n_samples` firing positions across the whole activation range: each
  firing event gets a pseudo-random priority hashed from (seed, position, component) and the
  largest priorities are kept, so the sample is the same however the data is split into
  batches, devices or processes (a deterministic reservoir);
- co-occurrence counts with every other component of the run (a dense C_total x C_total
  matrix, kept only when C_total <= `cooc_max`);
- for LMs, the input tokens it fires on (sparse counts) against the corpus token counts.

Everything is ordered by (value desc, position asc). This is the first version of the
harvest's accumulator: its per-batch sorting on the host was what made `pdctl harvest` slow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BINS = 20
SUM_SCALE = 2**24  # the CI sum's unit: 1 / SUM_SCALE
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def priority(seed: int, position: np.ndarray, component: np.ndarray) -> np.ndarray:
    """A uniform [0, 1) number per (position, global component), splitmix64-hashed: the
    reservoir's keys."""
    with np.errstate(over="ignore"):
        z = (position.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ (
            component.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
        )
        z = z ^ np.uint64(seed & 0xFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53)


@dataclass
class Top:
    """The k best events per component: key (K, C), position (K, C), CI (K, C), and the
    window's tokens and CIs (K, C, 2w + 1). Empty slots have key -inf and position -1."""

    key: np.ndarray
    pos: np.ndarray
    ci: np.ndarray
    win_tok: np.ndarray
    win_ci: np.ndarray

    @classmethod
    def empty(cls, k: int, C: int, width: int) -> Top:
        return cls(
            np.full((k, C), -np.inf),
            np.full((k, C), -1, np.int64),
            np.zeros((k, C), np.float32),
            np.full((k, C, width), -1, np.int64),
            np.zeros((k, C, width), np.float32),
        )

    def merge(self, other: Top) -> Top:
        k = self.key.shape[0]
        cat = [np.concatenate([a, b]) for a, b in zip(self.fields(), other.fields(), strict=True)]
        key, pos = cat[0], cat[1]
        # (key desc, position asc) per column; empty slots (-inf) sort last
        order = np.lexsort((np.where(pos < 0, np.iinfo(np.int64).max, pos), -key), axis=0)[:k]
        picked = [np.take_along_axis(a, order.reshape(order.shape + (1,) * (a.ndim - 2)), 0)
                  for a in cat]  # fmt: skip
        return Top(*picked)

    def fields(self) -> tuple[np.ndarray, ...]:
        return (self.key, self.pos, self.ci, self.win_tok, self.win_ci)


@dataclass
class SiteStats:
    count: np.ndarray  # (C,) int64
    ci_sum: np.ndarray  # (C,) int64, in units of 1 / SUM_SCALE
    ci_max: np.ndarray  # (C,) float32
    hist: np.ndarray  # (C, BINS) int64
    top: Top
    sample: Top


class SiteLayout:
    """The components of a harvest's sites, numbered globally (for both accumulators); needs
    `sites` ({site: C}, in the run's site order) and `cooc_max`."""

    sites: dict[str, int]
    cooc_max: int

    @property
    def c_total(self) -> int:
        return sum(self.sites.values())

    @property
    def cooc_kept(self) -> bool:
        return self.c_total <= self.cooc_max

    def offsets(self) -> dict[str, int]:
        """The global index of each site's component 0 (sites in order)."""
        return offsets(self.sites)


def offsets(sites: Mapping[str, int]) -> dict[str, int]:
    """The global index of each site's component 0, for sites {site: C} in order."""
    out, o = {}, 0
    for s, C in sites.items():
        out[s], o = o, o + C
    return out


@dataclass
class Harvest(SiteLayout):
    sites: dict[str, int]  # site -> C, in the run's site order
    threshold: float
    top_k: int = 20
    n_samples: int = 20
    window: int = 8
    vocab: int | None = None  # LMs: the vocabulary (token statistics); toys: None
    cooc_max: int = 8192
    seed: int = 0
    skip_first: int = 0  # LMs: the first positions of every sequence are not harvested
    n_positions: int = 0
    stats: dict[str, SiteStats] = field(default_factory=dict)
    cooc: np.ndarray | None = None  # (C_total, C_total) int64, or None (skipped)
    token_keys: np.ndarray | None = None  # sorted global_component * vocab + token
    token_counts: np.ndarray | None = None
    corpus_counts: np.ndarray | None = None  # (vocab,) int64: every harvested position

    def __post_init__(self) -> None:
        w = 2 * self.window + 1
        for s, C in self.sites.items():
            if s not in self.stats:
                self.stats[s] = SiteStats(
                    np.zeros(C, np.int64),
                    np.zeros(C, np.int64),
                    np.zeros(C, np.float32),
                    np.zeros((C, BINS), np.int64),
                    Top.empty(self.top_k, C, w),
                    Top.empty(self.n_samples, C, w),
                )
        if self.cooc is None and self.cooc_kept:
            self.cooc = np.zeros((self.c_total, self.c_total), np.int64)
        if self.vocab is not None and self.corpus_counts is None:
            self.corpus_counts = np.zeros(self.vocab, np.int64)
            self.token_keys = np.zeros(0, np.int64)
            self.token_counts = np.zeros(0, np.int64)

    def add(self, ci: Mapping[str, np.ndarray], tokens: np.ndarray | None, start: int) -> None:
        """One batch. `ci[s]`: (B, T, C) for an LM (positions start + b * T + t), (B, C) for a
        toy (positions start + b); `tokens` (B, T) for an LM (the inputs at those positions),
        None for a toy. An LM's positions t < `skip_first` are left out of every statistic
        (their tokens still show in the windows of the positions after them)."""
        lm = tokens is not None
        shape = next(iter(ci.values())).shape
        B, T = (shape[0], shape[1]) if lm else (shape[0], 1)
        n = B * T
        pos = start + np.arange(n, dtype=np.int64)
        keep = np.arange(n) % T >= (self.skip_first if lm else 0)  # (n,)
        offsets = self.offsets()
        fired_all = []
        if tokens is not None:  # an LM (`lm`)
            assert self.vocab is not None and self.corpus_counts is not None  # set for an LM
            self.corpus_counts += np.bincount(tokens.reshape(-1)[keep], minlength=self.vocab)[
                : self.vocab
            ]
        for s, C in self.sites.items():
            c3 = np.asarray(ci[s], np.float32).reshape(B, T, C)
            flat = c3.reshape(n, C)
            st = self.stats[s]
            fired = (flat > self.threshold) & keep[:, None]
            fired_all.append(fired)
            st.count += fired.sum(0)
            kept = flat[keep]
            st.ci_sum += np.rint(kept * np.float32(SUM_SCALE)).astype(np.int64).sum(0)
            if kept.size:
                st.ci_max = np.maximum(st.ci_max, kept.max(0))
            bins = np.clip((kept * BINS).astype(np.int64), 0, BINS - 1)
            idx = (np.arange(C, dtype=np.int64)[None, :] * BINS + bins).reshape(-1)
            st.hist += np.bincount(idx, minlength=C * BINS).reshape(C, BINS)
            comp = offsets[s] + np.arange(C, dtype=np.int64)
            key = np.where(keep[:, None], flat, -np.inf)
            st.top = st.top.merge(self._candidates(key, flat, pos, c3, tokens, self.top_k))
            prio = np.where(fired, priority(self.seed, pos[:, None], comp[None, :]), -np.inf)
            st.sample = st.sample.merge(
                self._candidates(prio, flat, pos, c3, tokens, self.n_samples)
            )
            if tokens is not None:
                assert self.vocab is not None  # an LM (checked above)
                b_idx, c_idx = np.nonzero(fired)
                keys = (offsets[s] + c_idx).astype(np.int64) * self.vocab + tokens.reshape(-1)[
                    b_idx
                ].astype(np.int64)
                self._add_tokens(keys)
        if self.cooc is not None:
            F = np.concatenate(fired_all, axis=1).astype(np.float32)
            # exact: every count of one batch is an integer below 2**24
            self.cooc += (F.T @ F).astype(np.int64)
        self.n_positions += int(keep.sum())

    def _candidates(self, key, flat, pos, c3, tokens, k) -> Top:
        """This batch's best k per component by `key` (N, C), with their windows."""
        n, C = flat.shape
        k_here = min(k, n)
        order = np.lexsort((np.broadcast_to(pos[:, None], key.shape), -key), axis=0)[:k_here]
        top_key = np.take_along_axis(key, order, 0)
        top_ci = np.take_along_axis(flat, order, 0)
        top_pos = np.where(np.isfinite(top_key), pos[order], -1)
        w = self.window
        width = 2 * w + 1
        win_tok = np.full((k_here, C, width), -1, np.int64)
        win_ci = np.zeros((k_here, C, width), np.float32)
        if tokens is not None:
            T = c3.shape[1]
            b, t = np.divmod(order, T)  # order: rows of this batch's flat positions
            offs = np.arange(-w, w + 1)
            tt = t[..., None] + offs  # (k, C, width)
            ok = (tt >= 0) & (tt < T)
            ttc = np.clip(tt, 0, T - 1)
            bb = np.broadcast_to(b[..., None], tt.shape)
            cc = np.broadcast_to(np.arange(C)[None, :, None], tt.shape)
            win_tok = np.where(ok, tokens[bb, ttc], -1).astype(np.int64)
            win_ci = np.where(ok, c3[bb, ttc, cc], 0.0).astype(np.float32)
        empty = ~np.isfinite(top_key)
        win_tok[empty] = -1
        win_ci[empty] = 0.0
        top = Top(top_key, top_pos, top_ci, win_tok, win_ci)
        if k_here < k:  # pad to k rows
            top = Top.empty(k, C, width).merge(top)
        return top

    def _add_tokens(self, keys: np.ndarray) -> None:
        u, c = np.unique(keys, return_counts=True)
        allk = np.concatenate([self.token_keys, u])
        allc = np.concatenate([self.token_counts, c])
        uk, inv = np.unique(allk, return_inverse=True)
        self.token_keys = uk
        self.token_counts = np.bincount(inv, weights=allc, minlength=uk.size).astype(np.int64)

    # ---- derived statistics -----------------------------------------------------------------

    def cooc_rows(
        self, top_pairs: int = 20
    ) -> list[tuple[int, int, int, float, float, float, float]]:
        """(component, other, count, precision, recall, jaccard, pmi) for each component's
        `top_pairs` partners by Jaccard (ties: count desc, other asc); global indices.
        precision = n_ab / n_a (of a's firings, the share where b fires too), recall = n_ab /
        n_b, jaccard = n_ab / (n_a + n_b - n_ab), pmi = ln(n_ab N / (n_a n_b))."""
        if self.cooc is None:
            return []
        # the matrix's rows and columns: every component, or those of `cooc_index` (global
        # indices, ascending: a co-occurrence pass restricted to the most often firing ones)
        index = getattr(self, "cooc_index", None)
        glob = np.arange(self.cooc.shape[0]) if index is None else np.asarray(index)
        n = np.diag(self.cooc).astype(np.float64)
        N = float(self.n_positions)
        rows = []
        for a in range(self.cooc.shape[0]):
            nab = self.cooc[a].astype(np.float64)
            others = np.nonzero((nab > 0) & (np.arange(nab.size) != a))[0]
            if not others.size:
                continue
            jac = nab[others] / (n[a] + n[others] - nab[others])
            order = np.lexsort((others, -nab[others], -jac))[:top_pairs]
            for j in order:
                b = int(others[j])
                rows.append((int(glob[a]), int(glob[b]), int(nab[b]), nab[b] / n[a], nab[b] / n[b],
                             float(jac[j]), float(np.log(nab[b] * N / (n[a] * n[b])))))  # fmt: skip
        return rows

    def token_rows(self, top: int = 20) -> list[tuple[int, int, int, float, str]]:
        """(component, token, count, pmi, kind) per component: the `top` tokens it fires on
        most often (kind "count") and with the highest PMI against the corpus frequency (kind
        "pmi"), pmi = ln(p(token | fires) / p(token))."""
        if self.token_keys is None or not self.token_keys.size:
            return []
        # token counts are kept for an LM only, which has all of these
        assert self.vocab is not None
        assert self.corpus_counts is not None and self.token_counts is not None
        comp, tok = np.divmod(self.token_keys, self.vocab)
        total = float(self.corpus_counts.sum())
        n_fire = np.zeros(self.c_total, np.float64)
        np.add.at(n_fire, comp, self.token_counts)
        p_tok = self.corpus_counts[tok] / total
        pmi = np.log((self.token_counts / n_fire[comp]) / p_tok)
        rows = []
        starts = np.searchsorted(comp, np.arange(self.c_total + 1))
        for c in range(self.c_total):
            lo, hi = starts[c], starts[c + 1]
            if lo == hi:
                continue
            t, k, p = tok[lo:hi], self.token_counts[lo:hi], pmi[lo:hi]
            for kind, order in (("count", np.lexsort((t, -k))), ("pmi", np.lexsort((t, -k, -p)))):
                for j in order[:top]:
                    rows.append((c, int(t[j]), int(k[j]), float(p[j]), kind))
        return rows

    # ---- state ------------------------------------------------------------------------------

    def state(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {"n_positions": np.asarray(self.n_positions)}
        for i, s in enumerate(self.sites):
            st = self.stats[s]
            for name in ("count", "ci_sum", "ci_max", "hist"):
                out[f"{i}.{name}"] = getattr(st, name)
            for which in ("top", "sample"):
                for j, a in enumerate(getattr(st, which).fields()):
                    out[f"{i}.{which}.{j}"] = a
        for name in ("cooc", "token_keys", "token_counts", "corpus_counts"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.n_positions = int(state["n_positions"])
        for i, s in enumerate(self.sites):
            st = self.stats[s]
            for name in ("count", "ci_sum", "ci_max", "hist"):
                setattr(st, name, np.asarray(state[f"{i}.{name}"]))
            for which in ("top", "sample"):
                setattr(st, which, Top(*(np.asarray(state[f"{i}.{which}.{j}"]) for j in range(5))))
        for name in ("cooc", "token_keys", "token_counts", "corpus_counts"):
            if name in state:
                setattr(self, name, np.asarray(state[name]))
