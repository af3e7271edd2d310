"""TE's sequence-parallel block on two ranks (postmortems/te_thd_2892/seqpar_te.py, scripts/te_seqpar.py), on the CPU.

TE itself runs on two GPUs only. Here the TE stand-in (tests/data/fake_te: its Linear gathers a
column-parallel input and reduce-scatters a row-parallel output with torch.distributed, sized
from the local shard as TE's `gather_along_first_dim`) drives the run's code on gloo with two
ranks in real child processes, with two faults planted by environment: a gather of the unpadded
size (the report's claim) and a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from varlen_workbench.postmortems.te_thd_2892 import claims, on_te, seqpar_te
from varlen_workbench.postmortems.te_thd_2892.upstream import REPORT_CASE, TeCase
from varlen_workbench.workbench.layout import Case
from varlen_workbench.workbench.postmortem import NotRecorded
from varlen_workbench.workbench.provenance import REPO
from varlen_workbench.workbench.records import read_record

FAKE_TE = {"PYTHONPATH": str(REPO / "tests" / "data" / "fake_te")}
# 24 real tokens in 40 rows: 20 rows a rank, the second rank's shard starting inside a sequence.
SMALL = Case(
    seqlens_q=(5, 9, 3, 7),
    padded_q=(8, 16, 8, 8),
    padded_k=(8, 16, 8, 8),
    heads=4,
    head_dim=16,
    dtype="bfloat16",
    causal=True,
    seed=1,
)


def test_the_configurations_and_the_job_on_the_reports_shapes():
    assert [c.name for c in seqpar_te.SP_CASES] == ["bf16:different", "bf16:equal", "delayed:different", "delayed:equal"]
    assert seqpar_te.sp_case("delayed:equal").recipe.describe() == "DelayedScaling()"
    job = seqpar_te.make_job(seqpar_te.sp_case("bf16:different"))
    hidden = REPORT_CASE.heads * REPORT_CASE.head_dim
    assert job["x"].shape == (544, 1536) == job["dy"].shape and hidden == 1536 and job["tp"] == 2
    assert job["w_qkv"].shape == (3 * hidden, hidden) and job["w_proj"].shape == (hidden, hidden)
    assert job["cu_seqlens"].tolist() == [0, 100, 250, 370, 500] and job["cu_seqlens_padded"].tolist() == [0, 112, 272, 400, 544]
    assert int(job["real"].sum()) == 500 and (job["x"][~job["real"]] == 0).all() and (job["dy"][~job["real"]] == 0).all()
    assert (job["max_seqlen"], job["max_seqlen_padded"]) == (150, 160)


def test_attention_is_given_both_boundary_sets_or_verls_one_tensor_twice():
    different = seqpar_te.attention_kwargs(seqpar_te.make_job(seqpar_te.sp_case("bf16:different", SMALL)), "cpu")
    assert different["cu_seqlens_q"].tolist() == [0, 5, 14, 17, 24]
    assert different["cu_seqlens_q_padded"].tolist() == [0, 8, 24, 32, 40]
    assert different["max_seqlen_q"] == 9
    equal = seqpar_te.attention_kwargs(seqpar_te.make_job(seqpar_te.sp_case("bf16:equal", SMALL)), "cpu")
    assert equal["cu_seqlens_q"] is equal["cu_seqlens_q_padded"] is equal["cu_seqlens_kv"]  # VERL passes one tensor
    assert equal["max_seqlen_q"] == 16


def test_arguments_are_checked_with_the_fix_named():
    with pytest.raises(ValueError, match="'bf16:same' is not a sequence-parallel configuration"):
        seqpar_te.sp_case("bf16:same")
    with pytest.raises(ValueError, match="boundaries = 'equal-copies': the sequence-parallel run takes"):
        seqpar_te.make_job(TeCase(seqpar_te.SP_CASES[0].recipe, "equal-copies", SMALL))
    with pytest.raises(ValueError, match="41 rows, not a multiple of world_size = 2: pad the packed batch"):
        seqpar_te.make_job(seqpar_te.sp_case("bf16:different", SMALL.with_(padded_q=(8, 16, 8, 9), padded_k=(8, 16, 8, 9))))
    with pytest.raises(ValueError, match="device = 'gpu' must be 'cuda'"):
        seqpar_te.run_config(seqpar_te.sp_case("bf16:different", SMALL), "gpu")


def test_the_judge_reads_real_rows_and_catches_one_off():
    """The ranks' tensors against fp64 within the one-process block's bound: equal to the BF16
    block they pass; a REAL row off fails; a padding row off does not count."""
    job = seqpar_te.make_job(seqpar_te.sp_case("bf16:different", SMALL))
    exact, bf16 = seqpar_te.oracle(job), seqpar_te.oracle(job, torch.bfloat16)
    shards = [{n: t.chunk(2, 1 if n == "dw_proj" else 0)[r] for n, t in bf16.items()} for r in range(2)]
    assembled = seqpar_te.assemble(shards)
    assert all(torch.equal(assembled[n], bf16[n]) for n in seqpar_te.JUDGED)
    same = seqpar_te.judge(job, assembled, bf16, exact)
    assert all(t["within"] and t["vs_one_process"] == 0 for t in same.values())
    real, padding = job["real"].nonzero()[3, 0], (~job["real"]).nonzero()[0, 0]
    off = {**assembled, "out": assembled["out"].clone()}
    off["out"][padding] += 100
    assert seqpar_te.judge(job, off, bf16, exact)["out"]["within"]
    off["out"][real] += 1
    assert not seqpar_te.judge(job, off, bf16, exact)["out"]["within"]
    short = {**assembled, "dx": assembled["dx"][:24]}  # an unpadded size
    assert seqpar_te.judge(job, short, bf16, exact)["dx"] == {"error": "shape [24, 64], one process's [40, 64]"}


def test_a_child_says_the_stage_it_reached():
    err = f"{seqpar_te.STAGE}import\nsome log\n{seqpar_te.STAGE}forward, step 0\nmore\n"
    assert seqpar_te.reached(err) == "forward, step 0" and seqpar_te.reached("nothing") is None


def _two_gpu_record() -> dict:
    """A record as scripts/te_seqpar.py writes one on two GPUs, every configuration ending as TE's
    source says it should (the claim's check is what is tested, not TE)."""

    def child(who: str) -> dict:
        versions = {"transformer-engine": "2.20.2", "torch": "2.11.0", "cudnn": "9.14.0"}
        return {"who": who, "outcome": "exited", "code": 0, "versions": versions}

    judged = {name: {"real_error": 0.01, "bound": 0.1, "within": True} for name in seqpar_te.JUDGED}
    runs = [
        {
            "case": c.name,
            "layout_rows": 544,
            "real_rows": 500,
            "gathered_rows": [[544], [544]],
            "padded_downstream": True,
            "real_within_bound": True,
            "tensors": judged,
            "ranks": [child("0"), child("1")],
            "reference": child("reference"),
        }
        for c in seqpar_te.SP_CASES
    ]
    provenance = {"device": "NVIDIA H100 80GB HBM3", "date": "2027-01-01T00:00:00", "commit": "abc1234"}
    return {"config": {"device": "cuda"}, "runs": runs, "partial": False, "provenance": provenance}


def test_the_claim_on_te_reads_the_two_gpu_record(monkeypatch):
    """Holds on a record where every rank gathered the padded rows; fails when a rank gathered the
    unpadded size, a child crashed, or the record was made on the CPU; without a record it raises
    NotRecorded naming the run (the page claims nothing of it until then)."""

    def verdict(record):
        monkeypatch.setattr(on_te, "load_records", lambda pattern: [] if record is None else [{**record, "file": "x.json"}])
        return on_te.seqpar_verdict()

    with pytest.raises(NotRecorded, match="python3 scripts/te_seqpar.py --device cuda"):
        verdict(None)
    good = _two_gpu_record()
    holds, evidence = verdict(good)
    assert holds, evidence
    assert "rows gathered [544]; worst 0.10 of the bound (NVIDIA H100 80GB HBM3, TE 2.20.2" in evidence
    assert "544 rows, not cu_seqlens[-1] = 500" in on_te.SEQPAR_CLAIM
    assert on_te.SEQPAR_CLAIM not in claims.statements  # a page claims what ran
    unpadded = json.loads(json.dumps(good))
    unpadded["runs"][0]["gathered_rows"] = [[500], [500]]
    holds, evidence = verdict(unpadded)
    assert not holds and "rows gathered [500, 544]" in evidence
    crashed = json.loads(json.dumps(good))
    crashed["runs"][3]["ranks"][1] |= {"outcome": "killed", "signal": "SIGSEGV", "code": None}
    assert not verdict(crashed)[0]
    assert not verdict({**good, "config": {"device": "cpu"}})[0]


def test_the_pages_table_reads_the_record(monkeypatch):
    record = _two_gpu_record()
    record["runs"][1] |= {"tensors": None, "real_within_bound": False}
    record["runs"][1]["ranks"][0] |= {"error": "RuntimeError: NCCL error", "outcome": "exited", "code": 1}
    record["runs"][2]["tensors"] = {**record["runs"][2]["tensors"], "dx": {"real_error": 1.0, "bound": 0.1, "within": False}}
    monkeypatch.setattr(on_te, "load_records", lambda pattern: [{**record, "file": "x.json"}])
    rows = on_te.seqpar_table().rows
    assert [r[0] for r in rows] == [c.name for c in seqpar_te.SP_CASES]
    assert rows[0][1:5] == ("exited 0, exited 0", "544 / 544", "544 (500 real)", "yes")
    assert rows[1][1] == "exited 1, exited 0" and rows[1][5] == "RuntimeError: NCCL error"
    assert rows[2][5] == "out DX dw_qkv dw_proj"


def _script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "scripts" / "te_seqpar.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}, cwd=REPO)


@pytest.mark.slow  # three child processes a configuration: two gloo ranks and the one-process block
def test_the_script_records_two_ranks_against_one_process(tmp_path):
    record = tmp_path / "seqpar.json"
    small = json.dumps(SMALL.to_dict())
    done = _script(
        "--device", "cpu", "--only", "bf16:different,delayed:equal", "--case", small, "--record", str(record), env=FAKE_TE
    )
    assert done.returncode == 0, done.stderr[-2000:]
    data = read_record(record)
    assert data["partial"] is False and data["provenance"]["command"].startswith("python3 scripts/te_seqpar.py --device cpu")
    assert data["config"]["tp"] == 2 and data["config"]["env"] == seqpar_te.MULTICAST_OFF
    assert [r["case"] for r in data["runs"]] == ["bf16:different", "delayed:equal"]
    for run in data["runs"]:
        assert [r["code"] for r in [*run["ranks"], run["reference"]]] == [0, 0, 0], run
        assert (run["layout_rows"], run["real_rows"], run["shard_rows"]) == (40, 24, 20)
        assert run["gathered_rows"] == [[40], [40]] and run["padded_downstream"]
        assert [r["observed"]["proj_out_rows"] for r in run["ranks"]] == [[20], [20]]  # reduce-scattered back to shards
        assert run["reference"]["observed"]["qkv_out_rows"] == [40]
        assert all(r["env"] == seqpar_te.MULTICAST_OFF and r["reached"] == "saved" for r in run["ranks"])
        assert run["real_within_bound"] and set(run["tensors"]) == set(seqpar_te.JUDGED)
        assert run["ranks"][0]["versions"]["transformer-engine"] == "0.0.0+fake"
        assert run["ranks"][0]["backend"]["selected"] == ["FusedAttention (sub-backend 1)"]
    # BF16: only the row-parallel sum's order differs from one process; the weight gradients do not.
    bf16 = data["runs"][0]["tensors"]
    assert bf16["dw_qkv"]["vs_one_process"] == 0 and bf16["out"]["vs_one_process"] <= bf16["out"]["bound"]
    bad = _script("--only", "bf16:nope")
    assert bad.returncode == 2 and "--only ['bf16:nope'] are not configurations" in bad.stderr


@pytest.mark.slow  # three child processes
def test_a_gather_of_the_unpadded_size_is_caught():
    """The report's claim planted in the stand-in: the column-parallel gather returns cu_seqlens[-1]
    rows. The record shows the rows gathered, attention given too few, the error, no verdict."""
    real = str(sum(SMALL.real_lengths("q")))
    run = seqpar_te.run_config(
        seqpar_te.sp_case("bf16:different", SMALL), "cpu", 120, {**FAKE_TE, "FAKE_TE_SP_GATHER_ROWS": real}
    )
    assert run["gathered_rows"] == [[24], [24]] and run["layout_rows"] == 40 and not run["padded_downstream"]
    for rank in run["ranks"]:
        assert rank["observed"]["attention_rows"] == [24] and rank["observed"]["proj_in_rows"] == []
        assert rank["stage"] == "forward, step 0" and "cu_seqlens_q_padded[-1] = 40 exceeds q.shape[0] = 24" in rank["error"]
    assert run["reference"]["code"] == 0 and "error" not in run["reference"]  # one process gathers nothing
    assert run["tensors"] is None and not run["real_within_bound"]


@pytest.mark.slow  # three child processes, killed on their timeout
def test_a_hang_is_recorded_as_timed_out_with_its_stage():
    # 40 s: three children importing torch at once on a two-core machine reach the forward in about 15,
    # and past 30 on a machine loaded beyond its two cores.
    run = seqpar_te.run_config(seqpar_te.sp_case("bf16:different", SMALL), "cpu", 40, {**FAKE_TE, "FAKE_TE_HANG": "1"})
    for child in [*run["ranks"], run["reference"]]:
        assert child["outcome"] == "timed out" and child["reached"] == "forward, step 0", child
    assert run["gathered_rows"] == [None, None] and run["tensors"] is None and not run["real_within_bound"]
