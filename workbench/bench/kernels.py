"""Speed and memory of the fixed kernel against the attention a torch user can pick, side by side.

Every configuration is timed in one process with CUDA events after warm-up, calls back to back
(no host sync between them, as in training), for: our kernel (validate=False; also with
validate=True, and the whole forward+backward step captured in a CUDA graph and replayed);
FlashAttention-4 alone and behind our contract wrapper (`backend="fa4"`), where it is installed;
torch `varlen_attn` (FlashAttention-2); SDPA on the dense padded batch (default backend, and
the cuDNN and flash backends forced where they accept the call), only where the batch is
near-equal-length (dense padding of a long-tailed mix would time mostly padding); FlexAttention
with a document mask (compiled; the window too for the sliding-window workload). Throughput
counts only real work, per document: 4*h*d*sum(s_i^2) FLOPs forward, halved when causal
(exact visible pairs under a sliding window), and 3.5x that for forward+backward. Ratios are
peer time / our time measured in the same run, so a noisy machine shifts both alike.

CUDA only; `python -m varlen_workbench.workbench.bench.kernels --record FILE` or `varlen-workbench bench`. The committed
records (data/gpu/bench-*.json, `varlen_workbench.workbench.bench.kernel_record`) are read back on any
machine by `varlen_workbench.workbench.records.load_records("bench-*.json", how=RECORD_COMMAND)`, and judged,
tabled and plotted by `varlen_workbench.workbench.bench.kernel_report` (the performance notebook).
"""

from __future__ import annotations

import argparse
import inspect
import shlex
import sys
from collections.abc import Callable

import torch

from varlen_workbench.workbench.bench.kernel_record import Row, Timing, set_peer_ratios, to_record, variant
from varlen_workbench.workbench.bench.kernel_report import format_table, targets
from varlen_workbench.workbench.bench.verdict import format_targets
from varlen_workbench.workbench.bench.workloads import Workload, workloads
from varlen_workbench.workbench.layout import Case, pack, thd_to_bshd
from varlen_workbench.workbench.records import write_record
from varlen_workbench.workbench.timing import MIN_ITERS, time_call


def _compile_candidates(case: Case, index: int, device: str = "cuda", window: tuple[int, int] = (-1, -1)) -> None:
    """Runs forward+backward of a small batch of `case`'s kernel class with candidate `index`
    of every kernel pinned: Triton compiles, and caches on disk, what the tuner will time."""
    from varlen_workbench.kernels.varlen import varlen_attention
    from varlen_workbench.kernels.varlen.launch import candidate_tiles, tuner
    from varlen_workbench.kernels.varlen.tuner import NATIVE_TILES

    dtype = case.torch_dtype
    tiles = {k: candidate_tiles(k, case.head_dim, dtype, torch.device(device)) for k in NATIVE_TILES}
    # 256 rows: every stride keeps the 16-divisibility the benchmark's layouts have, so the
    # compiled specializations are the ones the timed process loads.
    small = case.with_(seqlens_q=(200, 56), seqlens_k=None, padded_q=None, padded_k=None, align=None, tail_q=0, tail_k=0)
    with tuner().pinned(**{k: t[min(index, len(t) - 1)] for k, t in tiles.items()}):
        pack(small, device=device).call(varlen_attention, validate=False, window_size=window, backend="triton").sum().backward()


