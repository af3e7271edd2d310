"""Where a launch of our Triton kernels runs: compiled for CUDA tensors, through Triton's CPU
interpreter for CPU tensors. Decided per launch, from the tensors; nothing is decided or changed
when `kernels` is imported.

Why not `triton.jit`: Triton decides once, when a function is decorated, whether it is compiled
(a `JITFunction`) or interpreted (an `InterpretedFunction`), by reading TRITON_INTERPRET; its
own library (`tl.sum`, `tl.zeros`, the reductions' combine functions) is decorated when triton
is imported. So a process that imported triton (transformers does) before setting the variable
cannot interpret a kernel that calls Triton's library, and one that set it cannot compile any. Our kernels are decorated
with `jit` below instead: a `JITFunction` (the compiler and nested calls see what they always
see) whose launch picks

- the interpreter when its first tensor argument is on the CPU, or when the interpreter is
  forced: inside `use_interpreter()`, or where TRITON_INTERPRET=1 was set before triton was
  imported (Triton's own switch: its library is then interpreted, so nothing can compile).
  Forced, CUDA tensors are interpreted too: the interpreter copies them to the host and back;
- compilation otherwise (CUDA tensors), as `triton.jit` would.

`interpreted(device)` gives the same answer to code around the kernels (tile choice, the bf16
`tl.dot` workaround, ...).

An interpreted launch runs inside `interpreting()`, which makes Triton's interpreter work in
this process whatever was imported first, and undoes all of it on exit, exceptions included.
While it runs, these are process-wide (Triton's interpreter is: it patches `triton.language`
for every thread during a launch): `JITFunction.__call__`, `InterpretedFunction.__call__`, the
interpreter's `_patch_lang` and `_patch_lang_tensor`, and `triton.knobs.runtime.interpret`
(True, which also puts TRITON_INTERPRET=1 in `os.environ`). Interpreted launches therefore take
one lock, one at a time; another thread must not decorate, compile or launch natively meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from triton import knobs
from triton.language import standard
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from varlen_workbench.kernels.caches import FORCED, INTERPRETING, cached

# A fact about this process, fixed when triton was imported, not a choice: with TRITON_INTERPRET=1
# then, Triton decorated its own library (`tl.zeros`, ...) for the interpreter.
_LIBRARY_INTERPRETED: bool = not isinstance(standard.zeros, JITFunction)


class InterpretableJITFunction(JITFunction):
    """A `JITFunction` whose every launch (`kernel[grid](...)`, `run`, `warmup`) is compiled or
    interpreted, by `interpreted` applied to its first tensor argument."""

    def run(self, *args, grid, warmup, **kwargs):
        return self._launch(grid, warmup, args, kwargs)

    def __getitem__(self, grid):
        # Triton's `__getitem__` without its detour through `run`: a compiled launch then costs about
        # 0.2 us of host time more than one of `triton.jit` (which takes tens of microseconds).
        return lambda *args, **kwargs: self._launch(grid, False, args, kwargs)

    def _launch(self, grid, warmup: bool, args: tuple, kwargs: dict):
        if FORCED.open or _LIBRARY_INTERPRETED or _first_tensor_on_cpu(args, kwargs):
            with interpreting():
                return _interpreted(self.fn).run(*args, grid=grid, warmup=warmup, **kwargs)
        return JITFunction.run(self, *args, grid=grid, warmup=warmup, **kwargs)


def jit(fn: Callable | None = None, **options: Any) -> Any:
    """`triton.jit` for our kernels, with the same options (`do_not_specialize=`, ...): the
    function is compiled or interpreted per launch (`InterpretableJITFunction`)."""
    if fn is None:
        return functools.partial(jit, **options)
    return InterpretableJITFunction(fn, **options)


@contextlib.contextmanager
def use_interpreter() -> Iterator[None]:
    """Inside the block our kernels run through Triton's interpreter on every device, CUDA
    tensors included (copied to the host and back: slow, but it shows what the interpreter
    computes on a GPU machine). Process-wide while the block is open, not per thread, because
    autograd runs the backward pass of CUDA tensors in threads of its own (the count of open
    blocks is `caches.FORCED`)."""
    with FORCED.lock:
        FORCED.open += 1
    try:
        yield
    finally:
        with FORCED.lock:
            FORCED.open -= 1


def interpreter_forced() -> bool:
    """Whether CUDA tensors are interpreted too: inside `use_interpreter()`, or where Triton's
    library is interpreted (`triton_library_interpreted`). TRITON_INTERPRET=1 set after triton
    was imported forces nothing: our kernels keep the per-device rule."""
    return FORCED.open > 0 or _LIBRARY_INTERPRETED


def interpreted(where: torch.Tensor | torch.device | str) -> bool:
    """Whether our kernels run through Triton's interpreter for tensors on `where` (a device or
    a tensor): on the CPU always, on CUDA (or any other device) only where `interpreter_forced()`."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    return device.type == "cpu" or interpreter_forced()


def triton_library_interpreted() -> bool:
    """Whether Triton's own library (`tl.zeros`, ...) was decorated for its interpreter, as it is
    when TRITON_INTERPRET=1 was set before triton was imported: then nothing that calls it can
    be compiled in this process."""
    return _LIBRARY_INTERPRETED


