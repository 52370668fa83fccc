"""The text rendering of a graph diff: a unified diff of the readable graphs, with provenance.

Every node is a line as ``autoscale.inspect.format_graph`` prints it, prefixed ``-``/``+`` where the
pipeline removed, inserted or changed it and annotated with the pass that did it and why; a rescale
point's backward is one line unless expanded. The header lists the ops kept in float32 for forward
overflow, one line each. Colours are ANSI escapes, only when asked for (overflow checks dimmed:
they only watch a value).
"""

from __future__ import annotations

from collections.abc import Callable

from autoscale.diff.model import GraphDiff, NodeEntry
from autoscale.diff.notes import layer_cells, map_columns, scale_note, summary_details

__all__ = ["render_text"]

_WHY_WIDTH = 40  # the text map's last column; the JSON and the HTML page have the whole reason
_ANSI = {"-": "\x1b[31m", "+": "\x1b[32m", "@": "\x1b[36m", "hdr": "\x1b[1m", "scale": "\x1b[35m",
         "dim": "\x1b[2m", "end": "\x1b[0m"}


def render_text(d: GraphDiff, *, color: bool, backward_only: bool, expand: bool, summary_only: bool = False) -> str:
    """``GraphDiff.to_text``'s document (its docstring says what the options do): a header with the
    summary, the per-layer map, then per section and graph one hunk of node lines."""
    def paint(style: str, text: str) -> str:
        return f"{_ANSI[style]}{text}{_ANSI['end']}" if color else text

    s = d.summary
    out = [paint("hdr", f"autoscale diff: {s}")]
    out.extend("  " + line for line in summary_details(s, d, decisions=True))
    out.extend(_layer_map(d, paint))
    if summary_only:
        return "\n".join(out) + "\n"
    sections = [d.backward] if backward_only else [d.forward, d.backward]
    infos = {(i.graph, i.node): i for i in d.scale_ops}
    for section in sections:
        what = ("Dynamo graph, as captured", "after the dynamo stage") if section.name == "forward" else (
            "AOTAutograd backward of the captured graph", "AOTAutograd backward after both stages")
        out.append(paint("hdr", f"--- {section.name} before: {what[0]}"))
        out.append(paint("hdr", f"+++ {section.name} after: {what[1]}"))
        if not section.entries:
            out.append("  (no backward graph: nothing in the model requires a gradient)")
        for graph in section.graphs():
            entries = [e for e in section.entries if e.graph == graph]
            out.append(paint("@", _hunk_header(section.name, graph, entries)))
            # (a point's group stands at its last node, where its output is made: the scalars it
            # computes from the scales alone may be scheduled anywhere before)
            last = {e.scale_op: i for i, e in enumerate(entries) if e.scale_op is not None}
            for i, e in enumerate(entries):
                if e.kind == "stats" and not expand:  # (the statistics fold: one line)
                    if i == 0 or entries[i - 1].kind != "stats":
                        n = next((j for j, f in enumerate(entries[i:]) if f.kind != "stats"), len(entries) - i)
                        out.append(paint("dim", f"+ [statistics: {n} ATen nodes] the rescale points' "
                                                "measurements, folded into the scaler's statistics at once"))
                    continue
                if e.scale_op is not None and not expand:
                    if last[e.scale_op] == i:
                        info = infos[(graph, e.scale_op)]
                        out.append(paint("scale", f"+ [{e.scale_op} backward: {info.backward_nodes} ATen nodes] "
                                                  f"{scale_note(info)}"))
                    continue
                out.extend(_text_lines(e, paint))
            for f in section.folded:  # (the model's own folded casts show as removed nodes)
                if f.graph == graph and f.created_by is not None:
                    out.append(paint("dim", f"# folded ({f.stage}{', ' + f.side if f.side else ''}, inserted by "
                                            f"{f.created_by}): {f.text}"))
    return "\n".join(out) + "\n"


def _layer_map(d: GraphDiff, paint: Callable[[str, str], str]) -> list[str]:
    """The per-layer map as an aligned table (float32 layers dimmed on a terminal, so the float16
    ones stand out), with what each column says under it."""
    if not d.layers:
        return []
    measured = any(r.measured is not None for r in d.layers)
    columns = map_columns(d.layers)
    out = [paint("hdr", "per-layer map" + (" (predicted / measured on one float32 step)" if measured
                                           else " (predicted by the analysis; --measure adds measured values)"))]
    cells = [{c: "" for c in columns} | layer_cells(r) for r in d.layers]
    for row in cells:  # (the reasons are sentences: cut to keep the table within a wide terminal)
        if len(row["why float32"]) > _WHY_WIDTH:
            row["why float32"] = row["why float32"][:_WHY_WIDTH - 1] + "…"
    columns = {c: what for c, what in columns.items() if c == "layer" or any(row[c] for row in cells)}  # (none empty)
    widths = {c: max(len(c), *(len(row[c]) for row in cells)) for c in columns}
    last = list(columns)[-1]

    def line(row: dict[str, str]) -> str:
        return "  " + "  ".join(row[c] if c == last else row[c].ljust(widths[c]) for c in columns).rstrip()

    out.append(paint("hdr", line({c: c for c in columns})))
    for r, row in zip(d.layers, cells, strict=True):
        out.append(paint("dim", line(row)) if r.precision == "float32" else line(row))
    out.extend(paint("dim", f"    {c}: {what}") for c, what in columns.items() if c not in ("layer", "module"))
    return out


def _text_lines(e: NodeEntry, paint: Callable[[str, str], str]) -> list[str]:
    if e.status == "unchanged":
        return [f"  {e.after}"]
    if e.status == "removed":
        return [paint("-", f"- {e.before}{_removed_note(e)}")]
    style = ("scale" if e.kind in ("scale", "unscale", "align") or e.scale_op
             else "dim" if e.kind in ("check", "stats") else "+")
    plus = paint(style, f"+ {e.after}{_entry_note(e)}")
    return [plus] if e.status == "inserted" else [paint("-", f"- {e.before}"), plus]


def _hunk_header(section: str, graph: int, entries: list[NodeEntry]) -> str:
    n_before = sum(1 for e in entries if e.before is not None)
    n_after = sum(1 for e in entries if e.after is not None)
    counts = {k: sum(1 for e in entries if e.status == k) for k in ("inserted", "removed", "changed")}
    return (f"@@ graph {graph} {section}: {n_before} -> {n_after} nodes, "
            + ", ".join(f"{v} {k}" for k, v in counts.items()) + " @@")


def _entry_note(e: NodeEntry) -> str:
    """What a node's line does not say: a backward node's origin, or a rescale point's numbers."""
    if e.scale is not None:
        return "  {" + scale_note(e.scale) + "}"
    p = e.provenance
    if p is not None and p.derived_from is not None:
        tag = "+" if p.created else p.precision or ""
        return f"  # [{p.pass_name}{' ' + tag if tag else ''}] {p.reason}"
    return ""


def _removed_note(e: NodeEntry) -> str:
    p = e.provenance
    return f"  # [{p.pass_name} -] {p.reason}" if p is not None else ""
