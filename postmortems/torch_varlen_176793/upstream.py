"""torch's own varlen_attn as installed: the function, its signature and its source (the code the replica mirrors)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch

from varlen_workbench.workbench.audit import adapt


def torch_style(varlen_fn: Callable, name: str) -> Callable:
    """A torch-style varlen function (the replica, torch's own, a workaround) behind the
    contract's signature, through the workbench's "torch-varlen" adapter."""
    return dataclasses.replace(adapt(varlen_fn, "torch-varlen"), name=name)


def _varlen_attn() -> Callable:
    """torch's own function (2.10+), imported only when used."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def upstream() -> Callable:
    """torch's own `varlen_attn` behind the contract's signature (either release's signature)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "torch.nn.attention.varlen.varlen_attn runs on CUDA only (FlashAttention-2, fp16/bf16, "
            "Ampere or newer); on this machine study the replica, and read the recorded GPU runs "
            "with varlen_workbench.workbench.postmortem.latest_gpu_record(META)."
        )
    return torch_style(_varlen_attn(), "varlen_attn")


def upstream_signature() -> str:
    return f"varlen_attn{inspect.signature(_varlen_attn())}"


def upstream_code(module: str = "torch.nn.attention.varlen") -> str:
    """The executable code of the installed torch's `module`, docstrings stripped."""
    import ast
    import importlib

    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            if isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)
