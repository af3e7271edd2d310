"""The host-sync counter (varlen_workbench.workbench.instruments.syncs): which runtime calls are waits, whose code issued them,
how one op's calls make one sync; on synthetic profiler events shaped as a CUDA trace is, on the
CPU profiler for real, and on CUDA for the waits torch makes."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from varlen_workbench.workbench.instruments import syncs
from varlen_workbench.workbench.instruments.syncs import (
    ASYNC_COPY,
    BLOCKING_COPY,
    UNMATCHED_COPY,
    WINDOW,
    count_syncs,
    owner,
    runtime_calls,
    tally,
    wait_kind,
)
from varlen_workbench.workbench.provenance import REPO


@pytest.mark.parametrize(
    ("name", "activity", "kind"),
    [
        ("cudaStreamSynchronize", "", "stream sync"),
        ("cudaStreamSynchronize_ptsz", "", "stream sync"),
        ("cudaEventSynchronize", "", "event sync"),
        ("cudaDeviceSynchronize", "", "device sync"),
        ("cudaMemcpyAsync", "Memcpy DtoH (Device -> Pageable)", BLOCKING_COPY),
        ("cudaMemcpyAsync", "Memcpy DtoH (Device -> Pinned)", ASYNC_COPY),
        ("cudaMemcpy", "Memcpy DtoH (Device -> Pinned)", BLOCKING_COPY),  # the synchronous API waits whatever the memory
        ("cudaMemcpyAsync_ptsz", "Memcpy DtoH (Device -> Pageable)", BLOCKING_COPY),
        ("cudaMemcpyAsync", "", UNMATCHED_COPY),  # no GPU activity matched: shown, never a wait
        ("cudaMemcpyAsync", "Memcpy HtoD (Pinned -> Device)", None),
        ("cudaMemcpyAsync", "Memcpy DtoD (Device -> Device)", None),
        ("cudaLaunchKernel", "", None),
        ("cudaStreamWaitEvent", "", None),  # a wait on the device, not the host
    ],
)
def test_wait_kind(name, activity, kind):
    assert wait_kind(name, activity) == kind


SITE = "/usr/lib/python3.12/site-packages"


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        # Innermost first: torch's frames and builtins name nobody, the first frame outside them decides.
        (["<built-in method item of Tensor object at 0x7f>", "kernels/hf.py(95): packed_layout"], "ours"),
        ([f"{REPO}/kernels/varlen/op.py(400): varlen_attention"], "ours"),
        (["workbench/instruments/realclient.py(190): call", "transformers/integrations/sdpa_attention.py(80): sdpa"], "ours"),
        (["torch/_tensor.py(1100): __bool__", "transformers/masking_utils.py(700): create_causal_mask"], "transformers"),
        ([f"{SITE}/torch/nn/modules/module.py(1): _call_impl", f"{SITE}/transformers/modeling_utils.py(1): f"], "transformers"),
        (["functools.py(1): wrapper", "contextlib.py(81): inner", "transformers/utils/generic.py(1): w"], "transformers"),
        (["<frozen importlib._bootstrap>(1): _find", "kernels/varlen/fa4.py(1): load"], "ours"),
        # Installed from the wheel, ours by its import name; Hugging Face's `kernels` is not ours.
        ([f"{SITE}/varlen_workbench/kernels/hf.py(95): packed_layout"], "ours"),
        ([f"{SITE}/kernels/_internals/layer/layer.py(1): forward", "kernels/_internals/load.py(1): f"], "other"),
        ([f"{SITE}/varlen_workbench/workbench/instruments/syncs.py(250): count_syncs"], "other"),
        # A library called from our wrapper issued it: the library's, not ours.
        ([f"{SITE}/flash_attn/cute/interface.py(300): _flash_attn_fwd", "kernels/varlen/fa4.py(200): forward"], "other"),
        # The harness names nobody: a sync under it with no other frame is no one's in particular.
        (["workbench/bench/stepbench.py(260): step", "workbench/instruments/syncs.py(250): count_syncs"], "other"),
        (["tests/test_x.py(3): test"], "other"),
        ([], "other"),
    ],
)
def test_owner_is_the_innermost_frame_outside_torch_python_and_the_harness(frames, expected):
    assert owner(frames) == expected


# -- synthetic profiler events: the attributes runtime_calls reads, shaped as a CUDA trace -------


@dataclass(eq=False)
class Event:
    name: str
    start: float
    end: float
    cpu_parent: Event | None = None
    is_python_function: bool = False
    device_type: DeviceType = DeviceType.CPU
    id: int = 0
    stack: list[str] = field(default_factory=list)

    @property
    def time_range(self):
        return SimpleNamespace(start=self.start, end=self.end)


def trace():
    """A step's trace: the counted window, a forward with a transformers mask check (.item(): a
    copy then a stream sync in one op), our layout's read of a maximum, a copy into pinned
    memory (no wait), a copy whose GPU activity is missing, an event sync made outside any op (parent found by time), a library's
    stream sync under our wrapper; a backward with a sync the C++ engine makes under an op with
    no Python frame, a device sync outside any op; and a sync after the window."""
    events: list[Event] = []

    def add(name, start, end, parent=None, **kw):
        events.append(Event(name, start, end, parent, **kw))
        return events[-1]

    frame = lambda name, s, e, p=None: add(name, s, e, p, is_python_function=True)

    def gpu(name, id_):
        add(name, 0, 1, device_type=DeviceType.CUDA, id=id_)

    window = add(WINDOW, 0, 1000)
    harness = frame("workbench/bench/stepbench.py(260): step", 1, 999, window)
    add("forward", 2, 500, harness)
    model = frame("transformers/models/llama/modeling_llama.py(400): forward", 3, 400, harness)
    mask = frame("transformers/masking_utils.py(100): create_causal_mask", 4, 50, model)
    builtin = frame("<built-in method all of Tensor object at 0x7f>", 5, 40, mask)
    item = add("aten::_local_scalar_dense", 6, 39, add("aten::item", 6, 39, builtin))
    add("cudaMemcpyAsync", 8, 10, item, id=101)
    gpu("Memcpy DtoH (Device -> Pageable)", 101)
    add("cudaStreamSynchronize", 11, 37, item, id=102)
    layout = frame("kernels/hf.py(95): packed_layout", 60, 80, model)
    read = add("aten::_local_scalar_dense", 62, 79, frame("torch/_tensor.py(1): __int__", 61, 79, layout))
    add("cudaMemcpyAsync", 63, 65, read, id=103)
    gpu("Memcpy DtoH (Device -> Pageable)", 103)
    add("cudaStreamSynchronize", 66, 78, read, id=104)
    op = frame("kernels/varlen/op.py(300): varlen_attention", 100, 200, model)
    add("cudaMemcpyAsync", 102, 104, add("aten::copy_", 101, 110, op), id=105)
    gpu("Memcpy DtoH (Device -> Pinned)", 105)
    add("cudaMemcpyAsync", 112, 113, add("aten::copy_", 111, 115, op), id=106)
    gpu("Memcpy HtoD (Pageable -> Device)", 106)
    add("cudaMemcpyAsync", 116, 117, add("aten::copy_", 116, 118, op), id=112)  # its activity lost: shown, no wait
    frame("torch/cuda/streams.py(220): synchronize", 120, 140, op)
    add("cudaEventSynchronize", 121, 139, id=107)  # outside any op, on CUPTI's own thread id: no parent
    fa4 = frame("kernels/varlen/fa4.py(200): forward", 300, 390, model)
    library = frame("/opt/venv/lib/python3.12/site-packages/flash_attn/cute/interface.py(9): run", 301, 389, fa4)
    add("cudaStreamSynchronize", 302, 303, add("aten::empty", 301, 304, library), id=108)
    add("backward", 501, 990, harness)
    engine_op = add("aten::nonzero", 510, 520)  # the autograd engine's thread: no Python frame at all
    add("cudaStreamSynchronize", 511, 519, engine_op, id=109)
    add("cudaDeviceSynchronize", 600, 610, id=110)  # by time: only the harness's frame encloses it
    add("cudaDeviceSynchronize", 1001, 1002, id=111)  # after the window: not counted
    return events


def test_runtime_calls_find_waits_in_the_window_with_their_frames_and_phases():
    calls = runtime_calls(trace(), phases=("forward", "backward"))
    assert [(c.name, c.phase) for c in calls] == [
        ("cudaMemcpyAsync", "forward"),
        ("cudaStreamSynchronize", "forward"),
        ("cudaMemcpyAsync", "forward"),
        ("cudaStreamSynchronize", "forward"),
        ("cudaMemcpyAsync", "forward"),  # into pinned memory: found, counted as a call, no wait
        ("cudaMemcpyAsync", "forward"),  # no GPU activity: found, counted as a call, no wait
        ("cudaEventSynchronize", "forward"),
        ("cudaStreamSynchronize", "forward"),
        ("cudaStreamSynchronize", "backward"),
        ("cudaDeviceSynchronize", "backward"),
    ]
    event_sync = calls[6]
    assert event_sync.issuer is None
    assert event_sync.frames[:2] == ("torch/cuda/streams.py(220): synchronize", "kernels/varlen/op.py(300): varlen_attention")
    assert calls[0].issuer == calls[1].issuer != calls[2].issuer  # .item(): one op, two calls
    assert calls[0].activity == "Memcpy DtoH (Device -> Pageable)"


def test_tally_counts_one_sync_per_op_and_splits_by_owner_and_phase():
    found = tally(runtime_calls(trace(), phases=("forward", "backward")))
    assert found.host_syncs == 6
    assert found.by_owner == {"ours": 2, "transformers": 1, "other": 3}  # other: flash_attn, the engine, the device sync
    assert found.by_phase == {
        "forward": {"ours": 2, "transformers": 1, "other": 1},
        "backward": {"ours": 0, "transformers": 0, "other": 2},
    }
    assert found.calls == {
        BLOCKING_COPY: 2,
        "stream sync": 4,
        ASYNC_COPY: 1,
        UNMATCHED_COPY: 1,
        "event sync": 1,
        "device sync": 1,
    }
    assert found.examples["ours"][0] == "cudaMemcpyAsync (Memcpy DtoH (Device -> Pageable))"
    assert found.examples["ours"][1:3] == ["torch/_tensor.py(1): __int__", "kernels/hf.py(95): packed_layout"]
    assert "transformers/masking_utils.py(100): create_causal_mask" in found.examples["transformers"]


def test_a_backward_op_without_frames_takes_its_recorded_stack():
    events = trace()
    engine_op = next(e for e in events if e.name == "aten::nonzero")
    engine_op.stack = ["transformers/models/llama/modeling_llama.py(1): forward"]  # the forward's, as the profiler sets it
    found = tally(runtime_calls(events))
    assert found.by_owner == {"ours": 2, "transformers": 2, "other": 2}


class OlderEvent:
    """An Event as a profiler without `is_python_function` gives it."""

    def __init__(self, event: Event, copies: dict[int, OlderEvent]):
        self.name, self.device_type, self.id, self.stack = event.name, event.device_type, event.id, event.stack
        self.time_range = event.time_range
        self.cpu_parent = copies.get(id(event.cpu_parent))
        copies[id(event)] = self


def test_python_frames_are_known_by_name_where_events_do_not_say():
    copies: dict[int, OlderEvent] = {}
    events = [OlderEvent(e, copies) for e in trace()]  # parents come before their children
    assert not hasattr(events[0], "is_python_function")
    assert tally(runtime_calls(events)) == tally(runtime_calls(trace()))


def test_runtime_calls_need_the_window():
    with pytest.raises(ValueError, match="no range named"):
        runtime_calls([Event("cudaDeviceSynchronize", 0, 1)])


def test_count_syncs_on_cpu_counts_nothing_and_does_not_crash():
    x = torch.randn(64, requires_grad=True)

    def step():
        with torch.profiler.record_function("forward"):
            loss = (x * 2).sum()
            float(loss.detach())  # a host read: a sync on CUDA, none on the CPU
        loss.backward()

    found = count_syncs(step, phases=("forward",))
    assert found.host_syncs == 0 and found.by_owner == dict.fromkeys(syncs.OWNERS, 0) and found.calls == {}
    assert x.grad is not None  # the callable ran


@pytest.mark.gpu
def test_counts_the_waits_torch_makes_on_cuda():
    """On the GPU, for real: each of torch's waits is one host sync, found with this file's frame;
    a copy into pinned memory is a call, no wait."""
    x = torch.randn(1024, device="cuda")
    pinned = torch.empty(1024, pin_memory=True)
    event = torch.cuda.Event()

    def waits():
        x.sum().item()  # a copy and a stream sync in one op
        x.tolist()
        torch.cuda.synchronize()
        event.record()
        event.synchronize()
        pinned.copy_(x, non_blocking=True)

    found = count_syncs(waits)
    assert found.host_syncs == 4, found.summary()
    assert found.calls[ASYNC_COPY] == 1 and found.calls["event sync"] == 1 and found.calls["device sync"] == 1, found.calls
    assert found.calls[BLOCKING_COPY] == 2 and UNMATCHED_COPY not in found.calls, found.calls  # every copy's GPU activity found
    assert found.by_owner["other"] == 4  # this test's own frames: neither ours nor transformers'
    assert any("test_syncs.py" in frame for frame in found.examples["other"]), found.examples