def precompile(chosen: list[Workload], jobs: int) -> None:
    """Compiles our kernel's candidate tiles for every kernel class of `chosen` in `jobs`
    processes. In-process tuning compiles them one after another (4 tiles x 3 kernels per
    head dim and mask: minutes for the full set); afterwards it only loads and times them."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from varlen_workbench.kernels.varlen.tuner import NATIVE_TILES

    classes = {(w.case.head_dim, w.case.heads, w.case.kv_heads, w.case.dtype, w.case.causal, w.window): w for w in chosen}
    most = max(len(t) for by_bytes in NATIVE_TILES.values() for t in by_bytes.values())
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs_ = [pool.submit(_compile_candidates, w.case, i, "cuda", w.window) for w in classes.values() for i in range(most)]
        for done in jobs_:
            done.result()


# -- implementations: each returns a zero-argument callable producing the output -----------


# Every call of ours passes the batch's VarlenMetadata, built once before the timed calls, as a
# training step builds it once for every layer (host times then compare with a step's).


def _ours(batch, window):
    from varlen_workbench.kernels.varlen import varlen_attention

    step = batch.step_metadata(validate=False)
    return lambda: batch.call_on(varlen_attention, step, window_size=window, backend="triton")


def _ours_validated(batch, window):
    """validate=True on the metadata every call reuses (as the layers of one step do)."""
    from varlen_workbench.kernels.varlen import varlen_attention

    if batch.case.seqlens_q[0] != 2048:
        return None  # judged on the 8x2048 workloads only
    step = batch.step_metadata(validate=True)
    return lambda: batch.call_on(varlen_attention, step, window_size=window, backend="triton")


def _ours_validated_fresh(batch, window):
    """validate=True on new metadata each call (as each new batch brings): the device check of the
    boundaries runs every call (kernels/varlen/device_check.py), its verdict read in the backward."""
    from varlen_workbench.kernels.varlen import VarlenMetadata, varlen_attention

    if batch.case.seqlens_q[0] != 2048:
        return None  # judged on the 8x2048 workloads only
    names = ("cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_q_padded", "cu_seqlens_k_padded")

    def run():
        q, k, q_padded, k_padded = (getattr(batch, n).clone() for n in names)
        rows = {"total_q": batch.q.shape[0], "total_k": batch.k.shape[0]}
        step = VarlenMetadata(
            q, k, batch.max_seqlen_q, batch.max_seqlen_k, cu_seqlens_q_padded=q_padded, cu_seqlens_k_padded=k_padded, **rows
        )
        return batch.call_on(varlen_attention, step, window_size=window, backend="triton")

    return run


def _ours_on(backend: str) -> Callable:
    def build(batch, window):
        """Our call on `backend`, validate=True on the metadata every call reuses, where the
        backend takes the batch (FA4: padded workloads included, views for TAIL rows, zeroed
        copies for GAP rows)."""
        from varlen_workbench.kernels.varlen import varlen_attention
        from varlen_workbench.kernels.varlen.backends import Call, lookup

        step = batch.step_metadata(validate=True)
        c = batch.case
        call = Call(batch.q, batch.k, batch.v, step, c.causal, batch.q.shape[-1] ** -0.5, *window, False, True)
        if lookup(backend).cannot_take(call):
            return None
        return lambda: batch.call_on(varlen_attention, step, window_size=window, backend=backend)

    return build


def grad_like(out: torch.Tensor) -> torch.Tensor:
    """A fixed random gradient for `out`, drawn on the CPU: the CUDA generator is never touched,
    so a CUDA graph capture that fails (and leaves that generator in capture state) cannot make
    every later run fail."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(out.shape, generator=generator, dtype=torch.float32).to(out.dtype).to(out.device)


class Graphed:
    """The whole forward+backward step, and the forward pass alone, each captured in a CUDA
    graph and replayed: what a training loop under `torch.cuda.graphs` or
    `torch.compile(mode="reduce-overhead")` pays. `measure` times the replays.

    Capture follows torch's whole-network recipe: new leaf tensors, warm-up on a side stream,
    no autograd graph kept alive from before the capture (its AccumulateGrad nodes would pin
    the leaves' gradients to the default stream, which a capture cannot wait on), gradients
    set to None so that the captured step allocates them from the graph's pool."""

    def __init__(self, batch, window):
        from varlen_workbench.kernels.varlen import varlen_attention

        batch = batch.fresh()
        step = batch.step_metadata(validate=False)  # built before the capture, as its work lists are

        def forward():
            return batch.call_on(varlen_attention, step, window_size=window, backend="triton")

        with torch.no_grad():
            grad = grad_like(forward())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream: tiles chosen and compiled
            for _ in range(3):
                forward().backward(grad)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for leaf in (batch.q, batch.k, batch.v):
            leaf.grad = None
        self.step_graph, self.forward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.step_graph):
            forward().backward(grad)
        with torch.no_grad(), torch.cuda.graph(self.forward_graph):
            self.out = forward()

    def forward(self):
        self.forward_graph.replay()
        return self.out

    def forward_backward(self):
        self.step_graph.replay()


def _ours_graphed(batch, window):
    graphed = Graphed(batch, window)
    return graphed.forward, graphed.forward_backward


