"""Post-mortem fa4-unwritten-padding: FlashAttention-4 leaves the padding rows of out, dq, dk, dv unwritten.

Our finding, from the H200 audit matrix (data/gpu/audit-fa4.json: tail-rows, gap-rows,
no-real-query, sliding-window) and a real transformers training step through FA4
(data/gpu/real-client-h200-fa4.json). FA4 allocates out and, in the sm90 backward, dq, dk, dv with
torch.empty (interface.py of the flash-attn-4 4.0.0b36 wheel) and writes only rows inside a
sequence's used length, so TAIL rows (past cu_seqlens[-1]) and GAP rows (past seqused inside a
slot) keep whatever memory held. The page reads the H200 records and shows the mechanism and the
workaround on the CPU with the replica of the same mechanism (kernels/replicas/torch_varlen.py):

    cases.py    META, the layouts, the records read
    study.py    reproduce(); the FA4-shaped replica; the workaround (`with_padding_zeroed`)
    claims.py   the claims, each with its evidence
    report.py   the report to file upstream, its repro run by the paste-block battery
"""

from varlen_workbench.postmortems.fa4_unwritten_padding.cases import CASES, CHECKS, META, STATUS, TAIL, TAIL_NAN, WHO
from varlen_workbench.postmortems.fa4_unwritten_padding.claims import claims
from varlen_workbench.postmortems.fa4_unwritten_padding.figures import audit_summary, audit_table, layer_norm_table, probe_table
from varlen_workbench.postmortems.fa4_unwritten_padding.report import REPORT
from varlen_workbench.postmortems.fa4_unwritten_padding.study import (
    Fa4PaddingResults,
    real_rows,
    replica_flash_attn_varlen_func,
    reproduce,
    with_padding_zeroed,
)

__all__ = [
    "CASES",
    "CHECKS",
    "META",
    "STATUS",
    "REPORT",
    "TAIL",
    "TAIL_NAN",
    "WHO",
    "Fa4PaddingResults",
    "audit_summary",
    "audit_table",
    "claims",
    "layer_norm_table",
    "probe_table",
    "real_rows",
    "replica_flash_attn_varlen_func",
    "reproduce",
    "with_padding_zeroed",
]
