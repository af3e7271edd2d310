"""Post-mortem flash-dmattn-flex-mask: flash-dmattn's Flex backend ignores `attn_mask`.

A finding of the audit matrix (data/gpu/audit-dmattn-flex.json, H200): `flex_dmattn_func` of
flash-dmattn 1.2.2 gives finite, wrong outputs and gradients on every padded layout. This module
runs the upstream function itself, the installed `flash_dmattn/flash_dmattn_flex.py` unmodified
(`upstream_module()`), and reads its source:

* its only `mask_mod` is `q_idx >= kv_idx`, handed to `flex_attention` only when `is_causal`
  (None counts as True); `attn_mask` is sliced and never used, so every masked key is attended;
* `attn_bias` is honoured (a `score_mod` adds it), which is the workaround inside the library.

On CPU the file runs with two stand-ins that change no arithmetic, both said where they act:
where transformers is missing, `compile_friendly_flex_attention` (transformers'
`torch.compile(flex_attention)`, read at huggingface/transformers@2ccc6ca) is provided by
`_TransformersStandIn`; and every `torch.compile` it reaches (that one and upstream's
`create_block_mask(_compile=True)`) runs under `torch.compiler.set_stance("force_eager")`, i.e.
torch's eager FlexAttention, because inductor would build C++ for minutes. FlexAttention has no
backward on CPU (torch raises), so CPU evidence is the forward; the H200 records add the audit's
gradients and the study re-run there (compiled, forward), and `gpu_probes`, which `varlen-workbench repro
--record` calls, measures the workarounds' gradients on a GPU.

`reproduce()` returns a `Results`; `claims` checks it; the notebook shows it.
"""

from varlen_workbench.postmortems.flash_dmattn_flex_mask.cases import AUDITED, CASES, GPU_COMMAND, IMPLS, META, STATUS, WHO
from varlen_workbench.postmortems.flash_dmattn_flex_mask.claims import (
    _gpu_as_is,
    _gpu_bitwise,
    _gpu_forward,
    _gpu_workarounds,
    claims,
)
from varlen_workbench.postmortems.flash_dmattn_flex_mask.figures import (
    audit_table,
    cases_table,
    mask_effect_table,
    row_error_figure,
    weights_figure,
    workaround_table,
)
from varlen_workbench.postmortems.flash_dmattn_flex_mask.gpu import gpu_probes, probe_all
from varlen_workbench.postmortems.flash_dmattn_flex_mask.report import REPORT
from varlen_workbench.postmortems.flash_dmattn_flex_mask.study import impact_figures, reproduce, study_batch
from varlen_workbench.postmortems.flash_dmattn_flex_mask.upstream import (
    listing,
    source_facts,
    transformers_version,
    upstream_function,
    upstream_module,
    upstream_path,
)
from varlen_workbench.workbench.postmortem import table

__all__ = [
    "AUDITED",
    "CASES",
    "GPU_COMMAND",
    "IMPLS",
    "META",
    "STATUS",
    "REPORT",
    "WHO",
    "_gpu_as_is",
    "_gpu_bitwise",
    "_gpu_forward",
    "_gpu_workarounds",
    "audit_table",
    "cases_table",
    "claims",
    "gpu_probes",
    "impact_figures",
    "listing",
    "mask_effect_table",
    "probe_all",
    "reproduce",
    "row_error_figure",
    "source_facts",
    "study_batch",
    "table",
    "transformers_version",
    "upstream_function",
    "upstream_module",
    "upstream_path",
    "weights_figure",
    "workaround_table",
]