def _torch_varlen(batch, window):
    from torch.nn.attention.varlen import varlen_attn

    if batch.case.padded_q is not None or batch.case.align is not None or batch.case.tail_q:
        return None  # no padded layout in its API
    params = inspect.signature(varlen_attn).parameters
    causal = batch.case.causal
    left, right = window[0], 0 if causal else window[1]
    if "window_size" in params:
        kwargs = {"window_size": (left, right)} if (left, right) != (-1, -1) else {}
    elif left >= 0:
        return None  # torch 2.10: no windows
    else:
        kwargs = {"is_causal": causal}
    args = batch.args()
    return lambda: varlen_attn(*args, **kwargs)


# Dense SDPA pads every document to the longest: beyond this many padded rows per real row, it
# would time mostly padding (a long-tailed mix) and is left out.
DENSE_MAX_WASTE = 1.25


def _dense(batch):
    """(B, H, S, D) padded copies and the key-padding mask, built once outside the timing."""
    tensors = []
    for t, cu, cu_pad, n in (
        (batch.q, batch.cu_seqlens_q, batch.cu_seqlens_q_padded, batch.max_seqlen_q),
        (batch.k, batch.cu_seqlens_k, batch.cu_seqlens_k_padded, batch.max_seqlen_k),
        (batch.v, batch.cu_seqlens_k, batch.cu_seqlens_k_padded, batch.max_seqlen_k),
    ):
        dense, mask = thd_to_bshd(t.detach(), cu, cu_pad, n)
        tensors.append(dense.transpose(1, 2).contiguous().requires_grad_())
    _, key_mask = thd_to_bshd(batch.k.detach(), batch.cu_seqlens_k, batch.cu_seqlens_k_padded, batch.max_seqlen_k)
    return tensors, key_mask


def _sdpa(backend_name: str | None):
    def make(batch, window):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        c = batch.case
        dense_rows = c.batch * max(max(c.real_lengths("q")), 1)
        if window[0] >= 0 or dense_rows > DENSE_MAX_WASTE * max(sum(c.real_lengths("q")), 1):
            return None
        (q, k, v), key_mask = _dense(batch)
        equal = bool(key_mask.all())
        mask = None
        if not equal:
            if backend_name is not None:
                return None  # flash and cuDNN take no arbitrary mask
            mask = key_mask[:, None, None, :]
            if batch.case.causal:
                mask = mask & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        group = q.shape[1] // k.shape[1]
        kwargs = {"enable_gqa": True} if group > 1 else {}
        causal = batch.case.causal and mask is None

        def run():
            if backend_name is None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **kwargs)
            with sdpa_kernel(getattr(SDPBackend, backend_name)):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)

        return run

    return make


def _flex(batch, window):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if batch.case.seqlens_k is not None:
        return None  # the document mask below assumes self-attention
    # Document id of every row, -1 on padding: padding rows see nothing and are seen by nobody.
    doc = torch.full((batch.q.shape[0],), -1, dtype=torch.long)
    starts, ends = batch.cu_seqlens_q_padded.tolist(), batch.cu_seqlens_q.tolist()
    for i in range(batch.case.batch):
        doc[starts[i] : starts[i] + ends[i + 1] - ends[i]] = i
    doc = doc.to(batch.device)
    total = doc.numel()
    # Self-attention: within one document, global index differences are the local ones.
    left, right = window[0], 0 if batch.case.causal else window[1]

    def mask_mod(b, h, q_idx, kv_idx):
        same = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0)
        if right >= 0:
            same = same & (kv_idx <= q_idx + right)
        if left >= 0:
            same = same & (kv_idx >= q_idx - left)
        return same

    # Eager creation materialises the whole (total x total) mask with int64 gathers (tens of GB
    # at 64k tokens); compiled creation works block by block.
    block_mask = create_block_mask(mask_mod, None, None, total, total, device=batch.device, _compile=total > 16384)
    compiled = torch.compile(flex_attention)
    q, k, v = (t.detach().transpose(0, 1)[None].contiguous().requires_grad_() for t in (batch.q, batch.k, batch.v))
    group = q.shape[1] // k.shape[1]
    kwargs = {"enable_gqa": True} if group > 1 else {}
    return lambda: compiled(q, k, v, block_mask=block_mask, **kwargs)


