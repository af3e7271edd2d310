"""scripts/initcheck_tma_control.py on the CPU: both programs write every element (the interpreter runs
the descriptor store as it is), and the driver's conclusion follows the two initcheck counts."""

from __future__ import annotations

import importlib.util

import pytest

from varlen_workbench.workbench.provenance import REPO


@pytest.fixture(scope="module")
def control():
    spec = importlib.util.spec_from_file_location("initcheck_tma_control", REPO / "scripts" / "initcheck_tma_control.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["pointer", "descriptor"])
def test_each_program_writes_every_element_before_its_read(control, variant):
    assert control.program(variant)


def test_the_conclusion_needs_both_programs_written_and_counted(control):
    def runs(pointer, descriptor, written=True, frames=None):
        return {
            "pointer": {"errors": pointer, "written": written},
            "descriptor": {"errors": descriptor, "written": True, "frames": frames or {}},
        }

    copy, read = "copy_rows_kernel in initcheck_tma_control.py:53", "void at::native::elementwise_kernel<128>(int)"
    assert control.conclusion(runs(0, 512)).endswith("so which reads it flags is open")  # frames not all printed
    assert control.conclusion(runs(0, 512, frames={copy: 200})).endswith("so which reads it flags is open")
    assert control.conclusion(runs(0, 512, frames={copy: 512})).endswith("that memory counts as written")
    assert control.conclusion(runs(0, 512, frames={copy: 500, read: 12})).startswith(
        "initcheck misses TMA stores: 12 of its reports"
    )
    assert control.conclusion(runs(0, 0)).startswith("initcheck sees TMA stores")
    assert control.conclusion(runs(4, 512)).startswith("inconclusive: the pointer program's read")
    assert control.conclusion(runs(0, 512, written=False)).startswith("inconclusive: a program did not write")
    assert control.conclusion(runs(None, 512)).startswith("inconclusive")


def test_frames_counts_printed_reports_per_device_frame(control):
    log = "\n".join(
        [
            "========= Uninitialized __global__ memory read of size 4 bytes",
            "=========     at copy_rows_kernel+0x910 in /tmp/x/initcheck_tma_control.py:48",
            "=========     by thread (0,0,0) in block (0,0,0)",
            "=========     Host Frame: [0x2d1] in libcuda.so.1",
            "========= Uninitialized __global__ memory read of size 4 bytes",
            "=========     at copy_rows_kernel+0x910 in /tmp/x/initcheck_tma_control.py:48",
            "========= Uninitialized __global__ memory read of size 2 bytes",
            "=========     at void at::native::elementwise_kernel<128>(int)+0x50",
            "========= ERROR SUMMARY: 3 errors",
        ]
    )
    assert control.frames(log) == {
        "copy_rows_kernel in initcheck_tma_control.py:48": 2,
        "void at::native::elementwise_kernel<128>(int)": 1,
    }
