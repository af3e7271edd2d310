"""The fixed varlen attention: Triton kernels (`attention_kernels`), their launchers (`launch`),
the `torch.library` custom op with autograd behind `varlen_attention` (`op`), the device check of
`validate=True` (`device_check`; `raise_pending` surfaces the checks not read yet) and the
contract-keeping path to FlashAttention-4 (`fa4`); `varlen_attn` is torch's `varlen_attn`
signature on the same kernel."""

from kernels.varlen.op import DTYPES, HEAD_DIMS, AuxRequest, raise_pending, varlen_attention, varlen_attn

__all__ = ["DTYPES", "HEAD_DIMS", "AuxRequest", "raise_pending", "varlen_attention", "varlen_attn"]