def _fa4(batch, window):
    """FlashAttention-4's varlen function (`flash-attn-4`, CuTe DSL), where it is installed."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        return None
    c = batch.case
    if c.padded_q is not None or c.align is not None or c.tail_q:
        return None  # timed on the unpadded layouts, as torch varlen_attn
    left, right = window[0], 0 if c.causal else window[1]
    kwargs = {
        "cu_seqlens_q": batch.cu_seqlens_q,
        "cu_seqlens_k": batch.cu_seqlens_k,
        "max_seqlen_q": batch.max_seqlen_q,
        "max_seqlen_k": batch.max_seqlen_k,
        "causal": c.causal,
        "window_size": (None if left < 0 else left, None if right < 0 else right),  # None: unbounded
    }
    q, k, v = batch.args()[:3]
    return lambda: flash_attn_varlen_func(q, k, v, **kwargs)[0]


def implementations() -> dict[str, Callable]:
    """Every benchmarked implementation by name: ours on the Triton kernel in its variants, ours
    on every other registered backend (`variant`), and the libraries'."""
    from varlen_workbench.kernels.varlen.backends import registered

    pinned = {variant(b.name): _ours_on(b.name) for b in registered() if b.name != "triton"}
    return {
        "ours": _ours,
        "FlashAttention-4 varlen": _fa4,
        "torch varlen_attn": _torch_varlen,
        "FlexAttention (compiled)": _flex,
        "SDPA dense (cuDNN)": _sdpa("CUDNN_ATTENTION"),
        "SDPA dense (flash)": _sdpa("FLASH_ATTENTION"),
        "SDPA dense (auto)": _sdpa(None),
        "ours validate=True": _ours_validated,
        "ours validate=True, new metadata": _ours_validated_fresh,
        **pinned,
        "ours CUDA graph": _ours_graphed,  # last: a capture is the one run that could disturb the process
    }


def recorded_iters(record: dict) -> int:
    """Timed calls per measurement in a bench record: its command's `--iters`, else the default
    (`MIN_ITERS`) the command ran with. Each time in the record is the median of that many calls."""
    words = record["provenance"].get("command", "").split()
    return int(words[words.index("--iters") + 1]) if "--iters" in words else MIN_ITERS


def recorded_minima(record: dict) -> bool:
    """Whether the record keeps each measurement's fastest call beside its median (newer runs do)."""
    return any(row.get("forward_backward_min_ms") is not None for row in record["rows"])


