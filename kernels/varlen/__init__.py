"""The fixed varlen attention: Triton kernels (`attention_kernels`), their launchers (`launch`) and
the `torch.library` custom op with autograd behind `varlen_attention` (`op`); `varlen_attn` is
torch's `varlen_attn` signature on the same kernel."""

from kernels.varlen.op import DTYPES, HEAD_DIMS, AuxRequest, varlen_attention, varlen_attn

__all__ = ["DTYPES", "HEAD_DIMS", "AuxRequest", "varlen_attention", "varlen_attn"]
