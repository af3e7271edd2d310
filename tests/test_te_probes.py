"""postmortems/te_thd_2892/te_probes.py and scripts/te_probes.py on the CPU, through the TE stand-in.

TE itself runs on the GPU machine only. The stand-in (tests/data/fake_te) computes attention with
the oracle and gives `Linear` an FP8 round trip scaled per tensor (delayed and current scaling)
or per 1x128 block (block scaling), so the runner's every part runs here in real child processes.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from varlen_workbench.postmortems.te_thd_2892 import te_probes
from varlen_workbench.postmortems.te_thd_2892.upstream import REPORT_CASE
from varlen_workbench.workbench.layout import Case
from varlen_workbench.workbench.provenance import GPU_DATA, REPO
from varlen_workbench.workbench.records import read_record

FAKE_TE = str(REPO / "tests" / "data" / "fake_te")


def test_the_smallest_variant_is_the_fuzzers_recorded_layout():
    recorded = read_record(GPU_DATA / "audit-te.json")
    shrunk = [f["case"] for f in recorded["fuzz"]["failures"] if f["check"] == "real-accuracy"]
    assert [Case(**c) for c in shrunk] == [te_probes.FUZZ_SMALLEST]
    cases = list(te_probes.ZERO_KEY_VARIANTS.values())
    assert len({c for c in cases}) == len(cases)  # no variant repeats another
    for name, case in te_probes.ZERO_KEY_VARIANTS.items():
        assert case.head_dim == 64 and case.dtype in ("bfloat16", "float16"), name


def test_the_initcheck_layouts_differ_only_in_padding():
    layouts = te_probes.INITCHECK_LAYOUTS
    lengths = {(c.seqlens_q, c.seqlens_k, c.heads, c.kv_heads, c.causal) for c in layouts.values()}
    assert len(lengths) == 3  # the same lengths, but for the layouts without the queryless sequence or GQA
    bare = layouts["no padding"]
    assert bare.padded_q is None and bare.tail_q == 0 and layouts["GAP only"].tail_q == 0
    assert layouts["TAIL only"].padded_q is None and layouts["TAIL only"].tail_q > 0


def test_padding_rows_take_the_fill_and_real_rows_stay():
    x0, real = te_probes.packed_activations(REPORT_CASE, "zeros", 256)
    x1, _ = te_probes.packed_activations(REPORT_CASE, "large", 256)
    assert x0.shape == (sum(REPORT_CASE.padded_lengths("q")), 256) and int(real.sum()) == sum(REPORT_CASE.real_lengths("q"))
    assert torch.equal(x0[real], x1[real]) and (x0[~real] == 0).all()
    assert float(x1[~real].float().abs().max()) > 1000 * float(x1[real].float().abs().max()) / 10
    with pytest.raises(ValueError, match="fill = 'nan' must be one of"):
        te_probes.packed_activations(REPORT_CASE, "nan", 8)


def test_scale_damage_reads_large_padding_against_zero_padding():
    rows = [
        {"name": "a", "fill": "zeros", "y_real_error": 0.02},
        {"name": "a", "fill": "large", "y_real_error": 0.05},
        {"name": "b", "fill": "zeros", "error": "RuntimeError: refused"},
    ]
    assert te_probes.scale_damage(rows) == {"a": pytest.approx(2.5)}


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("te_probes_script", REPO / "scripts" / "te_probes.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # child processes: a fresh interpreter each
def test_the_runner_records_its_parts_as_they_end(tmp_path):
    """The whole script on the cheap parts: on the CPU the row te is n/a (TE runs on CUDA only) and
    compute-sanitizer is not there, and the record says so rather than losing the runs."""
    record = tmp_path / "te-probes.json"
    env = {"PYTHONPATH": FAKE_TE, "PATH": "/usr/bin:/bin"}  # no compute-sanitizer on this PATH
    command = [
        sys.executable,
        "scripts/te_probes.py",
        "--device",
        "cpu",
        "--parts",
        "determinism,initcheck",
        "--record",
        str(record),
    ]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(record.read_text())
    assert not result["partial"] and set(result) == {"determinism", "initcheck", "partial", "provenance"}
    assert result["provenance"]["command"].startswith("python3 scripts/te_probes.py --device cpu")
    assert [(d["setting"], d["verdict"]) for d in result["determinism"]] == [("default", "n/a"), ("deterministic", "n/a")]
    assert "runs on CUDA only" in result["determinism"][0]["evidence"]
    assert result["determinism"][1]["env"] == {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    assert [r["layout"] for r in result["initcheck"]] == list(te_probes.INITCHECK_LAYOUTS)
    assert all(r["errors"] is None and "not installed" in r["why"] for r in result["initcheck"])
    bad = subprocess.run([*command[:-2], "--parts", "gemm,speed"], cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "--parts ['speed'] are not parts" in bad.stderr


@pytest.mark.slow  # child processes: a fresh interpreter each
def test_a_variant_is_probed_in_a_child_with_tes_backend_named(script, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", FAKE_TE)
    run = script.variant("the fuzzer's smallest", "cpu", 120)
    assert run["code"] == 0 and run["result"]["findings"] == [], run  # the stand-in is the oracle
    assert run["result"]["nonfinite"]["dk"] == {"REAL": 0, "GAP": 0, "TAIL": 0}
    assert run["backend"]["selected"] == ["FusedAttention (sub-backend 1)"]


@pytest.mark.slow  # child processes: a fresh interpreter each
def test_the_gemm_table_shows_per_tensor_scales_taking_padding_in(script, monkeypatch):
    """The stand-in's scales: one per tensor lets large padding coarsen REAL rows, one per block does not."""
    monkeypatch.setenv("PYTHONPATH", FAKE_TE)
    small = "Case(seqlens_q=(20, 13), padded_q=(32, 16), heads=2, head_dim=64, dtype='bfloat16')"
    code = (
        "import json\nfrom varlen_workbench.workbench.layout import Case\nfrom varlen_workbench.postmortems.te_thd_2892.te_probes import fp8_linear_table\n"
        f"print({script.RESULT!r} + json.dumps(fp8_linear_table('cpu', {small})))\n"
    )
    run = script.child(code, 120)
    assert run["code"] == 0, run
    rows = run["result"]
    assert {(r["name"], r["fill"]) for r in rows} == {
        (n, f) for n in ("bf16", "delayed", "current", "block") for f in te_probes.PADDING_FILLS
    }
    damage = te_probes.scale_damage(rows)
    assert damage["bf16"] == 1.0 and damage["block"] == pytest.approx(1.0)
    assert damage["delayed"] > 1.5 and damage["current"] > 1.5
    assert all(r["y_padding_finite"] for r in rows)
