"""How to register an adapter, in ten lines: shown where `varlen-workbench audit` cannot infer a call, in
`varlen-workbench audit --help` and in the README. Its own module, free of torch, so `--help` stays fast."""

REGISTER_EXAMPLE = """\
from varlen_workbench.workbench.audit import register_adapter

@register_adapter("my-attn", lacks={"padded": "my_attn has no padded layout (GAP rows)"})
def my_attn_adapter(fn):
    def call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
             cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, causal=False, scale=None):
        return fn(q, k, v, cu_seqlens_q, max_seqlen_q, is_causal=causal, sm_scale=scale)
    return call

# in mypkg/adapters.py; then: varlen-workbench audit mypkg.attn:my_attn --import mypkg.adapters --adapter my-attn"""
