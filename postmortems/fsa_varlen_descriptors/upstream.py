"""flash-sparse-attn 2.0.6 as installed, runnable on the CPU under the Triton interpreter, with every
tensor descriptor its kernels build checked against Triton's rule and recorded.

Triton requires a tensor descriptor's base to be 16-byte aligned and its leading strides multiples
of 16 bytes (the docstring of `tl.make_tensor_descriptor`; the interpreter's
`TensorDescHandle.validate` asserts exactly that). Inside `recorded_descriptors()` a violation is
recorded instead of raised, so that a whole call runs and every descriptor of its forward and
backward is listed (kernel, source line, base address mod 16, strides, shape: an extent of 0 is a
descriptor over no element); outside it the interpreter asserts as it always does.

To run the library under the interpreter at all, `load("cpu")` stands in, in this process only, for
what needs CUDA (the SM count, the launch-config cache: 64 x 64 tiles, the library's own
is_autotune=False default; its compiled-kernel cache), lets Triton 3.6's interpreter see methods of
`@aggregate` classes, and gives it the descriptor atomic add it lacks; its kernels are decorated
for the interpreter (`varlen_workbench.kernels.runtime.decorating_for_interpreter`: every launch then runs inside
`interpreting()`, with the loop-bound fix for numpy >= 2.4). The library's files are not changed.
flash_sparse_attn imports OpenAI's triton_kernels for its projection kernels only: a stub stands in
for it where it is missing (`varlen_workbench.workbench.upstream`).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from types import FrameType, ModuleType

from varlen_workbench.kernels.runtime import decorating_for_interpreter
from varlen_workbench.workbench.upstream import import_module

VERSION = "2.0.6"
H200_SMS = 132
TILE_M = TILE_N = 64  # the launch config answered on the CPU (the library's own is_autotune=False tiles)
# A fault's site: the library's kernels are the frames whose function name ends so.
_KERNEL_SUFFIX = "_kernel"
_RECORDERS: list[list[dict]] = []  # the innermost `recorded_descriptors()` list, if any
_PREPARED: list[bool] = []


def import_fsa() -> ModuleType:
    """flash_sparse_attn as installed, through `varlen_workbench.workbench.upstream` (a stub for a missing triton_kernels)."""
    return import_module(
        "flash_sparse_attn",
        stub={"triton_kernels": "flash_sparse_attn"},
        install=f"pip install --no-deps flash-sparse-attn=={VERSION} (the project's `upstream` extra)",
    )


def _site_of_caller() -> tuple[str | None, str | None]:
    """(kernel, 'file:line' in flash_sparse_attn) of the descriptor being built, from the call stack."""
    site = kernel = None
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if "flash_sparse_attn" in code.co_filename:
            if site is None:
                site = f"{code.co_filename.split('flash_sparse_attn/')[-1]}:{frame.f_lineno}"
            if code.co_name.endswith(_KERNEL_SUFFIX):
                kernel = code.co_name
                break
        frame = frame.f_back
    return kernel, site


def _prepare_interpreter() -> None:
    """Before flash_sparse_attn is imported: what Triton 3.6's interpreter needs to run it, and the
    descriptor recorder. Changes this process only; once."""
    if _PREPARED:
        return
    import numpy as np
    import triton.language.core as core
    from triton.runtime import interpreter

    original_aggregate = core._aggregate

    def aggregate(cls):
        # Under the interpreter @triton.jit gives an InterpretedFunction, which _aggregate does not
        # copy onto the aggregate: copy static methods as they are and bind the others.
        value = original_aggregate(cls)
        for name, member in cls.__dict__.items():
            raw = member.__func__ if isinstance(member, staticmethod) else member
            if name != "__init__" and isinstance(raw, interpreter.InterpretedFunction):
                if isinstance(member, staticmethod):
                    setattr(value, name, staticmethod(raw))
                else:
                    setattr(value, name, (lambda f: lambda self, *a, **k: f(self, *a, **k))(raw))
        return value

    core._aggregate = aggregate
    check = interpreter.TensorDescHandle.validate

    def validate(self):
        if not _RECORDERS:
            return check(self)
        kernel, site = _site_of_caller()
        size = self.base.dtype.element_ty.primitive_bitwidth // 8
        record = {
            "kernel": kernel,
            "site": site,
            "base_mod16": int(self.base.data.item()) % 16,
            "strides_bytes": [int(s.data.item()) * size for s in self.strides],
            "shape": [int(s.data.item()) for s in self.shape],
            "accesses": 0,
        }
        try:
            check(self)
        except AssertionError as exc:  # Triton's rule broken: recorded; the GPU would fault here
            record["violation"] = str(exc)
        _RECORDERS[-1].append(record)
        self.record = record

    interpreter.TensorDescHandle.validate = validate
    materialize = interpreter.TensorDescHandle.materialize_pointers

    def counted(self, offsets):  # every load or store through a recorded descriptor
        if hasattr(self, "record"):
            self.record["accesses"] += 1
        return materialize(self, offsets)

    interpreter.TensorDescHandle.materialize_pointers = counted

    def create_descriptor_reduce(self, kind, desc, value, indices):
        # Interpreted programs run one at a time: load + add + store is the atomic add.
        assert str(kind).endswith("ADD"), f"only the atomic add is provided here, not {kind}"
        ptrs, mask = desc.materialize_pointers(indices)
        zero = interpreter.TensorHandle(np.zeros_like(value.data), value.dtype.scalar)
        old = self.create_masked_load(ptrs, mask, zero, None, None, False)
        return self.create_masked_store(
            ptrs, interpreter.TensorHandle(old.data + value.data, value.dtype.scalar), mask, None, None
        )

    if not hasattr(interpreter.InterpreterBuilder, "create_descriptor_reduce"):
        interpreter.InterpreterBuilder.create_descriptor_reduce = create_descriptor_reduce
    _PREPARED.append(True)


def _stand_in_for_cuda(fsa_triton: ModuleType) -> None:
    """After import: the CUDA queries flash_sparse_attn makes on the host, answered for the CPU."""
    fsa_triton.cache_utils.get_device_num_sms = lambda device: H200_SMS
    fsa_triton.launch_template.load_launch_config = lambda **kwargs: (TILE_M, TILE_N, 4, 1, 1)
    # CachedKernel compiles through `kernel.warmup`, which interpreted functions lack: launch directly.
    fsa_triton.cache_utils.CachedKernel.__getitem__ = lambda self, grid: self._kernel[grid]


def load(device: str = "cpu") -> ModuleType:
    """flash_sparse_attn, ready to run on `device` (on the CPU: under the interpreter). Idempotent."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: flash_sparse_attn runs on 'cuda', or on 'cpu' under the Triton interpreter")
    if device == "cpu":
        _prepare_interpreter()
    with decorating_for_interpreter() if device == "cpu" else contextlib.nullcontext():
        fsa = import_fsa()
        fsa_triton = importlib.import_module("flash_sparse_attn.ops.triton")
        for name in ("cache_utils", "launch_template", "flash_bwd_preprocess"):
            importlib.import_module(f"flash_sparse_attn.ops.triton.{name}")
    if device == "cpu":
        _stand_in_for_cuda(fsa_triton)
    return fsa


