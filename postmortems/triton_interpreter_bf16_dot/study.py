"""The study: tl.dot in bf16 under the interpreter against the fp32 product, the attention it feeds, the cost of
the workaround, what compiled Triton does, the interpreter's source, and reproduce()."""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.runtime import interpreted
from varlen_workbench.kernels.varlen import varlen_attention_triton
from varlen_workbench.postmortems.triton_interpreter_bf16_dot.cases import (
    BF16,
    CASES,
    FIXED,
    META,
    RECORD_COMMAND,
    REPRODUCTION,
    TIMING_REPEATS,
    WORKAROUND,
)
from varlen_workbench.postmortems.triton_interpreter_bf16_dot.probes import (
    native_dots,
    report,
    single_block_attention,
    triton_sum_with_nan,
)
from varlen_workbench.workbench.layout import pack
from varlen_workbench.workbench.postmortem import (
    Results,
    gpu_records,
    latest_gpu_record,
)
from varlen_workbench.workbench.probes import probe


def _attention_row(impl: str, record) -> dict[str, Any]:
    return {
        "impl": impl,
        "dtype": record.case.dtype,
        "real_finite": record.real_finite,
        "real_within_bound": record.real_within_bound,
        "padding_exactly_zero": record.padding_exactly_zero,
        "errors": {name: {"error": e.error, "bound": e.bound, "ratio": e.ratio} for name, e in record.errors.items()},
    }


def attention_study(device: str | torch.device | None = None) -> list[dict[str, Any]]:
    """A user's bf16 reproduction (no workaround) next to fp32/fp16, the workaround, and our
    fixed kernel forward and backward, each probed against the fp64 oracle, on `device`."""
    rows = [_attention_row(REPRODUCTION, probe(single_block_attention, pack(case, device), backward=False)) for case in CASES]
    bf16 = pack(BF16, device)
    rows.append(_attention_row(WORKAROUND, probe(partial(single_block_attention, upcast=True), bf16, backward=False)))
    rows.append(_attention_row(FIXED, probe(varlen_attention_triton, bf16)))
    return rows


def forward_seconds(
    impl: Callable = varlen_attention_triton, repeats: int = TIMING_REPEATS, device: str | torch.device | None = None
) -> dict[str, float]:
    """Best-of-`repeats` forward time of `impl` per dtype on `device`, after one warm-up call.

    Under the interpreter the clock is this process's CPU time: the interpreter is single-threaded
    Python and numpy, and CPU time ignores other jobs on a shared CI machine. Natively it is wall
    time with the GPU synchronised.
    """
    device = default_device() if device is None else torch.device(device)
    clock = time.process_time if interpreted(device) else time.perf_counter
    seconds = {}
    for case in CASES:
        batch = pack(case, device, requires_grad=False)
        batch.call(impl)
        best = float("inf")
        for _ in range(repeats):
            if batch.device.type == "cuda":
                torch.cuda.synchronize(batch.device)
            start = clock()
            batch.call(impl)
            if batch.device.type == "cuda":
                torch.cuda.synchronize(batch.device)
            best = min(best, clock() - start)
        seconds[case.dtype] = best
    return seconds


def _decade(x: float) -> str:
    """An order of magnitude ('~1e+9'): evidence that reads the same on any CPU's rounding."""
    return f"~1e{round(math.log10(x)):+d}" if x > 0 else "0"


def impact_figures() -> dict[str, str]:
    """The index's figure, from the committed H200 record (its interpreter run): the relative
    error of a bf16 tl.dot, to its order of magnitude."""
    record = latest_gpu_record(META)
    if record is None:
        raise FileNotFoundError(f"no data/gpu/{META.id}-*.json: record one with `{RECORD_COMMAND}`")
    return {"bf16_relative_error": _decade(record["results"]["interpreter"]["detector"]["checks"]["bfloat16"]["relative"])}


def study(device: str | torch.device | None = None) -> dict[str, Any]:
    """Everything this post-mortem measures on `device` (on the CPU: the interpreter's). JSON-ready."""
    return {"detector": report(device), "attention": attention_study(device), "forward_seconds": forward_seconds(device=device)}


def compiled() -> dict[str, dict[str, Any]]:
    """The 16x16 dot kernel compiled for sm_90 with the upcast flag off and on (no GPU needed)."""
    return {
        "on" if flag else "off": asdict(native) | {"mma": list(native.mma), "operand_type": native.operand_type}
        for flag, native in native_dots().items()
    }


