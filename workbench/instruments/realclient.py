"""Does my Hugging Face run hit this? One training step of a transformers Llama on a packed batch, per attention backend.

The batch is what `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` hands a model:
documents of mixed length concatenated into one row, position_ids restarting at 0 for every
document, the `cu_seq_lens_q/k` and `max_length_q/k` keywords, and labels -100 on each document's
first token. Behind the documents sit TAIL rows, the spare capacity of a fixed-size buffer
(labels -100, position_ids 0, 1, ... as a padding segment, outside `cu_seq_lens`), as a
training loop with static shapes (CUDA graphs, `torch.compile`) has.

Every backend runs through transformers' `AttentionInterface`: ours through `varlen_workbench.kernels.hf`, torch's
`varlen_attn` and FlashAttention-4 through the same adapter, SDPA (per backend) and FlexAttention
through transformers' own "sdpa" and "flex_attention" implementations. The same weights, in bf16,
take one step, once with memory as it comes and once under `varlen_workbench.workbench.instruments.poison.poisoned_memory()`
(every fresh buffer NaN); the deterministic mode that poisoning needs makes torch refuse cuDNN SDPA,
so that run says so. The reference is the step in float32 with attention done per document by
SDPA; the bar is the same per-document SDPA in bf16: a backend's gradient error should be at most
`BAR_FACTOR` times the bar's.

    python -m varlen_workbench.workbench.instruments.realclient --size h200 --record data/gpu/real-client-h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from varlen_workbench.kernels.hf import NAME as HF_NAME
from varlen_workbench.workbench.bounds import FACTORS
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.records import write_record
from varlen_workbench.workbench.reference import per_document_sdpa

BAR_FACTOR = FACTORS["dq"]  # FlashAttention's test bound for gradients: 3x PyTorch's own error in the dtype
MEMORIES = ("as is", "poisoned")
RECORD = "real-client-h200.json"  # under varlen_workbench.workbench.provenance.GPU_DATA


@dataclass(frozen=True)
class Size:
    """The model and the packed batch."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    documents: tuple[int, ...]  # token counts, packed in this order
    tail: int  # TAIL rows after the last document


SIZES = {
    # Seconds on a CPU: ours there is the torch backend ("auto"), or, interpreter asked for, the Triton kernel
    # (under a minute; the interpreter's cost grows with heads and documents).
    "cpu": Size(layers=4, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=64, documents=(7, 12, 5), tail=4),
    # 4 layers shaped like Llama-3.2-1B's (hidden 2048, GQA 32/8, head dim 64, MLP 8192), a 32k
    # vocabulary, 7,728 tokens of long-tailed documents (as a pretraining mix packs them) and 256 TAIL rows.
    "h200": Size(
        layers=4,
        hidden=2048,
        heads=32,
        kv_heads=8,
        head_dim=64,
        intermediate=8192,
        vocab=32000,
        documents=(2900, 1700, 1100, 700, 450, 300, 200, 130, 90, 60, 40, 25, 15, 9, 5, 3, 1),
        tail=256,
    ),
}