@contextlib.contextmanager
def recorded_descriptors() -> Iterator[list[dict]]:
    """Inside: every tensor descriptor the interpreter builds is appended to the yielded list (one
    record per program), a violation of Triton's rule recorded under "violation" instead of raised."""
    records: list[dict] = []
    _RECORDERS.append(records)
    try:
        yield records
    finally:
        _RECORDERS.remove(records)


def summarize_descriptors(records: list[dict]) -> list[dict]:
    """One row per (kernel, source line, strides): its programs, their base addresses mod 16, the
    rule's violation if any, and how many programs built it over no element (and accessed it)."""
    rows: dict[tuple, dict] = {}
    for r in records:
        key = (r["kernel"], r["site"], tuple(r["strides_bytes"]))
        row = rows.setdefault(
            key, {"kernel": r["kernel"], "site": r["site"], "strides_bytes": r["strides_bytes"], "programs": 0, "base_mod16": {}}
        )
        row["programs"] += 1
        row["base_mod16"][str(r["base_mod16"])] = row["base_mod16"].get(str(r["base_mod16"]), 0) + 1
        if 0 in r["shape"]:  # a descriptor over no element (a sequence of length 0), and what went through it
            row["zero_extent"] = row.get("zero_extent", 0) + 1
            row["zero_extent_accesses"] = row.get("zero_extent_accesses", 0) + r["accesses"]
        if "violation" in r:
            row["violation"] = r["violation"]
    return list(rows.values())
