"""An older recorded audit re-read with today's rules, from what it recorded alone.

Records are kept as recorded (data/gpu/*.json), but the rules that graded them changed:

- The bad-input campaign once ran on a layout with TAIL rows (`varlen_workbench.workbench.malformed.base_args`
  with `tail=True`), so an implementation that leaves TAIL rows unwritten returned "silent NaN"
  on malformed calls for that reason alone; and it called any exception other than ValueError /
  TypeError a crash. `regrade_campaign` re-classifies each recorded exception message with the
  one rule of today (`varlen_workbench.workbench.audit.campaign.classify_exception`), and names the "silent NaN"
  whose count is exactly the layout's TAIL values, or (on a valid call) every value.
- Checks once built their cases with TAIL rows and judged TAIL rows in them, so a TAIL-row bug
  failed checks about something else (empty-sequences, say). Today each check judges its own
  subject, and only tail-rows has TAIL rows. `regrade_checks` says which recorded FAILs other
  than tail-rows' are TAIL-row findings alone: today's check would not see them.
"""

from __future__ import annotations

import re
from typing import Any

from varlen_workbench.workbench.audit.campaign import classify_exception
from varlen_workbench.workbench.audit.records import CAMPAIGN_CHECKS
from varlen_workbench.workbench.malformed import CATALOGUE, HEAD_DIM, HEADS, REAL, ROWS

TAIL_BUG = "TAIL bug (the NaN are exactly the TAIL rows)"
EVERY_ROW_NAN = "silent wrong result (a valid call; every row NaN, REAL rows included)"
TAIL_ONLY = "not this check's finding: TAIL rows alone (tail-rows' finding; today's case has none)"
_CLASSIFIED = ("crash", "vague error", "clear error")
_REGION_PART = re.compile(r"^\w+: .* in \d+ (REAL|GAP|TAIL) rows$")


def regrade_campaign(record: dict[str, Any], aliases: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(case id, recorded outcome, today's outcome) of each malformed call of `record`'s campaign,
    which ran on base_args' layout with TAIL rows (`aliases`: the function's own argument names)."""
    by_id = {case.id: case for case in CATALOGUE}
    tail_values = (ROWS - REAL[-1]) * HEADS * HEAD_DIM
    all_values = ROWS * HEADS * HEAD_DIM
    rows: list[dict[str, str]] = next((c["rows"] for c in record["checks"] if c["name"] in CAMPAIGN_CHECKS), [])
    out = []
    for row in rows:
        outcome = row["outcome"]
        if outcome in _CLASSIFIED:
            _, _, message = row["evidence"].partition(": ")
            outcome = classify_exception(RuntimeError(message), by_id[row["id"]], aliases).value
        elif outcome == "silent NaN" and row["evidence"] == f"returned an output with {tail_values} non-finite values":
            outcome = TAIL_BUG
        elif (
            outcome == "silent NaN"
            and by_id[row["id"]].valid
            and row["evidence"] == f"returned an output with {all_values} non-finite values"
        ):
            outcome = EVERY_ROW_NAN
        out.append((row["id"], row["outcome"], outcome))
    return out


def tail_only(evidence: str) -> bool:
    """Whether a recorded FAIL's evidence ('<case> (<fill> padding): out: ... in 2 TAIL rows; ...', or
    a fuzzer failure's, without the case) names TAIL rows and nothing else."""
    _, case, findings = evidence.partition("padding): ")
    findings = findings if case else evidence
    parts = [part.strip() for part in findings.split(";") if part.strip()]
    return bool(parts) and all(_REGION_PART.match(part) and part.endswith("TAIL rows") for part in parts)


def padding_only(evidence: str) -> bool:
    """Whether a recorded FAIL's evidence names GAP or TAIL rows only (no REAL row, no exception)."""
    _, case, findings = evidence.partition("padding): ")
    findings = findings if case else evidence
    parts = [part.strip() for part in findings.split(";") if part.strip()]
    return bool(parts) and all((m := _REGION_PART.match(part)) is not None and m[1] != "REAL" for part in parts)


def regrade_checks(record: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """{check: (recorded verdict, today's reading)} for each check of `record`: a FAIL of a
    check other than tail-rows whose evidence is TAIL rows alone reads TAIL_ONLY."""
    return {
        check["name"]: (
            check["verdict"],
            TAIL_ONLY
            if check["verdict"] == "FAIL" and check["name"] != "tail-rows" and tail_only(check["evidence"])
            else check["verdict"],
        )
        for check in record["checks"]
    }


__all__ = ["EVERY_ROW_NAN", "TAIL_BUG", "TAIL_ONLY", "padding_only", "regrade_campaign", "regrade_checks", "tail_only"]
