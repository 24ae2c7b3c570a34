"""`pdctl interp export`: harvest.db -> one JSONL record per component, and scoring trials.

A record (`component_records`) holds the component's site and index, its statistics, its top
and sampled examples (each with the token window decoded, its CI per token, and `text`: the
window with the firing token marked <<like this>>), its input tokens by PMI and by count, its
output effects, the toy features (toys), the prompt (`prompt.label_prompt`, template id in
`template`) and its label fields as harvest.db holds them (null when unlabelled): fill `label`
and `pdctl interp import` reads the file back.

Held-out examples: the last `held_out` sampled examples (the sample is uniform over firing
positions; its order is random) are never shown in the prompt (nor is a top example at the same
position); they are listed under `held_out`, and the trials score a label on them.

Trials (`trials`), for each labelled component (the anchors' definitions: goodfire-ai/spd and
goodfire-ai/param-decomp, after EleutherAI's sae-auto-interp):
  detection  the held-out firing examples and as many non-firing ones (firing examples of other
             components of the run, at positions that are none of this component's harvested
             examples), each with its centre token marked, shuffled;
  fuzzing    the held-out firing examples: the first half marked where the component fires
             (CI >= the harvest's threshold in the window), the rest with as many tokens marked
             at random among those where it does not fire, shuffled.
A trial that cannot hold both kinds (one held-out example, no other component) is not written.
Each trial record carries its `prompt`, the example texts, `fires` (the truth `score` uses:
do not send it) and `predictions: null` for the user (or `--endpoint`) to fill with yes / no.
"""

from __future__ import annotations

import json
import math
import random
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any, NamedTuple

from pdctl.errors import PdctlError
from pdctl.harvest import db
from pdctl.interp import prompt as P

MARK = ("<<", ">>")
STATS = ("count", "frequency", "mean_ci", "max_ci", "v_norm", "u_norm")


def marked_text(tokens: list[str], ids: list[int], marks: set[int]) -> str:
    """The window's text, tokens outside the sequence (id -1) left out, `marks` between
    << and >>."""
    return "".join(
        f"{MARK[0]}{t}{MARK[1]}" if i in marks else t
        for i, (t, tid) in enumerate(zip(tokens, ids, strict=True))
        if tid >= 0
    )


