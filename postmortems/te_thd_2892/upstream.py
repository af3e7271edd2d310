"""TransformerEngine itself on the report's repro, each case in a process of its own (GPU only).

The report (NVIDIA/TransformerEngine#2892, "Reproduction") claims, for DotProductAttention with
qkv_format="thd" and cu_seqlens_q != cu_seqlens_q_padded: a SIGSEGV under FP8 blockwise scaling,
an output of unpadded size under FP8 delayed scaling, and a correct result in BF16. Two kinds of
run settle that on TE as installed:

- `REPORT_SCRIPT`, the report's script exactly as written, then with its slips (`SLIPS`) mended
  one at a time, each run as a file of its own (`run_script`): how each version ended, the error
  and the line of the script that raised it;
- `te_cases()`: the cases the report meant, on its shapes (`REPORT_CASE`: 4 sequences padded for
  FP8 alignment, 32 heads of 48, causal, BF16 inputs, normal values in every row as its script
  draws them, `report_batch`), through TE's DotProductAttention called as the audit matrix calls
  it (`varlen_workbench.workbench.audit.adapters.te`), under each recipe of `RECIPES`, with the boundaries
  `different` (real cu_seqlens, padded cu_seqlens_padded), `equal` (cu_seqlens =
  cu_seqlens_padded, one tensor passed twice: VERL's workaround) and `equal-copies` (the same
  values in two tensors: TE#3487 reports that TE's object-identity auto-detect of
  pad_between_seqs then counts them as padded). `run_case` measures each with `varlen_workbench.workbench.probes.probe`
  against the fp64 oracle: out, dq, dk, dv on REAL rows within the FlashAttention-style bound,
  what padding rows hold, non-finite counts; and TE's own output shape. Equal boundaries are
  judged three ways: by the real boundaries (`contract`), the same with dO zero on padding rows
  as a loss over real tokens sends it (`contract_real_rows_grad`), and by the boundaries passed
  (`as_called`, every row a token).

Every run is a child process (`spawn`, `run_script`) with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2, so that
a SIGSEGV is recorded as a finding (`outcome`), with the backend TE's log had named before it
(`backend_log`). scripts/te_thd_cases.py runs them all and records the result.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from varlen_workbench.postmortems.te_thd_2892.cases import TE
from varlen_workbench.postmortems.te_thd_2892.mechanism import identical_boundaries
from varlen_workbench.workbench.layout import Case, Fill, Region, pack
from varlen_workbench.workbench.probes import TENSORS, ProbeRecord, grad_output, probe

REPORT = f"{TE}/issues/2892"

# The report's "Reproduction" script, verbatim.
REPORT_SCRIPT = """\
import torch
import transformer_engine.pytorch as te
from transformer_engine.pytorch.attention import DotProductAttention

# Setup
batch_size = 4
real_seqlens = [100, 150, 120, 130]  # actual sequence lengths
padded_seqlens = [112, 160, 128, 144]  # padded to 16-byte alignment for FP8
total_padded = sum(padded_seqlens)
hidden_dim = 1536
num_heads = 32
head_dim = hidden_dim // num_heads

# Create cu_seqlens
cu_seqlens_q = torch.tensor([0] + list(torch.cumsum(torch.tensor(real_seqlens), 0)),
                             dtype=torch.int32, device='cuda')
cu_seqlens_q_padded = torch.tensor([0] + list(torch.cumsum(torch.tensor(padded_seqlens), 0)),
                                    dtype=torch.int32, device='cuda')

# Create Q, K, V in thd format (padded layout)
q = torch.randn(total_padded, num_heads, head_dim, device='cuda', dtype=torch.bfloat16)
k = torch.randn(total_padded, num_heads, head_dim, device='cuda', dtype=torch.bfloat16)
v = torch.randn(total_padded, num_heads, head_dim, device='cuda', dtype=torch.bfloat16)

# This works (cu_seqlens_q == cu_seqlens_q_padded):
attn = DotProductAttention(num_heads, head_dim, head_dim)
with te.fp8_autocast(enabled=True, fp8_recipe=te.recipe.BlockScaling()):
    out = attn(q, k, v,
               qkv_format='thd',
               cu_seqlens_q=cu_seqlens_q_padded,  # same as padded
               cu_seqlens_kv=cu_seqlens_q_padded,
               cu_seqlens_q_padded=cu_seqlens_q_padded,
               cu_seqlens_kv_padded=cu_seqlens_q_padded,
               max_seqlen_q=max(padded_seqlens),
               max_seqlen_kv=max(padded_seqlens),
               attn_mask_type='causal')

