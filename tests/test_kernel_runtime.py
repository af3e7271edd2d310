"""Where our kernels run (kernels/runtime.py): compiled for CUDA tensors, interpreted for CPU
tensors, decided per launch, in any import order, with nothing set or patched at import and
everything an interpreted launch changes restored."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction, InterpreterError
from triton.runtime.jit import JITFunction, KernelInterface

import varlen_workbench.kernels.runtime as runtime
from varlen_workbench.kernels.runtime import _first_tensor_on_cpu, interpreted, jit, use_interpreter

ROOT = Path(__file__).resolve().parent.parent


@jit
def _reduce(x):
    return tl.sum(x, 0) + tl.max(tl.zeros([16], tl.float32), 0)  # Triton's own @jit functions, nested


@jit
def _nested_kernel(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(X + i)
    for _ in range(0, tl.load(X).to(tl.int32) + 2):  # a runtime loop bound (numpy >= 2.4 needs the fix)
        x = x + 1
    tl.store(Y + i, x + _reduce(x))


@jit
def _failing(x):
    tl.static_assert(x.shape[0] == 1, "planted failure")  # raises when interpreted (16 rows)
    return x


@jit
def _failing_kernel(X, N: tl.constexpr):
    tl.store(X + tl.arange(0, N), _failing(tl.load(X + tl.arange(0, N))))


def _run_nested(device="cpu") -> torch.Tensor:
    x = torch.arange(16, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    _nested_kernel[(1,)](x, y, N=16)
    return y


EXPECTED = torch.arange(16, dtype=torch.float32) + 2 + sum(range(2, 18))  # two loop steps, then + sum(x)


# -- the per-device answer -----------------------------------------------------------------------


@pytest.fixture
def library_compiled(monkeypatch):
    """As where TRITON_INTERPRET=1 was not set before triton was imported (CI may set it)."""
    monkeypatch.setattr(runtime, "_LIBRARY_INTERPRETED", False)


def test_interpreted_on_the_cpu_compiled_on_cuda(library_compiled):
    for where in ("cpu", torch.device("cpu"), torch.zeros(1)):
        assert interpreted(where)
    for where in ("cuda", torch.device("cuda", 0), torch.zeros(1, device="meta")):
        assert not interpreted(where)


def test_use_interpreter_forces_every_device_and_ends_with_its_block(library_compiled):
    with use_interpreter():
        assert interpreted("cuda")
        with use_interpreter():
            assert interpreted("cuda")
        assert interpreted("cuda")  # the outer block is still open
    assert not interpreted("cuda")
    with pytest.raises(RuntimeError, match="planted"), use_interpreter():
        raise RuntimeError("planted")
    assert not interpreted("cuda")


def test_triton_interpret_forces_every_device_where_it_made_tritons_library_interpreted(monkeypatch):
    """TRITON_INTERPRET=1 before triton's import: Triton's library is interpreted, nothing can
    compile, every device is interpreted. Set afterwards, it changes nothing of ours."""
    monkeypatch.setattr(runtime, "_LIBRARY_INTERPRETED", True)
    assert interpreted("cuda")
    monkeypatch.setattr(runtime, "_LIBRARY_INTERPRETED", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not interpreted("cuda") and interpreted("cpu")


def test_a_launch_goes_where_its_first_tensor_is(monkeypatch, library_compiled):
    """Routing of `kernel[grid](...)`: the first tensor argument decides; a meta tensor stands in
    for a CUDA one (neither is on the CPU), both roads recorded instead of run."""
    roads = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: roads.append("compiled"))

    class Interpreter:
        def run(self, *args, **kwargs):
            roads.append("interpreted")

    monkeypatch.setattr(runtime, "_interpreted", lambda fn: Interpreter())
    on_meta, on_cpu = torch.zeros(16, device="meta"), torch.zeros(16)
    _nested_kernel[(1,)](on_meta, on_cpu, N=16)
    _nested_kernel[(1,)](on_cpu, on_meta, N=16)
    with use_interpreter():
        _nested_kernel[(1,)](on_meta, on_meta, N=16)
    assert roads == ["compiled", "interpreted", "interpreted"]
    assert _first_tensor_on_cpu((3, on_cpu, on_meta), {}) and _first_tensor_on_cpu((3,), {"X": on_cpu})
    assert not _first_tensor_on_cpu((3, on_meta, on_cpu), {}) and not _first_tensor_on_cpu((3,), {})


def test_use_interpreter_on_a_cpu_run():
    with use_interpreter():
        assert torch.equal(_run_nested(), EXPECTED)


# -- an interpreted launch restores everything ---------------------------------------------------

# What Triton's interpreter and our runtime touch during an interpreted launch.
WATCHED_CLASSES = (tl.tensor, tl.core.tensor_descriptor_base, tl.dtype, JITFunction, InterpretedFunction, KernelInterface)
WATCHED_MODULES = (tl, tl.core, tl.math, tl.standard, interpreter)


def _state() -> dict:
    classes = {cls: {name: getattr(cls, name) for name in dir(cls)} for cls in WATCHED_CLASSES}
    modules = {module: dict(vars(module)) for module in WATCHED_MODULES}
    return {"classes": classes, "modules": modules, "knobs": dict(vars(knobs.runtime)), "environ": dict(os.environ)}


def _changes(before: dict, after: dict) -> list[str]:
    """What differs. A module may gain names: Triton's interpreter copies its own globals into the
    module of every function it rewrites (its rewritten code needs them); nothing else."""
    found = [f"{key} differs" for key in ("knobs", "environ") if before[key] != after[key]]
    for cls, names in before["classes"].items():
        now = after["classes"][cls]
        found += [f"{cls.__name__}.{n}" for n in set(names) | set(now) if n not in now or n not in names or now[n] != names[n]]
    for module, names in before["modules"].items():
        now = after["modules"][module]
        found += [f"{module.__name__}.{n}" for n in names if n not in now or now[n] is not names[n]]
        found += [f"{module.__name__}.{n} added" for n in set(now) - set(names) if n not in vars(interpreter)]
    return found


@pytest.mark.parametrize("triton_interpret", [None, "1"], ids=["unset", "TRITON_INTERPRET=1 set after import"])
def test_an_interpreted_launch_restores_everything_it_changes(monkeypatch, triton_interpret):
    """Nested calls to Triton's library and ours, a runtime loop bound; then a failing launch.
    With TRITON_INTERPRET=1 set after triton was imported (as a post-mortem of an upstream library
    does), our kernels still run, and the variable keeps the value the process gave it."""
    if triton_interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", triton_interpret)
    before = _state()
    assert torch.equal(_run_nested(), EXPECTED)
    assert _changes(before, _state()) == []
    x = torch.zeros(16)
    with pytest.raises(InterpreterError, match="planted failure"):
        _failing_kernel[(1,)](x, N=16)
    assert _changes(before, _state()) == []


def test_native_compilation_after_interpreted_launches():
    """Compiling needs no GPU: an interpreted launch, then the same kernel compiled for sm_90 in
    this process (what leftover interpreter patches of triton.language would break)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert torch.equal(_run_nested(), EXPECTED)
    source = ASTSource(_nested_kernel, signature={"X": "*fp32", "Y": "*fp32", "N": "constexpr"}, constexprs={"N": 16})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert ".target sm_90a" in ptx or ".target sm_90" in ptx


