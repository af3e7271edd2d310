"""No state fixed at import in `varlen_workbench.kernels`: every piece of process-wide state lives in
kernels/caches.py, and the default device is read when asked (kernels/_compat.py).

The rule, checked on the source (AST) of every module under kernels/ but kernels/caches.py. A
module breaks it with:

1. a `global` statement anywhere (a function rebinding module state);
2. a module-level assignment (plain, annotated or augmented; in the module body or a block of
   it: `if`, `try`, `with`) of a call, unless the call makes an immutable value: a builtin of
   `IMMUTABLE_BUILTINS`, a class of kernels/ that is a frozen dataclass or a NamedTuple, or one
   of `ALLOWED_CALLS` (each with its reason). `x = Tuner()`, `x = threading.Lock()`,
   `x = weakref.WeakKeyDictionary()`, `x = functools.cache(f)` all break it;
3. a mutable display (list, dict or set literal or comprehension) at module level that the
   module mutates: item assignment or deletion, or a mutating method call (`MUTATORS`) on it;
4. a decorator `functools.cache`, `functools.lru_cache(...)`, `cache` or `lru_cache` (anywhere,
   methods included): memoize with `caches.cached`, which `caches.reset()` clears.

Known exceptions are listed with their reasons (`EXEMPT`), and each must still be needed: an
exception that no longer matches anything fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from varlen_workbench.kernels import _compat, caches

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
CACHES = KERNELS / "caches.py"

IMMUTABLE_BUILTINS = frozenset({"tuple", "frozenset", "range", "int", "float", "str", "bytes", "bool", "isinstance", "len"})
ALLOWED_CALLS = {
    "ContextVar": "a context variable is set per context and reset by token, never flipped in place (hopper.forward_config)",
    "TypeVar": "a typing construct",
    "constexpr": "a Triton compile-time constant (attention_kernels.py's LOG2E, LN2)",
    "pinned": "varlen/__init__.py's varlen_attention_fa4: a functools.partial of a pure function",
}
MUTATORS = frozenset(
    {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add", "discard"}
)
CACHE_DECORATORS = frozenset({"cache", "lru_cache"})

# (path relative to kernels/, name): why it stays, until its owner moves it.
EXEMPT = {
    ("varlen/backends/registry.py", "_REGISTRY"): "the backend registry: configuration that register() extends by design, "
    "not a cache (caches.reset() must keep the shipped backends)",
    ("replicas/torch_varlen.py", "_STALE"): "the replica's stale-memory switch, study code: process-wide by design "
    "(autograd's device thread reads it, which a ContextVar set in the caller's thread would not reach)",
}


def _name(node: ast.expr) -> str:
    """The last name of a callee or decorator: `functools.cache` -> 'cache', `lru_cache(1)` -> 'lru_cache'."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _immutable_classes(trees: dict[str, ast.Module]) -> set[str]:
    """Classes of kernels/ whose instances cannot change: frozen dataclasses and NamedTuples."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            frozen = any(
                isinstance(d, ast.Call)
                and _name(d) == "dataclass"
                and any(k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value for k in d.keywords)
                for d in node.decorator_list
            )
            if frozen or any(_name(base) == "NamedTuple" for base in node.bases):
                names.add(node.name)
    return names


def _module_statements(body: list[ast.stmt]):
    """The statements that run at import: the body and the blocks of its if/try/with, not functions or classes."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                yield from _module_statements(getattr(node, field, []))
        for handler in getattr(node, "handlers", []):
            yield from _module_statements(handler.body)