def component_records(
    con: sqlite3.Connection,
    decode: Callable[[list[int]], str],
    *,
    top: int = 10,
    sample: int = 10,
    held_out: int = 6,
    sites: list[str] | None = None,
    silent: bool = False,
) -> Iterator[dict[str, Any]]:
    """One record per component (see the module), in site order then component order; a
    component that never fired is left out unless `silent`."""
    con.row_factory = sqlite3.Row
    meta = db.read_pairs(con, lenient=True)
    kind = str(meta.get("kind", "?"))
    labels = db.read_labels(con)
    cache: dict[int, str] = {}

    def tok(t: int) -> str:
        if t < 0:
            return ""
        if t not in cache:
            cache[t] = decode([t])
        return cache[t]

    def example(r: sqlite3.Row) -> dict[str, Any]:
        where = f"examples of {r['site']}:{r['component']}"
        ids = _json_list(r["tokens"], f"{where}: tokens", int)
        cis = _json_list(r["cis"], f"{where}: cis", (int, float))
        if len(cis) != len(ids):
            raise ValueError(f"{where}: {len(cis)} cis for {len(ids)} tokens")
        _number(r["ci"], f"{where}: ci")
        toks = [tok(t) for t in ids]
        mid = (len(ids) - 1) // 2
        return {"rank": r["rank"], "ci": r["ci"], "position": r["position"], "tokens": toks,
                "ids": ids, "cis": [x if math.isfinite(x) else None for x in cis],
                "marked": mid,
                "text": marked_text(toks, ids, {mid})}  # fmt: skip

    order = [r["site"] for r in con.execute("SELECT site FROM sites ORDER BY idx")]
    for site in order:
        if sites and site not in sites:
            continue
        for c in con.execute(
            "SELECT * FROM components WHERE site = ? ORDER BY component", (site,)
        ).fetchall():
            comp = c["component"]
            for k in STATS:
                _number(c[k], f"components.{k} of {site}:{comp}", none=k not in STATS[:2])
            if c["count"] == 0 and not silent:
                continue
            ex = {kind_: [example(r) for r in con.execute(
                "SELECT * FROM examples WHERE site = ? AND component = ? AND kind = ? "
                "ORDER BY rank", (site, comp, kind_))] for kind_ in ("top", "sample")}  # fmt: skip
            samples = ex["sample"]
            n_held = held_out if len(samples) > held_out else len(samples) // 2
            held = samples[len(samples) - n_held :]
            held_pos = {e["position"] for e in held}
            tokens = {k: [{"token": tok(r["token"]), "id": r["token"], "count": r["count"],
                           "pmi": r["pmi"]} for r in con.execute(
                "SELECT token, count, pmi FROM tokens WHERE site = ? AND component = ? AND "
                "kind = ? ORDER BY rowid", (site, comp, k))] for k in ("pmi", "count")}  # fmt: skip
            effects = {k: [{"token": tok(r["token"]), "id": r["token"], "nats": r["nats"]}
                           for r in con.execute(
                "SELECT token, nats FROM effects WHERE site = ? AND component = ? AND kind = ? "
                "ORDER BY rank", (site, comp, k))] for k in ("raised", "lowered")}  # fmt: skip
            features = [{"feature": r["feature"], "ci": r["ci"]} for r in con.execute(
                "SELECT feature, ci FROM toy_features WHERE site = ? AND component = ? "
                "ORDER BY feature", (site, comp))]  # fmt: skip
            rec: dict[str, Any] = {
                "key": f"{site}:{comp}",
                "site": site,
                "component": comp,
                "stats": {k: c[k] for k in STATS},
                "top": [e for e in ex["top"] if e["position"] not in held_pos][:top],
                "sample": samples[: len(samples) - n_held][:sample],
                "held_out": held,
                "input_tokens": tokens,
                "output_effects": effects,
                "features": features,
                "template": P.TEMPLATE_ID,
            }
            rec["prompt"] = P.label_prompt(rec, kind)
            known = labels.get((site, comp), {})
            rec.update({k: known.get(k) for k in db.LABEL_FIELDS})
            yield rec


def _number(v: Any, where: str, none: bool = False) -> None:
    """A finite number from the database (None too with `none`), else ValueError naming it."""
    if v is None and none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{where}: not a finite number ({v!r:.80})")


def _json_list(text: Any, where: str, kind: type | tuple[type, ...]) -> list:
    """A JSON list of `kind` stored as text in the database, else ValueError naming it."""
    try:
        v = json.loads(text) if isinstance(text, (str, bytes)) else None
    except (ValueError, RecursionError):
        v = None
    if not isinstance(v, list) or not all(
        isinstance(x, kind) and not isinstance(x, bool) for x in v
    ):
        raise ValueError(f"{where}: not a JSON list of numbers ({text!r:.80})")
    return v


def trials(
    records: list[dict[str, Any]], threshold: float, n_trials: int = 1, seed: int = 0
) -> Iterator[dict[str, Any]]:
    """Detection and fuzzing trials (see the module) for every labelled record with held-out
    examples; seeded per component (`random.Random(f"{seed}:{key}:{task}:{trial}")`), so a
    record's trials do not depend on which others are exported."""
    donors = [(r["key"], e) for r in records for e in (*r["top"], *r["sample"], *r["held_out"])
              if e["ids"][e["marked"]] >= 0]  # fmt: skip
    for r in records:
        label = r.get("label")
        held = [e for e in r["held_out"] if e["ids"][e["marked"]] >= 0]
        if not label or not held:
            continue
        own = {e["position"] for e in (*r["top"], *r["sample"], *r["held_out"])}
        others = [e for key, e in donors if key != r["key"] and e["position"] not in own]
        for t in range(n_trials):
            rng = random.Random(f"{seed}:{r['key']}:detection:{t}")
            items = [(e["text"], True) for e in held]
            if others:
                items += [(e["text"], False) for e in rng.choices(others, k=len(held))]
            rng.shuffle(items)
            if both(items):
                yield _trial("detection", r, t, label, items)
            rng = random.Random(f"{seed}:{r['key']}:fuzzing:{t}")
            order = rng.sample(held, len(held))
            half = (len(order) + 1) // 2
            items = []
            for i, e in enumerate(order):
                valid = [j for j, tid in enumerate(e["ids"]) if tid >= 0]
                firing = {j for j in valid if (e["cis"][j] or 0.0) >= threshold} | {e["marked"]}
                if i < half:
                    items.append((marked_text(e["tokens"], e["ids"], firing), True))
                    continue
                pool = [j for j in valid if j not in firing]
                if not pool:
                    continue  # nothing to mark at random (a window of firing tokens only)
                marks = set(rng.sample(pool, min(len(firing), len(pool))))
                items.append((marked_text(e["tokens"], e["ids"], marks), False))
            rng.shuffle(items)
            if both(items):
                yield _trial("fuzzing", r, t, label, items)