# -- import order ---------------------------------------------------------------------------------


def _python(code: str, env: dict | None = None, timeout: float = 300) -> dict:
    """Runs `code` in a fresh interpreter from the repository root; returns the JSON of its last line."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env or dict(os.environ)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


TRAIN_A_STEP = """
import importlib.util, json, os, sys
import triton
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import is_kernels_available
environ = dict(os.environ)
import torch
import varlen_workbench.kernels.hf
from varlen_workbench.kernels.varlen.launch import tuner

from varlen_workbench.kernels.runtime import use_interpreter
name = varlen_workbench.kernels.hf.register()
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, attn_implementation=name)
torch.manual_seed(0)
model = LlamaForCausalLM(config)
ids = torch.randint(1, 64, (1, 12))
position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])  # two documents, packed
with use_interpreter():  # the Triton kernel, which "auto" leaves for the torch backend on the CPU
    loss = model(input_ids=ids, labels=ids, position_ids=position_ids, use_cache=False).loss
    loss.backward()
hub = importlib.util.find_spec("kernels")  # Hugging Face's, where transformers required it
print(json.dumps({
    "kernels_found_at": hub.origin if hub else None,
    "hf_kernels_available": is_kernels_available(),
    "loss": loss.item(),
    "grads_finite": all(bool(p.grad.isfinite().all()) for p in model.parameters()),
    "kernels": sorted({key[0] for key in tuner().chosen}),
    "environ": sorted(k for k in set(environ) | set(os.environ) if environ.get(k) != os.environ.get(k)),
}))
"""


def test_triton_then_transformers_then_the_project_trains_a_step_on_cpu():
    """The order that crashed: triton and transformers first, then `varlen_workbench.kernels.hf`, one training step
    of a tiny Llama through the swap on the CPU, from the repository root. The name `kernels` that
    transformers probes is Hugging Face's distribution where it is installed, never our folder."""
    env = {name: value for name, value in os.environ.items() if name not in ("TRITON_INTERPRET", "WORKBENCH_DEVICE")}
    found = _python(TRAIN_A_STEP, env)
    hub_installed = "kernels" in importlib.metadata.packages_distributions().get("kernels", [])
    assert found["hf_kernels_available"] is hub_installed, found
    if found["kernels_found_at"]:
        assert not Path(found["kernels_found_at"]).is_relative_to(ROOT / "kernels"), found
    assert found["grads_finite"] and found["kernels"] == ["dkdv", "dq", "forward"], found
    assert found["environ"] == [], found  # nothing set by kernels nor by the step


