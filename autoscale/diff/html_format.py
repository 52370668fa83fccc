"""The HTML rendering of a graph diff: one self-contained page, before and after side by side.

Inline CSS and JavaScript and no network, so the page can be mailed or attached to a report:
inserted casts and rescale points are highlighted, overflow checks muted (they only watch a value),
a rescale point's backward folds into one row, hovering a node outlines the nodes it reads, the
ops kept in float32 for forward overflow have a table of their own, and the per-node numbers are
in tooltips and tables.
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Literal

from autoscale.diff.notes import rate_text, scale_note, scale_text, summary_details
from autoscale.ops import FP16_MAX

if TYPE_CHECKING:
    from autoscale.diff.model import GraphDiff, GraphSection, NodeEntry, ScaleInfo

__all__ = ["render_html"]

_CSS = """
:root { --ins: #e6ffec; --ins-b: #1a7f37; --del: #ffebe9; --del-b: #cf222e; --chg: #fff8c5;
        --cast: #ddf4ff; --cast-b: #0969da; --scale: #fbefff; --scale-b: #8250df; --emu: #f6f8fa; }
* { box-sizing: border-box; }
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; padding: 16px 24px; color: #1f2328; }
h1 { font-size: 20px; margin: 0 0 6px; } h2 { font-size: 17px; margin: 24px 0 8px; } h3 { font-size: 15px; }
.summary { font-size: 16px; font-weight: 600; margin: 4px 0; }
.details { color: #57606a; margin: 2px 0; }
.legend span { display: inline-block; padding: 1px 8px; margin: 2px 4px 2px 0; border-radius: 3px;
                border: 1px solid #d0d7de; }
table.graph { width: 100%; border-collapse: collapse; table-layout: fixed; }
table.graph th { text-align: left; background: #f6f8fa; padding: 4px 6px; border-bottom: 1px solid #d0d7de; }
table.graph td { font: 12px/1.35 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: pre-wrap;
                 word-break: break-all; vertical-align: top; padding: 1px 6px; border-left: 4px solid transparent; }
td.node.unchanged { color: #57606a; }
td.node.changed { background: var(--chg); border-left-color: #bf8700; }
td.node.removed { background: var(--del); border-left-color: var(--del-b); text-decoration: line-through; }
td.node.inserted { background: var(--ins); border-left-color: var(--ins-b); }
td.node.inserted.cast, .legend .cast { background: var(--cast); border-left-color: var(--cast-b); }
td.node.emulated, .legend .emulated { background: var(--emu); border-left-color: #8c959f; }
td.node.inserted.scale, .legend .scale, td.group.scale { background: var(--scale); border-left-color: var(--scale-b);
                                                        font-weight: 600; }
td.node.inserted.unscale, td.node.inserted.align, .legend .unscale, td.group.unscale, td.group.align {
  background: #f5f0ff; border-left-color: #b392f0; }
tr.group-head td.group { font-family: system-ui, sans-serif; }
.badge { display: inline-block; margin-left: 6px; padding: 0 6px; border-radius: 8px; background: var(--scale-b);
         color: #fff; font: 600 11px/1.6 system-ui, sans-serif; white-space: nowrap; }
.unscale .badge, .align .badge { background: #b392f0; }
td.node.inserted.scale_op { background: #fdf6ff; border-left-color: #c297ff; }
td.node.inserted.check, td.node.inserted.stats, .legend .check {
  background: #f6f8fa; color: #8c959f; border-left-color: #d0d7de; font-style: italic; }
table.numbers tr.promoted td.source { font-weight: 600; }
.legend .inserted { background: var(--ins); } .legend .removed { background: var(--del); }
.legend .changed { background: var(--chg); }
tbody.scale-op tr.member { display: none; }
tbody.scale-op:has(input:checked) tr.member { display: table-row; }
body:has(#only-changes:checked) tr.row.unchanged { display: none; }
tr.row.reads td { outline: 1px dashed #0969da; }
table.numbers { border-collapse: collapse; font-size: 12px; margin-top: 6px; }
table.numbers th, table.numbers td { border: 1px solid #d0d7de; padding: 2px 6px; text-align: left;
                                      vertical-align: top; }
table.numbers th { background: #f6f8fa; }
table.numbers td.num { text-align: right; font-variant-numeric: tabular-nums; }
ul { margin: 4px 0; }
"""

_JS = """
(function () {
  // Hovering a row outlines the rows of the nodes it reads (its arguments).
  var rows = document.querySelectorAll("tr.row[data-name]");
  var byName = {};
  rows.forEach(function (r) { byName[r.closest("section").id + ":" + r.dataset.name] = r; });
  rows.forEach(function (r) {
    var reads = (r.dataset.reads || "").split(" ").filter(Boolean);
    var sec = r.closest("section").id;
    r.addEventListener("mouseenter", function () {
      reads.forEach(function (n) { var t = byName[sec + ":" + n]; if (t) t.classList.add("reads"); });
    });
    r.addEventListener("mouseleave", function () {
      reads.forEach(function (n) { var t = byName[sec + ":" + n]; if (t) t.classList.remove("reads"); });
    });
  });
  document.documentElement.dataset.js = "ready";
})();
"""


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def render_html(d: GraphDiff, *, backward_only: bool) -> str:
    """``GraphDiff.to_html``'s page; the summary's counts are also ``data-*`` attributes of
    ``#summary``, for scripts and tests that read the page."""
    s = d.summary
    infos = {(i.graph, i.node): i for i in d.scale_ops}
    data = {"scale-points": s.scale_points, "unscale-points": s.unscale_points, "align-points": s.align_points,
            "casts": s.casts, "emulated-ops": s.emulated_ops, "backward-casts": s.backward_casts,
            "casts-folded": s.casts_folded, "converted": s.converted, "total": s.total, "watched": s.watched,
            "float32-for-overflow": s.float32_for_overflow}
    attrs = " ".join(f'data-{k}="{v}"' for k, v in data.items())
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>autoscale diff: {_esc(s)}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<header>",
        "<h1>autoscale diff</h1>",
        f'<p class="summary" id="summary" {attrs}>{_esc(s)}</p>',
    ]
    parts.extend(f'<p class="details">{_esc(line)}</p>' for line in summary_details(s, d))
    parts.append('<p class="legend"><span class="inserted">inserted</span><span class="removed">removed</span>'
                 '<span class="changed">changed</span><span class="cast">precision cast</span>'
                 '<span class="emulated">emulated op</span><span class="scale">scale point</span>'
                 '<span class="unscale">unscale / align point</span><span class="check">overflow check</span> '
                 '<label><input type="checkbox" id="only-changes"> show only changes</label></p>')
    parts.append("</header>")
    parts.extend(_html_overflow(d, link=not backward_only))
    sections = [d.backward] if backward_only else [d.forward, d.backward]
    for section in sections:
        parts.extend(_html_section(section, infos))
    parts.append(f"<script>{_JS}</script>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _html_overflow(d: GraphDiff, *, link: bool) -> Iterator[str]:
    """The "Forward overflow" section: one row per op kept in float32 for forward overflow, with
    the predicted max |x| next to float16's; nothing when there is none (the summary's details
    already say how many values are watched). ``link``: node names link to their forward rows."""
    if not d.overflow:
        return
    yield '<section id="overflow" class="section">'
    yield "<h2>Forward overflow</h2>"
    yield (f'<p class="details">Ops kept in float32 because float16 (max {FP16_MAX:g}) cannot hold a value they '
           "compute or read: predicted by the analysis, promoted by the GradScaler after an overflow at run "
           "time, or following one of those.</p>")
    yield ('<table class="numbers overflow"><thead><tr><th>layer</th><th>op</th><th>node</th><th>source</th>'
           f"<th>predicted max |x| (float16: {FP16_MAX:g})</th><th>reason</th></tr></thead><tbody>")
    for o in d.overflow:
        name = _esc(o.node) + (f" (graph {o.graph})" if d.summary.graphs > 1 else "")
        node = f'<a href="#forward-{o.graph}-{_esc(o.node)}">{name}</a>' if link else name
        amax = f"{o.predicted_max:.3g}" if o.predicted_max is not None else ""
        yield (f'<tr class="{o.source}"><td>{_esc(o.layer or "(model)")}</td><td>{_esc(o.op)}</td>'
               f'<td>{node}</td><td class="source">{o.source}</td><td class="num">{amax}</td>'
               f"<td>{_esc(o.reason)}</td></tr>")
    yield "</tbody></table></section>"


def _cell(e: NodeEntry, side: Literal["before", "after"]) -> str:
    text = e.before if side == "before" else e.after
    if text is None:
        return '<td class="empty"></td>'
    status = e.status if side == "after" or e.status in ("removed", "changed") else "unchanged"
    classes = f"node {status} {e.kind}"
    badge = f'<span class="badge">{_esc(scale_note(e.scale))}</span>' if side == "after" and e.scale else ""
    return f'<td class="{classes}" title="{_esc(_title(e))}">{_esc(text)}{badge}</td>'


def _reads(e: NodeEntry) -> str:
    """The names a node's line reads (for the hover outline): identifiers inside its call."""
    text = e.after or e.before or ""
    head, _, call = text.partition(" = ")
    call = call.split("  # ")[0]
    names = []
    for token in call.replace("(", " ").replace(")", " ").replace(",", " ").replace("[", " ").replace("]", " ").split():
        if token.isidentifier():
            names.append(token)
    return " ".join(dict.fromkeys(names))


def _html_section(section: GraphSection, infos: Mapping[tuple[int, str], ScaleInfo]) -> Iterator[str]:
    title = "Forward (Dynamo graph)" if section.name == "forward" else "Backward (AOTAutograd)"
    yield f'<section id="{section.name}" class="section">'
    yield f"<h2>{title}</h2>"
    counts = ", ".join(f"{section.count(k)} {k}" for k in ("inserted", "removed", "changed", "unchanged"))
    yield f'<p class="details">{_esc(counts)}</p>'
    if not section.entries:
        yield "<p>No backward graph: nothing in the model requires a gradient.</p></section>"
        return
    yield '<table class="graph"><colgroup><col style="width:50%"><col style="width:50%"></colgroup>'
    yield "<thead><tr><th>before</th><th>after</th></tr></thead>"
    members: dict[tuple[int, str], list[NodeEntry]] = defaultdict(list)
    for e in section.entries:
        if e.scale_op is not None:
            members[(e.graph, e.scale_op)].append(e)
    yield "<tbody>"
    for e in section.entries:
        if e.scale_op is None:
            yield _html_row(section.name, e)
            continue
        key = (e.graph, e.scale_op)
        if key not in members:
            continue
        # a rescale point's backward nodes: one group (at its first node), folded away until asked
        info = infos[key]
        yield "</tbody>"
        yield (f'<tbody class="scale-op {info.kind}" data-scale-op="{_esc(info.node)}">'
               f'<tr class="group-head"><td class="empty"></td>'
               f'<td class="group {info.kind}" title="{_esc(info.reason)}">'
               f"{_esc(info.node)} backward: {_esc(scale_note(info))} "
               f'<label><input type="checkbox"> show its {info.backward_nodes} ATen nodes</label></td></tr>')
        for m in members.pop(key):
            yield _html_row(section.name, m)
        yield "</tbody><tbody>"
    yield "</tbody></table>"
    if section.folded:
        yield "<h3>Folded casts</h3><ul>"
        for f in section.folded:
            who = f"inserted by {f.created_by}" if f.created_by else "the model's own cast"
            yield f'<li class="folded">{_esc(f.text)} <em>({_esc(f.stage)}, {_esc(who)})</em></li>'
        yield "</ul>"
    if section.islands:
        yield "<h3>FP32 islands</h3><ul>"
        for i in section.islands:
            yield f"<li><code>{_esc(i.op)}</code> ({_esc(', '.join(i.nodes))}): {_esc(i.reason)}</li>"
        yield "</ul>"
    yield from _html_numbers(section, infos)
    yield "</section>"


def _html_row(section: str, e: NodeEntry) -> str:
    row_class = f"row {e.status}" + (" member" if e.scale_op is not None else "")
    return (f'<tr class="{row_class}" id="{section}-{e.graph}-{_esc(e.name)}" data-name="{_esc(e.name)}" '
            f'data-reads="{_esc(_reads(e))}">{_cell(e, "before")}{_cell(e, "after")}</tr>')


def _html_numbers(section: GraphSection, infos: Mapping[tuple[int, str], ScaleInfo]) -> Iterator[str]:
    """The per-node numbers as a table: every node that changed (scale ops as one row each), and
    every node with a predicted underflow rate."""
    yield "<h3>Per-node numbers</h3>"
    yield ('<table class="numbers"><thead><tr><th>node</th><th>status</th><th>kind</th><th>layer</th>'
           "<th>dtype before</th><th>dtype after</th><th>predicted underflow</th><th>scale</th>"
           "<th>pass</th><th>reason</th></tr></thead><tbody>")
    done: set[tuple[int, str]] = set()
    for e in section.entries:
        if e.scale_op is not None:
            if (e.graph, e.scale_op) in done:
                continue
            done.add((e.graph, e.scale_op))
            i = infos[(e.graph, e.scale_op)]
            yield (f'<tr class="group-row {i.kind}"><td>{_esc(i.node)} (backward, {i.backward_nodes} nodes)</td>'
                   f"<td>inserted</td><td>{i.kind}</td><td>{_esc(i.layer)}</td><td></td><td></td>"
                   f'<td class="num">{rate_text(i.underflow) if i.underflow is not None else ""}</td>'
                   f'<td class="num">{scale_text(i.scale)}</td><td>insert_grad_scaling</td>'
                   f"<td>{_esc(i.reason)}</td></tr>")
            continue
        if e.status == "unchanged" and e.underflow is None:
            continue
        p = e.provenance
        scale = scale_text(e.scale.scale) if e.scale is not None else ""
        yield (f'<tr class="{e.status} {e.kind}"><td><a href="#{section.name}-{e.graph}-{_esc(e.name)}">'
               f"{_esc(e.name)}</a></td><td>{e.status}</td><td>{e.kind}</td><td>{_esc(e.layer)}</td>"
               f"<td>{_esc(e.dtype_before or '')}</td><td>{_esc(e.dtype_after or '')}</td>"
               f'<td class="num">{rate_text(e.underflow) if e.underflow is not None else ""}</td>'
               f'<td class="num">{scale}</td><td>{_esc(p.pass_name if p else "")}</td>'
               f"<td>{_esc(p.reason if p else '')}</td></tr>")
    yield "</tbody></table>"


def _title(e: NodeEntry) -> str:
    """The per-node numbers, one per line, for a tooltip."""
    lines = [f"{e.name}: {e.status} {e.kind}", f"op: {e.op}"]
    if e.layer:
        lines.append(f"layer: {e.layer}")
    if e.dtype_before is not None or e.dtype_after is not None:
        lines.append(f"dtype: {e.dtype_before or '-'} -> {e.dtype_after or '-'}")
    if e.underflow is not None:
        lines.append(f"predicted underflow (scale 1): {rate_text(e.underflow)}")
    if e.scale is not None:
        lines.append(scale_note(e.scale))
    if e.provenance is not None:
        lines.append(f"pass: {e.provenance.pass_name}")
        lines.append(f"reason: {e.provenance.reason}")
    return "\n".join(lines)
