"""What a check of the audit returns: its verdict, its findings and its result. Apart from the
checks (`checks`), so that a check run elsewhere (`context_parallel`, a separate process group)
returns the same types without importing the checks back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from varlen_workbench.workbench.layout import Case
from varlen_workbench.workbench.probes import ProbeRecord

CONTEXT_PARALLEL = "context-parallel"  # the check, and the feature only a context-parallel attention has


class Verdict(str, enum.Enum):
    """pass / FAIL / n/a for correctness checks; the three grades of the input-validation check,
    which never fail an audit (a correct attention that checks nothing still computes right)."""

    PASS = "pass"
    FAIL = "FAIL"
    NA = "n/a"
    VALIDATES = "validates"
    PARTLY = "partly validates"
    NO_VALIDATION = "no validation"

    @property
    def graded(self) -> bool:
        return self in (Verdict.VALIDATES, Verdict.PARTLY, Verdict.NO_VALIDATION)


GRADE_VERDICTS = {"validates": Verdict.VALIDATES, "partial": Verdict.PARTLY, "none": Verdict.NO_VALIDATION}


@dataclass(frozen=True)
class Finding:
    """One way a layout broke the contract."""

    check: str
    evidence: str

    def __str__(self) -> str:
        return f"{self.check}: {self.evidence}"


@dataclass
class CheckResult:
    name: str
    verdict: Verdict
    evidence: str
    cases: tuple[Case, ...] = ()  # the cases probed; on FAIL the failing one comes first
    rows: tuple[dict[str, Any], ...] = ()  # per-case detail (the bad-input campaign)
    seconds: float = 0.0
    records: tuple[ProbeRecord, ...] = field(default=(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "verdict": self.verdict.value,
            "evidence": self.evidence,
            "cases": [c.to_dict() for c in self.cases],
            "rows": list(self.rows),
            "seconds": round(self.seconds, 3),
        }