def violations(tree: ast.Module, immutable: set[str]) -> list[tuple[str, str]]:
    """(name, what) for each break of the rule (the module docstring) in one module."""
    found: list[tuple[str, str]] = []
    displays: set[str] = set()
    for node in _module_statements(tree.body):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            value = node.value
            if isinstance(value, ast.Call):
                callee = _name(value)
                if callee not in IMMUTABLE_BUILTINS and callee not in immutable and callee not in ALLOWED_CALLS:
                    found += [(name, f"assigned {callee}(...) at module level") for name in names]
            elif isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
                displays.update(names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found += [(name, "rebound by a `global` statement") for name in node.names]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [
                ("@cache", f"{node.name} memoized by functools") for d in node.decorator_list if _name(d) in CACHE_DECORATORS
            ]
        target = None
        if isinstance(node, (ast.Assign, ast.Delete, ast.AugAssign)):
            for t in node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                    target = t.value.id
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            if isinstance(node.func.value, ast.Name):
                target = node.func.value.id
        if target in displays:
            found.append((target, "a module-level container the module mutates"))
    return sorted(set(found))


def _trees() -> dict[str, ast.Module]:
    return {str(p.relative_to(KERNELS)): ast.parse(p.read_text(), str(p)) for p in sorted(KERNELS.rglob("*.py")) if p != CACHES}


def test_no_module_of_kernels_keeps_state_outside_the_caches_module():
    trees = _trees()
    assert len(trees) > 15 and "varlen/metadata.py" in trees  # the scan sees the package, not an empty folder
    immutable = _immutable_classes(trees)
    assert {"Tile", "ForwardConfig", "SafeLayout"} <= immutable
    found = {(path, name): what for path, tree in trees.items() for name, what in violations(tree, immutable)}
    unexpected = {key: what for key, what in found.items() if key not in EXEMPT}
    assert unexpected == {}, "module state outside kernels/caches.py (move it there, or memoize with caches.cached)"
    stale = set(EXEMPT) - set(found)
    assert stale == set(), "exemptions that nothing needs any more: drop them from EXEMPT"


PLANTED = """
import functools, threading
TUNER = Tuner()
LOCK = threading.Lock()
SEEN = {}
CONSTANT = {"a": 1}
FROZEN = Frozen(1)
counter = 0

def note(key):
    global counter
    counter += 1
    SEEN[key] = True

@functools.lru_cache(maxsize=None)
def slow(x):
    return x
"""


def test_the_rule_flags_every_planted_kind_of_state():
    """It cannot pass vacuously: each kind of state the rule names is caught in a planted module,
    and what is constant (a dict never mutated, a frozen instance) is not."""
    found = violations(ast.parse(PLANTED), {"Frozen"})
    assert found == [
        ("@cache", "slow memoized by functools"),
        ("LOCK", "assigned Lock(...) at module level"),
        ("SEEN", "a module-level container the module mutates"),
        ("TUNER", "assigned Tuner(...) at module level"),
        ("counter", "rebound by a `global` statement"),
    ]


def test_reset_clears_every_cache_and_keeps_the_open_blocks(monkeypatch):
    """On the caches module's own containers, swapped for fresh ones: the process's caches stay
    (op.pinned's callables keep their identity, which the audit reads)."""
    from varlen_workbench.kernels.varlen import fa4, launch, op

    assert {launch.native_tiles, _compat.device_capability, fa4.load, op.pinned} <= set(caches._CACHED)
    for name, empty in (("_CACHED", []), ("_INSTANCES", {}), ("_DERIVED", {}), ("LAST", caches.Memo())):
        monkeypatch.setattr(caches, name, empty)
    calls: list[int] = []

    @caches.cached
    def answer(x: int) -> int:
        calls.append(x)
        return x

    class Batch:
        pass

    batch = Batch()
    answer(1), answer(1)
    tuner, derived = launch.tuner(), caches.derived("b", batch, lambda: ["built"])
    assert launch.tuner() is tuner and caches.derived("b", batch, list) is derived and calls == [1]
    caches.LAST.get((), "x", lambda: "kept")
    forced = caches.FORCED.open
    caches.reset()
    answer(1)
    assert calls == [1, 1] and launch.tuner() is not tuner and caches.derived("b", batch, list) == []
    assert caches.LAST.value is None and caches.FORCED.open == forced


def test_the_default_device_follows_workbench_device_without_a_reimport(monkeypatch):
    monkeypatch.setenv("WORKBENCH_DEVICE", "cpu")
    assert _compat.default_device() == torch.device("cpu")
    monkeypatch.setenv("WORKBENCH_DEVICE", " CPU ")
    assert _compat.default_device() == torch.device("cpu")
    monkeypatch.delenv("WORKBENCH_DEVICE")
    assert _compat.default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert not hasattr(_compat, "DEVICE")  # nothing fixed at import


@pytest.mark.parametrize(
    "value, match",
    [
        ("gpu", r"WORKBENCH_DEVICE='gpu' is not one of \('cpu', 'cuda'\); unset it .* or set it to 'cpu' or 'cuda'"),
        pytest.param(
            "cuda",
            "WORKBENCH_DEVICE=cuda but torch sees no CUDA device .*; unset it or set WORKBENCH_DEVICE=cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA says"),
        ),
    ],
)
def test_a_bad_workbench_device_names_the_variable_and_the_fix(monkeypatch, value, match):
    monkeypatch.setenv("WORKBENCH_DEVICE", value)
    with pytest.raises(ValueError, match=match):
        _compat.default_device()
