"""One name per meaning: `DTYPES` is our kernel's dtypes, defined once; tables of other
meanings are named for what they are."""

import re
from pathlib import Path

import torch

import varlen_workbench.kernels.varlen
from varlen_workbench.kernels.interpreter import DOT_DTYPES
from varlen_workbench.kernels.replicas.dmattn import FLASH_DMATTN_DTYPES
from varlen_workbench.kernels.replicas.torch_varlen import VARLEN_ATTN_DTYPES
from varlen_workbench.workbench.audit_catalog import CASE_DTYPES
from varlen_workbench.workbench.layout import DTYPE_NAMES, Case

ROOT = Path(__file__).resolve().parent.parent


def test_dtypes_is_defined_once():
    definitions = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("kernels", "workbench", "postmortems")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.match(r"\s*DTYPES\s*[:=]", line)
    ]
    assert [d.split(":")[0] for d in definitions] == ["kernels/varlen/op.py"], definitions
    # The audit's catalogue names them without importing torch (`--help`): the same dtypes, by name.
    assert CASE_DTYPES == tuple(str(d).removeprefix("torch.") for d in varlen_workbench.kernels.varlen.DTYPES)


def test_each_table_holds_what_its_name_says():
    assert set(DOT_DTYPES) == set(varlen_workbench.kernels.varlen.DTYPES), (
        "the interpreter study checks the dtypes our kernels take"
    )
    assert all(getattr(torch, name) is dtype for name, dtype in DTYPE_NAMES.items())
    assert set(varlen_workbench.kernels.varlen.DTYPES) < set(DTYPE_NAMES.values())  # a Case can name every kernel dtype
    # what each upstream takes is a subset of what a Case can name, so each can be studied
    assert set(FLASH_DMATTN_DTYPES) <= set(DTYPE_NAMES.values()) and set(VARLEN_ATTN_DTYPES) <= set(DTYPE_NAMES.values())
    assert Case(seqlens_q=(2,), dtype=torch.bfloat16).dtype == "bfloat16"