def both(items: list[tuple[str, bool]]) -> bool:
    """A trial holds examples of both kinds (else it scores nothing: not written)."""
    return any(y for _, y in items) and not all(y for _, y in items)


def _trial(task: str, r: dict[str, Any], t: int, label: str, items: list) -> dict[str, Any]:
    texts = [x for x, _ in items]
    return {"task": task, "key": r["key"], "site": r["site"], "component": r["component"],
            "trial": t, "label": label, "prompt": P.trial_prompt(task, label, texts),
            "examples": texts, "fires": [y for _, y in items],
            "predictions": None}  # fmt: skip


def dumps(record: dict[str, Any]) -> str:
    """One JSONL line (UTF-8 kept as is; floats as Python writes them, which read back equal)."""
    return json.dumps(record, ensure_ascii=False, allow_nan=False)


class Exported(NamedTuple):
    records: list[dict[str, Any]]
    trials: list[dict[str, Any]]
    text: bytes  # the records as JSONL
    trials_text: bytes


def from_harvest(
    path: Path,
    decoder: Callable[[], Callable[[list[int]], str]],
    *,
    sites: list[str] | None,
    top: int,
    sample: int,
    held_out: int,
    n_trials: int,
    seed: int,
    silent: bool,
) -> Exported:
    """The records and trials of the harvest database at `path`, and their JSONL: `sites`
    checked against the harvest's, its threshold read, `decoder()` (the run's token decoder,
    made only once the database opened) applied to the examples. A database pdctl cannot read
    or write out is one line naming it (`PdctlError`)."""
    try:
        with closing(db.open_readonly(path)) as con:
            known = [s for (s,) in con.execute("SELECT site FROM sites ORDER BY idx")]
            for s in sites or []:
                if s not in known:
                    raise PdctlError(f"--site: no site {s!r} in the harvest ({', '.join(known)})")
            threshold = db.read_pairs(con, lenient=True).get("threshold", 0.0)
            if (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                    or not math.isfinite(threshold)):  # fmt: skip
                raise PdctlError(f"{path}: meta.threshold: not a number ({threshold!r:.80})")
            records = list(component_records(
                con, decoder(), top=top, sample=sample, held_out=held_out, sites=sites,
                silent=silent))  # fmt: skip
        tr = list(trials(records, threshold, n_trials, seed))
        return Exported(records, tr, "".join(dumps(r) + "\n" for r in records).encode("utf-8"),
                        "".join(dumps(t) + "\n" for t in tr).encode("utf-8"))  # fmt: skip
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
            UnicodeError, RecursionError, sqlite3.Error) as e:  # fmt: skip
        why = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise PdctlError(f"{path}: a harvest database pdctl cannot export ({why})") from None


def label_jobs(
    records: list[dict[str, Any]], done: set[str]
) -> list[tuple[str, str, dict[str, Any]]]:
    """(key, prompt, what the answer records) of each unlabelled component whose answer is not
    in the answers file yet (`done`)."""
    return [(r["key"], r["prompt"], {"key": r["key"], "site": r["site"],
                                     "component": r["component"]})
            for r in records if r["label"] is None and r["key"] not in done]  # fmt: skip
