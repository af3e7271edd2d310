"""A stand-in for TransformerEngine in CPU tests: DotProductAttention's THD call, computed by the oracle.

It behaves as TE 2.20.2 does where the report of NVIDIA/TransformerEngine#2892 and the workbench
touch it (constructor and forward keywords, the GQA and mask-type assertions, recipes, autocast,
the debug log's backend lines, output flattened to (tokens, heads * dim); Linear's FP8 round trip
and its column- and row-parallel modes with sequence parallelism, through torch.distributed), and
plants the crash the report claims (SIGSEGV under Float8BlockScaling with cu_seqlens_q !=
cu_seqlens_q_padded), so that the runner's classification of a killed child is tested; by
environment, a gather of the unpadded size and a hang (transformer_engine/pytorch/__init__.py). It
computes nothing of TE's own.
"""