# This CRASHES (cu_seqlens_q != cu_seqlens_q_padded):
with te.fp8_autocast(enabled=True, fp8_recipe=te.recipe.BlockScaling()):
    out = attn(q, k, v,
               qkv_format='thd',
               cu_seqlens_q=cu_seqlens_q,  # actual boundaries
               cu_seqlens_kv=cu_seqlens_q,
               cu_seqlens_q_padded=cu_seqlens_q_padded,  # padded boundaries
               cu_seqlens_kv_padded=cu_seqlens_q_padded,
               max_seqlen_q=max(real_seqlens),
               max_seqlen_kv=max(real_seqlens),
               attn_mask_type='causal')
# SIGSEGV ^^^
"""


@dataclass(frozen=True)
class Slip:
    """One slip of the script, read in TE's source (transformer_engine/pytorch, 2.20.2), and its mend."""

    name: str
    why: str
    edits: tuple[tuple[str, str], ...]  # (as written, as meant): every occurrence is replaced


# In the order the script meets them.
SLIPS = (
    Slip(
        "gqa-groups",
        "DotProductAttention's third positional parameter is num_gqa_groups, not a head dimension: 48 groups "
        "do not divide 32 heads",
        (("DotProductAttention(num_heads, head_dim, head_dim)", "DotProductAttention(num_heads, head_dim)"),),
    ),
    Slip(
        "recipe",
        "transformer_engine.pytorch exports no `recipe`, and TE's recipes name the blockwise one Float8BlockScaling",
        (
            ("te.recipe.BlockScaling()", "Float8BlockScaling()"),
            (
                "import transformer_engine.pytorch as te\n",
                "import transformer_engine.pytorch as te\nfrom transformer_engine.common.recipe import Float8BlockScaling\n",
            ),
        ),
    ),
    Slip(
        "mask-type",
        "qkv_format='thd' takes a padding mask type; 'padding_causal' is the causal one",
        (("attn_mask_type='causal'", "attn_mask_type='padding_causal'"),),
    ),
)


def report_script(mended: int = 0, device: str = "cuda") -> str:
    """The report's script with its first `mended` slips mended (0: as written), on `device` (its
    own is 'cuda'; another serves a stand-in for TE in tests)."""
    if not 0 <= mended <= len(SLIPS):
        raise ValueError(f"mended = {mended}: the script has {len(SLIPS)} slips; mend 0 to {len(SLIPS)} of them.")
    text = REPORT_SCRIPT
    for slip in SLIPS[:mended]:
        for wrong, right in slip.edits:
            if wrong not in text:
                raise ValueError(f"slip {slip.name!r}: {wrong!r} is not in the script (the transcription changed?)")
            text = text.replace(wrong, right)
    return text.replace("device='cuda'", f"device={device!r}")


# The report's shapes. Its script draws every row from a normal distribution, padding included
# (`report_batch`); TE's own tests zero padding rows instead.
REPORT_CASE = Case(
    seqlens_q=(100, 150, 120, 130),
    padded_q=(112, 160, 128, 144),
    padded_k=(112, 160, 128, 144),
    heads=32,
    head_dim=48,
    dtype="bfloat16",
    causal=True,
    seed=2892,
    fill=Fill.ZEROS,
)


@dataclass(frozen=True)
class Recipe:
    """An FP8 recipe of transformer_engine.common.recipe, by class name and arguments (None: no FP8)."""

    name: str
    cls: str | None = None
    kwargs: tuple[tuple[str, Any], ...] = ()

    def build(self, recipes) -> Any:
        """The recipe object, from TE's recipe module `recipes` (None for no FP8)."""
        return None if self.cls is None else getattr(recipes, self.cls)(**dict(self.kwargs))

    def describe(self) -> str:
        if self.cls is None:
            return "no FP8 (the inputs' BF16)"
        return f"{self.cls}({', '.join(f'{k}={v!r}' for k, v in self.kwargs)})"


