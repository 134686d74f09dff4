"""One self-contained static HTML page for a query run: inline CSS and SVG, no script, no network.

`render(report)` takes plain data (recipes/report.py makes it) and returns the page; every user
text is escaped. docs/report.md explains every number on it.
"""

from __future__ import annotations

import html
from typing import Any, Dict, List, Optional, Sequence

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2.2em; border-bottom: 1px solid #ccc; }
.meta { color: #555; } .query { background: #f4f6fa; padding: .6em .9em; border-radius: 4px; }
table { border-collapse: collapse; width: 100%; margin: .6em 0; }
td, th { border-bottom: 1px solid #e4e4e4; padding: .35em .5em; vertical-align: top; text-align: left; }
th { background: #fafafa; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.flag { display: inline-block; font-size: .8em; padding: 0 .4em; border-radius: 3px; background: #fde2c8; color: #7a3b00; margin-left: .3em; }
.tok { border-radius: 2px; padding: 0 1px; } .prompt { color: #888; }
.legend { font-size: .85em; color: #555; } svg { vertical-align: middle; }
"""


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def histogram_svg(
    scores: Sequence[float], marks: Sequence[float], width: int = 260, height: int = 60, bins: int = 30
) -> str:
    """An inline SVG histogram of `scores` with a tick at each of `marks` (the shown rows' scores)."""
    if not scores:
        return ""
    lo, hi = min(scores), max(scores)
    span = (hi - lo) or 1.0
    counts = [0] * bins
    for s in scores:
        counts[min(bins - 1, int((s - lo) / span * bins))] += 1
    top = max(counts)
    bar = width / bins
    rects = "".join(
        f'<rect x="{i * bar:.1f}" y="{height - 12 - c / top * (height - 14):.1f}" width="{bar - 1:.1f}" height="{c / top * (height - 14):.1f}" fill="#8aa8c8"/>'
        for i, c in enumerate(counts)
        if c
    )
    ticks = "".join(
        f'<line x1="{(m - lo) / span * width:.1f}" x2="{(m - lo) / span * width:.1f}" y1="0" y2="{height - 12}" stroke="#c0392b" stroke-width="1"/>'
        for m in marks
    )
    labels = f'<text x="0" y="{height - 1}" font-size="10">{lo:+.3g}</text><text x="{width}" y="{height - 1}" font-size="10" text-anchor="end">{hi:+.3g}</text>'
    return f'<svg class="histogram" width="{width}" height="{height}" role="img" aria-label="histogram of {len(scores)} scores">{rects}{ticks}{labels}</svg>'


def _token_html(tokens: List[str], terms: List[Optional[float]], supervised: Optional[Sequence[bool]] = None) -> str:
    """Tokens shaded by their term: green helps the score, red opposes it; a token without a term
    is grey, and so is the text of a prompt token (`supervised` False) shaded by its term."""
    scale = max((abs(t) for t in terms if t is not None), default=0.0) or 1.0
    parts = []
    for i, (token, term) in enumerate(zip(tokens, terms)):
        text = esc(token)
        if term is None:
            parts.append(f'<span class="prompt">{text}</span>')
            continue
        alpha = min(1.0, abs(term) / scale) * 0.85
        color = f"rgba(39,174,96,{alpha:.2f})" if term >= 0 else f"rgba(192,57,43,{alpha:.2f})"
        kind = "tok prompt" if supervised is not None and not supervised[i] else "tok"
        parts.append(
            f'<span class="{kind}" data-term="{term:.6g}" title="{term:+.4g}" style="background:{color}">{text}</span>'
        )
    return "".join(parts)


def shares_svg(shares: Sequence[float], steps: Sequence[int], width: int = 96, height: int = 22) -> str:
    """One bar per checkpoint, up green or down red, scaled to the largest; the values in its tooltip."""
    scale = max((abs(s) for s in shares), default=0.0) or 1.0
    bar, mid = width / len(shares), height / 2
    rects = "".join(
        f'<rect x="{i * bar:.1f}" y="{mid - max(s, 0) / scale * mid:.1f}" width="{max(bar - 1, 1):.1f}" '
        f'height="{abs(s) / scale * mid:.1f}" fill="{"#27ae60" if s >= 0 else "#c0392b"}"/>'
        for i, s in enumerate(shares)
    )
    title = esc(", ".join(f"step {st}: {s:+.4f}" for st, s in zip(steps, shares)))
    line = f'<line x1="0" x2="{width}" y1="{mid}" y2="{mid}" stroke="#bbb"/>'
    return f'<svg class="shares" width="{width}" height="{height}"><title>{title}</title>{line}{rects}</svg>'


def _rows_table(rows: List[Dict[str, Any]], steps: Sequence[int]) -> str:
    # A column per checkpoint while they fit; beyond three, one small bar chart per row.
    wide = 0 < len(steps) <= 3
    head = (
        "<tr><th>rank</th><th>row</th><th>score</th><th>percentile</th>"
        + ("".join(f"<th>step {s}</th>" for s in steps) if wide else "<th>by checkpoint</th>" if steps else "")
        + "<th>text (tokens shaded by their share of the score)</th></tr>"
    )
    body = []
    for r in rows:
        flags = "".join(f'<span class="flag">{esc(f)}</span>' for f in r.get("flags", []))
        shares = [r["checkpoints"].get(str(s), 0.0) for s in steps]
        if wide:
            by_step = "".join(f'<td class="num">{s:+.4f}</td>' for s in shares)
        else:
            by_step = f"<td>{shares_svg(shares, steps)}</td>" if steps else ""
        text = _token_html(r["tokens"], r["terms"], r.get("supervised")) if r.get("tokens") else esc(r.get("text", ""))
        body.append(
            f'<tr class="result" data-index="{r["index"]}"><td class="num">{r["rank"]}</td><td>{esc(r["id"])}{flags}</td>'
            f'<td class="num">{r["score"]:+.4f}</td><td class="num">{r["percentile"]:.1f}</td>{by_step}<td>{text}</td></tr>'
        )
    return f"<table>{head}{''.join(body)}</table>"


def render(report: Dict[str, Any]) -> str:
    """The page: a header saying how the scores were made, then one section per query."""
    steps = report.get("checkpoint_steps") or []
    sections = []
    for q in report["queries"]:
        marks = [r["score"] for r in q["top"]]
        sections.append(
            f'<section class="query-section" id="q-{esc(q["id"])}"><h2>Query {esc(q["id"])}</h2>'
            f'<p class="query">{esc(q["text"])}</p>'
            f'<p class="meta">Scores of all {len(q["all_scores"])} ranked rows (red ticks: the rows below): {histogram_svg(q["all_scores"], marks)}</p>'
            f"<h3>Top rows</h3>{_rows_table(q['top'], steps)}"
            + (f"<h3>Opponents (most negative)</h3>{_rows_table(q['bottom'], steps)}" if q.get("bottom") else "")
            + "</section>"
        )
    how = esc(report["scoring"])
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>gradian report: {esc(report["title"])}</title>'
        f"<style>{STYLE}</style></head><body><h1>gradian report: {esc(report['title'])}</h1>"
        f'<p class="meta">{len(report["queries"])} queries against {report["rows"]} training rows. Scores: {how}. '
        "Percentile: the share of the query's ranked rows that score below the row. "
        + (
            f"Checkpoint shares (steps {', '.join(map(str, steps))}, oldest first): each one's weighted share of the summed score; they add up to it (hover for the values). "
            if steps
            else ""
        )
        + f'{esc(report["token_note"])} Flags: <span class="flag">truncated</span> the completion was cut by grads.max_seq_length; '
        '<span class="flag">not finite</span> the gradient had NaN/inf (never ranked).</p>'
        f'<p class="legend">Token shading: <span class="tok" style="background:rgba(39,174,96,.7)">raises the score</span> '
        '<span class="tok" style="background:rgba(192,57,43,.7)">lowers it</span>, in proportion to the largest term of the row; hover for the value. Grey text: prompt (not supervised).</p>'
        + "".join(sections)
        + "</body></html>"
    )
