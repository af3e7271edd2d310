"""Post-mortem torch-varlen-176793: torch `varlen_attn` and rows beyond `cu_seqlens[-1]`.

The bug: `varlen_attn` (FlashAttention-2 underneath) allocates its output and gradients with
`empty_like` and writes only rows covered by `cu_seqlens`; TAIL rows (a padded token budget,
legal memory) return whatever the allocator left. We study it through a Triton replica of that
mechanism (`varlen_workbench.kernels.replicas.torch_varlen`) on any machine, and through torch's own
`varlen_attn` on a GPU: `gpu_probes(device)` is what `varlen-workbench repro torch-varlen-176793
--device cuda --record data/gpu/torch-varlen-176793-h200.json` adds to the record.

`reproduce()` returns `Results`; `claims` checks them. The notebook shows only what is here.
"""

from varlen_workbench.kernels.replicas.torch_varlen import replica_varlen_attn
from varlen_workbench.postmortems.torch_varlen_176793.cases import CASES, META, STATUS, STUDY, WHO
from varlen_workbench.postmortems.torch_varlen_176793.claims import claims, register_gpu_claims
from varlen_workbench.postmortems.torch_varlen_176793.figures import capture_table, gpu_points_table, gpu_workaround_table
from varlen_workbench.postmortems.torch_varlen_176793.gpu import gpu_probes, upstream_probes
from varlen_workbench.postmortems.torch_varlen_176793.mechanism import (
    _masked_grad_out,
    corrected_repro,
    nan_map,
    seed_input_problems,
    tail_rows_report,
)
from varlen_workbench.postmortems.torch_varlen_176793.study import (
    TRAIN_CONFIG,
    budget_batches,
    gradient_norm_explorer,
    reproduce,
    token_budget_attention,
    workaround_evidence,
)
from varlen_workbench.postmortems.torch_varlen_176793.upstream import upstream_code
from varlen_workbench.postmortems.torch_varlen_176793.window import window_finding, window_finding_markdown
from varlen_workbench.postmortems.torch_varlen_176793.workarounds import (
    LATER_KEYWORDS,
    _subjects,
    _zero_rows_from,
    as_dummy_sequence,
    as_sliced,
    compile_fullgraph,
    fixed_torch_style,
    proposed_check,
    qkv_damage,
    swap_in_keywords,
    workarounds,
)
from varlen_workbench.workbench.instruments.tinylm import TinyLM
from varlen_workbench.workbench.postmortem import table

__all__ = [
    "CASES",
    "LATER_KEYWORDS",
    "META",
    "STATUS",
    "STUDY",
    "WHO",
    "TRAIN_CONFIG",
    "TinyLM",
    "_masked_grad_out",
    "_subjects",
    "_zero_rows_from",
    "as_dummy_sequence",
    "as_sliced",
    "budget_batches",
    "capture_table",
    "claims",
    "compile_fullgraph",
    "corrected_repro",
    "fixed_torch_style",
    "gpu_points_table",
    "gpu_probes",
    "gpu_workaround_table",
    "gradient_norm_explorer",
    "nan_map",
    "proposed_check",
    "qkv_damage",
    "register_gpu_claims",
    "replica_varlen_attn",
    "reproduce",
    "seed_input_problems",
    "table",
    "tail_rows_report",
    "token_budget_attention",
    "upstream_code",
    "swap_in_keywords",
    "upstream_probes",
    "window_finding",
    "window_finding_markdown",
    "workaround_evidence",
    "workarounds",
]
