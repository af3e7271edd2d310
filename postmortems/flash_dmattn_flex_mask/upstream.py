"""flash-dmattn 1.2.2's FlexAttention path as installed: loading its file unmodified (with a stand-in for the
transformers import it does not use here), and reading its source (the listings the notebook shows)."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.workbench.postmortem import source_at

UPSTREAM_PACKAGE, UPSTREAM_VERSION = "flash-dmattn", "1.2.2"

UPSTREAM_FILE = "flash_dmattn/flash_dmattn_flex.py"  # in the 1.2.2 sdist and wheel, identical to tag v1.2.2

SUCCESSOR_PACKAGE, SUCCESSOR_VERSION = "flash-sparse-attn", "2.0.6"

SUCCESSOR_FILE = "flash_sparse_attn/deprecated/flash_sparse_attn_flex.py"

SOURCE = source_at("SmallDoges/flash-dmattn@1dcc395d495318c3f0cee27353b9afadc3928650")  # tag v1.2.2


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
