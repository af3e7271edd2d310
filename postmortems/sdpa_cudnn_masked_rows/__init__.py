"""Post-mortem sdpa-cudnn-masked-rows: SDPA's cuDNN backend and query rows with no visible key.

Our own finding, from the H200 audit matrix (data/gpu/audit-sdpa-cudnn.json, torch 2.11): with a
boolean `attn_mask`, `scaled_dot_product_attention` under the cuDNN backend gives a REAL query row
whose mask row is all False (a key sequence of length 0; causal bottom-right with len_q > len_k)
a finite, non-zero output, and gradients flow from that row into keys it must not see; the math
and memory-efficient backends give 0 there. On that H200, SDPA runs cuDNN for masked calls when no
backend is asked for (data/gpu/sdpa-default-backend-h200.json, `varlen_workbench.workbench.instruments.sdpa_dispatch`).

* the cuDNN behaviour is shown from the committed H200 records, with their provenance;
* the mechanism is studied on the CPU with a replica: the math backend given the *additive* mask
  torch builds for cuDNN from a boolean one (a finite fill, -65504, where the mask is False). A
  fully masked row then has every score shifted by the same constant, so softmax ignores the mask
  and the row attends to every key slot of its batch row. The replica reproduces the recorded
  cuDNN errors of out, dq, dk and dv in both failing cases to three digits;
* `gpu_probes(device)` (torch only) records on a GPU what the CPU cannot show: which backend SDPA
  picks, the cuDNN output of fully masked rows against unmasked attention and under float masks of
  -65504 and -inf, gradients, repeat-run determinism, and the workarounds' times, with
  `varlen-workbench repro sdpa-cudnn-masked-rows --device cuda --record data/gpu/sdpa-cudnn-masked-rows-h200.json`.
"""

from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.cases import (
    CASES,
    CUDNN_FILL,
    FULLY,
    META,
    STATUS,
    TENSORS,
    UNEQUAL,
    WHO,
)
from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.claims import claims
from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.figures import (
    error_table,
    gpu_table,
    mask_figure,
    row_error_figure,
    workaround_table,
)
from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.gpu import gpu_probes, probe_points
from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.report import REPORT
from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.study import (
    audit_record,
    cudnn_mask_replica,
    keyless_rows,
    padded_inputs,
    recorded_check,
    reproduce,
)
from varlen_workbench.workbench.postmortem import table

__all__ = [
    "CASES",
    "CUDNN_FILL",
    "FULLY",
    "META",
    "STATUS",
    "REPORT",
    "WHO",
    "TENSORS",
    "UNEQUAL",
    "audit_record",
    "claims",
    "cudnn_mask_replica",
    "error_table",
    "gpu_probes",
    "gpu_table",
    "keyless_rows",
    "mask_figure",
    "padded_inputs",
    "probe_points",
    "recorded_check",
    "reproduce",
    "row_error_figure",
    "table",
    "workaround_table",
]
