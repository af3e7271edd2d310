"""Faithful replicas of upstream buggy mechanisms: each reproduces a bug's cause, not only its symptom.

One module per upstream bug (its Triton kernels may sit beside it: dmattn's in dmattn_kernels);
add a line below for yours.
"""

from varlen_workbench.kernels.replicas.dmattn import triton_dmattn_func  # noqa: F401  (HKUSTDial/flash-sparse-attention#121)
from varlen_workbench.kernels.replicas.torch_varlen import replica_varlen_attn  # noqa: F401  (pytorch/pytorch#176793)
