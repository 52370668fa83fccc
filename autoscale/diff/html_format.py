"""The HTML rendering of a graph diff: one self-contained page that opens on the per-layer map.

Inline CSS and JavaScript and no network, so the page can be mailed or attached to a report. It
opens on what a user asks first: one row per layer with its float16/float32 decision and why, its
scale point, and the predicted (and measured) gradient underflow and forward maximum as bars,
sortable by any column. Each layer's node-level diff (before and after side by side, inserted
casts and rescale points highlighted, overflow checks muted, a rescale point's backward folded
into one row, hovering a node outlines the nodes it reads) is collapsed under its row.

Why the nodes are data: a 12-layer transformer has ~10,000 forward and backward nodes, and as
table rows they made a page of ~6 MiB that a browser lays out for seconds. So the nodes travel as
one JSON document in the page, and the script builds a layer's rows when it is opened (``#all`` in
the address opens every layer: for printing, and for tests that read the whole DOM).
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from autoscale.diff.model import GraphDiff, LayerRow, NodeEntry
from autoscale.diff.notes import layer_cells, map_columns, scale_note, share_text, summary_details
from autoscale.protocol import FP16_MAX

if TYPE_CHECKING:
    from autoscale.layer_numbers import LayerNumbers

__all__ = ["render_html"]

_CSS = """
:root { --ins: #e6ffec; --ins-b: #1a7f37; --del: #ffebe9; --del-b: #cf222e; --chg: #fff8c5;
        --cast: #ddf4ff; --cast-b: #0969da; --scale: #fbefff; --scale-b: #8250df; --emu: #f6f8fa;
        --f16: #0969da; --f32: #8c959f; }
* { box-sizing: border-box; }
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; padding: 16px 24px; color: #1f2328; }
h1 { font-size: 20px; margin: 0 0 6px; } h2 { font-size: 17px; margin: 24px 0 8px; } h3 { font-size: 15px; }
.summary { font-size: 16px; font-weight: 600; margin: 4px 0; }
.details { color: #57606a; margin: 2px 0; }
.legend span { display: inline-block; padding: 1px 8px; margin: 2px 4px 2px 0; border-radius: 3px;
               border: 1px solid #d0d7de; }
table.layers { border-collapse: collapse; font-size: 13px; width: 100%; }
table.layers th { text-align: left; background: #f6f8fa; padding: 4px 6px; border-bottom: 1px solid #d0d7de;
                  cursor: pointer; white-space: nowrap; user-select: none; }
table.layers th.sorted-up::after { content: " \\25B2"; } table.layers th.sorted-down::after { content: " \\25BC"; }
table.layers td { padding: 2px 6px; border-bottom: 1px solid #eaeef2; vertical-align: middle; }
tr.layer-row td.name { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: nowrap; }
tr.layer-row td.name button { border: 0; background: none; cursor: pointer; width: 1.4em; padding: 0; }
tr.layer-row.open td.name button { transform: rotate(90deg); }
tr.layer-row td.precision { font-weight: 600; }
tr.layer-row.float16 td.precision, tr.layer-row.bfloat16 td.precision { color: var(--f16); }
tr.layer-row.float32 td.precision, tr.layer-row.float32 td.name { color: var(--f32); }
tr.layer-row.mixed td.precision { color: #9a6700; }
td.num { font-variant-numeric: tabular-nums; white-space: nowrap; min-width: 9em; }
td.num .bars { display: block; height: 6px; margin-top: 1px; }
td.num .bar { display: block; height: 3px; background: #8250df; }
td.num .bar.m { background: #57606a; }
td.num .bar.hot { background: #cf222e; }
td.why { color: #57606a; font-size: 12px; }
tr.nodes > td { padding: 4px 0 12px 24px; background: #fcfcfd; }
table.graph { width: 100%; border-collapse: collapse; table-layout: fixed; }
table.graph th { text-align: left; background: #f6f8fa; padding: 4px 6px; border-bottom: 1px solid #d0d7de; }
table.graph td { font: 12px/1.35 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: pre-wrap;
                 word-break: break-all; vertical-align: top; padding: 1px 6px; border-left: 4px solid transparent; }
table.graph tr.part td { font: 600 12px system-ui, sans-serif; background: #f6f8fa; color: #57606a; }
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
.legend .inserted { background: var(--ins); } .legend .removed { background: var(--del); }
.legend .changed { background: var(--chg); }
tbody.scale-op tr.member { display: none; }
tbody.scale-op:has(input:checked) tr.member { display: table-row; }
body:has(#only-changes:checked) table.graph tr.row.unchanged { display: none; }
tr.row.reads td { outline: 1px dashed #0969da; }
table.numbers { border-collapse: collapse; font-size: 12px; margin-top: 6px; }
table.numbers th, table.numbers td { border: 1px solid #d0d7de; padding: 2px 6px; text-align: left;
                                      vertical-align: top; }
table.numbers th { background: #f6f8fa; }
table.numbers td.num { text-align: right; }
ul { margin: 4px 0; }
"""

_JS = """
(function () {
  var data = JSON.parse(document.getElementById("diff-data").textContent);
  var scaleOps = data.scale_ops;
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text != null) e.textContent = text;
    return e;
  }
  // A node row: before | after. n = [section, graph, name, status, kind, before, after, scale_op]
  function row(n, member) {
    var status = n[3], kind = n[4], before = n[5], after = n[6];
    if (status === "unchanged") before = after;
    var tr = el("tr", "row " + status + (member ? " member" : ""));
    tr.dataset.name = n[2];
    tr.dataset.section = n[0];
    var left = status === "removed" || status === "changed" ? status : "unchanged";
    [[before, left], [after, status]].forEach(function (side, i) {
      if (side[0] == null) { tr.appendChild(el("td", "empty")); return; }
      var td = el("td", "node " + side[1] + " " + kind, side[0]);
      td.dataset.section = n[0];
      var info = i === 1 && n[0] === "forward" ? scaleOps[n[1] + ":" + n[2]] : null;
      if (info) td.appendChild(el("span", "badge", info.note));
      tr.appendChild(td);
    });
    return tr;
  }
  function build(group) {
    var table = el("table", "graph");
    table.innerHTML = '<colgroup><col style="width:50%"><col style="width:50%"></colgroup>' +
      "<thead><tr><th>before</th><th>after</th></tr></thead>";
    var body = el("tbody"), part = null, groups = {}, last = {};
    table.appendChild(body);
    // (a point's group stands at its last node, where its output is made: the scalars it computes
    // from the scales alone may be scheduled anywhere before)
    group.nodes.forEach(function (n, i) { if (n[7] != null) last[n[1] + ":" + n[7]] = i; });
    group.nodes.forEach(function (n, i) {
      var where = n[0] + " " + n[1];
      if (where !== part) {
        part = where;
        var head = el("tr", "part");
        var td = el("td", null, n[0] + (data.graphs > 1 ? ", graph " + n[1] : ""));
        td.colSpan = 2; head.appendChild(td);
        body = el("tbody"); body.appendChild(head); table.appendChild(body);
      }
      if (n[7] == null) { body.appendChild(row(n, false)); return; }
      var key = n[1] + ":" + n[7], members = groups[key];
      if (!members) {  // a rescale point's backward nodes: one group, folded away until asked
        var info = scaleOps[key] || {kind: "scale", note: n[7], size: 0};
        members = groups[key] = el("tbody", "scale-op " + info.kind);
        members.dataset.scaleOp = n[7];
        var head = el("tr", "group-head");
        head.appendChild(el("td", "empty"));
        var cell = el("td", "group " + info.kind, n[7] + " backward: " + info.note + " ");
        var label = el("label"), box = el("input");
        box.type = "checkbox";
        label.appendChild(box);
        label.appendChild(document.createTextNode(" show its " + info.size + " ATen nodes"));
        cell.appendChild(label); head.appendChild(cell); members.appendChild(head);
      }
      members.appendChild(row(n, true));
      if (last[key] === i) {
        table.appendChild(members);
        body = el("tbody"); table.appendChild(body);
      }
    });
    return table;
  }
  function open(tbody, show) {
    var head = tbody.querySelector("tr.layer-row"), holder = tbody.querySelector("tr.nodes");
    if (show && !holder.dataset.built) {
      holder.firstChild.appendChild(build(data.groups[+tbody.dataset.group]));
      holder.dataset.built = "1";
    }
    holder.hidden = !show;
    head.classList.toggle("open", show);
  }
  var layers = document.getElementById("layer-table");
  layers.querySelectorAll("tbody.layer").forEach(function (tbody) {
    tbody.querySelector("button").addEventListener("click", function () {
      open(tbody, tbody.querySelector("tr.nodes").hidden);
    });
  });
  // Sorting: a header click orders the layers by that column (again: the other way).
  layers.querySelectorAll("thead th").forEach(function (th, col) {
    th.addEventListener("click", function () {
      var up = !th.classList.contains("sorted-up");
      layers.querySelectorAll("thead th").forEach(function (h) { h.classList.remove("sorted-up", "sorted-down"); });
      th.classList.add(up ? "sorted-up" : "sorted-down");
      var bodies = Array.prototype.slice.call(layers.querySelectorAll("tbody.layer"));
      function key(b) {
        var cell = b.querySelector("tr.layer-row").children[col];
        return cell.dataset.v != null ? (cell.dataset.v === "" ? null : +cell.dataset.v) : cell.textContent;
      }
      bodies.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (x === y) return +a.dataset.group - +b.dataset.group;
        if (x === null) return 1;
        if (y === null) return -1;
        return (x < y ? -1 : 1) * (up ? 1 : -1);
      });
      bodies.forEach(function (b) { layers.appendChild(b); });
    });
  });
  // Hovering a node outlines the rows of the nodes it reads (the names inside its call).
  document.addEventListener("mouseover", function (ev) {
    var tr = ev.target.closest && ev.target.closest("tr.row");
    document.querySelectorAll("tr.row.reads").forEach(function (r) { r.classList.remove("reads"); });
    if (!tr) return;
    var text = tr.lastChild.textContent.split(" = ").slice(1).join(" = ").split("  # ")[0];
    var names = text.match(/[A-Za-z_][A-Za-z0-9_.]*/g) || [];
    var table = tr.closest("table");
    names.forEach(function (name) {
      table.querySelectorAll("tr.row").forEach(function (r) { if (r.dataset.name === name) r.classList.add("reads"); });
    });
  });
  function fromAddress() {
    var hash = decodeURIComponent(location.hash.slice(1));
    layers.querySelectorAll("tbody.layer").forEach(function (tbody) {
      if (hash === "all" || hash === "layer-" + tbody.dataset.group) open(tbody, true);
    });
  }
  window.addEventListener("hashchange", fromAddress);
  fromAddress();
  document.documentElement.dataset.readyMs = String(Math.round(performance.now()));
  document.documentElement.dataset.js = "ready";
})();
"""


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def render_html(d: GraphDiff, *, backward_only: bool) -> str:
    """``GraphDiff.to_html``'s page; the summary's counts are also ``data-*`` attributes of
    ``#summary``, for scripts and tests that read the page."""
    s = d.summary
    data = {"scale-points": s.scale_points, "unscale-points": s.unscale_points, "align-points": s.align_points,
            "casts": s.casts, "emulated-ops": s.emulated_ops, "backward-casts": s.backward_casts,
            "casts-folded": s.casts_folded, "converted": s.converted, "total": s.total, "watched": s.watched,
            "float32-for-overflow": s.float32_for_overflow, "layers": len(d.layers)}
    attrs = " ".join(f'data-{k}="{v}"' for k, v in data.items())
    groups, index = _groups(d, backward_only=backward_only)
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
    parts.append("</header>")
    parts.extend(_html_layers(d, groups, index))
    parts.extend(_html_overflow(d, index))
    parts.extend(_html_details(d))
    payload = {"graphs": s.graphs, "groups": groups,
               "scale_ops": {f"{i.graph}:{i.node}": {"kind": i.kind, "note": scale_note(i), "size": i.backward_nodes}
                             for i in d.scale_ops}}
    # (inside <script>, only "</" could end the element early)
    parts.append('<script type="application/json" id="diff-data">'
                 + json.dumps(payload, separators=(",", ":")).replace("</", "<\\/") + "</script>")
    parts.append(f"<script>{_JS}</script>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _node(section: str, e: NodeEntry) -> list[Any]:
    """A node as the script reads it (``row`` in ``_JS``); an unchanged node's line once."""
    return [section, e.graph, e.name, e.status, e.kind, None if e.status == "unchanged" else e.before, e.after,
            e.scale_op]


def _groups(d: GraphDiff, *, backward_only: bool) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Each layer's nodes, forward then backward, in graph order: one group per row of the map, in
    its order, and one more per layer a node names that has no row (``index``: layer -> group)."""
    index = {r.layer: i for i, r in enumerate(d.layers)}
    groups: list[dict[str, Any]] = [{"layer": r.layer, "nodes": []} for r in d.layers]
    sections = [d.backward] if backward_only else [d.forward, d.backward]
    for section in sections:
        for e in section.entries:
            if e.layer not in index:
                index[e.layer] = len(groups)
                groups.append({"layer": e.layer, "nodes": []})
            groups[index[e.layer]]["nodes"].append(_node(section.name, e))
    return groups, index


def _html_layers(d: GraphDiff, groups: list[dict[str, Any]], index: Mapping[str, int]) -> Iterator[str]:
    """The per-layer map: a sortable table, each row with its layer's node diff folded under it."""
    measured = any(r.measured is not None for r in d.layers)
    yield '<section id="layers" class="section">'
    yield "<h2>Layers</h2>"
    yield ('<p class="details">One row per layer (module path), in the order the layers compute. Numbers are at '
           "scale 1, as the analysis predicts them"
           + (" / as one float32 step measured them (the grey bar)" if measured else
              " (diff(..., measure=True) or --measure adds measured ones)")
           + ". Click a header to sort, a layer's arrow to see its nodes before and after.</p>")
    yield ('<p class="legend"><span class="inserted">inserted</span><span class="removed">removed</span>'
           '<span class="changed">changed</span><span class="cast">precision cast</span>'
           '<span class="emulated">emulated op</span><span class="scale">scale point</span>'
           '<span class="unscale">unscale / align point</span><span class="check">overflow check</span> '
           '<label><input type="checkbox" id="only-changes"> show only changes</label></p>')
    columns = map_columns(d.layers)
    yield '<table class="layers" id="layer-table"><thead><tr>'
    yield "".join(f'<th title="{_esc(what)}">{_esc(name)}</th>' for name, what in columns.items())
    yield "</tr></thead>"
    for r in d.layers:
        yield _layer_body(r, index[r.layer], len(groups[index[r.layer]]["nodes"]), columns)
    for layer, i in index.items():  # nodes whose layer has no row (a backward-only module, say)
        if i >= len(d.layers):
            yield (f'<tbody class="layer other" data-group="{i}"><tr class="layer-row"><td class="name">'
                   f'<button aria-label="nodes">&#9656;</button>{_esc(layer or "(model)")}</td>'
                   f'<td colspan="{len(columns) - 1}" class="why">{len(groups[i]["nodes"])} nodes</td></tr>'
                   f'<tr class="nodes" hidden><td colspan="{len(columns)}"></td></tr></tbody>')
    yield "</table></section>"


def _layer_body(r: LayerRow, group: int, nodes: int, columns: Mapping[str, str]) -> str:
    cells = layer_cells(r)
    tds = []
    for column in columns:
        text = _esc(cells.get(column, ""))
        if column == "layer":
            tds.append(f'<td class="name" title="{nodes} nodes"><button aria-label="nodes">&#9656;</button>{text}</td>')
        elif column == "precision":
            tds.append(f'<td class="precision">{text}</td>')
        elif column == "why float32":
            tds.append(f'<td class="why">{text}</td>')
        elif column in _BARS:
            name, bar = _BARS[column]
            pred, meas = _value(r.predicted, name), _value(r.measured, name)
            bars = ""
            if bar is not None:
                bars = ('<span class="bars">' + bar(pred, "") + (bar(meas, " m") if r.measured is not None else "")
                        + "</span>")
            tds.append(f'<td class="num" data-v="{_number(pred)}">{text}{bars}</td>')
        elif column in _SORT_KEYS:
            tds.append(f'<td class="num" data-v="{_number(_SORT_KEYS[column](r))}">{text}</td>')
        else:
            tds.append(f"<td>{text}</td>")
    return (f'<tbody class="layer" data-group="{group}" id="layer-{group}"><tr class="layer-row {r.precision}">'
            + "".join(tds) + f'</tr><tr class="nodes" hidden><td colspan="{len(columns)}"></td></tr></tbody>')


def _number(x: float | None) -> str:
    """A sort key for ``data-v``: empty for none (sorted last)."""
    return "" if x is None or math.isnan(x) else repr(float(x))


def _value(n: LayerNumbers | None, name: str) -> float | None:
    value = getattr(n, name) if n is not None else None
    return float(value) if value is not None else None


def _share_bar(x: float | None, cls: str) -> str:
    """An underflow share on a log scale: 10^-7 (or less) is an empty bar, all entries a full one."""
    if x is None:
        return ""
    width = 0.0 if x <= 0 else min(max((math.log10(x) + 7) / 7, 0.0), 1.0)
    return f'<span class="bar{cls}" style="width:{100 * width:.0f}%" title="{share_text(x)}"></span>'


def _max_bar(x: float | None, cls: str) -> str:
    """A forward maximum on a log scale from 10^-2 to float16's max; red beyond it."""
    if x is None:
        return ""
    width = 0.0 if x <= 0 else min(max((math.log10(x) + 2) / (math.log10(FP16_MAX) + 2), 0.0), 1.0)
    hot = " hot" if x > FP16_MAX else ""
    return f'<span class="bar{cls}{hot}" style="width:{100 * width:.0f}%" title="{x:.3g}"></span>'


# The map's columns of predicted (and measured) numbers: the ``LayerNumbers`` field that sorts
# them and how it is drawn (None: no bar); and the telemetry's, by the number that sorts them.
_BARS: dict[str, tuple[str, Callable[[float | None, str], str] | None]] = {
    "dW flushed": ("weight_underflow", _share_bar), "dY flushed": ("grad_underflow", _share_bar),
    "|dY| max": ("grad_max", None), "fwd max": ("forward_max", _max_bar),
}
_SORT_KEYS: dict[str, Callable[[LayerRow], float | None]] = {
    "scale": lambda r: r.scale,
    "run scale": lambda r: r.run.final_scale if r.run is not None else None,
    "run dW zeros": lambda r: r.run.mean_zero_rate if r.run is not None else None,
    "run overflows": lambda r: float(r.run.overflows) if r.run is not None else None,
}


def _html_overflow(d: GraphDiff, index: Mapping[str, int]) -> Iterator[str]:
    """The "Forward overflow" section: one row per op kept in float32 for forward overflow, with
    the predicted max |x| next to float16's; nothing when there is none (the summary's details
    already say how many values are watched). A layer links to its row of the map."""
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
        layer = _esc(o.layer or "(model)")
        if o.layer in index:
            layer = f'<a href="#layer-{index[o.layer]}">{layer}</a>'
        amax = f"{o.predicted_max:.3g}" if o.predicted_max is not None else ""
        yield (f'<tr class="{o.source}"><td>{layer}</td><td>{_esc(o.op)}</td>'
               f'<td>{name}</td><td class="source">{o.source}</td><td class="num">{amax}</td>'
               f"<td>{_esc(o.reason)}</td></tr>")
    yield "</tbody></table></section>"


def _html_details(d: GraphDiff) -> Iterator[str]:
    """The float32 islands and the folded casts, as lists folded away (the map says the same per
    layer; these are per op)."""
    folded = [*d.forward.folded, *d.backward.folded]
    if not d.summary.islands and not folded:
        return
    yield '<section id="details" class="section">'
    if d.summary.islands:
        yield f"<details><summary>float32 islands ({len(d.summary.islands)})</summary><ul>"
        for i in d.summary.islands:
            yield f"<li><code>{_esc(i.op)}</code> ({_esc(', '.join(i.nodes))}): {_esc(i.reason)}</li>"
        yield "</ul></details>"
    if folded:
        yield f"<details><summary>folded casts ({len(folded)})</summary><ul>"
        for f in folded:
            who = f"inserted by {f.created_by}" if f.created_by else "the model's own cast"
            yield f'<li class="folded">{_esc(f.text)} <em>({_esc(f.stage)}, {_esc(who)})</em></li>'
        yield "</ul></details>"
    yield "</section>"
