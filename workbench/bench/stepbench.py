"""The training step a user of the swap pays for: forward and backward of a Llama-like model on a
packed batch, per attention implementation, timed side by side.

The model is a transformers `LlamaForCausalLM` built from a config, seeded random weights
(`SHAPES["h200"]`: 8 layers, hidden 2048, MLP 5632, 16 query and 4 key/value heads of 128, a
32k vocabulary, bf16). The batch is 16,384 tokens of documents whose lengths are drawn
log-uniformly in 64-4096 (`varlen_workbench.workbench.bench.workloads.log_uniform_lengths`), packed by transformers'
`DataCollatorWithFlattening(return_flash_attn_kwargs=True)`: one row, position_ids restarting at
every document, and the `cu_seq_lens_q/k`, `max_length_q/k` keywords, which the model's forward
hands every layer's attention function. One step is what a training loop runs between optimizer
steps: gradients set to None, forward, loss, backward.

Implementations, each selected by `attn_implementation`:

* ours through the swap (`varlen_workbench.kernels.hf.register`): the default (no `backend` argument), and
  `backend="triton"` and `backend="fa4"` pinned;
* FlashAttention-4's `flash_attn_varlen_func`, bare, through the same swap: no padding contract,
  but what a user would otherwise pick;
* torch's `varlen_attn` through the same swap;
* transformers' own "sdpa" on the same documents as a right-padded batch (one row per
  document, as long as the longest, with an attention_mask).

Each is timed over `--iters` steps after warm-up with CUDA events (`varlen_workbench.workbench.timing`); its peak
memory is read on one more step, and its host syncs counted on one profiled step
(`varlen_workbench.workbench.instruments.syncs`: by owner, ours / transformers / other, and by phase, forward / backward).
The default's host syncs are also counted on every kind of batch the swap takes (`BATCH_KINDS`:
the collator's boundary keywords, position_ids alone, right-padded, plain rows): issue 34 asks
for at most one sync of our code per forward on each. What the machine cannot run is recorded
as skipped with the reason, what fails with its error.

    python -m varlen_workbench.workbench.bench.stepbench --record data/gpu/train-step-h200.json

`varlen_workbench.workbench.bench.step_report.format_train_step` reads the record and judges the targets (the
performance page). `--shape cpu --iters 0` runs the same harness on a tiny model in seconds per
step (our kernel through the Triton interpreter), untimed and without the profiler: CI's check
(tests/test_stepbench.py) runs it.
"""

from __future__ import annotations

import argparse
import functools
import math
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from varlen_workbench.workbench.bench.kernels import precompile as compile_candidates
from varlen_workbench.workbench.bench.step_record import (
    BARE_FA4,
    DEFAULT,
    OURS_FA4,
    PADDED_SDPA,
    PHASES,
    TRITON,
    VARLEN_ATTN,
    train_step_ratios,
)
from varlen_workbench.workbench.bench.step_report import format_train_step
from varlen_workbench.workbench.bench.workloads import Workload, log_uniform_lengths
from varlen_workbench.workbench.bounds import FACTORS, ErrorCheck
from varlen_workbench.workbench.instruments import realclient
from varlen_workbench.workbench.instruments.syncs import count_syncs
from varlen_workbench.workbench.layout import Case
from varlen_workbench.workbench.records import provenance_block, write_record
from varlen_workbench.workbench.timing import MIN_ITERS, time_call