RECIPES = (
    Recipe("bf16"),
    Recipe("delayed", "DelayedScaling"),
    Recipe("delayed-dpa", "DelayedScaling", (("fp8_dpa", True),)),
    Recipe("current", "Float8CurrentScaling"),
    Recipe("current-dpa", "Float8CurrentScaling", (("fp8_dpa", True),)),
    Recipe("block", "Float8BlockScaling"),
    Recipe("block-dpa", "Float8BlockScaling", (("fp8_dpa", True),)),
)
BOUNDARIES = ("different", "equal", "equal-copies")


@dataclass(frozen=True)
class TeCase:
    """One recipe and one choice of boundaries on one layout."""

    recipe: Recipe
    boundaries: str
    case: Case = REPORT_CASE

    def __post_init__(self) -> None:
        if self.boundaries not in BOUNDARIES:
            raise ValueError(f"boundaries = {self.boundaries!r} must be one of {BOUNDARIES}.")

    @property
    def name(self) -> str:
        return f"{self.recipe.name}:{self.boundaries}"

    def to_json(self) -> str:
        return json.dumps({"recipe": dataclasses.asdict(self.recipe), "boundaries": self.boundaries, "case": self.case.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> TeCase:
        data = json.loads(text)
        recipe = data["recipe"]
        return cls(
            Recipe(recipe["name"], recipe["cls"], tuple(tuple(kv) for kv in recipe["kwargs"])),
            data["boundaries"],
            Case(**data["case"]),
        )


def te_cases(case: Case = REPORT_CASE) -> list[TeCase]:
    """Every recipe of RECIPES with each choice of boundaries, on `case`."""
    return [TeCase(recipe, boundaries, case) for recipe in RECIPES for boundaries in BOUNDARIES]


# -- in the child process -------------------------------------------------------------------


def report_batch(case: Case, device):
    """`case` packed with normal values in its padding rows too, as the report's script draws them."""
    batch = pack(case, device)
    generator = torch.Generator().manual_seed(case.seed + 2)
    leaves = {}
    for name, regions in (("q", batch.regions_q), ("k", batch.regions_k), ("v", batch.regions_k)):
        x = getattr(batch, name).detach()
        drawn = torch.randn(x.shape, generator=generator).to(x.dtype).to(x.device)
        padding = (regions != Region.REAL).to(x.device)[:, None, None]
        leaves[name] = torch.where(padding, drawn, x).requires_grad_()
    return dataclasses.replace(batch, **leaves)


def identical_batch(batch, separate: bool = False):
    """The batch as VERL's workaround describes it: every row a token, cu_seqlens = cu_seqlens_padded,
    one tensor for both (`separate`: a copy of the same values, as `identical_boundaries`)."""
    case = batch.case
    padded = case.padded_lengths("q")
    same = pack(case.with_(seqlens_q=padded, seqlens_k=None, padded_q=None, padded_k=None, align=None), batch.device)
    real_q, real_k = (t.clone() if separate else t for t in (same.cu_seqlens_q_padded, same.cu_seqlens_k_padded))
    return dataclasses.replace(same, q=batch.q, k=batch.k, v=batch.v, cu_seqlens_q=real_q, cu_seqlens_k=real_k)


def _error(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _probed(record: ProbeRecord) -> dict[str, Any]:
    """What a probe showed, per tensor: REAL-row error and bound, padding rows' largest |x|, non-finite counts."""
    tensors = {}
    for name in TENSORS:
        if name not in record.tensors:
            continue
        check = record.errors.get(name)
        tensors[name] = {
            "real_error": check.error if check else None,
            "bound": check.bound if check else None,
            "within": check.within if check else None,
            "padding_max_abs": max(record.max_abs[name]["GAP"], record.max_abs[name]["TAIL"], key=lambda x: (x != x, x)),
            "nonfinite": record.nonfinite[name],
        }
    return {
        "tensors": tensors,
        "real_within_bound": record.real_within_bound,
        "padding_exactly_zero": record.padding_exactly_zero,
    }


def _measure(impl, batch, grad_out: str | torch.Tensor = "randn") -> dict[str, Any]:
    """Forward and backward through `impl` (dO: `grad_out`); a backward that raises leaves the forward's record."""
    try:
        return {"ran": "forward+backward", **_probed(probe(impl, batch, name="te", grad_out=grad_out))}
    except Exception as exc:
        failed = _error(exc)
    try:
        forward = _probed(probe(impl, batch, name="te", backward=False))
    except Exception:
        return {"ran": "nothing", "stage": "forward", "error": failed, "traceback": traceback.format_exc().splitlines()[-6:]}
    return {"ran": "forward", "stage": "backward", "error": failed, **forward}


def real_rows_grad(batch) -> torch.Tensor:
    """The probes' dO with padding rows zeroed: what a loss over real tokens sends back."""
    real = (batch.regions_q == Region.REAL).to(batch.device)[:, None, None]
    return torch.where(real, grad_output(batch), torch.zeros((), dtype=batch.q.dtype, device=batch.device))


def run_case(te_case: TeCase, device: str) -> dict[str, Any]:
    """One case in this process: the recipe built, then TE on the contract's batch (and, for equal
    boundaries, on the workaround's own batch, where every row is a token)."""
    import importlib.metadata

    from varlen_workbench.workbench.audit import adapt
    from varlen_workbench.workbench.audit.adapters.te import _recipes, _te, te_dot_product_attention, with_recipe

    result: dict[str, Any] = {"case": te_case.name, "recipe": te_case.recipe.describe(), "boundaries": te_case.boundaries}
    result["versions"] = {n: importlib.metadata.version(n) for n in ("transformer-engine", "torch")}
    result["versions"]["cudnn"] = ".".join(str(x) for x in _te().get_cudnn_version())
    try:
        recipe = te_case.recipe.build(_recipes())
    except Exception as exc:
        return {**result, "stage": "recipe", "error": _error(exc)}
    shapes: list[list[int]] = []
    same_objects: list[bool] = []

    @functools.wraps(te_dot_product_attention)
    def recorded(*args, **keywords):  # TE's own output, before the adapter gives it q's shape
        # What TE's pad_between_seqs auto-detect reads: are the real boundaries the padded ones' objects?
        same_objects.append(
            keywords["cu_seqlens_q"] is keywords["cu_seqlens_q_padded"]
            and keywords["cu_seqlens_kv"] is keywords["cu_seqlens_kv_padded"]
        )
        out = te_dot_product_attention(*args, **keywords)
        shapes.append(list(out.shape))
        return out

    impl = adapt(with_recipe(recipe, recorded), "te-thd", device)
    batch = report_batch(te_case.case, device)
    if te_case.boundaries == "different":
        result["contract"] = _measure(impl, batch)
    else:
        # Judged by the real boundaries: with the probes' dO (non-zero on padding rows), and with
        # padding rows' dO zeroed, as in training, where the loss covers real tokens only.
        workaround = identical_boundaries(impl, separate=te_case.boundaries == "equal-copies")
        result["contract"] = _measure(workaround, batch)
        result["contract_real_rows_grad"] = _measure(workaround, batch, real_rows_grad(batch))
        # Judged by the boundaries passed.
        result["as_called"] = _measure(impl, identical_batch(batch, separate=te_case.boundaries == "equal-copies"))
    result["te_output_shapes"] = [list(s) for s in dict.fromkeys(tuple(s) for s in shapes)]
    result["boundaries_same_object"] = sorted(set(same_objects))
    result["q_shape"] = list(batch.q.shape)
    return result


RESULT = "TE_CASE_RESULT "  # the child's last line of stdout: this marker, then its JSON


def child(text: str, device: str) -> None:
    """The child's entry point (`spawn`): run one case, print its result after RESULT."""
    print(RESULT + json.dumps(run_case(TeCase.from_json(text), device)), flush=True)


def printed(stdout: str) -> Any:
    """What a child printed last after RESULT (None: it printed nothing there, e.g. it crashed first)."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    return json.loads(lines[-1][len(RESULT) :]) if lines else None


# -- in the parent --------------------------------------------------------------------------

# TE logs its backend choice at debug level (transformer_engine/pytorch/attention/dot_product_attention/utils.py).
DEBUG_ENV = {"NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2"}
_BACKEND_LINES = {
    "available": re.compile(r"Available backends = \{(.*)\}"),
    "selected": re.compile(r"Selected backend = (.*?)\.?\s*$"),
    "running": re.compile(r"Running with (.*)$"),  # "FusedAttention backend (sub-backend 1)"
    "disabled": re.compile(r"(Disabling .*)$"),
}
# TE's fused-attention sub-backends (NVTE_Fused_Attn_Backend in transformer_engine/fused_attn.h):
# 1 = F16_arbitrary_seqlen (BF16/FP16), 2 = FP8.
_FP8_SUB_BACKEND = re.compile(r"FusedAttention \(sub-backend 2\)")


def backend_log(text: str) -> dict[str, Any]:
    """TE's backend choice as its debug log states it: each kind of line, distinct, in order."""
    found: dict[str, list[str]] = {kind: [] for kind in _BACKEND_LINES}
    for line in text.splitlines():
        for kind, pattern in _BACKEND_LINES.items():
            match = pattern.search(line)
            said = match.group(1).replace(" backend", "", 1).strip() if match else None
            if said and said not in found[kind]:
                found[kind].append(said)
    chosen = found["selected"] or found["running"]
    precision = None
    if chosen:
        precision = "fp8" if any(_FP8_SUB_BACKEND.search(c) for c in chosen) else "bf16/fp16"
    return {**found, "attention_precision": precision}


def outcome(returncode: int | None) -> dict[str, Any]:
    """How a child ended: exited (with its code), killed by a signal (SIGSEGV: the report's
    crash), or timed out (`returncode` None)."""
    if returncode is None:
        return {"outcome": "timed out"}
    if returncode < 0:
        return {"outcome": "killed", "signal": signal.Signals(-returncode).name}
    return {"outcome": "exited", "code": returncode}


_RAISED = re.compile(r"^(\w+(?:\.\w+)*(?:Error|Exception|Interrupt|Exit)\b.*)$")


def raised(stderr: str, script: str | None = None) -> dict[str, Any]:
    """The exception a Python traceback in `stderr` ends with and, where `script` names the file
    that ran, the line of it that raised."""
    lines = stderr.splitlines()
    error = next((line for line in reversed(lines) if _RAISED.match(line)), None)
    found: dict[str, Any] = {"error": error}
    if script is not None:
        located = re.findall(rf'File "{re.escape(script)}", line (\d+)', stderr)
        if located:
            number = int(located[-1])
            found["line"] = number
            found["source"] = Path(script).read_text().splitlines()[number - 1].strip()
    return found


def _run(command: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str, str, float]:
    """(return code, None if it timed out; stdout; stderr; seconds)."""
    began = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
        return None, out, err, time.perf_counter() - began
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - began


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with `extra` and TE's debug log on (the child imports
    varlen_workbench as installed, as this process does)."""
    return {**os.environ, **DEBUG_ENV, **(extra or {})}


def spawn(te_case: TeCase, device: str = "cuda", timeout: float = 300, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`te_case` in a child process: its result, how it ended, and TE's backend log."""
    code = "import sys\nfrom varlen_workbench.postmortems.te_thd_2892.upstream import child\nchild(sys.argv[1], sys.argv[2])\n"
    rc, out, err, seconds = _run([sys.executable, "-c", code, te_case.to_json(), device], child_env(env), timeout)
    result = printed(out) or {"case": te_case.name, **raised(err)}
    return {
        **result,
        **outcome(rc),
        "seconds": round(seconds, 1),
        "backend": backend_log(err),
        "stderr_tail": err.splitlines()[-8:],
    }


def run_script(mended: int, timeout: float = 300, env: dict[str, str] | None = None, device: str = "cuda") -> dict[str, Any]:
    """The report's script with `mended` slips mended, run as a file: how it ended, what raised where, the backend."""
    with tempfile.TemporaryDirectory() as directory:
        script = Path(directory) / "repro_fp8_padding_bug.py"
        script.write_text(report_script(mended, device))
        rc, _, err, seconds = _run([sys.executable, str(script)], child_env(env), timeout)
        where = raised(err, str(script)) if rc else {}
    mends = [s.name for s in SLIPS[:mended]]
    return {"mended": mends, **outcome(rc), **where, "seconds": round(seconds, 1), "backend": backend_log(err)}
