"""DotProductAttention where TE exports it too."""

from transformer_engine.pytorch import DotProductAttention

__all__ = ["DotProductAttention"]