@dataclass(frozen=True)
class Shape:
    """The model and the batch: `size` holds the model's dimensions and the documents, drawn
    log-uniformly in `lengths` (see `shape`)."""

    size: realclient.Size
    lengths: tuple[int, int]  # (shortest, longest) document
    dtype: str
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def model(self, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The seeded LlamaForCausalLM in training mode, on `device` in `dtype` (default: the shape's)."""
        return realclient.llama(self.size, self.seed).to(device=device, dtype=dtype or self.torch_dtype).train()


def shape(tokens: int, lengths: tuple[int, int], dtype: str, seed: int = 0, **model: int) -> Shape:
    """A Llama of `model`'s dimensions (realclient.Size's names) on `tokens` tokens of documents
    whose lengths are drawn log-uniformly in `lengths` (the last one cut to fit)."""
    documents = log_uniform_lengths(tokens, seed, *lengths)
    return Shape(realclient.Size(**model, documents=documents, tail=0), lengths, dtype, seed)


SHAPES = {
    "h200": shape(
        16384,
        (64, 4096),
        "bfloat16",
        layers=8,
        hidden=2048,
        heads=16,
        kv_heads=4,
        head_dim=128,
        intermediate=5632,
        vocab=32000,
    ),
    # CI's: the same harness on a CPU in seconds per step through the Triton interpreter, in
    # float32, where ours and padded SDPA must agree to the rounding of fp32 (`loss_check`).
    "cpu": shape(300, (16, 128), "float32", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=128),
}


# -- the batches: the same documents packed and right-padded -----------------------------------


def document_tokens(shape: Shape) -> list[torch.Tensor]:
    """Each document's token ids (seeded; 0 is left for padding)."""
    generator = torch.Generator().manual_seed(shape.seed)
    return [torch.randint(1, shape.size.vocab, (n,), generator=generator) for n in shape.size.documents]


def packed_inputs(documents: Sequence[torch.Tensor], device: torch.device | str) -> dict[str, Any]:
    """The model's keywords for `documents` packed by DataCollatorWithFlattening(return_flash_attn_kwargs=True)."""
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d.tolist()} for d in documents])
    # A training step keeps no KV cache; left on, transformers would build one.
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()} | {"use_cache": False}


def padded_inputs(documents: Sequence[torch.Tensor], device: torch.device | str) -> dict[str, Any]:
    """The model's keywords for `documents` as a right-padded batch: a row per document, as long
    as the longest, attention_mask 0 and labels -100 on padding. The loss counts the same
    predictions as the packed batch's: each document's tokens after its first."""
    rows, longest = len(documents), max(len(d) for d in documents)
    input_ids = torch.zeros(rows, longest, dtype=torch.int64)
    mask = torch.zeros(rows, longest, dtype=torch.int64)
    for i, d in enumerate(documents):
        input_ids[i, : len(d)], mask[i, : len(d)] = d, 1
    labels = input_ids.masked_fill(mask == 0, -100)
    on = lambda t: t.to(device)
    return {"input_ids": on(input_ids), "attention_mask": on(mask), "labels": on(labels), "use_cache": False}


FLASH_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
BATCH_KINDS = ("cu_seq_lens", "position_ids", "right-padded", "plain")  # the batches the swap takes
PLAIN_ROWS = 4