def interpreter_sum_with_nan() -> dict[str, float | None]:
    """{dtype: tl.sum of [NaN, 2, ..., 16]} under the interpreter (CPU tensors), JSON-ready: None where the
    sum is NaN, as it must be; the finite number it returned where the NaN was lost."""
    sums = {str(d).removeprefix("torch."): triton_sum_with_nan(d, "cpu") for d in (torch.float16, torch.bfloat16)}
    return {name: None if math.isnan(x) else x for name, x in sums.items()}


def interpreter_source() -> dict[str, str]:
    """The installed interpreter's bf16 storage rule and its `create_dot`, verbatim."""
    from triton.runtime import interpreter

    storage = [line for line in inspect.getsource(interpreter._get_np_dtype).splitlines() if "bfloat16" in line]
    return {"storage": "\n".join(storage), "create_dot": inspect.getsource(interpreter.InterpreterBuilder.create_dot)}


@dataclass
class StudyResults(Results):
    """What reproduce() measured, JSON-ready: the interpreter's study, the native one (None on a
    CPU machine), the dot kernel compiled for sm_90, the installed interpreter's source of the bug,
    and the GPU runs recorded under data/gpu/ (`gpu_records(META)`)."""

    interpreter: dict[str, Any]
    native: dict[str, Any] | None
    compiled: dict[str, dict[str, Any]]
    source: dict[str, str]
    gpu: list[dict[str, Any]]
    sum_nan: dict[str, float | None] | None = None  # interpreter_sum_with_nan(): None where NaN propagates (triton#11604)


def reproduce(device: str | torch.device | None = None) -> StudyResults:
    """The interpreter's study (on CPU tensors, on any machine), the native study when `device`
    (default: `default_device()`) runs compiled, the native compilation of the dot kernel, the
    interpreter's source, and the recorded GPU runs."""
    device = default_device() if device is None else torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"reproduce(device={str(device)!r}) but torch {torch.__version__} sees no CUDA device: run "
            f"`varlen-workbench repro {META.id} --device cuda` on a GPU machine, or pass device='cpu' (the interpreter's study)."
        )
    return StudyResults(
        interpreter=study("cpu"),
        native=None if interpreted(device) else study(device),
        compiled=compiled(),
        source=interpreter_source(),
        gpu=gpu_records(META),
        sum_nan=interpreter_sum_with_nan(),
    )


def _runs(results: StudyResults) -> dict[str, dict[str, Any]]:
    return {mode: run for mode, run in (("interpreter", results.interpreter), ("native", results.native)) if run is not None}


def _recorded(record: dict[str, Any]) -> StudyResults:
    """A GPU record's results as StudyResults (records written before `source` and `gpu` existed lack them)."""
    r = record["results"]
    return StudyResults(r["interpreter"], r["native"], r["compiled"], r.get("source", {}), [])


def _interpreter_dot_source() -> str:
    source = interpreter_source()
    return source["storage"] + "\n\n" + source["create_dot"]


def _workaround_source() -> str:
    from varlen_workbench.kernels.varlen import kernel_common

    return inspect.getsource(getattr(kernel_common._dot, "fn", kernel_common._dot))


def _upcast_decision_source() -> str:
    from varlen_workbench.kernels.varlen import launch

    deciders = [inspect.getsource(f) for name, f in vars(launch).items() if "upcast" in name.lower() and inspect.isfunction(f)]
    passes = [line.strip() for line in inspect.getsource(launch).splitlines() if "DOT_UPCAST=" in line]
    return "\n".join(deciders + ["# passed as:"] + passes)


LISTINGS: dict[str, Callable[[], str]] = {
    "interpreter create_dot": _interpreter_dot_source,  # the installed Triton's interpreter
    "our _dot": _workaround_source,  # kernels/varlen/kernel_common.py
    "upcast decision": _upcast_decision_source,  # kernels/varlen/launch.py
}


@dataclass(frozen=True)
class Listing:
    """Source code as it is now, printed verbatim: `listing(name)` in a notebook cell. A test
    re-renders every listing a committed notebook shows and compares (tests/test_registry.py)."""

    name: str
    text: str

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__


def listing(name: str) -> Listing:
    """The current source of `name` (one of LISTINGS), read from the code itself."""
    if name not in LISTINGS:
        raise ValueError(f"listing({name!r}): give one of {sorted(LISTINGS)}.")
    return Listing(name, LISTINGS[name]().rstrip("\n"))


def _row(results: StudyResults, impl: str, dtype: str = "bfloat16") -> dict[str, Any]:
    return next(r for r in results.interpreter["attention"] if r["impl"] == impl and r["dtype"] == dtype)
