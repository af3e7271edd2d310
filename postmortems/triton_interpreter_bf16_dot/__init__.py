"""Post-mortem triton-interpreter-bf16-dot: the CPU interpreter multiplies raw bfloat16 bits.

Our own find while building the workbench, a tooling bug. Under `TRITON_INTERPRET=1` numpy holds
every tensor and has no bfloat16, so the interpreter keeps bf16 as uint16 bit patterns;
`create_dot` converts only 8-bit floats before `np.matmul`, so a bf16 `tl.dot` multiplies the bit
patterns. Any kernel with a bf16 `tl.dot` run on the CPU interpreter returns results ~1e9 too
large and finite: a silent bug inside the tool people use to study silent bugs. Compiled runs on
a GPU are correct.

The study (`study(device)`) runs on one device, the CPU (the interpreter) or CUDA (native), and
returns plain JSON-ready data; `reproduce()` always includes the interpreter's answer (CPU tensors,
in the same process on a GPU box), on a GPU the native one, the native compilation of the dot kernel, the installed interpreter's source
of the bug, and the GPU runs recorded under data/gpu/ (`gpu_records(META)`). Tables and figures
for the notebook are built here from those results with `table()` and `figure()`; source listings
go through `listing(name)`, so a test can check that a committed notebook shows the current code.
"""

from varlen_workbench.postmortems.triton_interpreter_bf16_dot.cases import (
    CASES,
    FIXED,
    META,
    RECORD_COMMAND,
    REPRODUCTION,
    SOURCE_READ,
    STATUS,
    WORKAROUND,
)
from varlen_workbench.postmortems.triton_interpreter_bf16_dot.claims import claims
from varlen_workbench.postmortems.triton_interpreter_bf16_dot.figures import (
    attention_table,
    compiled_table,
    cost_table,
    dot_table,
    gpu_table,
    plot_dot_errors,
    workaround_table,
)
from varlen_workbench.postmortems.triton_interpreter_bf16_dot.study import _recorded, impact_figures, listing, reproduce

__all__ = [
    "CASES",
    "FIXED",
    "META",
    "STATUS",
    "RECORD_COMMAND",
    "REPRODUCTION",
    "SOURCE_READ",
    "WORKAROUND",
    "_recorded",
    "attention_table",
    "claims",
    "compiled_table",
    "cost_table",
    "dot_table",
    "gpu_table",
    "listing",
    "plot_dot_errors",
    "impact_figures",
    "reproduce",
    "workaround_table",
]