def test_importing_kernels_sets_nothing_and_patches_nothing():
    code = """
import json, os
import torch, triton, triton.language as tl
from triton import knobs
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction
watched = (tl, tl.core, tl.math, tl.standard, tl.tensor, interpreter, JITFunction, interpreter.InterpretedFunction, knobs.runtime)
def state():
    return [dict(vars(o)) for o in watched] + [dict(os.environ)]
before = state()
import varlen_workbench.kernels.varlen, varlen_workbench.kernels.hf, varlen_workbench.kernels.interpreter, varlen_workbench.kernels.replicas.dmattn, varlen_workbench.kernels.replicas.torch_varlen, varlen_workbench.kernels.varlen.tiles
after = state()
names = [getattr(o, "__name__", type(o).__name__) for o in watched] + ["os.environ"]
print(json.dumps([name for name, b, a in zip(names, before, after) if b != a]))
"""
    assert _python(code) == []


@pytest.mark.slow  # a fresh interpreter (torch, Triton, the project compiled): seconds; the full suite runs it
def test_triton_interpret_before_triton_keeps_everything_interpreted():
    """A user's TRITON_INTERPRET=1, set before triton is imported: Triton's own library is then
    interpreted, our kernels run interpreted too (forward and backward), and compiling for a GPU
    goes to a child process (`triton_library_interpreted`)."""
    code = """
import json, torch
from varlen_workbench.kernels.varlen import varlen_attention
from varlen_workbench.kernels.runtime import triton_library_interpreted
q = torch.randn(6, 2, 16, requires_grad=True); cu = torch.tensor([0, 2, 6], dtype=torch.int32)
varlen_attention(q, q, q, cu, cu, 4, 4, causal=True).sum().backward()
print(json.dumps({"library": triton_library_interpreted(), "finite": bool(q.grad.isfinite().all())}))
"""
    assert _python(code, os.environ | {"TRITON_INTERPRET": "1"}) == {"library": True, "finite": True}


# -- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_use_interpreter_runs_cuda_tensors_through_the_interpreter():
    """Forced, a bf16 tl.dot on CUDA tensors shows the interpreter's bug; compiled it is right."""
    from varlen_workbench.kernels.interpreter import check_dot, interpreter_bf16_dot_is_broken

    assert check_dot(torch.bfloat16, "cuda").correct and not check_dot(torch.bfloat16, "cuda").interpreted
    with use_interpreter():
        forced = check_dot(torch.bfloat16, "cuda")
        assert torch.equal(_run_nested("cuda").cpu(), EXPECTED)
    assert forced.interpreted and forced.correct == (not interpreter_bf16_dot_is_broken())


@pytest.mark.gpu
def test_one_process_interprets_cpu_tensors_and_compiles_cuda_ones():
    assert torch.equal(_run_nested("cpu"), EXPECTED)
    assert torch.equal(_run_nested("cuda").cpu(), EXPECTED)
    assert torch.equal(_run_nested("cpu"), EXPECTED)
