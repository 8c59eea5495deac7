"""Per-graph dumps: ``before.py``, ``after.py``, ``report.md``, ``report.json``, ``graph.dot``
(and ``graph.svg`` when Graphviz's ``dot`` is on PATH).

Layout: ``DIR/graph_000/``, ``DIR/graph_001/``... numbered by compile order within that directory,
so two runs of the same program produce the same names and their dumps can be diffed.

The DOT graph is built as a networkx ``DiGraph`` of the graph *before* rewriting; every matched
region is a coloured cluster labelled with its pattern, and the node where a near miss stopped is
drawn red with the reason.  networkx's own DOT writers need pydot/pygraphviz, which we do not depend
on, and cannot express clusters anyway, so the DOT text is written here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import networkx as nx
import torch.fx as fx

from .report import GraphReport

_CLUSTER_COLOURS = ("#cfe8ff", "#d6f5d6", "#ffe9c7", "#ead6ff", "#ffd6e7", "#d6fff7")


def next_dump_folder(root: Path) -> Path:
    """``root/graph_NNN`` with the next free number (compile order within ``root``)."""
    root.mkdir(parents=True, exist_ok=True)
    taken = sorted(p.name for p in root.glob("graph_[0-9][0-9][0-9]"))
    folder = root / f"graph_{len(taken):03d}"
    folder.mkdir()
    return folder


def write_dump(root: Path, report: GraphReport, before_code: str, after: Optional[fx.GraphModule],
               original: fx.GraphModule) -> Path:
    """Write every dump file for one graph and return its folder."""
    folder = next_dump_folder(Path(root))
    (folder / "before.py").write_text(before_code)
    (folder / "after.py").write_text(after.code if after is not None else "# not rewritten: see report.md\n" + before_code)
    (folder / "report.json").write_text(json.dumps(report.to_dict(), indent=2, sort_keys=True) + "\n")
    dot_text = to_dot(graph_to_networkx(original.graph), report)
    (folder / "graph.dot").write_text(dot_text)
    svg_note = render_svg(folder / "graph.dot", folder / "graph.svg")
    (folder / "report.md").write_text(report_markdown(report, svg_note))
    return folder


def graph_to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """One networkx node per FX node (keyed by name, with ``op`` and ``label``), edges = data flow."""
    g = nx.DiGraph()
    for node in graph.nodes:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        g.add_node(node.name, op=node.op, label=f"{node.name}\\n{node.op}: {target}")
        for inp in node.all_input_nodes:
            g.add_edge(inp.name, node.name)
    return g


def to_dot(g: nx.DiGraph, report: GraphReport) -> str:
    """DOT text: matched regions as filled clusters, near-miss stop nodes in red."""
    def q(s: str) -> str:
        return '"' + s.replace('"', '\\"') + '"'

    in_cluster: dict[str, int] = {}
    for i, m in enumerate(report.matches):
        for name in m.nodes:
            in_cluster[name] = i
    missed = {}
    for n in report.near_misses:
        missed.setdefault(n.node, []).append(f"{n.pattern}: {n.reason.value}")

    lines = ["digraph fusion {", "  rankdir=TB;", '  node [shape=box, fontname="monospace", fontsize=10];']
    for i, m in enumerate(report.matches):
        colour = _CLUSTER_COLOURS[i % len(_CLUSTER_COLOURS)]
        lines.append(f"  subgraph cluster_{i} {{")
        lines.append(f'    label={q(f"{m.pattern} #{i}: {m.summary}")}; style=filled; color={q(colour)};')
        for name in m.nodes:
            if name in g:
                label = "\\n".join([g.nodes[name]["label"], *missed.get(name, [])])
                red = ", color=red, fontcolor=red, penwidth=2" if name in missed else ""
                lines.append(f"    {q(name)} [label={q(label)}, style=filled, fillcolor=white{red}];")
        lines.append("  }")
    for name, data in g.nodes(data=True):
        if name in in_cluster:
            continue
        attrs = [f"label={q(data['label'])}"]
        if name in missed:
            label = "\\n".join([data["label"], *missed[name]])
            attrs = [f"label={q(label)}", "color=red", "fontcolor=red", "penwidth=2"]
        elif data["op"] in ("placeholder", "output"):
            attrs.append("shape=ellipse")
        lines.append(f"  {q(name)} [{', '.join(attrs)}];")
    for a, b in sorted(g.edges()):
        lines.append(f"  {q(a)} -> {q(b)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_svg(dot_path: Path, svg_path: Path) -> str:
    """Render with Graphviz when available; returns a sentence for the report either way."""
    exe = shutil.which("dot")
    if exe is None:
        return "graph.svg not written: Graphviz's `dot` is not on PATH (render graph.dot with `dot -Tsvg`)."
    try:
        subprocess.run([exe, "-Tsvg", str(dot_path), "-o", str(svg_path)], check=True, capture_output=True, timeout=60)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"graph.svg not written: dot failed ({exc})."
    return "graph.svg rendered with Graphviz."


def report_markdown(report: GraphReport, svg_note: str = "") -> str:
    """The report as Markdown: matches with source lines, near misses, fallbacks, stage times."""
    out = [f"# {report.graph_name}", "", f"Enabled patterns: {', '.join(report.enabled_patterns) or '(none)'}", ""]
    out += ["## Fused regions", ""]
    if not report.matches:
        out.append("None.")
    for i, m in enumerate(report.matches):
        out.append(f"{i}. **{m.pattern}**: `{m.summary}` → `{m.fused_op}` ({m.kernel})")
        out.append(f"   - nodes: {', '.join(f'`{n}`' for n in m.nodes)}")
        for s in m.source_lines:
            out.append(f"   - {s}")
        out.append(f"   - config: `{m.config}`")
    out += ["", "## Near misses", ""]
    if not report.near_misses:
        out.append("None.")
    for n in report.near_misses:
        where = f" ({n.source_line})" if n.source_line else ""
        out.append(f"- **{n.pattern}** from `{n.anchor}` stopped at `{n.node}`{where}: *{n.reason.value}*: {n.message}")
    out += ["", "## Fallbacks", ""]
    out += [f"- {f.stage} ({f.pattern}): {f.error}" for f in report.fallbacks] or ["None."]
    out += ["", "## Time per stage", ""]
    out += [f"- {k}: {v * 1e3:.1f} ms" for k, v in report.stage_seconds.items()]
    if svg_note:
        out += ["", svg_note]
    return "\n".join(out) + "\n"
