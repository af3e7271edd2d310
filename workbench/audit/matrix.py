"""The audit matrix: every path's recorded audit as one grid (rows: implementations, columns: checks).

`load_matrix()` reads data/gpu/audit-<row>.json for each row of `workbench.audit.adapters.MATRIX`
(written by scripts/gpu_audit_matrix.py); `grid()` gives the verdict of every cell, `fails()`
every FAIL with its evidence, `matrix_html()` the table with the evidence one click away (a
<details> per cell: the check's evidence, and for the fuzzer the shrunk layout and its
plain-torch snippet), `heatmap()` the picture, `wrappers()` how each adapter builds its call.
`KNOWN_UPSTREAM` ties findings to upstream reports found with a search of the trackers, and
`POSTMORTEMS` to the post-mortem page that explains them (linked from the cell).

The notebook notebooks/audit-matrix.ipynb is a thin page over these functions.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from workbench.audit.adapters import ADAPTERS, MATRIX
from workbench.audit.checks import CHECKS
from workbench.provenance import GPU_DATA

# The package whose version names each row (torch's own paths: torch).
ROW_PACKAGE = {
    "ours": None,
    "dmattn-triton": "flash-dmattn",
    "dmattn-triton-nobias": "flash-dmattn",
    "dmattn-flex": "flash-dmattn",
    "fsa-dense-varlen": "flash-sparse-attn",
    "fsa-sparse-varlen": "flash-sparse-attn",
}
CORRECTNESS = [name for name in CHECKS if name != "input-validation"]
COLUMNS = [*CORRECTNESS, "fuzzer", "input-validation"]  # every column a matrix can have


def columns(records: list[dict[str, Any]]) -> list[str]:
    """The matrix's columns: the checks some recorded run ran (a check added after the records
    were made, such as sliding-window, gets its column with the first recording that runs it),
    then the fuzzer and input validation."""
    recorded = {check["name"] for record in records if ran(record) for check in record["checks"]}
    return [c for c in CORRECTNESS if c in recorded] + ["fuzzer", "input-validation"]


GRADES = ("validates", "partly validates", "no validation")
# Verdict -> (heat-map colour, order in the legend).
COLOURS = {
    "pass": "#4c9a5b",
    "FAIL": "#c8453a",
    "n/a": "#d9d9d9",
    "validates": "#4c9a5b",
    "partly validates": "#e0a030",
    "no validation": "#f2d27a",
    "not run": "#ffffff",
}

# The FAIL cells of one mechanism each, named once: KNOWN_UPSTREAM, JUDGEMENTS and POSTMORTEMS
# below key on them, and the page asserts every FAIL of the records is judged.
_DMATTN_TRITON_FAILS = (
    "real-accuracy",
    "padding-leak",
    "empty-sequences",
    "no-real-query",
    "custom-scale",
    "fully-masked-rows",
    "causal-unequal",
    "fuzz:real-accuracy",
)
_DMATTN_NOBIAS_FAILS = (*_DMATTN_TRITON_FAILS[:-1], "determinism", "fuzz:raises-on-valid-layout")
_DMATTN_FLEX_FAILS = tuple(c for c in _DMATTN_TRITON_FAILS if c != "no-real-query")
_CUDNN_KEYLESS_FAILS = ("fully-masked-rows", "causal-unequal")

# Findings already reported upstream: (row, check or "fuzz:<check>", as `fails` names them) ->
# [(url, what it says)]. Each link was found with a search of the upstream trackers and read; a
# FAIL not listed here appears to be new.
_PT_NAN_MASKED = (
    "https://github.com/pytorch/pytorch/issues/101967",
    "SDPA produces NaN when input has NaN in masked-out positions",
)
_PT_176793 = ("https://github.com/pytorch/pytorch/issues/176793", "varlen_attn leaves rows past cu_seqlens[-1] uninitialised")
_DMATTN_121 = (
    "https://github.com/HKUSTDial/flash-sparse-attention/issues/121",
    "flash-dmattn dV NaN/Inf (filed against the CUDA backend; the Triton fully-masked-block NaN is its mechanism there)",
)
KNOWN_UPSTREAM: dict[tuple[str, str], list[tuple[str, str]]] = {
    ("torch-varlen", "tail-rows"): [_PT_176793],
    ("sdpa-math", "padding-leak"): [_PT_NAN_MASKED],
    ("sdpa-efficient", "padding-leak"): [_PT_NAN_MASKED],
    ("sdpa-cudnn", "padding-leak"): [_PT_NAN_MASKED],
    ("sdpa-math", "fuzz:real-accuracy"): [_PT_NAN_MASKED],
    ("sdpa-efficient", "fuzz:real-accuracy"): [_PT_NAN_MASKED],
    ("sdpa-cudnn", "fuzz:real-accuracy"): [_PT_NAN_MASKED],
    **{("dmattn-triton", check): [_DMATTN_121] for check in _DMATTN_TRITON_FAILS},
}


# FAIL cells a post-mortem of this workbench explains: (row, check or "fuzz:<check>") -> post-mortem id
# (its page is <id>.html beside this one). tests/test_audit_matrix.py checks each id is registered.
POSTMORTEMS: dict[tuple[str, str], str] = {
    **{("dmattn-flex", check): "flash-dmattn-flex-mask" for check in _DMATTN_FLEX_FAILS},
    **{("sdpa-cudnn", check): "sdpa-cudnn-masked-rows" for check in _CUDNN_KEYLESS_FAILS},
}


def postmortem_links(row: str, column: str) -> list[str]:
    """The post-mortem ids of one cell (the fuzzer's cell: those of every fuzz:<check> of the row)."""
    if column == "fuzzer":
        return sorted({pm for (r, c), pm in POSTMORTEMS.items() if r == row and c.startswith("fuzz:")})
    return [POSTMORTEMS[(row, column)]] if (row, column) in POSTMORTEMS else []


def known_links(row: str, column: str) -> list[tuple[str, str]]:
    """The upstream links of one cell (the fuzzer's cell: those of every fuzz:<check> of the row)."""
    if column == "fuzzer":
        return [link for (r, c), links in KNOWN_UPSTREAM.items() if r == row and c.startswith("fuzz:") for link in links]
    return KNOWN_UPSTREAM.get((row, column), [])


def new_findings(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """FAILs with no upstream report found."""
    return [(row, check) for row, check, _ in fails(records) if (row, check) not in KNOWN_UPSTREAM]


# Every FAIL the matrix shows, judged: (row, check or "fuzz:<check>") -> (kind, one line), kind one of
#   "upstream"    genuine behaviour of the upstream code, reached through a call a user makes
#   "documented"  upstream behaviour its own documentation or maintainers describe as intended
#   "wrapper"     a consequence of a choice our adapter makes (the line says which)
_LEAK = (
    "upstream",
    "0 x NaN: a NaN planted in a padded key/value slot reaches real rows through P.V (and dq through dS.K) "
    "although the mask drops its score; matters only when padding holds non-finite values",
)
_NOBIAS = (
    "upstream",
    "flash-dmattn 1.2.2's Triton backward returns a bias gradient for attn_bias=None, the signature's default, "
    "so every backward without an explicit bias raises in autograd",
)
_DMATTN_NAN = (
    "upstream",
    "NaN in dk/dv of real keys with a finite output: the fuzzer's smallest failing layout is one sequence of one "
    "query, no padding at all, so it is not the padding mask; rows the Triton kernel sees as fully masked (padded "
    "query rows, rows past seqlen_q in a block) are the mechanism the flash-dmattn-121 post-mortem reads in this kernel",
)
_FLEX_DMATTN = (
    "upstream",
    "flex_dmattn_func ignores attn_mask (its mask_mod is q_idx >= kv_idx, used only when is_causal) so padded keys "
    "are attended: finite, silently wrong outputs and gradients",
)
JUDGEMENTS: dict[tuple[str, str], tuple[str, str]] = {
    ("torch-varlen", "tail-rows"): (
        "upstream",
        "varlen_attn allocates out/dq/dk/dv with empty_like and never writes rows past cu_seqlens[-1]",
    ),
    ("torch-varlen", "no-real-query"): (
        "upstream",
        "a valid batch whose sequences hold no query (max_seqlen_q 0) raises CUDA invalid argument instead of returning zeros",
    ),
    ("flex-document", "padding-leak"): _LEAK,
    ("flex-document", "fuzz:real-accuracy"): (_LEAK[0], "the shrunk layout's padding holds NaN: " + _LEAK[1]),
    ("flex-document", "fuzz:gap-rows"): (
        "upstream",
        "a GAP query row is fully masked, yet NaN planted in the padding of its block reaches its output (0 x NaN); "
        "zero-filled padding would not show it",
    ),
    ("flex-document", "fuzz:tail-rows"): (
        "upstream",
        "as fuzz:gap-rows, for a TAIL row: NaN in the padding of its block reaches it through 0 x NaN",
    ),
    ("sdpa-math", "padding-leak"): _LEAK,
    ("sdpa-math", "fuzz:real-accuracy"): (_LEAK[0], "the shrunk layout's padding holds NaN: " + _LEAK[1]),
    ("sdpa-efficient", "padding-leak"): _LEAK,
    ("sdpa-efficient", "fuzz:real-accuracy"): (_LEAK[0], "the shrunk layout's padding holds NaN: " + _LEAK[1]),
    ("sdpa-cudnn", "padding-leak"): _LEAK,
    ("sdpa-cudnn", "fully-masked-rows"): (
        "upstream",
        "a real query row with no visible key gets a finite non-zero output from the cuDNN backend (the math backend "
        "gives 0): silent, and it differs by backend. torch turns the boolean mask into an additive one filled with "
        "the finite -65504 for cuDNN, so such a row softmaxes over every key slot; a replica of that fill reproduces "
        "the recorded errors within 0.4% (post-mortem sdpa-cudnn-masked-rows)",
    ),
    ("sdpa-cudnn", "causal-unequal"): (
        "upstream",
        "the same fully-masked-row behaviour: with len_q > len_k, bottom-right causality leaves the first rows no key",
    ),
    ("sdpa-cudnn", "determinism"): (
        "documented",
        "the cuDNN backward's dq differs bitwise between two identical runs; torch says so itself: with "
        "torch.use_deterministic_algorithms(True) it refuses the cuDNN backend ('cuDNN SDPA is not deterministic', "
        "check_cudnn_deterministic in sdp_utils.cpp)",
    ),
    ("sdpa-cudnn", "fuzz:real-accuracy"): (_LEAK[0], "the shrunk layout's padding holds NaN: " + _LEAK[1]),
    **{("dmattn-triton", check): _DMATTN_NAN for check in _DMATTN_TRITON_FAILS},
    **{("dmattn-triton-nobias", check): _NOBIAS for check in _DMATTN_NOBIAS_FAILS},
    **{("dmattn-flex", check): _FLEX_DMATTN for check in _DMATTN_FLEX_FAILS if check != "padding-leak"},
    ("dmattn-flex", "padding-leak"): (
        "upstream",
        "attn_mask ignored (see real-accuracy), so NaN planted in padded keys is attended outright",
    ),
    ("fsa-dense-varlen", "real-accuracy"): (
        "upstream",
        "the backward's preprocess kernel (flash_bwd_preprocess.py) reads lse through a tensor descriptor (a TMA load "
        "on sm_90) based at LSE + h * total_q + cu_seqlens_q[b] floats, which Triton requires 16-byte aligned; it is so "
        "only when that offset is a multiple of 4, and for this call (cu_seqlens_q [0, 5, 8, 15], 18 rows) 4 of its 6 "
        "(batch, head) bases are not, 3 of 6 without the TAIL rows. Shown on the CPU (interpreter: every other descriptor "
        "of the call aligned; scripts/fsa_misaligned.py). The H200 record fits: the error came at the first Triton "
        "kernel load after the probe synchronized on the forward, and this kernel is the only Triton kernel launched "
        "in between; the faulting kernel itself was not observed there",
    ),
    ("fsa-sparse-varlen", "real-accuracy"): (
        "upstream",
        "the same misaligned lse descriptor: the sparse varlen backward runs the same preprocess kernel on the same call",
    ),
}


def unjudged(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """FAIL cells without a judgement (the page asserts there are none)."""
    return [(row, check) for row, check, _ in fails(records) if (row, check) not in JUDGEMENTS]


def load_matrix(directory: Path = GPU_DATA) -> list[dict[str, Any]]:
    """The recorded audit of every MATRIX row that has one, in MATRIX order, each with `row` and `file`."""
    records = []
    for row, target, adapter in MATRIX:
        path = Path(directory) / f"audit-{row}.json"
        if path.exists():
            record = json.loads(path.read_text())
            records.append({**record, "row": row, "file": path.name, "target": record.get("target", target), "adapter": adapter})
    if not records:
        raise FileNotFoundError(
            f"no audit-<row>.json under {directory}; record them on a GPU with `python scripts/gpu_audit_matrix.py`"
        )
    return records


def ran(record: dict[str, Any]) -> bool:
    return record.get("ran", True) is not False and "checks" in record


def implementation(record: dict[str, Any]) -> str:
    """'flash-dmattn 1.2.2: flash_dmattn.flash_dmattn_triton:triton_dmattn_func (adapter dmattn)'."""
    package = ROW_PACKAGE.get(record["row"], "torch")
    versions = record.get("versions", {})
    if package is None:
        named = f"ours @ {record['provenance'].get('commit', '?')}"
    else:
        named = f"{package} {versions.get(package, record['provenance'].get(package, '?'))}"
    return f"{record['row']} ({named})"


def cell(record: dict[str, Any], column: str) -> tuple[str, str]:
    """(verdict, evidence) of one cell."""
    if not ran(record):
        return "not run", "; ".join(record.get("output", [])[-2:]) or "not recorded"
    if column == "fuzzer":
        fuzzed = record.get("fuzz")
        if not fuzzed:
            lost = next((c["evidence"] for c in record["checks"] if c["evidence"].startswith("not run:")), None)
            if lost or any("misaligned address" in c["evidence"] or "illegal memory" in c["evidence"] for c in record["checks"]):
                return "not run", lost or "a CUDA fault lost the context before the fuzzer"
            return "n/a", "the fuzzer did not run (nothing applicable)"
        found = sorted({f["check"] for f in fuzzed["failures"]})
        summary = f"{fuzzed['tried']} layouts, {fuzzed['failing_layouts']} failing" + (f": {', '.join(found)}" if found else "")
        return ("FAIL" if found else "pass"), summary
    for check in record["checks"]:
        if check["name"] == column or (column == "input-validation" and check["name"] == "bad-input"):
            if check["evidence"].startswith("not run:"):  # after a sticky CUDA fault
                return "not run", check["evidence"]
            return check["verdict"], check["evidence"]
    return "not run", "this check was not in the recorded run"


def grid(records: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """{row: {column: verdict}}."""
    shown = columns(records)
    return {r["row"]: {c: cell(r, c)[0] for c in shown} for r in records}


def fails(records: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Every FAIL: (row, check or 'fuzz:<check>', evidence), fuzzer failures one by one."""
    out = []
    for record in records:
        if not ran(record):
            continue
        for check in record["checks"]:
            if check["verdict"] == "FAIL":
                out.append((record["row"], check["name"], check["evidence"]))
        for failure in (record.get("fuzz") or {}).get("failures", []):
            out.append((record["row"], f"fuzz:{failure['check']}", failure["evidence"]))
    return out


def _layout_text(case: dict[str, Any]) -> str:
    from workbench.layout import Case

    return Case(**case).label()


def _details(summary: str, body: str) -> str:
    return f"<details><summary>{summary}</summary>{body}</details>"


def matrix_html(records: list[dict[str, Any]]) -> str:
    """The grid as an HTML table: each cell its verdict, the evidence a click away."""
    shown = columns(records)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ["implementation", *shown])
    body = []
    for record in records:
        cells = [f"<td><b>{html.escape(implementation(record))}</b></td>"]
        for column in shown:
            verdict, evidence = cell(record, column)
            inner = f"<p>{html.escape(evidence)}</p>"
            if column == "fuzzer" and ran(record) and record.get("fuzz"):
                for failure in record["fuzz"]["failures"]:
                    inner += (
                        f"<p><b>{html.escape(failure['check'])}</b>: smallest layout "
                        f"<code>{html.escape(_layout_text(failure['case']))}</code> "
                        f"({failure['shrink_probes']} shrink probes)</p><pre>{html.escape(failure['snippet'])}</pre>"
                    )
            if column == "input-validation" and ran(record):
                rows: list = next((c["rows"] for c in record["checks"] if c["name"] in ("input-validation", "bad-input")), [])
                if rows:
                    inner += (
                        "<pre>"
                        + html.escape("\n".join(f"{r['id']:<26} {r['outcome']:<20} {r['evidence']}" for r in rows))
                        + "</pre>"
                    )
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

    from workbench.tables import fixed_width

    cols = columns(records)
    short = {"validates": "val", "partly validates": "part", "no validation": "none", "not run": "-"}
    key = " | ".join(f"{i} {c}" for i, c in enumerate(cols, 1))
    table = fixed_width(
        [("row", *map(str, range(1, len(cols) + 1)))]
        + [(r["row"], *[short.get(v, v) for v in grid(records)[r["row"]].values()]) for r in records]
    )
    legend = "pass, FAIL, n/a; - not run; validation: val(idates), part(ly), none"
    return "\n".join([*textwrap.wrap("columns: " + key, 100, break_on_hyphens=False), legend, "", table])


def heatmap(records: list[dict[str, Any]]):
    """A matplotlib Figure: rows x columns, one colour per verdict, the verdict written in each cell."""
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    from workbench.plots import figure

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
            text = {"partly validates": "partly", "no validation": "none", "validates": "valid"}.get(
                g[row][column], g[row][column]
            )
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if g[row][column] == "FAIL" else "black")
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


def wrappers(records: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(row, adapter, what the adapter decides: its docstring) for each row."""
    out = []
    for record in records:
        adapter = ADAPTERS.get(record["adapter"])
        doc = " ".join((adapter.wrap.__doc__ or adapter.doc or "").split()) if adapter else "adapter not registered"
        out.append((record["row"], record["adapter"], doc))
    return out


def sanitizer(directory: Path = GPU_DATA) -> dict[str, dict[str, Any]]:
    """{row: {tool: report}} from data/gpu/audit-sanitizer.json ({} when not recorded)."""
    path = Path(directory) / "audit-sanitizer.json"
    return json.loads(path.read_text())["rows"] if path.exists() else {}


def sanitizer_status(report: dict[str, Any]) -> tuple[int | None, str]:
    """(errors, what happened) of one compute-sanitizer run, read from its record.

    A run counts only if the watched program completed its forward+backward (its last line says
    so): a program that failed to import its package or was refused reports "0 errors" about
    nothing. racecheck reports a hazard summary instead of an error summary."""
    if report.get("errors") is None and not report.get("first"):
        return None, f"not run: {report.get('why') or 'no log'}"
    program = " ".join(report.get("program") or [])
    if "forward+backward in" not in program and report.get("errors"):  # the tool's errors aborted the program
        kinds = ", ".join(f"{k} x{n}" for k, n in (report.get("kinds") or {}).items() if "returned an error" not in k)
        return report["errors"], f"{report['errors']} errors ({kinds}; first 20 shown); the program then aborted"
    if "forward+backward in" not in program:
        last = (report.get("program") or ["?"])[-1].strip()
        return None, f"did not complete: {last[:140]}"
    errors = report.get("errors")
    if errors is None:
        race = next((line for line in report.get("first", []) if "RACECHECK SUMMARY" in line), "")
        found = re.search(r"\((\d+) errors", race)
        errors = int(found.group(1)) if found else None
    if errors is None:
        return None, "no summary in the log"
    kinds = ", ".join(f"{k} x{n}" for k, n in (report.get("kinds") or {}).items() if "returned an error" not in k)
    return errors, f"{errors} errors" + (f" ({kinds}; first 20 shown)" if errors and kinds else "")


def sanitizer_text(reports: dict[str, dict[str, Any]]) -> str:
    """One line per (row, tool): what compute-sanitizer reported, or why the run does not count."""
    from workbench.tables import fixed_width

    lines = [("row", "tool", "result")]
    for row, by_tool in reports.items():
        for tool, report in by_tool.items():
            lines.append((row, tool, sanitizer_status(report)[1]))
    return fixed_width(lines)
