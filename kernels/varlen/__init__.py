"""The fixed varlen attention: Triton kernels (`triton_kernels`), their launchers (`launch`) and
the `torch.library` custom op with autograd behind `varlen_attention` (`op`)."""

from kernels.varlen.op import DTYPES, HEAD_DIMS, varlen_attention

__all__ = ["DTYPES", "HEAD_DIMS", "varlen_attention"]
