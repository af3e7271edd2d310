"""Which memory access of flash-sparse-attn's varlen call is misaligned (the audit's 'misaligned address').

    python scripts/fsa_misaligned.py [--ptx] [--fixed] [--json PATH]     # CPU: the Triton interpreter
    python scripts/fsa_misaligned.py --device cuda [--json PATH] [--sanitizer] [--no-autotune]
    python scripts/fsa_misaligned.py --checks tail-rows,gqa,... [--json PATH]   # CPU: the audit checks' calls
    python scripts/fsa_misaligned.py --workaround [--device cuda] [--json PATH]  # + the post-mortem's workaround

The H200 audit's first call of flash_sparse_attn's *_varlen_func (forward + backward) raised
`Triton Error [CUDA]: misaligned address` at a module load (`_init_handles`): a sticky error
from an earlier kernel. This script runs that call, and two controls, the way the audit's
`fsa-varlen` adapter makes it (THD tensors as they are, int32 cu_seqlens, is_causal=False,
softmax_scale=None, the library's defaults for everything else):

    audit     lengths (5, 3, 7), 3 TAIL query rows and 2 TAIL key rows (the audit's case)
    no-tail   lengths (5, 3, 7), no TAIL rows
    aligned   lengths (8, 4, 12), no TAIL rows: every cu_seqlens_q[b] and the row count a multiple of 4

each with 2 heads of 64, float16, through flash_dense_attn_varlen_func and flash_sparse_attn_varlen_func.
--fixed adds the fixed-length flash_dense_attn_func on a batch of 2 sequences of 7 and of 8
(its lse is (B, H, S): the same preprocess kernel, the same rule, at b * H * S + h * S floats).

CPU (the library imported for Triton's interpreter): the interpreter runs every kernel of the forward and the
backward, and every `tl.make_tensor_descriptor` is recorded where it is created (kernel, source
line, base address mod 16, strides in bytes) against Triton's own rule (its docstring: "base ...
must be 16-byte aligned", leading strides multiples of 16 bytes; the interpreter's
`TensorDescHandle.validate` asserts exactly that). Here a violation is recorded, not raised, so
the whole call runs; its outputs are compared with a float64 reference. The interpreter
harness (what stands in for CUDA in this process, the descriptor recording) is
postmortems/fsa_varlen_descriptors/upstream.py, which the fsa-varlen-descriptors post-mortem runs
too. The library's files are not changed.

GPU (--device cuda): each case in a fresh process (a fault loses the CUDA context) with
CUDA_LAUNCH_BLOCKING=1, so the error is raised at the launch of the kernel that faults; prints
where (forward or backward, the library's source line) and, from the tensors the backward
preprocess kernel receives, the address mod 16 of the lse descriptor each of its programs
builds, and whether a synchronization right after that kernel (everything before it having
finished) reports the fault. --sanitizer also runs the audit case under `compute-sanitizer --tool memcheck`.

--checks (CPU) replays, instead of the cases above, the first call each named audit check makes of
the `fsa-varlen` adapter in the H200 matrix (float16, head dim 64, the checks' native layouts; the
H200 cell of each records that call's error, each check having run in a fresh process): the
audit's own probe, forward and backward, under the interpreter, with the same recording.

--workaround adds both functions through the fsa-varlen-descriptors post-mortem's workaround
(`repacked`: empty sequences dropped, each sequence's queries padded at its start to a multiple of
4) on each of that post-mortem's calls, forward and backward against the float64 oracle: on CUDA,
each in a fresh process, whether it faults and whether REAL rows are within the bound.

--ptx (either device) compiles the backward preprocess kernel for sm_90 with Triton's bundled
compiler, no GPU needed, and counts its tensor-map (TMA) instructions: whether the lse
descriptor becomes a TMA descriptor on Hopper.

Needs only torch, triton, the flash-sparse-attn wheel (2.0.6) and this repository (run from its
root); triton_kernels, which flash_sparse_attn imports for its projection kernels only, is stubbed
when missing (varlen_workbench.workbench.upstream).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

# Imported where used, not here: the CPU run imports flash_sparse_attn for the interpreter, --ptx
# for compilation, and `triton.jit` decides once per module (--ptx compiles in a child process).

CASES = {
    "audit": ((5, 3, 7), 3, 2),
    "no-tail": ((5, 3, 7), 0, 0),
    "aligned": ((8, 4, 12), 0, 0),
}
FUNCTIONS = ("flash_dense_attn_varlen_func", "flash_sparse_attn_varlen_func")
# --fixed: the fixed-length function, batch 2, sequence length 7 (not a multiple of 4) and 8
FIXED = {"fixed-7": 7, "fixed-8": 8}
FIXED_FUNCTION = "flash_dense_attn_func"
HEADS, HEAD_DIM = 2, 64
H200_SMS = 132


# -- the call ------------------------------------------------------------------------------------


def inputs(case: str, device):
    """q, k, v (THD, fp16, requires grad; for a fixed-length case (B, S, H, D)), cu_seqlens_q/k
    (int32), max_seqlen_q/k, d_out."""
    import torch

    generator = torch.Generator().manual_seed(0)
    if case in FIXED:
        shape = (2, FIXED[case], HEADS, HEAD_DIM)
        q, k, v = (torch.randn(shape, generator=generator).to(torch.float16).to(device).requires_grad_() for _ in range(3))
        d_out = torch.randn(shape, generator=generator).to(torch.float16).to(device)
        cu = torch.arange(0, 3 * FIXED[case], FIXED[case], dtype=torch.int32)  # for the reference only
        return q, k, v, cu, cu, FIXED[case], FIXED[case], d_out
    lengths, tail_q, tail_k = CASES[case]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])

    def tensor(rows):
        x = torch.randn(rows, HEADS, HEAD_DIM, generator=generator).to(torch.float16)
        x[total:] = 0  # TAIL rows: zeros, as the audit's zero padding
        return x.to(device).requires_grad_()

    q, k, v = tensor(total + tail_q), tensor(total + tail_k), tensor(total + tail_k)
    d_out = torch.randn(q.shape, generator=generator).to(torch.float16).to(device)
    return q, k, v, cu.to(device), cu.to(device), max(lengths), max(lengths), d_out


def reference(q, k, v, cu, d_out):
    """float64 attention per sequence (not causal, scale 1/sqrt(D)): out, dq, dk, dv on real rows."""
    import torch

    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    outs = []
    bounds = cu.cpu().tolist()
    for start, end in zip(bounds, bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in leaves)
        p = torch.softmax(qs @ ks.transpose(1, 2) / HEAD_DIM**0.5, dim=-1)
        outs.append((p @ vs).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(d_out.cpu().double()[: out.shape[0]])
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


LSE_BASES: list[dict] = []  # what the backward preprocess kernel is given (filled by the hook)


def hook_preprocess(fsa_triton):
    """Records, at each launch of the backward preprocess kernel, the address mod 16 of the lse
    descriptor base every program (batch b, head h) builds: LSE + h * lse.stride(0) + cu_seqlens_q[b]
    float32 elements for varlen (flash_bwd_preprocess.py, `lse_base` with USE_PADDED=False),
    LSE + b * lse.stride(0) + h * lse.stride(1) for fixed length."""
    module = fsa_triton.flash_bwd_preprocess
    original = module._flash_attn_bwd_preprocess

    def recorded(*args, **kwargs):
        import torch

        lse, cu = kwargs["lse"], kwargs.get("cu_seqlens_q")
        if cu is None:  # fixed length: lse (B, H, S), program (b, h) at b * stride(0) + h * stride(1)
            batch, heads, head_stride = lse.shape[0], lse.shape[1], lse.stride(1)
            starts = [b * lse.stride(0) for b in range(batch)]
            if lse.is_cuda:
                torch.cuda.synchronize()  # everything before this kernel has finished
        else:  # varlen: lse (H, total_q), program (b, h) at h * stride(0) + cu_seqlens_q[b]
            heads, head_stride = lse.shape[0], lse.stride(0)
            starts = cu.tolist()[:-1]  # on a GPU this synchronizes too: everything before has finished
        launch = {
            "lse_shape": list(lse.shape),
            "lse_data_ptr_mod16": lse.data_ptr() % 16,
            "base_mod16": {
                f"b{b} h{h}": (lse.data_ptr() + lse.element_size() * (h * head_stride + s)) % 16
                for h in range(heads)
                for b, s in enumerate(starts)
            },
        }
        LSE_BASES.append(launch)
        result = original(*args, **kwargs)
        if lse.is_cuda:  # the preprocess kernel alone between two synchronizations: did it fault?
            try:
                torch.cuda.synchronize()
                launch["synchronize_after_it"] = "ok"
            except Exception as exc:
                launch["synchronize_after_it"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                raise
        return result

    module._flash_attn_bwd_preprocess = recorded


def run_call(fsa, function: str, case: str, device) -> dict:
    """The adapter's call (forward, then backward), stage by stage; on CPU with the reference."""
    import torch

    q, k, v, cu_q, cu_k, max_q, max_k, d_out = inputs(case, device)
    found: dict = {"function": function, "case": case, "q_shape": list(q.shape), "cu_seqlens_q": cu_q.tolist()}
    found["inputs"] = {
        n: {
            "data_ptr_mod16": t.data_ptr() % 16,
            "row_stride_bytes": t.stride(0) * t.element_size(),
            "contiguous": t.is_contiguous(),
        }
        for n, t in (("q", q), ("k", k), ("v", v))
    }
    fn = getattr(fsa, function)
    stage = "forward"
    varlen = case not in FIXED
    try:
        if varlen:
            out = fn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, softmax_scale=None, **CALL_EXTRA)
        else:
            out = fn(q, k, v, is_causal=False, softmax_scale=None, **CALL_EXTRA)
        if device.type == "cuda":
            torch.cuda.synchronize()
        stage = "backward"
        out.backward(d_out)
        if device.type == "cuda":
            torch.cuda.synchronize()
        stage = "done"
    except Exception as exc:  # the finding: where, and what
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "flash_sparse_attn" in f.filename]
        found["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        found["library_frames"] = [f"{f.filename.split('flash_sparse_attn/')[-1]}:{f.lineno} {f.name}" for f in frames[-3:]]
    found["stage"] = stage
    found["preprocess_lse_bases"] = list(LSE_BASES)
    LSE_BASES.clear()
    if stage == "done" and device.type == "cpu":
        thd = (lambda t: t) if varlen else (lambda t: t.reshape(-1, HEADS, HEAD_DIM))  # (B, S) -> packed rows
        ref = reference(thd(q), thd(k), thd(v), cu_q, thd(d_out))
        rows = {"out": int(cu_q[-1]), "dq": int(cu_q[-1]), "dk": int(cu_k[-1]), "dv": int(cu_k[-1])}
        got = {"out": thd(out.detach()), "dq": thd(q.grad), "dk": thd(k.grad), "dv": thd(v.grad)}
        found["max_abs_error_vs_float64"] = {n: float((got[n][: rows[n]].double() - ref[n][: rows[n]]).abs().max()) for n in got}
    return found


CALL_EXTRA: dict = {}


# -- CPU: the interpreter, with every descriptor recorded (varlen_workbench.postmortems.fsa_varlen_descriptors.upstream) --


def load(device: str):
    """flash_sparse_attn, ready to run on `device` (on the CPU: under the interpreter), with the
    backward preprocess launches recorded."""
    from varlen_workbench.postmortems.fsa_varlen_descriptors.upstream import load as load_fsa

    fsa = load_fsa(device)
    hook_preprocess(importlib.import_module("flash_sparse_attn.ops.triton"))
    return fsa


def one(fsa, function: str, case: str, device: str) -> dict:
    import torch

    from varlen_workbench.postmortems.fsa_varlen_descriptors.upstream import recorded_descriptors, summarize_descriptors

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"  # before any fault
    with recorded_descriptors() as records:
        found = run_call(fsa, function, case, torch.device(device))
    found["device"] = name
    if device == "cpu":
        found["descriptors"] = summarize_descriptors(records)
    found["versions"] = {
        "torch": torch.__version__,
        "triton": importlib.import_module("triton").__version__,
        "flash_sparse_attn": fsa.__version__,
    }
    return found


def one_check(fsa, function: str, check: str) -> dict:
    """`first_call` run under the interpreter: where it stops, the lse bases, every descriptor."""
    import torch

    from varlen_workbench.postmortems.fsa_varlen_descriptors.audit import first_call
    from varlen_workbench.postmortems.fsa_varlen_descriptors.upstream import recorded_descriptors, summarize_descriptors
    from varlen_workbench.workbench.audit.checks import Context

    ctx, case, kwargs = first_call(check, function)
    found: dict = {"function": function, "case": f"check {check}", "layout": case.label(), "probe_kwargs": kwargs}
    cu_q = torch.tensor([0, *torch.tensor(case.real_lengths("q")).cumsum(0).tolist()])
    found["cu_seqlens_q"], found["q_shape"] = cu_q.tolist(), [int(cu_q[-1]) + case.tail_q, case.heads, case.head_dim]
    with recorded_descriptors() as records:
        try:
            Context.probe(ctx, case, reference=False, **{k: v for k, v in kwargs.items() if k != "reference"})
            found["stage"] = "done"
        except Exception as exc:  # what the interpreter itself refuses, beside the recorded descriptors
            found["stage"] = "raised"
            found["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if "flash_sparse_attn" in f.filename]
            found["library_frames"] = [f"{f.filename.split('flash_sparse_attn/')[-1]}:{f.lineno} {f.name}" for f in frames[-3:]]
    found["preprocess_lse_bases"] = list(LSE_BASES)
    LSE_BASES.clear()
    found["descriptors"] = summarize_descriptors(records)
    found["device"] = "cpu (Triton interpreter)"
    return found


WORKAROUND = "workaround:"  # a case name so prefixed: the page's workaround on that call of the post-mortem


def one_workaround(fsa, function: str, name: str, device: str) -> dict:
    """The post-mortem's call `name` through the workaround (`repacked`: empty sequences dropped,
    queries padded at the start to a multiple of 4), forward and backward, against the float64 oracle."""
    import torch

    from varlen_workbench.postmortems.fsa_varlen_descriptors.cases import NAMED
    from varlen_workbench.postmortems.fsa_varlen_descriptors.study import contract, repacked
    from varlen_workbench.workbench.layout import pack
    from varlen_workbench.workbench.probes import probe

    case = NAMED[name]
    found: dict = {"function": function, "case": WORKAROUND + name, "layout": case.label()}
    found["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    try:
        called = functools.partial(getattr(fsa, function), **CALL_EXTRA)  # --no-autotune as for the bare calls
        record = probe(contract(repacked(called)), pack(case, device), name="workaround")
        if device == "cuda":
            torch.cuda.synchronize()
        found["stage"] = "done"
        found["real_within_bound"], found["padding_exactly_zero"] = record.real_within_bound, record.padding_exactly_zero
        found["error_over_fp16s"] = {n: e.ratio for n, e in record.errors.items()}
    except Exception as exc:  # a fault of the workaround's call: the finding
        found["stage"] = "raised"
        found["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return found


def calls(args) -> list[tuple[str, str]]:
    """(function, case) pairs: both varlen functions on each case, then (--fixed) the fixed-length ones,
    then (--workaround) both through the workaround on each of the post-mortem's calls."""
    from varlen_workbench.postmortems.fsa_varlen_descriptors.cases import NAMED

    pairs = [(function, case) for function in FUNCTIONS for case in args.cases]
    pairs += [(FIXED_FUNCTION, case) for case in FIXED] if args.fixed else []
    return pairs + ([(function, WORKAROUND + name) for function in FUNCTIONS for name in NAMED] if args.workaround else [])


def one_call(fsa, function: str, case: str, device: str) -> dict:
    if case.startswith(WORKAROUND):
        return one_workaround(fsa, function, case.removeprefix(WORKAROUND), device)
    return one(fsa, function, case, device)


def in_process(args) -> list[dict]:
    """CPU: every call in this process (the interpreter loses no context)."""
    fsa = load("cpu")
    if args.checks:
        return [one_check(fsa, function, check) for function in FUNCTIONS for check in args.checks]
    return [one_call(fsa, function, case, "cpu") for function, case in calls(args)]


# -- GPU: one fresh process per call ---------------------------------------------------------------


def isolated(args) -> list[dict]:
    """Each call in a fresh process (natively a fault loses the CUDA context), with
    CUDA_LAUNCH_BLOCKING=1 so that a fault is raised at the launch of the kernel that made it."""
    results = []
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    for function, case in calls(args):
        command = [sys.executable, __file__, "--device", args.device, "--one", function, case]
        command += ["--no-autotune"] if args.no_autotune else []
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        results.append(
            json.loads(lines[-1])
            if lines
            else {
                "function": function,
                "case": case,
                "rc": done.returncode,
                "output": (done.stdout + done.stderr).strip().splitlines()[-12:],
            }
        )
    if args.sanitizer and args.device == "cuda":
        exe = shutil.which("compute-sanitizer") or next(
            (
                p
                for p in ("/usr/local/cuda/bin/compute-sanitizer", "/opt/nvidia/compute-sanitizer/compute-sanitizer")
                if Path(p).exists()
            ),
            None,
        )
        if exe is None:
            results.append({"sanitizer": "compute-sanitizer is not installed on this machine"})
        else:
            command = [
                exe,
                "--tool",
                "memcheck",
                "--leak-check",
                "no",
                "--print-limit",
                "10",
                sys.executable,
                __file__,
                "--device",
                "cuda",
                "--one",
                FUNCTIONS[0],
                "audit",
            ] + (["--no-autotune"] if args.no_autotune else [])
            done = subprocess.run(
                command,
                env={**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            results.append(
                {
                    "sanitizer": "memcheck",
                    "case": "audit",
                    "function": FUNCTIONS[0],
                    "rc": done.returncode,
                    "report": [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("=========")][:40],
                }
            )
    return results


# -- what the backward preprocess kernel compiles to on Hopper (no GPU needed) ----------------------


def hopper_ptx() -> dict:
    """Compiles flash_bwd_preprocess's kernel for sm_90 (Triton's bundled compiler, no GPU), with the
    audit call's arguments (18 query rows, 2 heads of 64, fp16, 64 x 64 tiles), and lists its tensor
    map (TMA) instructions: whether the lse descriptor is a TMA descriptor there."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from varlen_workbench.workbench.upstream import import_module

    import_module("flash_sparse_attn", stub={"triton_kernels": "flash_sparse_attn"}, for_interpreter=False)
    from flash_sparse_attn.ops.triton import flash_bwd_preprocess

    kernel = flash_bwd_preprocess._bwd_preprocess_kernel._kernel  # under cache_utils.CachedKernel
    names = kernel.arg_names
    pointers = {"Out": "*fp16", "dO": "*fp16", "dPsum": "*fp32", "LSE": "*fp32", "LSELog2": "*fp32", "dQaccum": "*fp32"}
    pointers["cu_seqlens_q"] = "*i32"
    rows_padded = 384  # total_q_rounded_padded for 18 rows, batch 3: ceil((18 + 3 * 128) / 128) * 128
    values = {
        "stride_ob": 0, "stride_oh": 64, "stride_om": 128, "stride_dob": 0, "stride_doh": 64, "stride_dom": 128,
        "stride_pb": 0, "stride_ph": rows_padded, "stride_pm": 1, "stride_lb": 0, "stride_lh": 18, "stride_lm": 1,
        "stride_l2b": 0, "stride_l2h": rows_padded, "stride_l2m": 1, "stride_dqab": 0, "stride_dqah": rows_padded * 64,
        "stride_dqam": 64, "seqused_q": None, "seqlen_q": 7, "head_dim": 64, "head_dim_rounded": 64,
        "HAS_CU_SEQLENS_Q": True, "HAS_SEQUSED_Q": False, "TILE_M": 64, "TILE_K": 64,
    }  # fmt: skip
    signature, constants, attributes = {}, {}, {}
    for i, name in enumerate(names):
        value = values.get(name)
        if name in pointers:
            signature[name] = pointers[name]
            attributes[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif value is None or isinstance(value, bool) or value in (0, 1) or name.isupper():
            signature[name] = "constexpr"  # as Triton specializes them at launch
            constants[(i,)] = value
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attributes[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attributes), target=GPUTarget("cuda", 90, 32)
    )
    ptx = compiled.asm["ptx"]
    return {
        "target": "cuda sm_90",
        "tensormaps_built_in_kernel": len(re.findall(r"tensormap\.replace\.tile\.global_address", ptx)),
        "tma_loads_1d": len(re.findall(r"cp\.async\.bulk\.tensor\.1d\.shared::cluster\.global", ptx)),
        "tma_loads_2d": len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global", ptx)),
        "tma_stores_1d": len(re.findall(r"cp\.async\.bulk\.tensor\.1d\.global\.shared", ptx)),
        "tma_stores_2d": len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ptx)),
    }


def hopper_ptx_in_subprocess(timeout: int) -> dict:
    """`hopper_ptx` in a fresh process without TRITON_INTERPRET, whose flash_sparse_attn is imported for
    compilation (this process's may be imported for the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, "--ptx-only"], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"target": "cuda sm_90", "error": (done.stdout + done.stderr).strip().splitlines()[-5:]}
    return json.loads(lines[-1])


# -- output --------------------------------------------------------------------------------------------


def print_results(results: list[dict]) -> None:
    for r in results:
        if "target" in r:
            print(f"\nbackward preprocess kernel compiled for {r['target']}: {r}")
            continue
        if "sanitizer" in r:
            print(f"\ncompute-sanitizer {r.get('sanitizer')} on {r.get('function')} / {r.get('case')} (rc {r.get('rc')}):")
            for line in r.get("report", []):
                print("  " + line)
            continue
        print(
            f"\n{r['function']} / {r['case']}:"
            + (f" q {r['q_shape']}" if "q_shape" in r else "")
            + (f" {r['layout']}" if "layout" in r else "")
            + (f", cu_seqlens_q {r['cu_seqlens_q']}" if "cu_seqlens_q" in r and (r["case"] in CASES or "layout" in r) else "")
            + f": reached {r.get('stage', '?')}"
            + (f", raised {r['error']} at {r.get('library_frames')}" if "error" in r else "")
        )
        if "output" in r:
            print("  (no record) " + " | ".join(r["output"]))
        for launch in r.get("preprocess_lse_bases", []):
            bad = {p: m for p, m in launch["base_mod16"].items() if m}
            print(
                f"  backward preprocess: lse {launch['lse_shape']} fp32; lse descriptor base mod 16 per program: {launch['base_mod16']}"
                + (f" -> {len(bad)} of {len(launch['base_mod16'])} not 16-byte aligned" if bad else " -> all aligned")
                + (f"; synchronize right after it: {launch['synchronize_after_it']}" if "synchronize_after_it" in launch else "")
            )
        for d in r.get("descriptors", []):
            flag = f"  VIOLATION: {d['violation']}" if "violation" in d else ""
            if d.get("zero_extent"):
                flag += f"  ZERO EXTENT: {d['zero_extent']} programs, {d['zero_extent_accesses']} loads/stores through them"
            print(f"  {d['kernel']:<24} {d['site']:<32} strides {d['strides_bytes']!s:<10} base mod 16 {d['base_mod16']}{flag}")
        if "real_within_bound" in r:
            print(
                f"  workaround: REAL rows within the bound {r['real_within_bound']}, padding exactly 0 "
                f"{r['padding_exactly_zero']}; error / fp16's: {r['error_over_fp16s']}"
            )
        if "max_abs_error_vs_float64" in r:
            print(
                "  max |error| vs float64 on real rows: "
                + ", ".join(f"{n} {e:.2g}" for n, e in r["max_abs_error_vs_float64"].items())
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--sanitizer", action="store_true", help="GPU: also run the audit case under compute-sanitizer memcheck")
    parser.add_argument("--no-autotune", action="store_true", help="GPU: is_autotune=False (64 x 64 tiles, no autotuning sweep)")
    parser.add_argument("--timeout", type=int, default=240, help="GPU: seconds per process (default 240)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"which cases (default {','.join(CASES)})")
    parser.add_argument("--checks", default="", help="CPU: replay the first call of these audit checks instead (comma-separated)")
    parser.add_argument("--fixed", action="store_true", help=f"also {FIXED_FUNCTION} at sequence lengths 7 and 8")
    parser.add_argument(
        "--workaround", action="store_true", help="also both functions through the fsa-varlen-descriptors workaround"
    )
    parser.add_argument("--isolate", action="store_true", help="CPU: each call in its own process, as on the GPU")
    parser.add_argument("--ptx", action="store_true", help="also compile the preprocess kernel for sm_90, list its TMA ops")
    parser.add_argument("--ptx-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one", nargs=2, metavar=("FUNCTION", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.cases = args.cases.split(",")
    args.checks = [c for c in args.checks.split(",") if c]
    if args.checks and (args.device != "cpu" or args.isolate):
        parser.error("--checks runs on the CPU (on CUDA, `varlen-workbench audit --checks` is the replay)")
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    if args.no_autotune:
        CALL_EXTRA["is_autotune"] = False
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("fsa_misaligned: --device cuda needs a CUDA device", file=sys.stderr)
            return 2
    if args.ptx_only:
        print(json.dumps(hopper_ptx()), flush=True)
        return 0
    if args.one:
        print(json.dumps(one_call(load(args.device), *args.one, args.device)), flush=True)  # before a faulted context's exit
        return 0
    results = isolated(args) if args.device == "cuda" or args.isolate else in_process(args)
    if args.ptx:
        results.append(hopper_ptx_in_subprocess(args.timeout))
    print_results(results)
    if args.json:  # provenance as every record has it (on a GPU machine, WORKBENCH_COMMIT names the commit)
        from varlen_workbench.workbench.records import write_record

        write_record(args.json, {"results": results}, command=shlex.join(["python", "scripts/fsa_misaligned.py", *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
