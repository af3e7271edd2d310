"""Post-mortem flash-dmattn-flex-mask: flash-dmattn's Flex backend ignores `attn_mask`.

A finding of the audit matrix (data/gpu/audit-dmattn-flex.json, H200): `flex_dmattn_func` of
flash-dmattn 1.2.2 gives finite, wrong outputs and gradients on every padded layout. This module
runs the upstream function itself, the installed `flash_dmattn/flash_dmattn_flex.py` unmodified
(`upstream_module()`), and reads its source:

* its only `mask_mod` is `q_idx >= kv_idx`, handed to `flex_attention` only when `is_causal`
  (None counts as True); `attn_mask` is sliced and never used, so every masked key is attended;
* `attn_bias` is honoured (a `score_mod` adds it), which is the workaround inside the library.

On CPU the file runs with two stand-ins that change no arithmetic, both said where they act:
transformers is not installed here, so `compile_friendly_flex_attention` (transformers'
`torch.compile(flex_attention)`, read at huggingface/transformers@2ccc6ca) is provided by
`_TransformersStandIn`; and every `torch.compile` it reaches (that one and upstream's
`create_block_mask(_compile=True)`) runs under `torch.compiler.set_stance("force_eager")`, i.e.
torch's eager FlexAttention, because inductor would build C++ for minutes. FlexAttention has no
backward on CPU (torch raises), so CPU evidence is the forward; the gradients come from the H200
record, and `gpu_probes` measures the workarounds' gradients on the next GPU run.

`reproduce()` returns a `Results`; `claims` checks it; the notebook shows it.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import re
import sys
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels import default_device, varlen_attention
from workbench import Case, pack, probe, reference_attention
from workbench.audit.adapters import ADAPTERS, bshd_mask
from workbench.postmortem import (
    OURS,
    UPSTREAM_CPU,
    UPSTREAM_GPU,
    Claims,
    Link,
    Meta,
    figure,
    latest_gpu_record,
    recorded_probes,
    source_at,
    table,
)
from workbench.postmortem import Results as PostmortemResults
from workbench.provenance import GPU_DATA
from workbench.records import read_record

META = Meta(
    id="flash-dmattn-flex-mask",
    title="flash-dmattn: the Flex backend ignores attn_mask, so padded keys are attended and outputs and gradients are silently wrong",
    component="flash-dmattn 1.2.2 (now flash-sparse-attn) / Flex backend (flex_dmattn_func)",
    category="training bug",
    impact=(
        "flash-dmattn <= 1.2.2 flex_dmattn_func: any padding, document or top-k attn_mask is dropped; "
        "finite outputs and gradients about 20 to 1,200 times PyTorch's own error on the H200, no warning"
    ),
    upstream_status="upstream unaware",
    status_note=(
        "no report found in the upstream tracker; every release since the backend appeared (v0.1.0) and the successor's "
        "copy in flash-sparse-attn 2.0.6 keep mask_mod = q_idx >= kv_idx; the docs rate the Flex backend's mask "
        "support 'limited' and advise avoiding it 'when strict attention mask compliance is required'"
    ),
    our_verdict=(
        "confirmed on the upstream code, CPU and H200: attn_mask changes no bit of the output; only rows whose mask "
        "row is all True are right; passing the mask as a -inf attn_bias, or torch's flex_attention with a mask_mod "
        "reading the mask, gives the right forward"
    ),
    detection="none: outputs and gradients stay finite; compare with another backend, or flip the mask and see nothing change",
    fix_type="workarounds: the mask as a -inf attn_bias (same function), or flex_attention with a BlockMask; upstream: a mask_mod that also reads attn_mask",
    tags=("attention mask", "padding", "silent error", "audit finding"),
    reported="2026-12-01",
    published="2026-12-01",
    links=(
        Link(
            "the Flex backend appears (af27f2e): mask_mod already q_idx >= kv_idx",
            "https://github.com/SmallDoges/flash-dmattn/commit/af27f2e10cd8dd7cecf45ae2bb5de27b5f0056cf",
            date="2025-07-03",
            kind="commit",
            status="the attn_mask line commented out since the first version",
        ),
        Link(
            "API docs: Flex backend 'Avoid when strict attention mask compliance is required' (d5b9be6)",
            "https://github.com/SmallDoges/flash-dmattn/commit/d5b9be6f086dc94f6fee9549b97b3a95267606ef",
            date="2025-09-08",
            kind="docs",
            status="a warning; attn_mask still documented as a parameter",
        ),
        Link(
            "flash-sparse-attention#146 (flex path of the example model)",
            "https://github.com/HKUSTDial/flash-sparse-attention/issues/146",
            date="2025-09-03",
            kind="issue",
            status="closed by #147, which removed the example's flex path; flex_dmattn_func untouched",
        ),
        Link(
            "flash-dmattn 1.2.2",
            "https://pypi.org/project/flash-dmattn/1.2.2/",
            date="2025-11-05",
            kind="release",
            status="last flash-dmattn release; flash_dmattn_flex.py as at tag v1.2.2 (1dcc395)",
        ),
        Link(
            "the same function as flash_sparse_attn_flex.py (e02668c)",
            "https://github.com/SmallDoges/flash-dmattn/commit/e02668c0b47e6db62c33857ec34051ec860b385b",
            date="2025-11-09",
            kind="commit",
            status="copied unchanged into the renamed package",
        ),
        Link(
            "flash-sparse-attn 2.0.6",
            "https://pypi.org/project/flash-sparse-attn/2.0.6/",
            date="2026-09-09",
            kind="release",
            status="latest; the function kept in flash_sparse_attn/deprecated/, not exported",
        ),
        Link(
            "flash_dmattn_flex.py at v1.2.2",
            "https://github.com/SmallDoges/flash-dmattn/blob/1dcc395d495318c3f0cee27353b9afadc3928650/flash_dmattn/flash_dmattn_flex.py",
        ),
        Link(
            "API reference at v1.2.2 (backend table, lines 85-121)",
            "https://github.com/SmallDoges/flash-dmattn/blob/1dcc395d495318c3f0cee27353b9afadc3928650/docs/api_reference.md",
        ),
        Link(
            "transformers' compile_friendly_flex_attention (read at 2ccc6ca)",
            "https://github.com/huggingface/transformers/blob/2ccc6cae21faaf11631efa5fb9054687ae5dc931/src/transformers/integrations/flex_attention.py",
        ),
    ),
)

UPSTREAM_PACKAGE, UPSTREAM_VERSION = "flash-dmattn", "1.2.2"
UPSTREAM_FILE = "flash_dmattn/flash_dmattn_flex.py"  # in the 1.2.2 sdist and wheel, identical to tag v1.2.2
SUCCESSOR_PACKAGE, SUCCESSOR_VERSION = "flash-sparse-attn", "2.0.6"
SUCCESSOR_FILE = "flash_sparse_attn/deprecated/flash_sparse_attn_flex.py"
SOURCE = source_at("SmallDoges/flash-dmattn@1dcc395d495318c3f0cee27353b9afadc3928650")  # tag v1.2.2
AUDIT_RECORD = "audit-dmattn-flex.json"
GPU_RECORD = f"data/gpu/{META.id}-h200.json"
GPU_COMMAND = f"workbench repro {META.id} --device cuda --record {GPU_RECORD}"


# -- the upstream code ------------------------------------------------------------------------------


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def upstream_path(package: str = UPSTREAM_PACKAGE) -> Path:
    """The installed upstream file (flash-dmattn's, or flash-sparse-attn's deprecated copy)."""
    relative = UPSTREAM_FILE if package == UPSTREAM_PACKAGE else SUCCESSOR_FILE
    if installed_version(package) is None:
        raise ModuleNotFoundError(
            f"{package} is not installed: install its wheel with `pip install --no-deps {package}` "
            f"(pure Python; flash-dmattn needs FLASH_DMATTN_SKIP_CUDA_BUILD=TRUE when built from the sdist)."
        )
    found = importlib.metadata.distribution(package).locate_file(relative)
    if not Path(found).exists():
        raise FileNotFoundError(
            f"{package} {installed_version(package)} has no {relative}; this page studies {UPSTREAM_VERSION}."
        )
    return Path(found)


def transformers_version() -> str | None:
    """The installed transformers (which upstream imports), or None: then `_TransformersStandIn` stands in."""
    return installed_version("transformers")


class _TransformersStandIn:
    """`transformers.integrations.flex_attention`, reduced to the one name upstream imports.

    transformers (read at huggingface/transformers@2ccc6ca) defines
    `compile_friendly_flex_attention(query, key, value, training=False, **kwargs)` as: compile
    `flex_attention` once with `torch.compile` (on torch >= 2.7 with no options; `training` only
    picks options on torch 2.6) and call it with the same arguments. This does exactly that.
    """

    _compiled: Callable | None = None

    @classmethod
    def compile_friendly_flex_attention(cls, query, key, value, training=False, **kwargs):
        from torch.nn.attention.flex_attention import flex_attention

        if cls._compiled is None:
            cls._compiled = torch.compile(flex_attention)
        return cls._compiled(query, key, value, **kwargs)


@contextlib.contextmanager
def _transformers_for_import() -> Any:
    """While upstream's file is executed: the real transformers if installed, else the stand-in,
    put in sys.modules for that import only (nothing else in the process sees it)."""
    if transformers_version() is not None:
        yield "transformers " + str(transformers_version())
        return
    names = ("transformers", "transformers.integrations", "transformers.integrations.flex_attention")
    saved = {n: sys.modules.get(n) for n in names}
    for name in names[:2]:
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    flex = types.ModuleType(names[2])
    flex.compile_friendly_flex_attention = _TransformersStandIn.compile_friendly_flex_attention
    sys.modules[names[2]] = flex
    try:
        yield "stand-in for transformers.integrations.flex_attention (transformers not installed)"
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@functools.lru_cache(maxsize=2)
def upstream_module(package: str = UPSTREAM_PACKAGE) -> types.ModuleType:
    """The installed upstream file, executed unmodified as a module of its own.

    Loaded by path, not through its package: flash-sparse-attn's `__init__` imports Triton code
    that needs the undeclared `triton_kernels`, and the file itself imports only torch and
    transformers. Its `transformers_used` attribute says what stood for transformers.
    """
    path = upstream_path(package)
    name = f"_upstream_{package.replace('-', '_')}_flex"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with _transformers_for_import() as used:
        spec.loader.exec_module(module)
    module.transformers_used = used
    return module


def upstream_function(device=None, package: str = UPSTREAM_PACKAGE) -> Callable:
    """Upstream's `flex_dmattn_func` (flash-sparse-attn: `flex_sparse_attn_func`), as is on a GPU.

    On CPU each call runs under `torch.compiler.set_stance("force_eager")`: the `torch.compile`
    calls it reaches run eagerly (torch's own eager FlexAttention), which computes the same
    attention without inductor's minutes-long C++ build. Forward only: FlexAttention on CPU
    refuses inputs that require grad.
    """
    module = upstream_module(package)
    fn = module.flex_dmattn_func if package == UPSTREAM_PACKAGE else module.flex_sparse_attn_func
    device = default_device() if device is None else torch.device(device)
    if device.type == "cuda":
        return fn

    @functools.wraps(fn)
    def eager(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*flex_attention called without torch\.compile")
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=r"(?s)_compile flag on create_block_mask")
            return fn(*args, **kwargs)

    return eager


def compile_room(device) -> contextlib.AbstractContextManager:
    """On a GPU: room for the recompiles a study of many shapes and dtypes needs (dynamo's default
    of 8 per function would silently fall back to eager FlexAttention past it). Nothing on CPU."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(recompile_limit=64)


# -- what the source says ---------------------------------------------------------------------------


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def source_facts(package: str = UPSTREAM_PACKAGE, text: str | None = None) -> dict[str, Any]:
    """What `flex_attention_forward` does with its arguments, read from the installed file's AST.

    attn_mask_reads: the lines where `attn_mask` is read; attn_mask_uses: those reads other than
    its `is not None` test and the right-hand side of its own re-assignment (the slice), i.e.
    anywhere its value could flow on; mask_mods / score_mods: each nested function named so, with
    the expression it returns / assigns; block_mask_passed_as: the BlockMask argument of the call;
    causal_default: what `is_causal=None` becomes; commented_out: comment lines starting `# return`;
    forward_ast: the function's syntax tree without positions (to compare two copies).
    """
    text = upstream_path(package).read_text() if text is None else text  # `text`: another version to read
    tree = ast.parse(text)
    forward = _function(tree, "flex_attention_forward")
    nested = [n for n in forward.body if isinstance(n, ast.FunctionDef)]
    reads = sorted(
        {n.lineno for n in ast.walk(forward) if isinstance(n, ast.Name) and n.id == "attn_mask" and isinstance(n.ctx, ast.Load)}
    )
    harmless: set[int] = set()  # ids of the Name nodes of the None test and of the slice re-assignment
    for node in ast.walk(forward):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "attn_mask is not None":
            harmless |= {id(n) for n in ast.walk(node.test)}
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["attn_mask"]:
            harmless |= {id(n) for n in ast.walk(node.value)}
    uses = sorted(
        {
            n.lineno
            for n in ast.walk(forward)
            if isinstance(n, ast.Name) and n.id == "attn_mask" and isinstance(n.ctx, ast.Load) and id(n) not in harmless
        }
    )
    mask_mods = {
        f.name: ast.unparse(next(s for s in f.body if isinstance(s, ast.Return)).value) for f in nested if "mask" in f.name
    }
    score_mods = {
        f.name: ast.unparse(next(s for s in f.body if isinstance(s, ast.Assign)).value) for f in nested if "score" in f.name
    }
    call = next(
        n
        for n in ast.walk(forward)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "compile_friendly_flex_attention"
    )
    passed = {k.arg: ast.unparse(k.value) for k in call.keywords}
    default = next(n for n in ast.walk(forward) if isinstance(n, ast.If) and ast.unparse(n.test) == "is_causal is None")
    return {
        "file": f"{UPSTREAM_FILE if package == UPSTREAM_PACKAGE else SUCCESSOR_FILE}",
        "attn_mask_reads": reads,
        "attn_mask_uses": uses,
        "mask_mods": mask_mods,
        "score_mods": score_mods,
        "block_mask_passed_as": passed.get("block_mask"),
        "causal_default": ast.unparse(default.body[0]),
        "commented_out": [line.strip() for line in text.splitlines() if line.strip().startswith("# return")],
        "forward_ast": ast.dump(forward, include_attributes=False),
    }


def upstream_lines(package: str = UPSTREAM_PACKAGE, numbers: tuple[tuple[int, int], ...] = ((23, 34), (36, 54), (63, 75))) -> str:
    """Numbered lines of the installed upstream file (the parts the page quotes)."""
    lines = upstream_path(package).read_text().splitlines()
    out = []
    for first, last in numbers:
        out += [f"{i:>3}  {lines[i - 1]}" for i in range(first, last + 1)]
        out.append("...")
    return "\n".join(out[:-1])


@dataclass(frozen=True)
class Listing:
    """Source as it is now, printed verbatim: `listing(name)` in a notebook cell (a registry test
    re-renders every listing a committed notebook shows and compares)."""

    name: str
    text: str

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__


LISTINGS: dict[str, Callable[[], str]] = {
    f"{UPSTREAM_FILE} ({UPSTREAM_PACKAGE} {UPSTREAM_VERSION})": upstream_lines,
}


def listing(name: str) -> Listing:
    if name not in LISTINGS:
        raise ValueError(f"listing({name!r}): give one of {sorted(LISTINGS)}.")
    return Listing(name, LISTINGS[name]())


# -- the cases: the failing layouts of the H200 audit ---------------------------------------------------

# check of the audit -> (the first case it failed on, keyword arguments of the call)
AUDITED: dict[str, tuple[Case, dict[str, Any]]] = {
    "real-accuracy": (Case((5, 3, 7), heads=2, head_dim=64, dtype="float16", fill="zeros"), {}),
    "empty-sequences": (Case((3, 0, 4, 0), heads=2, head_dim=64, dtype="float16", fill="zeros"), {}),
    "custom-scale": (Case((5, 9), heads=2, head_dim=64, dtype="float16", fill="zeros"), {"scale": 0.3}),
    "fully-masked-rows": (
        Case((3, 2, 4), seqlens_k=(3, 0, 2), heads=2, head_dim=64, dtype="float16", causal=True, fill="zeros"),
        {},
    ),
    "causal-unequal": (
        Case((5, 3), seqlens_k=(9, 7), heads=2, head_dim=64, dtype="float16", causal=True, fill="zeros"),
        {},
    ),
    "fuzz:real-accuracy": (Case((1, 2), heads=1, head_dim=64, dtype="bfloat16", fill="zeros"), {}),
}
CASES = tuple(case for case, _ in AUDITED.values())
STUDY = AUDITED["real-accuracy"][0]  # q=[5, 3, 7]: the picture's batch
GPU_SEEDS = (0, 1, 2)


def _bshd(case: Case, device) -> dict[str, torch.Tensor]:
    """The padded (B, S, H, D) batch the audit's adapter builds from `case`, and its mask (B, H, S_q, S_k) in q's dtype."""
    batch = pack(case, device, requires_grad=False)
    lens_q, lens_k = case.real_lengths("q"), case.real_lengths("k")
    seq_q, seq_k = max([*lens_q, 1]), max([*lens_k, 1])

    def padded(x, lengths, seq):
        out = x.new_zeros(len(lengths), seq, *x.shape[1:])
        start = 0
        for b, n in enumerate(lengths):
            out[b, :n] = x[start : start + n]
            start += n
        return out

    q, k, v = padded(batch.q, lens_q, seq_q), padded(batch.k, lens_k, seq_k), padded(batch.v, lens_k, seq_k)
    mask = bshd_mask(list(lens_q), list(lens_k), seq_q, seq_k, case.causal, q.device)
    return {"q": q, "k": k, "v": v, "mask": mask[:, None].expand(-1, case.heads, -1, -1).to(q.dtype).contiguous()}


# -- the workarounds, as a user writes them ------------------------------------------------------------


def mask_as_bias(fn: Callable) -> Callable:
    """Workaround (a): the same upstream function, the mask folded into `attn_bias` as -inf."""

    def call(query, key, value, attn_mask=None, attn_bias=None, is_causal=None, softmax_scale=None):
        # The page's mask_as_bias: a bool mask gives an additive bias in q's dtype, never a bool one.
        bias = torch.zeros((), dtype=query.dtype, device=query.device) if attn_bias is None else attn_bias.to(query.dtype)
        attn_bias = torch.where(attn_mask > 0, bias, float("-inf"))
        return fn(query, key, value, attn_mask=attn_mask, attn_bias=attn_bias, is_causal=is_causal, softmax_scale=softmax_scale)

    call.__name__ = "mask as -inf attn_bias"
    return call


def flex_with_mask(device=None) -> Callable:
    """Workaround (b): torch's own flex_attention with a mask_mod that reads the mask (compiled on a GPU, eager on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = default_device() if device is None else torch.device(device)
    flex = torch.compile(flex_attention) if device.type == "cuda" else flex_attention

    def call(query, key, value, attn_mask=None, attn_bias=None, is_causal=None, softmax_scale=None):
        keep = attn_mask > 0  # (B, H, S_q, S_k): every head's own mask, as on the page

        def mask_mod(b, h, q_idx, kv_idx):
            return keep[b, h, q_idx, kv_idx] & (q_idx >= kv_idx) if is_causal else keep[b, h, q_idx, kv_idx]

        def score_mod(score, b, h, q_idx, kv_idx):
            return score if attn_bias is None else score + attn_bias[b, h, q_idx, kv_idx]

        batch, seq_q, heads, _ = query.shape
        block_mask = create_block_mask(mask_mod, batch, heads, seq_q, key.shape[1], device=query.device)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*flex_attention called without torch\.compile")
            out = flex(
                query.transpose(1, 2),
                key.transpose(1, 2),
                value.transpose(1, 2),
                score_mod=score_mod,
                block_mask=block_mask,
                scale=softmax_scale,
                enable_gqa=heads != key.shape[2],
            )
        return out.transpose(1, 2)

    call.__name__ = "torch flex_attention + BlockMask"
    return call


def as_thd(fn: Callable) -> Callable:
    """`fn(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale)` behind the audit's own
    `dmattn` adapter: the same padded batch, mask, zero bias and is_causal=False as on the H200."""
    return ADAPTERS["dmattn"].wrap(fn)


# -- measurements ------------------------------------------------------------------------------------


def mask_effect(fn: Callable, device) -> dict[str, Any]:
    """The study batch called with four masks: padding (the right one), all ones, all zeros, and
    upstream's own top-k dynamic mask (`flash_dmattn.utils.mask.create_mask`, window 3). Which
    outputs are bit-identical to the all-ones one, and the error of each against the fp64 answer
    with that mask."""
    x = _bshd(STUDY.with_(dtype="float32"), device)
    q, k, v, padding = x["q"], x["k"], x["v"], x["mask"]
    generator = torch.Generator().manual_seed(3)
    bias = torch.randn(padding.shape, generator=generator).to(device)
    masks = {"padding": padding, "all ones": torch.ones_like(padding), "all zeros": torch.zeros_like(padding)}
    try:
        from flash_dmattn.utils.mask import create_mask

        topk = create_mask(
            attention_bias=bias,
            attention_mask=padding.bool(),
            batch_size=q.shape[0],
            query_len=q.shape[1],
            key_len=k.shape[1],
            window_size=3,
            min_dtype=torch.finfo(q.dtype).min,
        )
        masks["top-k (create_mask, window 3)"] = topk.expand_as(padding).to(q.dtype)
    except ImportError as exc:  # flash_dmattn's package import needs triton; recorded, not hidden
        masks_error = f"{type(exc).__name__}: {exc}"
    else:
        masks_error = ""
    outs = {name: fn(q, k, v, attn_mask=m, attn_bias=None, is_causal=False) for name, m in masks.items()}
    rows = []
    for name, m in masks.items():
        want = _dense(q, k, v, m > 0, None)
        real = m[:, 0].bool().any(-1)  # rows with a visible key
        err = (outs[name].double() - want).abs().amax(dim=(-1, -2))[real]
        rows.append(
            {
                "mask": name,
                "kept keys": int(m[:, 0].bool().sum()),
                "identical to all-ones": bool(torch.equal(outs[name], outs["all ones"])),
                "max error vs that mask": float(err.max()) if err.numel() else 0.0,
            }
        )
    return {"rows": rows, "error": masks_error}


def _dense(q, k, v, keep, bias, scale=None) -> torch.Tensor:
    """fp64 attention on (B, S, H, D) with a (B, H, S_q, S_k) boolean mask; rows with no key: 0."""
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = qh @ kh.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        scores = scores + bias.double()
    has = keep.any(-1, keepdim=True)
    scores = torch.where(has, scores.masked_fill(~keep, float("-inf")), torch.zeros_like(scores))
    return (torch.softmax(scores, -1) * has @ vh).transpose(1, 2)


def gqa_error(fn: Callable, device) -> str:
    """What a grouped-query call (2 query heads, 1 key/value head) gives: the exception, or 'ran'."""
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 8, h, 16, generator=generator).to(device) for h in (2, 1, 1))
    try:
        fn(q, k, v, is_causal=False)
    except Exception as exc:  # the finding is the exception itself
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def causal_default(fn: Callable, device) -> dict[str, bool]:
    """is_causal=None against True and False on the study batch (all-ones mask: no padding effect)."""
    x = _bshd(STUDY.with_(dtype="float32"), device)
    ones = torch.ones_like(x["mask"])
    got = {c: fn(x["q"], x["k"], x["v"], attn_mask=ones, is_causal=c) for c in (None, True, False)}
    top_left = _dense(x["q"], x["k"], x["v"], torch.ones(x["mask"].shape, dtype=torch.bool, device=device).tril(), None)
    return {
        "None == True (bitwise)": bool(torch.equal(got[None], got[True])),
        "None == False (bitwise)": bool(torch.equal(got[None], got[False])),
        "True is top-left causal (fp32 vs fp64 < 1e-5)": bool((got[True].double() - top_left).abs().max() < 1e-5),
    }


def applied_weights(fn: Callable, device) -> dict[str, torch.Tensor]:
    """The attention weights the function applies, measured through its output: with value =
    identity (key j's value is the unit vector e_j), output row i is row i of softmax(QK^T + bias).
    Returns the mask passed and the weights measured, (B, S_q, S_k) for head 0, on the study batch."""
    x = _bshd(STUDY.with_(dtype="float32"), device)
    batch, seq_k, heads, dim = x["k"].shape
    eye = torch.eye(seq_k, dim, device=device)[None, :, None, :].expand(batch, -1, heads, -1).contiguous()
    weights = fn(x["q"], x["k"], eye, attn_mask=x["mask"], attn_bias=None, is_causal=False)[..., 0, :seq_k]
    fixed = mask_as_bias(fn)(x["q"], x["k"], eye, attn_mask=x["mask"], attn_bias=None, is_causal=False)[..., 0, :seq_k]
    return {"mask": x["mask"][:, 0].bool().cpu(), "weights": weights.cpu(), "weights with the bias workaround": fixed.cpu()}


@dataclass
class CaseRun:
    """One implementation on one audited case: forward (and backward on a GPU) against the fp64 oracle."""

    check: str
    impl: str
    case: Case
    ratios: dict[str, float]  # tensor -> error / PyTorch's own error in that dtype
    within: bool
    finite: bool
    row_errors: list[float]  # per real query row: max |out - oracle| / the out bound
    rows_right: list[bool]  # per real query row: within the out bound
    rows_predicted: list[bool]  # per real query row: its mask row is all True (nothing to drop)
    seconds: float
    backward: bool = False

    def summary(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "impl": self.impl,
            "case": self.case.label(),
            "ratios": self.ratios,
            "within": self.within,
            "finite": self.finite,
            "rows_right": sum(self.rows_right),
            "rows": len(self.rows_right),
            "prediction_exact": self.rows_right == self.rows_predicted,
            "seconds": round(self.seconds, 2),
        }


def _predicted_rows(case: Case) -> list[bool]:
    """Real query rows whose output the ignored mask leaves right: those whose mask row over the
    padded keys is all True (nothing to drop), and, with zero-filled padding, those whose mask row
    is all False (every key of theirs is padding: all their weight lands on zero values, so they
    get 0, the oracle's answer for a row with no visible key, by accident)."""
    lens_q, lens_k = case.real_lengths("q"), case.real_lengths("k")
    seq_q, seq_k = max([*lens_q, 1]), max([*lens_k, 1])
    mask = bshd_mask(list(lens_q), list(lens_k), seq_q, seq_k, case.causal, "cpu")
    zeros = case.fill.value == "zeros"
    return [bool(mask[b, i].all()) or (zeros and lens_k[b] == 0) for b, n in enumerate(lens_q) for i in range(n)]


def run_case(check: str, impl: Callable, name: str, device, backward: bool, *, through_adapter: bool = True) -> CaseRun:
    """`impl` on the audited case of `check`; `through_adapter`: it is `as_thd(...)` and takes the padding fill."""
    case, kwargs = AUDITED[check]
    start = time.perf_counter()
    fill = {"padding_fill": case.fill} if through_adapter else {}
    record = probe(impl, pack(case, device), name=name, backward=backward, **fill, **kwargs)
    seconds = time.perf_counter() - start
    out_error = record.errors["out"]
    real = record.regions_q == 0  # Region.REAL
    fresh = pack(case, device, requires_grad=False)
    leaves = (t.double() for t in (fresh.q, fresh.k, fresh.v))
    call = {**fresh.kwargs(), **kwargs}
    oracle = reference_attention(*leaves, *fresh.args()[3:], **call, compute_dtype=torch.float64, validate=False).cpu()
    per_row = (record.tensors["out"].double() - oracle.double()).abs().flatten(1).amax(1)[real]
    bound = out_error.bound
    return CaseRun(
        check=check,
        impl=name,
        case=case,
        ratios={n: e.ratio for n, e in record.errors.items()},
        within=record.real_within_bound,
        finite=record.real_finite,
        row_errors=[float(e / bound) for e in per_row],
        rows_right=[bool(e <= bound) for e in per_row],
        rows_predicted=_predicted_rows(case),
        seconds=seconds,
        backward=backward,
    )


# -- the H200 records ----------------------------------------------------------------------------------

_RATIO = re.compile(r"(\w+): error [^;]*?\(([\d.e+]+)x PyTorch's own error\)")


def audit_record() -> dict[str, Any]:
    """data/gpu/audit-dmattn-flex.json: `workbench audit ... --device cuda` on the H200 (scripts/gpu_audit_matrix.py)."""
    path = GPU_DATA / AUDIT_RECORD
    return {**read_record(path, how="python scripts/gpu_audit_matrix.py --rows dmattn-flex"), "file": path.name}


def recorded_ratios(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """check (and fuzz:<check>) -> {case: the first failing case, ratios: {tensor: x PyTorch's own error}, nonfinite: bool}."""
    found = {}
    for check in record["checks"]:
        if check["verdict"] == "FAIL":
            found[check["name"]] = {
                "case": Case(**check["cases"][0]),
                "ratios": {t: float(r) for t, r in _RATIO.findall(check["evidence"])},
                "nonfinite": "non-finite" in check["evidence"],
                "evidence": check["evidence"],
            }
    for failure in (record.get("fuzz") or {}).get("failures", []):
        found[f"fuzz:{failure['check']}"] = {
            "case": Case(**failure["case"]),
            "ratios": {t: float(r) for t, r in _RATIO.findall(failure["evidence"])},
            "nonfinite": "non-finite" in failure["evidence"],
            "evidence": failure["evidence"],
        }
    return found


# -- the study --------------------------------------------------------------------------------------------


@dataclass
class Results(PostmortemResults):
    device: str
    versions: dict[str, str | None]
    transformers_used: str
    source: dict[str, Any]
    successor_source: dict[str, Any]
    successor_identical_output: bool
    mask_effect: dict[str, Any]
    causal: dict[str, bool]
    gqa: str
    weights: dict[str, torch.Tensor] = field(repr=False)
    runs: dict[str, dict[str, CaseRun]]  # impl -> check -> run
    audit: dict[str, Any] = field(repr=False)
    recorded: dict[str, dict[str, Any]]
    gpu: dict[str, Any] | None = field(repr=False, default=None)

    def run(self, impl: str, check: str) -> CaseRun:
        return self.runs[impl][check]


IMPLS = ("flex_dmattn_func", "(a) mask as -inf attn_bias", "(b) torch flex_attention + BlockMask", "(c) our varlen_attention")


def reproduce(device=None) -> Results:
    """Runs the upstream function (and the workarounds) on every audited case; reads the H200 record."""
    device = default_device() if device is None else torch.device(device)
    with compile_room(device):
        return _reproduce(device)


def _reproduce(device: torch.device) -> Results:
    fn = upstream_function(device)
    # Forward only for the FlexAttention paths, on every device: FlexAttention has no CPU backward,
    # and on a GPU the gradients are gpu_probes' (which records a probe that raises instead of dying).
    backward = False
    impls = {
        IMPLS[0]: as_thd(fn),
        IMPLS[1]: as_thd(mask_as_bias(fn)),
        IMPLS[2]: as_thd(flex_with_mask(device)),
    }
    runs: dict[str, dict[str, CaseRun]] = {name: {} for name in IMPLS}
    for name, impl in impls.items():
        for check in AUDITED:
            runs[name][check] = run_case(check, impl, name, device, backward)
    runs[IMPLS[3]]["real-accuracy"] = run_case(
        "real-accuracy", varlen_attention, IMPLS[3], device, backward=True, through_adapter=False
    )

    successor = upstream_function(device, SUCCESSOR_PACKAGE)
    x = _bshd(STUDY.with_(dtype="float32"), device)
    same = torch.equal(
        fn(x["q"], x["k"], x["v"], attn_mask=x["mask"], is_causal=False),
        successor(x["q"], x["k"], x["v"], attn_mask=x["mask"], is_causal=False),
    )
    record = audit_record()
    return Results(
        device=str(device),
        versions={
            UPSTREAM_PACKAGE: installed_version(UPSTREAM_PACKAGE),
            SUCCESSOR_PACKAGE: installed_version(SUCCESSOR_PACKAGE),
            "transformers": transformers_version(),
            "torch": torch.__version__,
        },
        transformers_used=upstream_module().transformers_used,
        source=source_facts(),
        successor_source=source_facts(SUCCESSOR_PACKAGE),
        successor_identical_output=same,
        mask_effect=mask_effect(fn, device),
        causal=causal_default(fn, device),
        gqa=gqa_error(fn, device),
        weights=applied_weights(fn, device),
        runs=runs,
        audit=record,
        recorded=recorded_ratios(record),
        gpu=latest_gpu_record(META),
    )


# -- tables and figures --------------------------------------------------------------------------------


def cases_table(r: Results, impls: tuple[str, ...] = IMPLS[:1]):
    """Per audited case and implementation: out error in units of PyTorch's own, rows right."""
    rows = []
    for check in AUDITED:
        recorded = r.recorded.get(check, {}).get("ratios", {}).get("out")
        for name in impls:
            if check not in r.runs[name]:
                continue
            run = r.run(name, check)
            rows.append(
                (
                    check,
                    run.case.label(),
                    name,
                    run.ratios["out"],
                    "yes" if run.within else "NO",
                    f"{sum(run.rows_right)}/{len(run.rows_right)}",
                    recorded if name == IMPLS[0] and recorded is not None else "",
                )
            )
    where = "CPU, forward" if r.device == "cpu" else f"{r.device}, forward+backward"
    return table(
        ("audit check", "case", "implementation", "out error / PyTorch's", "within bound", "real rows right", "H200 record"),
        rows,
        title=f"each failing case of the H200 audit, re-run ({where}); H200 record: out error / PyTorch's recorded there",
        fold=18,
    )


def weights_figure(r: Results):
    """Per batch item: the mask passed, the weights flex_dmattn_func applied, the weights with workaround (a)."""
    w = r.weights
    mask, applied, fixed = w["mask"], w["weights"], w["weights with the bias workaround"]
    lens = STUDY.real_lengths("q")
    fig, axes = figure(3, len(lens), width=7.2, height=2.3)
    labels = (
        "attn_mask passed\n(black: may attend)",
        "weights applied by\nflex_dmattn_func",
        "weights with (a):\nmask as -inf bias",
    )
    for b, n in enumerate(lens):
        for row, (image, cmap) in enumerate(((mask[b].float(), "Greys"), (applied[b], "Blues"), (fixed[b], "Blues"))):
            ax = axes[row, b]
            ax.grid(False)
            shown = ax.imshow(image[:n].numpy(), cmap=cmap, vmin=0, vmax=1, aspect="auto")
            if n < image.shape[-1]:
                ax.axvline(n - 0.5, color="#d1495b", linewidth=1.2, linestyle="--")
            ax.set_xticks(range(image.shape[-1]))
            ax.set_yticks(range(n))
            ax.tick_params(labelsize=7)
            if row == 0:
                ax.set_title(f"item {b}: {n} real tokens", fontsize=9)
            if b == 0:
                ax.set_ylabel(f"{labels[row]}\nquery row", fontsize=8)
            if row == 2:
                ax.set_xlabel("key (dashed: end of real keys)", fontsize=8)
    fig.colorbar(shown, ax=axes[1:, -1].tolist(), shrink=0.8, label="attention weight")
    fig.suptitle(f"{STUDY.with_(dtype='float32').label()}, padded to 7: the mask is dropped, padded keys get weight", fontsize=10)
    return fig


def row_error_figure(r: Results):
    """Per real query row of each audited case: out error over the bound, as-is and with workaround (a)."""
    checks = list(AUDITED)
    fig, axes = figure(1, 2, width=7.6, height=3.0, sharey=True)
    for ax, name in zip(axes[0], IMPLS[:2]):
        for i, check in enumerate(checks):
            run = r.run(name, check)
            errors = [max(e, 1e-3) for e in run.row_errors]
            colours = ["#3a9d5d" if ok else "#d1495b" for ok in run.rows_right]
            ax.scatter([i] * len(errors), errors, c=colours, s=14, alpha=0.8, edgecolors="none")
        ax.axhline(1.0, color="#1f2328", linewidth=0.9, linestyle="--")
        ax.set_yscale("log")
        ax.set_xticks(range(len(checks)), [c.replace("fuzz:", "fuzz\n").replace("-", "-\n", 1) for c in checks], fontsize=6.5)
        ax.set_title(name, fontsize=9)
    axes[0, 0].set_ylabel("out error of a real row / bound\n(dashed: the bound)", fontsize=8)
    fig.suptitle(
        "every real query row of the audited cases (green: within the bound, red: over it; below 1e-3 drawn at 1e-3)", fontsize=9
    )
    return fig


def study_batch(device=None) -> tuple[torch.Tensor, ...]:
    """q, k, v (B, S, H, D) and attn_mask (B, H, S, S) of the study case (fp32): three sequences
    of 5, 3 and 7 tokens padded to 7, as the audit's adapter builds them."""
    x = _bshd(STUDY.with_(dtype="float32"), default_device() if device is None else torch.device(device))
    return x["q"], x["k"], x["v"], x["mask"]


def workaround_table(r: Results, impl: str):
    """One implementation over the audited cases: the largest error / PyTorch's over the tensors it
    computed (out; and dq, dk, dv where the backward ran), within bound, real query rows right."""
    runs = r.runs[impl]
    backward = all(x.backward for x in runs.values())
    return table(
        (
            "audit check",
            "case",
            f"worst error / PyTorch's ({', '.join(next(iter(runs.values())).ratios)})",
            "within bound",
            "real rows right",
        ),
        [
            (
                check,
                x.case.label(),
                max(x.ratios.values()),
                "yes" if x.within else "NO",
                f"{sum(x.rows_right)}/{len(x.rows_right)}",
            )
            for check, x in runs.items()
        ],
        title=f"{impl}: {'CPU' if r.device == 'cpu' else r.device}, {'forward+backward' if backward else 'forward'}",
    )


def mask_effect_table(r: Results):
    return table(
        ("attn_mask passed", "keys kept", "output bit-identical to all-ones", "max error vs the fp64 answer with that mask"),
        [(x["mask"], x["kept keys"], x["identical to all-ones"], x["max error vs that mask"]) for x in r.mask_effect["rows"]],
        title=f"flex_dmattn_func on {STUDY.with_(dtype='float32').label()} padded to 7, is_causal=False",
    )


def _short(text: str, width: int = 60) -> str:
    """`text` cut at a word boundary before `width` characters, with '...' when cut."""
    return text if len(text) <= width else text[: text.rfind(" ", 0, width)] + " ..."


def audit_table(r: Results):
    """The H200 record, check by check: verdict and the ratios it recorded."""
    rows = []
    for check in r.audit["checks"]:
        ratios = dict(_RATIO.findall(check["evidence"]))
        shown = ", ".join(f"{t} {float(x):.3g}x" for t, x in ratios.items()) or _short(check["evidence"])
        rows.append((check["name"], check["verdict"], Case(**check["cases"][0]).label() if check["cases"] else "", shown))
    fuzz = r.audit["fuzz"]
    for failure in fuzz["failures"]:
        ratios = ", ".join(f"{t} {float(x):.3g}x" for t, x in _RATIO.findall(failure["evidence"]))
        rows.append(
            (
                f"fuzz:{failure['check']}",
                f"{fuzz['failing_layouts']}/{fuzz['tried']} layouts",
                Case(**failure["case"]).label(),
                ratios,
            )
        )
    prov = r.audit["provenance"]
    return table(
        ("check", "verdict", "first failing case", "recorded (error / PyTorch's own)"),
        rows,
        title=f"{r.audit['file']}: {prov['device']}, torch {prov['torch']}, triton {prov['triton']}, {r.audit['dtype']}, commit {prov['commit']}",
        fold=16,
    )


# -- GPU probes ----------------------------------------------------------------------------------------


def gpu_probes(device, budget_s: float = 200.0) -> dict[str, Any]:
    """What `workbench repro flash-dmattn-flex-mask --device cuda --record FILE` adds: upstream's own
    compiled FlexAttention path on the GPU, forward and backward, fp16 and bf16, as is and with the two
    workarounds, over `GPU_SEEDS` seeds of every audited case; and the mask bit test there.
    Imports torch, triton and the upstream wheels only (plus transformers if installed). A probe that
    would start past `budget_s` is recorded as skipped."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"gpu_probes(device={device!r}) needs a CUDA device: it records the compiled FlexAttention path.")
    found = probe_all(device, budget_s=budget_s)
    return {**found, "capability": list(torch.cuda.get_device_capability(device))}


def probe_all(
    device,
    *,
    budget_s: float,
    backward: bool = True,
    dtypes: tuple[str, ...] = ("float16", "bfloat16"),
    seeds: tuple[int, ...] = GPU_SEEDS,
) -> dict[str, Any]:
    """`gpu_probes`' work on any device: the bit test, then every (dtype, seed, audited case,
    implementation) probed in that order, each run's error ratios, or the exception it raised
    (a probe that raises is a finding, recorded, not a crash); past `budget_s` the rest is skipped."""
    device = torch.device(device)
    with compile_room(device):
        return _probe_all(device, budget_s, backward, dtypes, seeds)


def _probe_all(device, budget_s, backward, dtypes, seeds) -> dict[str, Any]:
    start = time.monotonic()
    fn = upstream_function(device)
    found: dict[str, Any] = {
        "transformers_used": upstream_module().transformers_used,
        "backward": backward,
        "mask_effect": mask_effect(fn, device),
        "causal": causal_default(fn, device),
        "runs": [],
        "skipped": [],
    }
    impls = {IMPLS[0]: as_thd(fn), IMPLS[1]: as_thd(mask_as_bias(fn)), IMPLS[2]: as_thd(flex_with_mask(device))}
    for dtype in dtypes:
        for seed in seeds:
            for check, (case, kwargs) in AUDITED.items():
                for name, impl in impls.items():
                    label = {"impl": name, "check": check, "dtype": dtype, "seed": seed}
                    if time.monotonic() - start > budget_s:
                        found["skipped"].append(label)
                        continue
                    varied = case.with_(dtype=dtype, seed=seed)
                    try:
                        record = probe(impl, pack(varied, device), name=name, backward=backward, padding_fill=case.fill, **kwargs)
                    except Exception as exc:
                        found["runs"].append({**label, "error": f"{type(exc).__name__}: {exc}"[:300]})
                        continue
                    found["runs"].append(
                        {
                            **label,
                            "ratios": {n: e.ratio for n, e in record.errors.items()},
                            "within": record.real_within_bound,
                            "finite": record.real_finite,
                        }
                    )
    found["seconds"] = round(time.monotonic() - start, 1)
    return found


# -- claims ----------------------------------------------------------------------------------------------

claims = Claims()


@claims(
    "in flash-dmattn 1.2.2's flex_attention_forward, attn_mask is read only to be sliced; the only mask_mod returns q_idx >= kv_idx, "
    "passed to flex_attention only when is_causal, and is_causal=None becomes True",
    evidence=SOURCE,
)
def _source_reads(r: Results):
    s = r.source
    holds = (
        not s["attn_mask_uses"]
        and s["mask_mods"] == {"causal_mask_mod": "q_idx >= kv_idx"}
        and s["block_mask_passed_as"] == "block_mask if is_causal else None"
        and s["causal_default"] == "is_causal = True"
    )
    return holds, (
        f"attn_mask read on lines {s['attn_mask_reads']} (its None test and its slice), used nowhere else; "
        f"the intended line commented out: {s['commented_out']}; "
        f"mask_mods {s['mask_mods']}; block_mask={s['block_mask_passed_as']}; {s['causal_default']} when None"
    )


@claims("attn_bias is honoured: the score_mod adds attn_bias[b][h][q_idx][kv_idx] to every score", evidence=SOURCE)
def _source_bias(r: Results):
    mods = r.source["score_mods"]
    return mods == {"score_mod": "score + attn_bias[batch_idx][head_idx][q_idx][kv_idx]"}, f"score_mods {mods}"


@claims(
    "attn_mask changes no bit of the output: padding, all-ones, all-zeros and upstream's own top-k mask give identical outputs",
    evidence=UPSTREAM_CPU,
)
def _bitwise(r: Results):
    rows = r.mask_effect["rows"]
    holds = len(rows) == 4 and all(x["identical to all-ones"] for x in rows)
    return holds, "; ".join(f"{x['mask']} ({x['kept keys']} keys kept): identical {x['identical to all-ones']}" for x in rows) + (
        f"; {r.mask_effect['error']}" if r.mask_effect["error"] else ""
    )


@claims(
    "the weights it applies, measured through its output, put weight on every padded key: softmax over all keys, the mask ignored",
    evidence=UPSTREAM_CPU,
)
def _weights(r: Results):
    w, mask = r.weights["weights"], r.weights["mask"]
    lens = STUDY.real_lengths("q")
    real_rows = torch.zeros_like(mask)
    for b, n in enumerate(lens):
        real_rows[b, :n] = True
    on_padded = w[real_rows & ~mask]
    fixed = r.weights["weights with the bias workaround"][real_rows & ~mask]
    holds = bool((on_padded > 0).all()) and bool((fixed == 0).all())
    return holds, (
        f"{on_padded.numel()} (real row, padded key) pairs: weight min {float(on_padded.min()):.3g}, "
        f"total per row up to {float((w * (real_rows & ~mask)).sum(-1).max()):.2f}; with (a) all exactly 0"
    )


@claims("is_causal=None is bitwise is_causal=True (top-left causal), not False", evidence=UPSTREAM_CPU)
def _causal(r: Results):
    c = r.causal
    return c["None == True (bitwise)"] and not c["None == False (bitwise)"] and c[
        "True is top-left causal (fp32 vs fp64 < 1e-5)"
    ], str(c)


@claims(
    "grouped K/V (the docs' 'GQA Support' for Flex) raise: flex_attention is called without enable_gqa",
    evidence=UPSTREAM_CPU,
)
def _gqa(r: Results):
    return r.gqa.startswith("ValueError") and "enable_gqa" in r.gqa, r.gqa


@claims(
    "every failing case of the H200 audit fails here too, finite, its out error 25-1200x PyTorch's own in fp16/bf16",
    evidence=UPSTREAM_CPU,
)
def _cases_fail(r: Results):
    runs = r.runs[IMPLS[0]].values()
    holds = all(not x.within and x.finite and 25 <= x.ratios["out"] <= 1200 for x in runs)
    return holds, ", ".join(f"{x.check} {x.ratios['out']:.3g}x" for x in runs)


@claims(
    "exactly the predicted real rows come out right, in every audited case: those whose mask row is all True (nothing to drop), "
    "and those of a sequence with no key (all weight on zero-filled padding: 0, by accident)",
    evidence=UPSTREAM_CPU,
)
def _rule(r: Results):
    runs = r.runs[IMPLS[0]].values()
    exact = [x.check for x in runs if x.rows_right == x.rows_predicted]
    right = sum(sum(x.rows_right) for x in runs)
    total = sum(len(x.rows_right) for x in runs)
    return len(exact) == len(AUDITED), f"{len(exact)}/{len(AUDITED)} cases exact; {right} of {total} real rows right"


@claims(
    "the CPU forward reproduces the H200 record: same first failing case per check, out error within 10% of the recorded ratio",
    evidence=UPSTREAM_GPU,
)
def _matches_gpu(r: Results):
    parts, good = [], 0
    for check, (case, _) in AUDITED.items():
        rec = r.recorded.get(check)
        run = r.run(IMPLS[0], check)
        ok = rec is not None and rec["case"] == case and abs(run.ratios["out"] / rec["ratios"]["out"] - 1) < 0.10
        good += ok
        parts.append(f"{check}: here {run.ratios['out']:.3g}x, H200 {rec['ratios']['out'] if rec else '-'}x")
    return good == len(AUDITED), "; ".join(parts)


@claims(
    "on the H200 (fp16/bf16, compiled): every failing check but padding-leak is finite and wrong in out, dq, dk and dv, "
    "20-1200x PyTorch's own error; most fuzzed layouts fail",
    evidence=UPSTREAM_GPU,
)
def _gpu_record(r: Results):
    wrong = {k: v for k, v in r.recorded.items() if k != "padding-leak"}
    holds = all(
        not v["nonfinite"]
        and set(v["ratios"]) == {"out", "dq", "dk", "dv"}
        and min(v["ratios"].values()) >= 20
        and max(v["ratios"].values()) <= 1200
        for v in wrong.values()
    )
    fuzz = r.audit["fuzz"]
    holds = holds and 2 * fuzz["failing_layouts"] > fuzz["tried"]
    lo = min(min(v["ratios"].values()) for v in wrong.values())
    hi = max(max(v["ratios"].values()) for v in wrong.values())
    prov = r.audit["provenance"]
    return holds, (
        f"{r.audit['file']} ({prov['device']}, torch {prov['torch']}, {prov['date']}): {len(wrong)} failing checks, "
        f"ratios {lo:.3g}-{hi:.3g}x, none non-finite; fuzzer {fuzz['failing_layouts']}/{fuzz['tried']} layouts failing"
    )


@claims(
    "padding-leak on the H200 (NaN in the padding): the non-finite values in out, dq, dk and dv are exactly the rows the rule "
    "predicts wrong (the padded sequences' real rows) x heads x head dim",
    evidence=UPSTREAM_GPU,
)
def _gpu_leak(r: Results):
    leak = r.recorded["padding-leak"]
    case = leak["case"]
    wrong = _predicted_rows(case).count(False)
    predicted = wrong * case.heads * case.head_dim
    counts = dict(re.findall(r"(\w+): (\d+) non-finite REAL values", leak["evidence"]))
    holds = set(counts) == {"out", "dq", "dk", "dv"} and all(int(n) == predicted for n in counts.values())
    return (
        holds,
        f"{case.label()} ({case.fill.value} padding): recorded {counts}; predicted {wrong} rows x {case.heads} x {case.head_dim} = {predicted}",
    )


@claims(
    "flash-sparse-attn 2.0.6 keeps the same function (deprecated/flash_sparse_attn_flex.py): identical AST, bit-identical output",
    evidence=UPSTREAM_CPU,
)
def _successor(r: Results):
    same_ast = r.source["forward_ast"] == r.successor_source["forward_ast"]
    return same_ast and r.successor_identical_output, (
        f"flex_attention_forward AST identical {same_ast}; output on the study batch bit-identical {r.successor_identical_output}"
    )


@claims(
    "workaround (a), the mask as a -inf attn_bias of the same function: forward within the bound on every audited case, fully masked rows included",
    evidence=UPSTREAM_CPU,
)
def _bias_workaround(r: Results):
    return _workaround_holds(r, IMPLS[1])


@claims(
    "workaround (b), torch's flex_attention with a mask_mod reading the mask: forward within the bound on every audited case",
    evidence=UPSTREAM_CPU,
)
def _flex_workaround(r: Results):
    return _workaround_holds(r, IMPLS[2])


def _workaround_holds(r: Results, impl: str) -> tuple[bool, str]:
    """Every audited case within the bound and finite through `impl`, and the worst error ratio."""
    runs = r.runs[impl].values()
    worst = max(max(x.ratios.values()) for x in runs)
    return all(
        x.within and x.finite for x in runs
    ), f"{sum(x.within for x in runs)}/{len(runs)} cases; worst {worst:.2f}x PyTorch's error"


@claims(
    "torch's own flex_attention with a document BlockMask passed real-accuracy on the H200 (the audit's flex-document row)",
    evidence=UPSTREAM_GPU,
)
def _flex_document(r: Results):
    path = GPU_DATA / "audit-flex-document.json"
    record = read_record(path, how="python scripts/gpu_audit_matrix.py --rows flex-document")
    verdict = next(c["verdict"] for c in record["checks"] if c["name"] == "real-accuracy")
    return (
        verdict == "pass",
        f"{path.name}: real-accuracy {verdict} ({record['provenance']['device']}, torch {record['provenance']['torch']})",
    )


@claims("our varlen_attention on the study case: real rows within the bound, forward and backward", evidence=OURS)
def _ours(r: Results):
    run = r.run(IMPLS[3], "real-accuracy")
    return run.within and run.finite, f"worst {max(run.ratios.values()):.2f}x PyTorch's error over {sorted(run.ratios)}"


# -- claims on the GPU probes: without a record they fail, their evidence naming the command that makes one


def _probes(r: Results) -> dict[str, Any]:
    return recorded_probes(r.gpu, META)


def _covered(runs: list[dict[str, Any]]) -> bool:
    """Every audited case has at least one run (a budget may skip later seeds and dtypes)."""
    return {x["check"] for x in runs} == set(AUDITED)


def _gpu_as_is(r: Results) -> tuple[bool, str]:
    probes = _probes(r)
    runs = [x for x in probes["runs"] if x["impl"] == IMPLS[0]]
    bad = [x for x in runs if "error" in x or x["within"] or not x["finite"]]
    holds = probes["backward"] and _covered(runs) and not bad
    return (
        holds,
        f"{len(runs) - len(bad)}/{len(runs)} runs finite and over the bound; {len(probes['skipped'])} probes skipped (budget)",
    )


def _gpu_workarounds(r: Results) -> tuple[bool, str]:
    probes = _probes(r)
    parts, good = [], bool(probes["backward"])
    for impl in IMPLS[1:3]:
        runs = [x for x in probes["runs"] if x["impl"] == impl]
        ok = [x for x in runs if "error" not in x and x["within"] and x["finite"]]
        good = good and _covered(runs) and len(ok) == len(runs)
        worst = max((max(x["ratios"].values()) for x in ok), default=float("nan"))
        parts.append(f"{impl}: {len(ok)}/{len(runs)} within (worst {worst:.2f}x)")
    return good, "; ".join(parts) + f"; {len(probes['skipped'])} probes skipped (budget)"


def _gpu_bitwise(r: Results) -> tuple[bool, str]:
    rows = _probes(r)["mask_effect"]["rows"]
    same = sum(x["identical to all-ones"] for x in rows)
    return len(rows) == 4 and same == 4, f"{same}/{len(rows)} masks give the all-ones output bit for bit"


GPU_CLAIMS = (
    ("on the GPU, compiled: attn_mask changes no bit of the output (the four masks)", _gpu_bitwise),
    (
        "on the GPU, forward and backward, every audited case (fp16/bf16, seeds as the budget allowed): as is, finite and over the bound",
        _gpu_as_is,
    ),
    (
        "on the GPU, forward and backward, every audited case: workarounds (a) and (b) within the bound in every run",
        _gpu_workarounds,
    ),
)
for statement, check in GPU_CLAIMS:
    claims(statement, evidence=UPSTREAM_GPU)(check)