def batch_inputs(kind: str, documents: Sequence[torch.Tensor], device: torch.device | str) -> dict[str, Any]:
    """The model's keywords for `documents` as one kind of batch the swap takes: packed with the
    collator's boundary keywords ("cu_seq_lens"), packed with position_ids alone (the collator's
    default, "position_ids"), "right-padded" with an attention_mask, or "plain": the tokens in
    PLAIN_ROWS equal rows without a mask, each row one sequence."""
    if kind == "cu_seq_lens":
        return packed_inputs(documents, device)
    if kind == "position_ids":
        return {k: v for k, v in packed_inputs(documents, device).items() if k not in FLASH_KEYWORDS}
    if kind == "right-padded":
        return padded_inputs(documents, device)
    if kind == "plain":
        tokens = torch.cat(list(documents))
        rows = tokens[: len(tokens) // PLAIN_ROWS * PLAIN_ROWS].view(PLAIN_ROWS, -1).to(device)
        return {"input_ids": rows, "labels": rows, "use_cache": False}
    raise ValueError(f"batch kind {kind!r} is not one of {BATCH_KINDS}.")


# -- the implementations ---------------------------------------------------------------------


def _runs_anywhere(device: torch.device) -> str:
    return ""


def _cuda_only(why: str) -> Callable[[torch.device], str]:
    return lambda device: "" if device.type == "cuda" else why


def _fa4_missing(device: torch.device) -> str:
    """Why FlashAttention-4 cannot run on `device`, or ""."""
    if device.type != "cuda":
        return "FlashAttention-4 (CuTe DSL) runs on CUDA GPUs only"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in (9, 10):
        return f"FlashAttention-4 runs on Hopper and Blackwell (sm90, sm100); this GPU is sm{major}x"
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as exc:  # not installed, or a DSL that fails while loading
        return f"FlashAttention-4 is not installed here ({realclient.first_line(exc)}); install the flash-attn-4 wheels"
    return ""


def _ours(backend: str | None = None) -> Callable[[], Callable]:
    """Our varlen_attention with `backend` pinned; None: the default, as a user calls it (no argument)."""

    def load() -> Callable:
        from varlen_workbench.kernels.varlen import varlen_attention

        return varlen_attention if backend is None else functools.partial(varlen_attention, backend=backend)

    return load


@dataclass(frozen=True)
class Implementation:
    """One way to run the step's attention: an `attn_implementation`, the varlen function the
    swap registers under it (None: transformers' own), and the batch it takes."""

    name: str
    attn: str
    varlen: Callable[[], Callable] | None = None
    padded: bool = False  # the right-padded batch (else the packed one)
    unavailable: Callable[[torch.device], str] = _runs_anywhere  # why it cannot run on a device, or ""
    note: str = ""

    def select(self, model: torch.nn.Module) -> None:
        if self.varlen is not None:
            from varlen_workbench.kernels import hf

            hf.register(self.attn, self.varlen())
        realclient.set_implementation(model, self.attn)


IMPLEMENTATIONS = (
    Implementation(DEFAULT, "stepbench_ours_default", _ours()),
    Implementation(TRITON, "stepbench_ours_triton", _ours(backend="triton")),
    Implementation(OURS_FA4, "stepbench_ours_fa4", _ours(backend="fa4"), unavailable=_fa4_missing),
    Implementation(
        BARE_FA4,
        "stepbench_fa4",
        realclient.flash_attention_4,
        unavailable=_fa4_missing,
        note="no padding contract: the batch has no padding, so it computes the same attention",
    ),
    Implementation(
        VARLEN_ATTN,
        "stepbench_varlen_attn",
        realclient.torch_varlen,
        unavailable=_cuda_only("torch varlen_attn runs FlashAttention-2 kernels: CUDA only"),
        note="through the audit's adapter; key/value heads repeated to the query's before torch 2.12 (no enable_gqa)",
    ),
    # Last: the padded batch is the largest, and leaves the allocator's cache the fullest.
    Implementation(PADDED_SDPA, "sdpa", padded=True, note="transformers' own attention: B documents x the longest"),
)
BY_NAME = {impl.name: impl for impl in IMPLEMENTATIONS}


# -- measuring ---------------------------------------------------------------------------------


def training_step(model: torch.nn.Module, inputs: dict[str, Any]) -> Callable[[], torch.Tensor]:
    """One step as a training loop runs it between optimizer steps; returns the loss (no host sync)."""
    from torch.profiler import record_function

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with record_function(PHASES[0]):
            loss = model(**inputs).loss
        with record_function(PHASES[1]):
            loss.backward()
        return loss.detach()

    return step


@dataclass
class Row:
    """One implementation's step: "ran", "skipped" (with why) or "failed" (with the error)."""

    impl: str
    status: str
    detail: str = ""
    loss: float | None = None
    median_ms: float | None = None
    min_ms: float | None = None
    host_ms: float | None = None  # host time to issue one step
    iters: int = 0
    peak_mb: float | None = None  # allocated at the step's peak: weights, batch, activations, gradients
    resting_mb: float | None = None  # allocated before the step: weights and batch
    syncs: dict[str, Any] | None = None  # varlen_workbench.workbench.instruments.syncs.SyncCount.summary() of one step


def _peak_mb(step: Callable[[], torch.Tensor], model: torch.nn.Module) -> tuple[float, float]:
    """(resting, peak) MB allocated around one step."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resting = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return resting / 2**20, torch.cuda.max_memory_allocated() / 2**20


def measure(
    impl: Implementation,
    model: torch.nn.Module,
    inputs: dict[str, Any],
    device: torch.device,
    iters: int,
    profile: bool = True,
) -> Row:
    """`impl`'s row: its loss on a first step (compiling and tuning happen there), then, with
    `iters`, the timed steps and the peak memory (CUDA), and with `profile` the host syncs."""
    why = impl.unavailable(device)
    if why:
        return Row(impl.name, "skipped", why)
    try:
        impl.select(model)
        step = training_step(model, inputs)
        row = Row(impl.name, "ran", impl.note, loss=float(step()))
        if iters:
            timing = time_call(step, warmup=2, iters=iters, device=device)
            row.median_ms, row.min_ms, row.host_ms, row.iters = timing.median_ms, timing.min_ms, timing.host_ms, timing.iters
            if device.type == "cuda":
                row.resting_mb, row.peak_mb = _peak_mb(step, model)
        if profile:
            row.syncs = count_syncs(step, PHASES).summary()
    except Exception as exc:  # an implementation that refuses the step is a finding, not a crash
        return Row(impl.name, "failed", realclient.first_line(exc))
    finally:
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def batch_syncs(
    model: torch.nn.Module, documents: Sequence[torch.Tensor], device: torch.device, impl: Implementation
) -> dict[str, dict[str, Any]]:
    """Host syncs of one step of `impl` per batch kind (`BATCH_KINDS`), each counted after a
    first step of its own (compiling, tuning): {kind: SyncCount.summary(), or {"error": ...}}."""
    impl.select(model)
    found: dict[str, dict[str, Any]] = {}
    for kind in BATCH_KINDS:
        step = training_step(model, batch_inputs(kind, documents, device))
        try:
            step()
            found[kind] = count_syncs(step, PHASES).summary()
        except Exception as exc:  # a batch kind the swap refuses is a finding, not a crash
            found[kind] = {"error": realclient.first_line(exc)}
        finally:
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return found


@dataclass
class StepRun:
    """What one run of the benchmark measured."""

    shape: Shape
    padded_shape: tuple[int, int]  # (documents, longest): the right-padded batch
    device: str
    transformers: str
    rows: list[Row] = field(default_factory=list)
    batch_syncs: dict[str, dict[str, Any]] = field(default_factory=dict)  # ours (the default) per batch kind

    def to_record(self) -> dict[str, Any]:
        return {
            "kind": "train-step",
            "shape": asdict(self.shape),
            "padded_shape": list(self.padded_shape),
            "device": self.device,
            "transformers": self.transformers,
            "rows": [asdict(r) for r in self.rows],
            "batch_syncs": self.batch_syncs,
            "ratios": train_step_ratios([asdict(r) for r in self.rows]),
        }


def run(
    shape: Shape,
    device: torch.device | str,
    iters: int = MIN_ITERS,
    impls: Sequence[str] | None = None,
    profile: bool = True,
    progress: Callable[[StepRun], None] | None = None,
) -> StepRun:
    """Measures every implementation (or those named in `impls`) on one model and one set of
    documents, and with `profile` the default's host syncs on every batch kind; `progress` gets
    the run after each row (to write the record as it grows)."""
    import transformers

    device = torch.device(device)
    unknown = set(impls or ()) - set(BY_NAME)
    if unknown:
        raise ValueError(f"impls {sorted(unknown)} are not among {list(BY_NAME)}.")
    documents = document_tokens(shape)
    batches = {False: batch_inputs("cu_seq_lens", documents, device), True: batch_inputs("right-padded", documents, device)}
    model = shape.model(device)
    found = StepRun(shape, tuple(batches[True]["input_ids"].shape), str(device), transformers.__version__)
    for impl in IMPLEMENTATIONS:
        if impls is None or impl.name in impls:
            found.rows.append(measure(impl, model, batches[impl.padded], device, iters, profile))
            if progress:
                progress(found)
    if profile and (impls is None or DEFAULT in impls):
        found.batch_syncs = batch_syncs(model, documents, device, BY_NAME[DEFAULT])
        if progress:
            progress(found)
    return found


# -- the loss check (CPU, float32) -------------------------------------------------------------


def reference_loss(shape: Shape) -> float:
    """The step's loss in float64 on the CPU: transformers' SDPA on the right-padded batch.
    transformers computes the loss from logits cast to float32 (`ForCausalLMLoss`), so its last
    steps round as fp32 does: `loss_check`'s floor covers them."""
    model = shape.model("cpu", torch.float64)
    realclient.set_implementation(model, "sdpa")
    with torch.no_grad():
        return float(model(**padded_inputs(document_tokens(shape), "cpu")).loss)


def loss_check(loss: float, sdpa_loss: float, reference: float, shape: Shape) -> ErrorCheck:
    """`loss` against the float64 `reference`, within FlashAttention's 2x of PyTorch's own error
    (padded SDPA's `sdpa_loss`, in the shape's dtype), floored at the rounding no fp32 step
    avoids: the loss is a mean over the predicted tokens of a log-softmax over the vocabulary of
    length-`hidden` dots, the floor of `varlen_workbench.workbench.bounds` with (D, n, keys) = (hidden, tokens,
    vocab), in ulps of the loss."""
    ulps = math.sqrt(shape.size.hidden + sum(shape.size.documents)) + math.log(shape.size.vocab)
    floor = torch.finfo(torch.float32).eps * max(1.0, abs(reference)) * ulps
    return ErrorCheck("loss", abs(loss - reference), abs(sdpa_loss - reference), FACTORS["out"], floor)


def precompile(shape: Shape, jobs: int) -> None:
    """Compiles our kernel's candidate tiles for the step's attention in `jobs` processes before
    the timing process tunes them (`varlen_workbench.workbench.bench.kernels.precompile`)."""
    s = shape.size
    case = Case(s.documents, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim, dtype=shape.dtype, causal=True)
    compile_candidates([Workload("training step", case)], jobs)


# -- the command line ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m varlen_workbench.workbench.bench.stepbench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--shape", choices=list(SHAPES), default="h200", help="the model and batch (cpu: CI's tiny one)")
    parser.add_argument(
        "--iters", type=int, default=MIN_ITERS, help=f"timed steps per implementation (at least {MIN_ITERS}; 0: untimed)"
    )
    parser.add_argument("--impls", nargs="+", metavar="NAME", choices=list(BY_NAME), help="only these implementations")
    parser.add_argument("--no-profile", action="store_true", help="do not count host syncs (never counted on a CPU)")
    parser.add_argument("--record", metavar="FILE", help="write the results with provenance as JSON (after each row)")
    parser.add_argument(
        "--compile-jobs",
        type=int,
        default=8,
        metavar="N",
        help="processes that compile our kernel's candidate tiles before timing (0: compile while tuning)",
    )
    args = parser.parse_args(argv)
    if args.iters and args.iters < MIN_ITERS:
        parser.error(f"--iters {args.iters}: time at least {MIN_ITERS} steps (--iters {MIN_ITERS}), or 0 for none")
    shape = SHAPES[args.shape]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and (args.shape != "cpu" or args.iters):
        print(
            f"varlen_workbench.workbench.bench.stepbench: torch {torch.__version__} sees no CUDA device; the step is timed with CUDA events, "
            "so run it on a GPU machine (or `--shape cpu --iters 0` here: untimed, CI's check).",
            file=sys.stderr,
        )
        return 2
    command = shlex.join(
        ["python", "-m", "varlen_workbench.workbench.bench.stepbench", *(argv if argv is not None else sys.argv[1:])]
    )

    def write(found: StepRun) -> None:
        if args.record:
            write_record(args.record, found.to_record(), command=command)

    if args.compile_jobs and device.type == "cuda" and set(args.impls or BY_NAME) & {DEFAULT, TRITON}:
        precompile(shape, args.compile_jobs)
    # A CPU has nothing to wait for, and profiling the interpreter's Python would take minutes.
    profile = device.type == "cuda" and not args.no_profile
    found = run(shape, device, args.iters, args.impls, profile, progress=write)
    print(format_train_step({**found.to_record(), "provenance": provenance_block(command)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