def pack(size: Size, seed: int = 0, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The model's keyword arguments for one packed batch (a batch of one row of `sum(documents) + tail` tokens)."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(size.documents) + size.tail
    input_ids = torch.randint(1, size.vocab, (1, total), generator=generator)
    labels = input_ids.clone()
    segments = [*size.documents, size.tail] if size.tail else list(size.documents)
    position_ids = torch.cat([torch.arange(n) for n in segments])[None]
    cu = F.pad(torch.tensor(size.documents).cumsum(0), (1, 0)).to(torch.int32)
    labels[0, cu[:-1].long()] = -100  # the collator's separator: no document predicts the next one's first token
    labels[0, int(cu[-1]) :] = -100  # TAIL rows
    on = lambda t: t.to(device)
    return {
        "input_ids": on(input_ids),
        "labels": on(labels),
        "position_ids": on(position_ids),
        "cu_seq_lens_q": on(cu),
        "cu_seq_lens_k": on(cu),
        "max_length_q": max(size.documents),
        "max_length_k": max(size.documents),
        # A training step keeps no KV cache; left on, transformers (5.24 here) skips its
        # packed-sequence mask for sdpa and flex_attention (see BACKENDS).
        "use_cache": False,
    }


def llama(size: Size, seed: int = 0) -> torch.nn.Module:
    """A LlamaForCausalLM built from a config (no download), float32 on the CPU, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        max_position_embeddings=max(max(size.documents), size.tail, 1),
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _repeat_kv(varlen: Callable) -> Callable:
    """`varlen` for a function without GQA: key/value heads repeated to the query's, as transformers' sdpa path does."""

    def call(q, k, v, *args, **kwargs):
        group = q.shape[1] // k.shape[1]
        return varlen(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), *args, **kwargs)

    return call


def torch_varlen() -> Callable:
    """torch's `varlen_attn` behind our varlen signature (the audit's adapter); key/value heads
    repeated where this torch's has no GQA (2.11: enable_gqa came in 2.12)."""
    from torch.nn.attention.varlen import varlen_attn

    from varlen_workbench.workbench.audit import adapt

    adapted = adapt(varlen_attn, "torch-varlen", device="cuda")
    return _repeat_kv(adapted) if "gqa" in adapted.lacks else adapted


def flash_attention_4() -> Callable:
    """FlashAttention-4's `flash_attn_varlen_func` bare behind our varlen signature: no padding
    contract (a padded layout is refused), what a user would otherwise call."""
    import inspect

    from flash_attn.cute import flash_attn_varlen_func

    params = set(inspect.signature(flash_attn_varlen_func).parameters)

    def call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None, **padded):
        if any(boundaries is not None for boundaries in padded.values()):
            raise ValueError("FlashAttention-4's varlen function has no padded layout (GAP rows).")
        kwargs = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=causal)
        out = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **{n: x for n, x in kwargs.items() if n in params}
        )
        return out[0] if isinstance(out, tuple) else out

    return call


@dataclass(frozen=True)
class Backend:
    """One way to run attention in transformers: an `attn_implementation` and what surrounds the step."""

    name: str
    implementation: str  # the attn_implementation string
    varlen: Callable[[], Callable] | None = None  # registered under `implementation` through varlen_workbench.kernels.hf
    sdpa: str | None = None  # the only SDPBackend allowed during the step
    cuda_only: str = ""  # why it cannot run on a CPU ("" if it can)
    dtype: torch.dtype = torch.bfloat16
    inputs: tuple[tuple[str, Any], ...] = ()  # model keywords that differ from `pack`'s

    def available(self, device: torch.device) -> str:
        """Why it cannot run on `device`, or "" when it can."""
        if self.cuda_only and device.type != "cuda":
            return self.cuda_only
        if self.varlen is not None:
            try:
                self.varlen()
            except Exception as exc:  # ImportError, or a library that fails while loading (a DSL without its GPU)
                return f"cannot be loaded here ({first_line(exc)})"
        return ""

    def register(self) -> None:
        if self.varlen is not None:
            from varlen_workbench.kernels import hf

            hf.register(self.implementation, self.varlen())

    def context(self) -> contextlib.AbstractContextManager:
        if self.sdpa is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([getattr(SDPBackend, self.sdpa)])


def _ours() -> Callable:
    """Ours as a user has it: the swap's default, `backend="auto"` (no backend pinned)."""
    from varlen_workbench.kernels.varlen import varlen_attention

    return varlen_attention


