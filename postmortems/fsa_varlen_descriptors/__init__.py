"""Post-mortem fsa-varlen-descriptors: flash-sparse-attn 2.0.6's varlen attention builds Triton tensor
descriptors that fault on an H200.

Our finding, from the H200 audit matrix (data/gpu/audit-fsa-*-varlen.json, sanitizer-fsa-*-varlen.json):
every varlen backward whose lse bases are not 16-byte aligned raises 'misaligned address', and a
batch with an empty sequence raises 'illegal instruction'. The page runs the library itself on the
CPU under the Triton interpreter with every descriptor recorded, replays the audit's calls, and
shows the workarounds with the library's own functions:

    cases.py     META, the calls replayed, the H200 records read, the source commit
    upstream.py  the library under the interpreter, every descriptor recorded
    audit.py     the first call each audit check made on the H200
    study.py     reproduce(); the workarounds (`repacked`, `real_rows`); the lse bases a batch misaligns
    figures.py   the tables
    claims.py    the claims, each with its evidence
    report.py    the reports to file upstream, their repros run by the paste-block battery
"""

from varlen_workbench.postmortems.fsa_varlen_descriptors.cases import (
    AUDIT,
    CASES,
    CAUSAL,
    EMPTY,
    FUNCTIONS,
    META,
    NO_KEY,
    NO_QUERY,
    STATUS,
    WHO,
)
from varlen_workbench.postmortems.fsa_varlen_descriptors.claims import claims
from varlen_workbench.postmortems.fsa_varlen_descriptors.figures import (
    audit_table,
    calls_table,
    descriptor_table,
    misaligned_h200_table,
    sanitizer_table,
    tail_table,
)
from varlen_workbench.postmortems.fsa_varlen_descriptors.report import REPORTS
from varlen_workbench.postmortems.fsa_varlen_descriptors.study import (
    ALIGNED,
    BARE,
    NO_EMPTY,
    REAL_ROWS,
    FsaDescriptorResults,
    measure,
    misaligned_lse_bases,
    real_rows,
    repack_plan,
    repacked,
    reproduce,
    run,
)
from varlen_workbench.postmortems.fsa_varlen_descriptors.upstream import load, recorded_descriptors

__all__ = [
    "ALIGNED",
    "AUDIT",
    "BARE",
    "CASES",
    "CAUSAL",
    "EMPTY",
    "FUNCTIONS",
    "META",
    "STATUS",
    "NO_EMPTY",
    "NO_KEY",
    "NO_QUERY",
    "REAL_ROWS",
    "REPORTS",
    "WHO",
    "FsaDescriptorResults",
    "audit_table",
    "calls_table",
    "claims",
    "descriptor_table",
    "load",
    "measure",
    "misaligned_h200_table",
    "misaligned_lse_bases",
    "real_rows",
    "recorded_descriptors",
    "repack_plan",
    "repacked",
    "reproduce",
    "run",
    "sanitizer_table",
    "tail_table",
]
