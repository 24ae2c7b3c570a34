"""index.html of a report: one static page, inline CSS, no scripts, no network assets; every
link is a file name relative to the page."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdctl.science.spd.evaluate import ALIVE_MEAN_THRESHOLD, LM_MASKINGS, PGD_MASKING

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1240px; color: #222;
       padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
.missing { background: #fff4e5; border: 1px solid #f0b45a; padding: 0.5em 1em; }
.ctx { font-family: ui-monospace, monospace; white-space: pre-wrap; font-size: 0.85em; }
.ctx mark { background: #ffd54f; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
"""


@dataclass
class Fig:
    """One figure on the page: its file (relative to the page), pixel size and caption, and an
    optional data file beside it."""

    src: str
    width: int
    height: int
    caption: str
    data: str | None = None


@dataclass
class Page:
    title: str
    subtitle: str
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    eval_html: str | None = None  # None: no evaluation section (not the train stage)
    eval_title: str = "Final evaluation"
    config_rows: list[tuple[str, str]] = field(default_factory=list)
    config_text: str = ""
    stages_rows: list[tuple[str, ...]] = field(default_factory=list)
    sections: list[tuple[str, list[Fig], str]] = field(default_factory=list)
    harvest: str | None = None  # the harvest's line (`harvest.run.harvest_line`), if one exists


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return esc(v)
    if not math.isfinite(v):
        return str(v)
    if float(v).is_integer() and abs(v) < 1e9:
        return f"{int(v)}"
    return f"{v:.4f}" if 1e-3 <= abs(v) < 1e3 else f"{v:.4g}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{_num(c)}</td>'
            if isinstance(c, int | float)
            else f"<td>{esc(c)}</td>"
            for c in row
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def toy_eval_table(ev: Mapping[str, Any]) -> str:
    """Final toy evaluation: one row per site (CI errors, MMCS, ML2R, L0, alive) + totals."""
    per_site = ("ci_errors", "mmcs", "ml2r", "l0", "alive")
    sites: list[str] = []
    for k in per_site:
        for s in ev.get(k) or {}:
            if s != "total" and s not in sites:
                sites.append(s)
    rows = [[s, *[(ev.get(k) or {}).get(s, "") for k in per_site]] for s in sites]
    total = (ev.get("ci_errors") or {}).get("total")
    out = table(["site", "CI errors", "MMCS", "ML2R", "L0", "alive"], rows)
    extra = []
    if total is not None:
        extra.append(f"CI errors, all sites: <b>{_num(total)}</b>")
    if "recovered" in ev:
        extra.append(f"features recovered at every identity site: <b>{_num(ev['recovered'])}</b>")
    return out + ("<p>" + "; ".join(extra) + "</p>" if extra else "")


def lm_eval_rows(ev: Mapping[str, Any]) -> list[list[Any]]:
    """CE / KL per masking variant from a final eval (`ce_<kind>` keys) or an eval line
    (`eval/ce_<kind>`)."""

    def get(key: str) -> Any:
        return ev.get(key, ev.get(f"eval/{key}", ""))

    rows = [["target", get("ce_target"), "", "", ""]]
    # the fresh-PGD masking first: its KL is the robustness figure
    pgd = (PGD_MASKING,) if get(f"kl_{PGD_MASKING}") != "" else ()
    for kind in (*pgd, *LM_MASKINGS, "zero_masked"):
        rows.append(
            [
                kind,
                get(f"ce_{kind}"),
                get(f"kl_{kind}"),
                get(f"ce_difference_{kind}"),
                get(f"ce_unrecovered_{kind}"),
            ]
        )
    return rows


def lm_eval_table(ev: Mapping[str, Any]) -> str:
    """CE / KL per masking (the fresh-PGD one first, when evaluated), then L0 and alive counts
    per site."""
    out = table(
        ["masking", "CE", "KL(target || masked)", "CE - CE(target)", "CE unrecovered"],
        lm_eval_rows(ev),
    )
    per_site = ("l0", "alive", "alive_mean")
    sites: list[str] = []
    for k in per_site:
        sites.extend(s for s in ev.get(k) or {} if s not in sites)
    if not sites:
        return out
    rows = [[s, *[(ev.get(k) or {}).get(s, "") for k in per_site]] for s in sites]
    header = ["site", "L0", "alive (CI above decomp.ci_threshold somewhere)",
              f"alive (mean CI > {ALIVE_MEAN_THRESHOLD:g})"]  # fmt: skip
    return out + table(header, rows)


def contexts_html(contexts: Mapping[str, list[dict[str, Any]]], how: str) -> str:
    parts = [f"<p>Decoded as: {esc(how)}. Highlighted: the token whose CI is shown.</p>"]
    for site, comps in contexts.items():
        parts.append(f"<h3>{esc(site)}</h3>")
        if not comps:
            parts.append("<p>No component above the threshold on the evaluation batch.</p>")
            continue
        rows = []
        for comp in comps:
            lines = "<br>".join(
                f'<span class="ctx">{_visible(c["before"])}<mark>{_visible(c["token"])}</mark>'
                f"{_visible(c['after'])}</span> <small>(CI {c['ci']:.2f})</small>"
                for c in comp["contexts"]
            )
            rows.append(
                f'<tr><td>{comp["component"]}</td><td class="num">{comp["density"]:.4f}</td>'
                f"<td>{lines}</td></tr>"
            )
        parts.append(
            "<table><thead><tr><th>component</th><th>density</th><th>top contexts</th></tr>"
            "</thead><tbody>" + "".join(rows) + "</tbody></table>"
        )
    return "".join(parts)


def _visible(text: str) -> str:
    return esc(text).replace("\n", "⏎").replace("\t", "⇥")


def render(page: Page) -> str:
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(page.title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(page.title)}</h1><p>{esc(page.subtitle)}</p>",
    ]
    if page.missing:
        items = "".join(f"<li>{esc(m)}</li>" for m in page.missing)
        out.append(f'<div class="missing"><b>Not in this report:</b><ul>{items}</ul></div>')
    if page.notes:
        out.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in page.notes) + "</ul>")
    if page.harvest:
        url = "http://127.0.0.1:8765/"
        out.append(
            f'<p id="harvest">{esc(page.harvest)}: every component, over the harvested corpus, '
            f'in the browser: run <code>pdctl browse</code>, then open <a href="{url}">{url}</a>'
            "</p>"
        )
    if page.eval_html is not None:
        out.append(f"<h2>{esc(page.eval_title)}</h2>")
        out.append(page.eval_html or "<p>No final evaluation recorded.</p>")
    out.append("<h2>Run</h2>")
    if page.stages_rows:
        out.append(table(["stage", "status", "step", "wall s", "checkpoint"], page.stages_rows))
    if page.config_rows:
        out.append(table(["config", "value"], page.config_rows))
    if page.config_text:
        out.append(
            "<details><summary>pdctl.toml (your part)</summary>"
            f"<pre>{esc(page.config_text)}</pre></details>"
        )
    for title, figs, extra in page.sections:
        out.append(f"<h2>{esc(title)}</h2>")
        for f in figs:
            data = f' (data: <a href="{esc(f.data)}">{esc(f.data)}</a>)' if f.data else ""
            out.append(
                f'<figure><img src="{esc(f.src)}" width="{f.width}" height="{f.height}" '
                f'alt="{esc(f.caption)}"><figcaption>{esc(f.caption)}{data}</figcaption></figure>'
            )
        out.append(extra)
    out.append("</body></html>")
    return "\n".join(out) + "\n"
