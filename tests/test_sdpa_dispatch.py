"""varlen_workbench.workbench.instruments.sdpa_dispatch: the backend SDPA ran, named from the profiler's aten ops."""

import torch

from varlen_workbench.workbench.instruments.sdpa_dispatch import BACKEND_OPS, Setting, backends_of, observe


def test_each_backend_op_names_its_backend_for_forward_and_backward():
    for op, backend in BACKEND_OPS.items():
        assert backends_of({"aten::mm", op, op + "_backward"}) == {"forward": backend, "backward": backend}
    assert backends_of({"aten::mm", "aten::softmax"}) == {"forward": None, "backward": None}


def test_a_cpu_run_is_observed_with_the_backend_the_dispatcher_chose():
    names = {int(b.value): n for n, b in torch.nn.attention.SDPBackend.__members__.items()}
    for mask in ("bool", "float", "none-causal"):
        row = observe(Setting("tiny", 2, 4, 2, 16, 8, "float32", mask), "cpu")
        assert row["forward"] is not None, row
        assert row["dispatcher_choice"] in names.values()
        # The math backend is what the dispatcher falls back to; otherwise what it chose is what ran.
        assert row["forward"] in (row["dispatcher_choice"], "MATH")
