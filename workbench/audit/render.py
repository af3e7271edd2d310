"""The audit matrix drawn: the HTML table (evidence a click away), the fixed-width text grid
nbval compares, and the heat map, over `varlen_workbench.workbench.audit.matrix`'s records with the links of
`varlen_workbench.workbench.audit.judgements`."""

from __future__ import annotations

import html
from typing import Any

from varlen_workbench.workbench.audit.judgements import known_links, postmortem_links
from varlen_workbench.workbench.audit.matrix import cell, columns, grid, implementation, ran
from varlen_workbench.workbench.audit.records import format_campaign, shown_snippet
from varlen_workbench.workbench.audit.sanitizer import row_summary
from varlen_workbench.workbench.gpu_records.freshness import freshness
from varlen_workbench.workbench.records import portable

GRADES = ("validates", "partly validates", "no validation")
# Verdict -> heat-map colour, in the legend's order.
COLOURS = {
    "pass": "#4c9a5b",
    "FAIL": "#c8453a",
    "n/a": "#d9d9d9",
    "validates": "#4c9a5b",
    "partly validates": "#e0a030",
    "no validation": "#f2d27a",
    "clean": "#4c9a5b",
    "errors": "#e07b39",
    "not run": "#ffffff",
}


def _layout_text(case: dict[str, Any]) -> str:
    from varlen_workbench.workbench.layout import Case

    return Case(**case).label()


def _details(summary: str, body: str) -> str:
    return f"<details><summary>{summary}</summary>{body}</details>"


def matrix_html(records: list[dict[str, Any]]) -> str:
    """The grid as an HTML table: each cell its verdict, the evidence a click away."""
    shown = columns(records)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ["implementation", *shown])
    body = []
    for record in records:
        # Its record's date, GPU and commit, badged where the code it audited has changed since.
        cells = [f"<td><b>{html.escape(implementation(record))}</b><br>{freshness(record).html()}</td>"]
        for column in shown:
            verdict, evidence = cell(record, column)
            inner = f"<p>{html.escape(portable(evidence))}</p>"
            if column == "fuzzer" and ran(record) and record.get("fuzz"):
                for failure in record["fuzz"]["failures"]:
                    inner += (
                        f"<p><b>{html.escape(failure['check'])}</b>: smallest layout "
                        f"<code>{html.escape(_layout_text(failure['case']))}</code> "
                        f"({failure['shrink_probes']} shrink probes)</p>"
                        # folded: a cell holds one snippet per failing check, each dozens of lines
                        + _details("plain-torch snippet", f"<pre>{html.escape(shown_snippet(failure))}</pre>")
                    )
            if column == "input-validation" and ran(record):
                rows: list = next((c["rows"] for c in record["checks"] if c["name"] in ("input-validation", "bad-input")), [])
                if rows:
                    inner += f"<pre>{html.escape(format_campaign(rows))}</pre>"
            for url, note in known_links(record["row"], column):
                inner += f'<p>known upstream: <a href="{html.escape(url)}">{html.escape(url)}</a> ({html.escape(note)})</p>'
            for pm_id in postmortem_links(record["row"], column):
                inner += f'<p>post-mortem: <a href="{html.escape(pm_id)}.html">{html.escape(pm_id)}</a></p>'
            colour = COLOURS.get(verdict, "#ffffff")
            cells.append(f'<td style="background:{colour}">{_details(html.escape(verdict), inner)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="audit-matrix"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def text_grid(records: list[dict[str, Any]]) -> str:
    """The grid as fixed-width text (what nbval compares), narrow enough for a page or a terminal:
    columns numbered, with their names in a key above, and verdicts of at most four letters."""
    import textwrap

    from varlen_workbench.workbench.tables import fixed_width

    cols = columns(records)
    short = {"validates": "val", "partly validates": "part", "no validation": "none", "not run": "-"}

    def text(record: dict[str, Any], column: str, verdict: str) -> str:
        if column == "sanitizer" and verdict != "not run":  # its error count
            return str(row_summary(record["sanitizer"])[2])
        return short.get(verdict, verdict)

    key = " | ".join(f"{i} {c}" for i, c in enumerate(cols, 1))
    table = fixed_width(
        [("row", *map(str, range(1, len(cols) + 1)))]
        + [(r["row"], *[text(r, c, v) for c, v in grid(records)[r["row"]].items()]) for r in records]
    )
    legend = "pass, FAIL, n/a; - not run; validation: val(idates), part(ly), none"
    if "sanitizer" in cols:
        legend += "; sanitizer: errors reported"
    return "\n".join([*textwrap.wrap("columns: " + key, 100, break_on_hyphens=False), legend, "", table])


def heatmap(records: list[dict[str, Any]]):
    """A matplotlib Figure: rows x columns, one colour per verdict, the verdict written in each cell."""
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    from varlen_workbench.workbench.plots import figure

    g = grid(records)
    rows = [r["row"] for r in records]
    shown = columns(records)
    image = [[to_rgb(COLOURS.get(g[row][c], "#ffffff")) for c in shown] for row in rows]
    fig, axes = figure(1, 1, width=1.0 + 0.85 * len(shown), height=0.9 + 0.42 * len(rows))
    ax = axes[0, 0]
    ax.grid(False)
    ax.imshow(image, aspect="auto")
    for i, row in enumerate(rows):
        for j, column in enumerate(shown):
            label = {"partly validates": "partly", "no validation": "none", "validates": "valid"}.get(
                g[row][column], g[row][column]
            )
            ax.text(j, i, label, ha="center", va="center", fontsize=7, color="white" if g[row][column] == "FAIL" else "black")
    ax.set_xticks(range(len(shown)), [c.replace("-", "\n", 1) for c in shown], fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_xticks([x - 0.5 for x in range(1, len(shown))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(rows))], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_title("Audit matrix (H200): each path against the padding contract", fontsize=10)
    used = [v for v in COLOURS if any(v in r.values() for r in g.values())]
    ax.legend(
        handles=[Patch(facecolor=COLOURS[v], edgecolor="grey", label=v) for v in used],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=min(len(used), 7),
        fontsize=7,
        frameon=False,
    )
    return fig