def _first_tensor_on_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether a launch's first tensor argument is on the CPU (a launch is on one device).
    Cheap: a native launch pays for one `isinstance` and one `is_cpu`."""
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.is_cpu
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return value.is_cpu
    return False


@cached
def _interpreted(fn: Callable) -> InterpretedFunction:
    """Triton's interpreter for the Python function `fn` (ours, or one of Triton's library)."""
    return InterpretedFunction(fn)


@contextlib.contextmanager
def interpreting() -> Iterator[None]:
    """Inside the block Triton's interpreter runs kernels in this process whatever was imported
    first: what every interpreted launch of ours runs in, and what code launching another
    library's interpreted kernels can use (`decorating_for_interpreter`). On exit everything is
    as it was, exceptions included. Reentrant; one thread at a time (module docstring), under
    `caches.INTERPRETING`'s lock."""
    with INTERPRETING.lock:
        outermost = INTERPRETING.open == 0
        INTERPRETING.open += 1
        try:
            with _interpreter_patches() if outermost else contextlib.nullcontext():
                yield
        finally:
            INTERPRETING.open -= 1


@contextlib.contextmanager
def _interpreter_patches() -> Iterator[None]:
    """What `interpreting()` changes, restored in reverse order on exit.

    - A `JITFunction` called from interpreted code (Triton's `tl.sum`, a helper of ours) runs
      interpreted, as it would had it been decorated under TRITON_INTERPRET=1.
    - Every nested call's patches of `triton.language` are undone when it returns: Triton's
      interpreter applies them on each nested call and never restores them (harmless where
      everything is interpreted forever; here a later native compilation would read them).
    - `knobs.runtime.interpret` reads True (`constexpr_function` asks it), through
      `knobs.runtime.scope()`, which restores the knobs and their environment variables.
    - Runtime loop bounds work under numpy >= 2.4 (`_squeezing_index`).
    """
    patch_lang, patch_lang_tensor = interpreter._patch_lang, interpreter._patch_lang_tensor
    jit_call, interpreted_call = JITFunction.__call__, InterpretedFunction.__call__
    opened: list = []  # every _patch_lang scope opened inside, in order

    def recording_patch_lang(fn):
        scope = patch_lang(fn)
        opened.append(scope)
        return scope

    def nested_call(self, *args, **kwargs):
        function = self if isinstance(self, InterpretedFunction) else _interpreted(self.fn)
        mark = len(opened)
        try:
            return interpreted_call(function, *args, **kwargs)
        finally:
            while len(opened) > mark:
                opened.pop().restore()

    with knobs.runtime.scope():
        knobs.runtime.interpret = True
        interpreter._patch_lang = recording_patch_lang
        JITFunction.__call__ = nested_call
        InterpretedFunction.__call__ = nested_call
        if _numpy_rejects_int_of_arrays():
            interpreter._patch_lang_tensor = _squeezing_index(patch_lang_tensor)
        try:
            yield
        finally:
            interpreter._patch_lang_tensor = patch_lang_tensor
            InterpretedFunction.__call__ = interpreted_call
            JITFunction.__call__ = jit_call
            interpreter._patch_lang = patch_lang
            while opened:  # already restored by their launches; a no-op unless one was cut short
                opened.pop().restore()


@cached
def _numpy_rejects_int_of_arrays() -> bool:
    """numpy >= 2.4 refuses `int()` of a 1-element array ("only 0-dimensional arrays can be converted")."""
    import numpy as np

    try:
        int(np.zeros(1, dtype=np.int32))
    except TypeError:
        return True
    return False


def _squeezing_index(patch_lang_tensor: Callable) -> Callable:
    """Lets interpreted kernels use runtime loop bounds (`range(lo, hi)`) under numpy >= 2.4.

    The interpreter holds scalars as 1-element arrays and converts them with `int(array)`,
    which numpy 2.4 rejects, so every loop with a tensor bound fails (triton-lang/triton#9171;
    fixed upstream after triton 3.6 by squeezing first). `while` loops would dodge it but
    forfeit native software pipelining.
    """

    def patch_tensor_squeezing_index(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    return patch_tensor_squeezing_index


class _LaunchedInterpreted(InterpretedFunction):
    """An `InterpretedFunction` whose launches run inside `interpreting()`."""

    def run(self, *args, **kwargs):
        with interpreting():
            return super().run(*args, **kwargs)


@contextlib.contextmanager
def decorating_for_interpreter() -> Iterator[None]:
    """Inside the block `@triton.jit` makes functions that Triton's interpreter runs, as under
    TRITON_INTERPRET=1, and whose launches run inside `interpreting()`: how a post-mortem imports
    an upstream Triton library to run it on CPU tensors, whatever this process imported first.
    Functions decorated outside the block, and modules imported before it, are unchanged."""
    decorated_as = interpreter.InterpretedFunction  # what `triton.jit` builds under the interpreter
    with knobs.runtime.scope():
        knobs.runtime.interpret = True
        interpreter.InterpretedFunction = _LaunchedInterpreted
        try:
            yield
        finally:
            interpreter.InterpretedFunction = decorated_as
