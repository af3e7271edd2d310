"""Post-mortem flash-dmattn-121: fully masked rows make flash-dmattn's dK/dV NaN; the proposed NaN-to-zero patch hides it.

The report under study proposes a patch for flash-sparse-attention#121 (formerly
SmallDoges/flash-dmattn), written with GitHub Copilot and not found in the tracker: `zeros_like` dk/dv buffers and `tl.where(tl.isfinite(x), x, 0.0)` over the
Triton backward. This module runs the upstream code itself, flash-dmattn 1.2.2's Triton backend
(`upstream_module()`: under the interpreter with its `q.is_cuda` assertions stripped, natively as
is), against a float64 dense oracle (`dense_reference`: a row with no visible key has output 0 and
gradient 0), on CPU in fp16 (the interpreter's bf16 `tl.dot` is broken) and, through `gpu_probes`,
on a GPU in bf16. It shows which of the report's claims hold on the released code, the NaN it does
have (a query row with no visible key in key block 0), two workarounds and a tiny model's training.

The replica (`varlen_workbench.kernels.replicas.dmattn`) is kept for what upstream cannot show: the proposed patch
applied, and a guard for rows with no visible key.

`reproduce()` returns a `Results`; `claims` checks it; the notebook shows it.
"""

from varlen_workbench.postmortems.flash_dmattn_121.cases import (
    CASES,
    GPU_SEEDS,
    GRADS,
    META,
    PADDED,
    REPLICA_CASES,
    SEED,
    STATUS,
    TRAIN_SEQLEN,
    TRAIN_VARIANTS,
    UPSTREAM_CASES,
    UPSTREAM_TENSORS,
    WHO,
    MaskCase,
    shown_name,
)
from varlen_workbench.postmortems.flash_dmattn_121.claims import claims, patch_error_ratios
from varlen_workbench.postmortems.flash_dmattn_121.figures import (
    coverage_table,
    gpu_table,
    nan_do_table,
    patch_table,
    plot_mechanism,
    plot_sweep,
    plot_training,
    ratio_text,
    report_claims_table,
    upstream_table,
    worst_ratio,
)
from varlen_workbench.postmortems.flash_dmattn_121.gpu import gpu_probes
from varlen_workbench.postmortems.flash_dmattn_121.study import (
    Coverage,
    Results,
    dense_reference,
    observed_upstream_nan_grad_items,
    observed_upstream_nan_rows,
    packed_equivalent,
    patch_as_written_error,
    predict_upstream_nan_grad_items,
    predict_upstream_nan_rows,
    reproduce,
    run,
    successor_import_error,
    train_health,
    training_deviation,
    training_summary,
    upstream_call_errors,
    upstream_cases,
    upstream_run,
)
from varlen_workbench.postmortems.flash_dmattn_121.upstream import (
    SUCCESSOR_VERSION,
    UPSTREAM_VERSION,
    import_successor,
    upstream_dtype,
    upstream_module,
    upstream_triton_func,
    upstream_version,
)

__all__ = [
    "CASES",
    "Coverage",
    "GPU_SEEDS",
    "GRADS",
    "META",
    "shown_name",
    "STATUS",
    "WHO",
    "MaskCase",
    "PADDED",
    "REPLICA_CASES",
    "Results",
    "SEED",
    "SUCCESSOR_VERSION",
    "TRAIN_SEQLEN",
    "TRAIN_VARIANTS",
    "UPSTREAM_CASES",
    "UPSTREAM_TENSORS",
    "UPSTREAM_VERSION",
    "import_successor",
    "claims",
    "coverage_table",
    "dense_reference",
    "gpu_probes",
    "gpu_table",
    "nan_do_table",
    "observed_upstream_nan_grad_items",
    "observed_upstream_nan_rows",
    "packed_equivalent",
    "patch_as_written_error",
    "patch_error_ratios",
    "patch_table",
    "plot_mechanism",
    "plot_sweep",
    "plot_training",
    "predict_upstream_nan_grad_items",
    "predict_upstream_nan_rows",
    "ratio_text",
    "report_claims_table",
    "reproduce",
    "run",
    "successor_import_error",
    "train_health",
    "training_deviation",
    "training_summary",
    "upstream_call_errors",
    "upstream_cases",
    "upstream_dtype",
    "upstream_module",
    "upstream_run",
    "upstream_table",
    "upstream_triton_func",
    "upstream_version",
    "worst_ratio",
]
