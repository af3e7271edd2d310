"""Audits recorded on a GPU (`varlen-workbench audit ... --record FILE`), read back on any machine.

A record is `AuditReport.to_dict()` as JSON: the verdict of every check, the fuzzer's run with
its shrunk failures, and the provenance of the machine that ran it. The tables here are the
ones `varlen-workbench audit` printed: `AuditReport` formats its live results through the same
`format_verdicts` and `format_campaign`, so a record reads on the site as the run read in the
terminal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from varlen_workbench.workbench.audit.fuzz import SNIPPET_IMPORTS, FuzzResult
from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import load_records, portable
from varlen_workbench.workbench.tables import fixed_width

CAMPAIGN_CHECKS = ("input-validation", "bad-input")  # its name, and its name in records before it was graded
RECORD_COMMAND = "varlen-workbench audit MODULE:FUNCTION --device cuda --record data/gpu/audit-<name>.json"


# Snippets recorded before the packages moved under `varlen_workbench` import the old top-level
# names, which are other distributions' now (Hugging Face's `kernels`, PyPI's `workbench`). The
# record keeps what ran; shown, a snippet gets the current names, so that it still runs.
_RENAMED_IN_SNIPPETS = (
    (
        "from workbench import Case, Fill, pack, probe\nfrom workbench.audit import adapt, layout_findings\n",
        "\n".join(SNIPPET_IMPORTS) + "\n",
    ),
    ("from workbench.", "from varlen_workbench.workbench."),
    ("from kernels import ", "from varlen_workbench.kernels.varlen import "),
    ('adapt("kernels:', 'adapt("varlen_workbench.kernels.varlen:'),
    ('adapt("workbench.', 'adapt("varlen_workbench.workbench.'),
)


def shown_snippet(failure: dict[str, Any]) -> str:
    """A recorded fuzz failure's snippet as it runs today (see `_RENAMED_IN_SNIPPETS`)."""
    text = failure["snippet"]
    for old, new in _RENAMED_IN_SNIPPETS:
        text = text.replace(old, new)
    return text


def load_audit_records(directory: Path = GPU_DATA) -> list[dict[str, Any]]:
    """Every audit record under `directory` (audit-*.json), in file-name order, each with its file name.

    Only audits that ran: the sanitizer's record (audit-sanitizer.json) and the note a path that
    could not run leaves (`"ran": false`) are the audit matrix's business (varlen_workbench.workbench.audit.matrix)."""
    records = [r for r in load_records("audit-*.json", directory) if "checks" in r and r.get("ran", True) is not False]
    if not records:
        raise FileNotFoundError(f"no audit-*.json under {directory}; record one on a GPU machine with `{RECORD_COMMAND}`")
    return records


def format_verdicts(rows: Iterable[tuple[str, str, str]]) -> str:
    """Table of (check, verdict, evidence) rows under a header."""
    # Evidence on one line: a CUDA error's message spans several.
    return fixed_width([("check", "verdict", "evidence"), *((c, v, portable(" ".join(e.split()))) for c, v, e in rows)])


def format_campaign(rows: Sequence[dict[str, str]]) -> str:
    """The bad-input campaign, one line per malformed call: id, outcome, evidence."""
    return fixed_width(((row["id"], row["outcome"], portable(row["evidence"])) for row in rows), header=False)


def verdicts(record: dict[str, Any]) -> dict[str, str]:
    """{check: verdict} of the record, as `AuditReport.verdicts()` gave them: pass, FAIL or n/a."""
    return {check["name"]: check["verdict"] for check in record["checks"]}


def verdict_table(record: dict[str, Any]) -> str:
    """The record's checks as `AuditReport.table()` printed them: check, verdict, evidence."""
    return format_verdicts((check["name"], check["verdict"], check["evidence"]) for check in record["checks"])


def campaign_table(record: dict[str, Any]) -> str:
    """The record's bad-input campaign as `AuditReport.campaign_table()` printed it (empty when not run)."""
    rows = next((check["rows"] for check in record["checks"] if check["name"] in CAMPAIGN_CHECKS), ())
    return format_campaign(rows)


def fuzz_summary(record: dict[str, Any]) -> str:
    """The fuzzer's line of the recorded run: layouts tried, profile, time, rate, failing layouts."""
    fuzzed = record["fuzz"]
    if fuzzed is None:
        return "fuzzer: not run"
    # FuzzResult.summary is the one wording of this line; the failures do not enter it.
    return FuzzResult(**{key: value for key, value in fuzzed.items() if key != "failures"}).summary()


def fuzz_failure(record: dict[str, Any], check: str) -> dict[str, Any]:
    """The fuzzer's shrunk failure of `check`: evidence, case (a `Case.to_dict()`), snippet."""
    failures = record["fuzz"]["failures"] if record["fuzz"] else []
    for failure in failures:
        if failure["check"] == check:
            return failure
    raise KeyError(f"the fuzzer of {record['target']} found no {check} failure; it found {[f['check'] for f in failures]}.")