def measure(make: Callable, batch, warmup: int = 3, iters: int = MIN_ITERS, window: tuple[int, int] = (-1, -1)) -> Timing | None:
    """`make(batch, window)` returns the forward callable (whose output is backpropagated for
    forward+backward), a (forward, forward_backward) pair, or None where it cannot run."""
    try:
        run = make(batch, window)
        if run is None:
            return None
        if isinstance(run, tuple):
            run, forward_backward = run
        else:
            out = run()
            grad = grad_like(out)

            def forward_backward():
                o = run()
                o.backward(grad)

        forward = time_call(run, warmup=warmup, iters=iters)
        # One untimed pass first, so that the baseline holds what persists across passes (the
        # inputs' .grad, allocated once) and nothing one-off (tile timing) lands in the peak:
        # the peak is then the pass's own working memory, comparable between implementations.
        forward_backward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        timed = time_call(forward_backward, warmup=warmup, iters=iters)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        return Timing(
            forward.median_ms,
            timed.median_ms,
            peak,
            timed.host_ms,
            forward_min_ms=forward.min_ms,
            forward_backward_min_ms=timed.min_ms,
        )
    except Exception as exc:  # a peer that cannot run a configuration is a result, not a crash
        return Timing(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")


def select_workloads(quick: bool = False, shapes: list[str] | None = None) -> list[Workload]:
    """The workloads whose name contains one of `shapes` (all without)."""
    chosen = [w for w in workloads(quick) if not shapes or any(s in w.name for s in shapes)]
    if not chosen:
        raise ValueError(f"shapes {shapes} match no workload; the workloads are {[w.name for w in workloads(quick)]}")
    return chosen


def run_benchmark(
    quick: bool = False,
    warmup: int = 3,
    iters: int = MIN_ITERS,
    impls: list[str] | None = None,
    shapes: list[str] | None = None,
    progress: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """Times every implementation (or `impls`) on every workload (or those whose name contains
    one of `shapes`); `progress(rows_so_far)` runs after each workload."""
    known = implementations()
    unknown = set(impls or ()) - set(known)
    if unknown:
        raise ValueError(f"impls {sorted(unknown)} are not benchmarked; choose from {list(known)}")
    chosen = select_workloads(quick, shapes)
    if not torch.cuda.is_available():
        raise RuntimeError("varlen-workbench bench needs CUDA: it times kernels with CUDA events. Run it on a GPU machine.")
    names = list(impls or known)
    rows: list[Row] = []
    # Two passes: every implementation on every workload, then the CUDA graph captures, so that
    # a capture that fails cannot disturb any other measurement.
    for pass_names in ([n for n in names if n not in CAPTURED], [n for n in names if n in CAPTURED]):
        if not pass_names:
            continue
        for workload in chosen:
            results = _measure_workload(workload, pass_names, warmup, iters)
            rows.extend(results.values())
            if progress:
                progress(rows)
    return rows


CAPTURED = ("ours CUDA graph",)  # implementations that capture CUDA graphs: timed in a pass of their own


def _measure_workload(workload: Workload, names: list[str], warmup: int, iters: int) -> dict[str, Row]:
    """Rows of `names` on one workload; our row gets the peers' ratios (peer time / ours)."""
    batch = pack(workload.case, device="cuda")
    known, results = implementations(), {}
    for name in names:
        timing = measure(known[name], batch, warmup, iters, workload.window)
        if timing is None:
            continue
        row = Row(workload.name, name, timing)
        if timing.forward_ms:
            row.tflops_fwd = workload.flops(False) / timing.forward_ms / 1e9
            row.gbs_fwd = workload.bytes_moved(False) / timing.forward_ms / 1e6
        if timing.forward_backward_ms:
            row.tflops_fwd_bwd = workload.flops(True) / timing.forward_backward_ms / 1e9
        results[name] = row
        torch.cuda.empty_cache()
    set_peer_ratios(results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="varlen-workbench bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one configuration of each kind")
    parser.add_argument(
        "--iters", type=int, default=MIN_ITERS, help=f"timed calls per measurement (median; at least {MIN_ITERS})"
    )
    parser.add_argument("--record", metavar="FILE", help="write the results with provenance as JSON (after each workload)")
    parser.add_argument("--shapes", nargs="+", metavar="TEXT", help="only workloads whose name contains one of these")
    parser.add_argument("--impls", nargs="+", metavar="NAME", choices=list(implementations()), help="only these implementations")
    parser.add_argument(
        "--compile-jobs",
        type=int,
        default=8,
        metavar="N",
        help="processes that compile our candidate tiles before timing (0: compile while tuning)",
    )
    args = parser.parse_args(argv)
    if args.iters < MIN_ITERS:
        parser.error(f"--iters {args.iters}: time at least {MIN_ITERS} calls per measurement (--iters {MIN_ITERS})")
    if not torch.cuda.is_available():
        # One line and the usage status, as `varlen-workbench repro --device cuda` gives: no traceback.
        print(
            f"varlen-workbench bench: torch {torch.__version__} sees no CUDA device; the benchmark times kernels with "
            "CUDA events, so run it on a GPU machine (committed records: data/gpu/bench-*.json).",
            file=sys.stderr,
        )
        return 2
    from varlen_workbench.kernels.varlen.launch import tuner

    command = shlex.join(
        ["python", "-m", "varlen_workbench.workbench.bench.kernels", *(argv if argv is not None else sys.argv[1:])]
    )

    def write(rows: list[Row]) -> None:
        if args.record:
            write_record(args.record, to_record(rows, tuner().report()), command=command)

    try:
        chosen = select_workloads(args.quick, args.shapes)
    except ValueError as exc:
        parser.error(str(exc))
    if args.compile_jobs and torch.cuda.is_available() and "ours" in (args.impls or implementations()):
        precompile(chosen, args.compile_jobs)
    rows = run_benchmark(quick=args.quick, iters=args.iters, impls=args.impls, shapes=args.shapes, progress=write)
    print(format_table(rows))
    print("\n" + format_targets(targets(rows)))
    print("\ntiles of our kernel, per shape class (timings of each candidate, ms):")
    for t in tuner().report():
        print(f"  {t}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