def ours_backend(device: str | torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """The backend `backend="auto"` runs ours on for a causal bf16 call on `device` in this process:
    "torch" (per-document SDPA) on CPU tensors unless the Triton interpreter is asked for; on a GPU
    the Triton kernel or FlashAttention-4, by the contract's rule (docs/contract.md, Backends)."""
    from varlen_workbench.kernels.varlen.op import auto_backend

    return auto_backend(device, dtype, head_dim=SIZES["cpu"].head_dim)


REFERENCE = Backend(
    "per-document SDPA, float32 (reference)", "realclient_per_document", lambda: per_document_sdpa, dtype=torch.float32
)
BAR = Backend("per-document SDPA, bf16 (the bar)", "realclient_per_document", lambda: per_document_sdpa)
OURS = Backend("ours (varlen_workbench.kernels.hf)", HF_NAME, _ours)
# Backend names as older records have them: ours ran as the top-level package `kernels` until 2026-12.
RECORDED_NAMES = {"ours (kernels.hf)": OURS.name}
BACKENDS = (
    BAR,
    OURS,
    Backend(
        "torch varlen_attn",
        "realclienttorch_varlen",
        torch_varlen,
        cuda_only="varlen_attn runs FlashAttention-2 kernels: CUDA only",
    ),
    Backend(
        "FlashAttention-4 varlen",
        "realclient_fa4",
        flash_attention_4,
        cuda_only="FlashAttention-4 (CuTe DSL) runs on Hopper and Blackwell only",
    ),
    Backend("transformers sdpa: math", "sdpa", sdpa="MATH"),
    Backend("transformers sdpa: flash", "sdpa", sdpa="FLASH_ATTENTION"),
    Backend("transformers sdpa: efficient", "sdpa", sdpa="EFFICIENT_ATTENTION", cuda_only="memory-efficient SDPA is CUDA only"),
    Backend("transformers sdpa: cuDNN", "sdpa", sdpa="CUDNN_ATTENTION", cuda_only="cuDNN SDPA is CUDA only"),
    # transformers builds the packed mask only without a cache (masking_utils._preprocess_mask_arguments),
    # and a LlamaForCausalLM makes one unless told use_cache=False, in training too.
    Backend("transformers sdpa, use_cache not disabled", "sdpa", inputs=(("use_cache", True),)),
    Backend(
        "transformers flex_attention",
        "flex_attention",
        cuda_only="FlexAttention has no backward on a CPU (torch raises NotImplementedError)",
    ),
)
BY_NAME = {backend.name: backend for backend in BACKENDS}


@dataclass
class Step:
    """One training step's loss and per-parameter gradients (float32, on the model's device)."""

    loss: float
    grads: dict[str, torch.Tensor]


def train_step(model: torch.nn.Module, inputs: dict[str, Any], backend: Backend, poisoned: bool) -> Step:
    """Forward and backward of `model` on `inputs` with `backend`, under poisoned memory if asked."""
    cuda = next(model.parameters()).is_cuda
    poison = poisoned_memory(cuda_prefill_mb=1024 if cuda else 0) if poisoned else contextlib.nullcontext()
    model.zero_grad(set_to_none=True)
    with poison, backend.context():
        loss = model(**inputs).loss
        loss.backward()
    grads = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
    return Step(float(loss.detach()), grads)


def layer_norms(grads: dict[str, torch.Tensor], layers: int) -> list[float]:
    """The gradient norm of each decoder layer's parameters (NaN where one is not finite)."""
    norms = []
    for i in range(layers):
        part = [g for n, g in grads.items() if f".layers.{i}." in n]
        norms.append(math.sqrt(sum(float(g.double().pow(2).sum()) for g in part)))
    return norms


def relative_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """||g - g_ref|| / ||g_ref|| over every parameter together (NaN if any gradient is not finite)."""
    diff = sum(float((grads[n].double() - g.double()).pow(2).sum()) for n, g in reference.items())
    norm = sum(float(g.double().pow(2).sum()) for g in reference.values())
    return math.sqrt(diff / norm)


@dataclass
class Run:
    """One backend's step under one memory mode."""

    backend: str
    memory: str
    status: str  # "ran", "raised" or "n/a"
    detail: str = ""  # the error, or why it cannot run here
    loss: float | None = None
    nonfinite: int | None = None  # gradient entries that are NaN or Inf
    grad_error: float | None = None  # relative to the reference
    layer_norms: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def finite(self) -> bool | None:
        return None if self.nonfinite is None else self.nonfinite == 0


@dataclass
class Report:
    size: Size
    device: str
    transformers: str
    reference_loss: float
    reference_norms: list[float]
    runs: list[Run]
    provenance: dict[str, str] = field(default_factory=dict)  # a recorded run's (varlen_workbench.workbench.records)

    @property
    def bar(self) -> float:
        """bf16 per-document SDPA's gradient error with memory as it comes: the bar."""
        return next(
            r.grad_error for r in self.runs if r.backend == BAR.name and r.memory == MEMORIES[0] and r.grad_error is not None
        )

    def meets_bar(self, run: Run) -> bool | None:
        """Finite, and gradient error within BAR_FACTOR x the bar (None when it did not run)."""
        if run.grad_error is None:
            return None
        return run.finite is True and run.grad_error <= BAR_FACTOR * self.bar

    def run(self, backend: str, memory: str = MEMORIES[0]) -> Run:
        return next(r for r in self.runs if r.backend == backend and r.memory == memory)

    def table(self) -> str:
        """The per-backend table as Markdown."""
        rows = [
            f"| backend | memory | loss | finite gradients (non-finite) | gradient error | within {BAR_FACTOR:g}x the bar |",
            "| --- | --- | --- | --- | --- | --- |",
            f"| {REFERENCE.name} | as is | {self.reference_loss:.5f} | yes (0) | 0 | |",
        ]
        for r in self.runs:
            if r.status != "ran":
                rows.append(f"| {r.backend} | {r.memory} | {r.status}: {r.detail} | | | |")
                continue
            finite = f"{'yes' if r.finite else 'NO'} ({r.nonfinite})"
            verdict = "yes" if self.meets_bar(r) else "NO"
            rows.append(f"| {r.backend} | {r.memory} | {r.loss:.5f} | {finite} | {r.grad_error:.3g} | {verdict} |")
        return "\n".join(rows)

    def to_record(self) -> dict[str, Any]:
        return {
            "kind": "real-client",
            "size": asdict(self.size),
            "device": self.device,
            "transformers": self.transformers,
            "bar_factor": BAR_FACTOR,
            "reference_loss": self.reference_loss,
            "reference_norms": self.reference_norms,
            "runs": [asdict(r) for r in self.runs],
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Report:
        size = Size(**{**record["size"], "documents": tuple(record["size"]["documents"])})
        runs = [Run(**{**r, "backend": RECORDED_NAMES.get(r["backend"], r["backend"])}) for r in record["runs"]]
        fields = (record["device"], record["transformers"], record["reference_loss"], record["reference_norms"])
        return cls(size, *fields, runs, record.get("provenance", {}))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def set_implementation(model: torch.nn.Module, name: str) -> None:
    """transformers 5's setter, or 4.x's config field."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def check(
    size: Size | str = "cpu",
    device: torch.device | str | None = None,
    backends: Sequence[Backend] = BACKENDS,
    memories: Sequence[str] = MEMORIES,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> Report:
    """Runs the step for every backend (and the bar) and memory mode; see the module docstring."""
    import transformers

    from varlen_workbench.kernels._compat import default_device

    size = SIZES[size] if isinstance(size, str) else size
    device = torch.device(device) if device is not None else default_device()
    unknown = set(memories) - set(MEMORIES)
    if unknown:
        raise ValueError(f"memories {sorted(unknown)} are not among {MEMORIES}.")
    base = llama(size, seed).to(device)  # copied per run on the device: a GPU-sized model copies in milliseconds there
    inputs = pack(size, seed, device)

    def step(backend: Backend, memory: str) -> Step:
        backend.register()
        model = copy.deepcopy(base).to(device=device, dtype=backend.dtype).train()
        set_implementation(model, backend.implementation)
        return train_step(model, {**inputs, **dict(backend.inputs)}, backend, memory == "poisoned")

    reference = step(REFERENCE, MEMORIES[0])
    runs = []
    for backend in [BAR, *(b for b in backends if b is not BAR)]:  # the bar always: every verdict needs it
        for memory in memories:
            why = backend.available(device)
            started = time.perf_counter()
            if why:
                run = Run(backend.name, memory, "n/a", why)
            else:
                try:
                    result = step(backend, memory)
                except Exception as exc:  # a backend that refuses the batch is a finding, not a crash
                    run = Run(backend.name, memory, "raised", first_line(exc))
                else:
                    nonfinite = sum(int((~torch.isfinite(g)).sum()) for g in result.grads.values())
                    error = relative_error(result.grads, reference.grads)
                    norms = layer_norms(result.grads, size.layers)
                    run = Run(backend.name, memory, "ran", "", result.loss, nonfinite, error, norms)
            run.seconds = time.perf_counter() - started
            runs.append(run)
            if log:
                log(f"{run.backend} [{run.memory}]: {run.status} {run.detail or ''} ({run.seconds:.1f} s)")
    return Report(size, str(device), transformers.__version__, reference.loss, layer_norms(reference.grads, size.layers), runs)


def plot_layer_norms(report: Report, memory: str = MEMORIES[0], ax=None):
    """Gradient norm per decoder layer, one line per backend that ran, the reference dashed."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6))
    layers = range(report.size.layers)
    for r in report.runs:
        if r.memory != memory or r.status != "ran":
            continue
        # A run with any non-finite gradient is listed, not drawn: its finite layers' norms mean nothing.
        values = [v if r.finite and math.isfinite(v) else float("nan") for v in r.layer_norms]
        label = r.backend if r.finite else f"{r.backend} (non-finite: not drawn)"
        ax.plot(layers, values, marker="o", label=label)
    ax.plot(
        layers, report.reference_norms, "k--", lw=1.5, zorder=5, label=REFERENCE.name
    )  # on top: the others should hide under it
    ax.set_xticks(list(layers))
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("gradient norm")
    ax.set_title(f"Gradient norm per layer, memory {memory}")
    ax.legend(fontsize=7)
    return ax


def load_h200() -> Report | None:
    """The H200 records of this check as one report, or None if none was recorded.

    `data/gpu/real-client-h200.json` is the full run; a later `--backends NAME` run of the same model
    and batch (`real-client-h200-<name>.json`, e.g. with FlashAttention-4 installed) fills in the rows
    the full run could not run ("n/a"). Its provenance is kept beside the first one's, under
    `provenance["added"]`, so that a page names both."""
    from varlen_workbench.workbench.records import load_records

    records = load_records(RECORD.replace(".json", "*.json"))
    if not records:
        return None
    full = next((r for r in records if r["file"] == RECORD), records[0])
    report = Report.from_record(full)
    added = []
    for record in (r for r in records if r is not full):
        more = Report.from_record(record)
        if (more.size, more.reference_loss) != (report.size, report.reference_loss):
            raise ValueError(
                f"{record['file']} ran another model or batch than {full['file']}; record both with the same --size."
            )
        ran = {(r.backend, r.memory): r for r in more.runs if r.status != "n/a" and r.backend != BAR.name}
        report.runs = [ran.get((r.backend, r.memory), r) if r.status == "n/a" else r for r in report.runs]
        added.append({**record["provenance"], "file": record["file"], "backends": sorted({b for b, _ in ran})})
    report.provenance = {**report.provenance, "file": full["file"], "added": added}  # type: ignore[dict-item]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--record", default=None, help="write the result as a JSON record with provenance")
    parser.add_argument(
        "--backends", nargs="+", choices=list(BY_NAME), default=list(BY_NAME), metavar="NAME", help="a subset, by name"
    )
    args = parser.parse_args(argv)
    chosen = [BY_NAME[name] for name in args.backends]
    report = check(args.size, args.device, chosen, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.table())
    if args.record:
        command = shlex.join(
            ["python", "-m", "varlen_workbench.workbench.instruments.realclient", *(sys.argv[1:] if argv is None else argv)]
        )
        write_record(args.record, report.to_record(), command=command)
        print(f"wrote {args.record}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
