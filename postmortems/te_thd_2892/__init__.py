"""Post-mortem te-thd-2892: real vs padded cu_seqlens in TransformerEngine's THD attention, FP8
alignment padding and VERL's identical-boundaries workaround (NVIDIA/TransformerEngine#2892).

TransformerEngine itself runs on a GPU only: scripts/te_pack.sh and scripts/te_install.py install
its wheels and build its PyTorch extension on the GPU machine (docs/gpu-transformer-engine.md),
and `upstream` runs the report's repro on it (scripts/te_thd_cases.py; the toy's training through
TE's attention: scripts/te_thd_training.py; `te_probes`: TE's audit FAILs taken apart and its FP8
Linear, scripts/te_probes.py). `on_te` reads those records for the page. Every claim says what
produced its evidence: TE itself on the GPU (the records), a reading of TE's source at a named
commit, our replica of a mechanism (the contract as one masked matmul,
`varlen_workbench.workbench.instruments.tinylm.dense_attention`; our FP8 quantizer and kernel), a toy model (`varlen_workbench.workbench.instruments.tinylm`),
or our own kernel (`varlen_workbench.kernels.varlen.varlen_attention`, also under our context-parallel attention,
`varlen_workbench.workbench.instruments.context_parallel`).

The study, one function per part:

1. `workaround_error` / `contract_error` / `workaround_sweep`: what `cu_seqlens = cu_seqlens_padded`
   (VERL's workaround) does to real rows of attention, causal and not;
2. `train_three_ways` / `bidirectional_seeds` / `health_runs`: the same on a tiny model's training
   (causal: nothing; bidirectional: several seeds; per-parameter gradient norms by padding share);
   `boundary_runs`: the causal pair through any attention (TE's, on the GPU, through `on_device`);
3. `fp8_study`: blockwise FP8 scales from real rows, from every row, and from every row with the
   padding zeroed;
4. `tail_blind` / `zero_tail`: a backend that never writes the rows after `cu_seqlens[-1]`, and
   the workaround of zeroing them;
5. `auto_detect_table`: TE's `pad_between_seqs` auto-detect, transcribed from two commits;
6. appendix: `rope_study`, `seqpar_study` (a sizing lesson), the 2 x cp_size padding rule of
   context parallelism (`varlen_workbench.workbench.audit.context_parallel.padding_rule_study`, `cp_rule_table`),
   `te_recipe` (TE's THD padding test on our kernel), `cast_study` (the Triton interpreter's e4m3 cast);
7. `upstream`, `te_probes`, `seqpar_te` (GPU only, not imported here): TE itself on the report's
   script and the cases it meant, its audit FAILs and its FP8 Linear, its sequence-parallel block on
   two GPUs (scripts/te_seqpar.py); `on_te`: their records, read for the page.

`reproduce()` runs them all and returns `TeResults`; `claims` checks them.
"""

from varlen_workbench.postmortems.te_thd_2892 import on_te
from varlen_workbench.postmortems.te_thd_2892.cases import (
    CASES,
    FP8_CASE,
    HEALTH_FRACTIONS,
    HEALTH_PARAMS,
    META,
    STATUS,
    TE_DOCSTRING,
    TE_MAIN,
    TE_V2_12,
    TRAINING_RUNS,
    padding_case,
)
from varlen_workbench.postmortems.te_thd_2892.claims import claims
from varlen_workbench.postmortems.te_thd_2892.figures import (
    auto_detect_table,
    cast_table,
    cp_rule_table,
    fp8_table,
    plot_contract,
    plot_fp8,
    plot_gradient_health,
    plot_rope,
    plot_seeds,
    plot_workaround_sweep,
    rope_table,
    seeds_table,
    seqpar_table,
    training_table,
    workaround_table,
)
from varlen_workbench.postmortems.te_thd_2892.mechanism import (
    _quantized,
    auto_detect,
    cast_study,
    contract_error,
    fp8_study,
    identical_boundaries,
    layout_contract,
    pad_between_seqs_main,
    pad_between_seqs_v2_12,
    rope_study,
    te_recipe,
    workaround_error,
    workaround_sweep,
)
from varlen_workbench.postmortems.te_thd_2892.study import TeResults, fp8_zero_padding_scales_equal, reproduce
from varlen_workbench.postmortems.te_thd_2892.training import (
    bidirectional_seeds,
    boundary_runs,
    health_runs,
    padded_batch,
    qkv_norm_ratio,
    tail_blind,
    train_three_ways,
    zero_tail,
)
from varlen_workbench.workbench.layout import Case, Fill, pack
from varlen_workbench.workbench.postmortem import table

__all__ = [
    "on_te",
    "CASES",
    "Case",
    "FP8_CASE",
    "Fill",
    "HEALTH_FRACTIONS",
    "HEALTH_PARAMS",
    "META",
    "STATUS",
    "TE_DOCSTRING",
    "TE_MAIN",
    "TE_V2_12",
    "TRAINING_RUNS",
    "TeResults",
    "_quantized",
    "auto_detect",
    "auto_detect_table",
    "bidirectional_seeds",
    "boundary_runs",
    "cast_study",
    "cast_table",
    "cp_rule_table",
    "claims",
    "contract_error",
    "fp8_study",
    "fp8_table",
    "fp8_zero_padding_scales_equal",
    "health_runs",
    "identical_boundaries",
    "layout_contract",
    "pack",
    "pad_between_seqs_main",
    "pad_between_seqs_v2_12",
    "padded_batch",
    "padding_case",
    "plot_contract",
    "plot_fp8",
    "plot_gradient_health",
    "plot_rope",
    "plot_seeds",
    "plot_workaround_sweep",
    "qkv_norm_ratio",
    "reproduce",
    "rope_study",
    "rope_table",
    "seeds_table",
    "seqpar_table",
    "table",
    "tail_blind",
    "te_recipe",
    "train_three_ways",
    "training_table",
    "workaround_error",
    "workaround_sweep",
    "workaround_table",
    "zero_tail",
]
