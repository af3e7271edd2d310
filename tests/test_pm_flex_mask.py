"""flash-dmattn-flex-mask: the upstream loader leaves no trace, bad input is named, and the GPU
claims' checks (registered once a GPU record exists) judge probe records right, both ways."""

import sys
import types

import pytest

pm = pytest.importorskip("varlen_workbench.postmortems.flash_dmattn_flex_mask")


@pytest.fixture(scope="module")
def probes():
    """probe_all on the CPU, forward only (FlexAttention has no CPU backward), one dtype and seed."""
    return pm.probe_all("cpu", budget_s=120, backward=False, dtypes=("float16",), seeds=(0,))


def as_results(probes, **changes):
    return types.SimpleNamespace(gpu={"probes": {**probes, **changes}})


def test_upstream_file_runs_without_leaving_a_transformers_stand_in():
    module = pm.upstream_module()
    assert callable(module.flex_dmattn_func)
    if pm.transformers_version() is None:
        assert "stand-in" in module.transformers_used
        assert not any(name == "transformers" or name.startswith("transformers.") for name in sys.modules)


def test_a_missing_package_is_named_with_the_fix():
    with pytest.raises(ModuleNotFoundError, match=r"no-such-package is not installed: install its wheel"):
        pm.upstream_path("no-such-package")


def test_gpu_checks_judge_probe_records(probes):
    assert not probes["skipped"] and len(probes["runs"]) == 3 * len(pm.AUDITED)
    # The checks demand a backward; CPU probes have none, so they must not pass as GPU evidence ...
    assert not pm._gpu_workarounds(as_results(probes))[0] and not pm._gpu_as_is(as_results(probes))[0]
    # ... and with the flag as a GPU run sets it, the same runs judge as the CPU claims do.
    assert pm._gpu_as_is(as_results(probes, backward=True))[0]
    assert pm._gpu_workarounds(as_results(probes, backward=True))[0]


def test_gpu_checks_fail_on_a_raising_or_missing_probe(probes):
    broken = [dict(x) for x in probes["runs"]]
    victim = next(x for x in broken if x["impl"] == pm.IMPLS[1])
    victim.pop("within")
    victim["error"] = "RuntimeError: backward of a fully masked row"
    holds, evidence = pm._gpu_workarounds(as_results(probes, backward=True, runs=broken))
    assert not holds and f"{len(pm.AUDITED) - 1}/{len(pm.AUDITED)} within" in evidence
    first = [x for x in probes["runs"] if x["check"] != "fully-masked-rows"]
    assert not pm._gpu_as_is(as_results(probes, backward=True, runs=first))[0], "a case never run is not covered"
    with pytest.raises(LookupError, match="varlen-workbench repro flash-dmattn-flex-mask --device cuda"):
        pm._gpu_bitwise(types.SimpleNamespace(gpu=None))


@pytest.fixture
def h200():
    """The committed H200 record: reproduce() re-run there (compiled, forward), its probes empty."""
    from varlen_workbench.workbench.provenance import GPU_DATA
    from varlen_workbench.workbench.records import read_record

    path = GPU_DATA / "flash-dmattn-flex-mask-h200.json"
    return {**read_record(path), "file": path.name}


def test_gpu_study_checks_read_the_re_run_and_can_fail(h200):
    import copy

    from varlen_workbench.workbench.postmortem import NotRecorded

    record = types.SimpleNamespace(gpu=h200)
    assert pm._gpu_bitwise(record)[0] and pm._gpu_forward(record)[0]
    changed = copy.deepcopy(h200)
    changed["results"]["mask_effect"]["rows"][0]["identical to all-ones"] = False
    changed["results"]["runs"][pm.IMPLS[1]]["fully-masked-rows"]["within"] = False
    assert not pm._gpu_bitwise(types.SimpleNamespace(gpu=changed))[0]
    assert not pm._gpu_forward(types.SimpleNamespace(gpu=changed))[0]
    changed["results"]["device"] = "cpu"
    with pytest.raises(NotRecorded, match="not made on a GPU"):
        pm._gpu_bitwise(types.SimpleNamespace(gpu=changed))
    if not h200["probes"]:  # a record without gpu_probes leaves the gradient claims unrecorded, not failed
        with pytest.raises(NotRecorded, match="not yet measured on a GPU"):
            pm._gpu_as_is(record)


def test_budget_skips_and_says_so():
    found = pm.probe_all("cpu", budget_s=0, backward=False, dtypes=("float16",), seeds=(0,))
    assert found["runs"] == [] and len(found["skipped"]) == 3 * len(pm.AUDITED)
    assert not pm._gpu_as_is(as_results(found, backward=True))[0]


def test_source_reading_sees_a_mask_mod_that_reads_the_mask():
    """The source claim can fail: with line 44 reading attn_mask (the fix upstream), the reading finds the use."""
    text = pm.upstream_path().read_text()
    assert pm.source_facts(text=text)["attn_mask_uses"] == []
    fixed = text.replace(
        "        return q_idx >= kv_idx\n",
        "        return (q_idx >= kv_idx) & (attn_mask[batch_idx][head_idx][q_idx][kv_idx] > 0)\n",
    )
    assert fixed != text
    facts = pm.source_facts(text=fixed)
    assert facts["attn_mask_uses"] == [44]
    assert facts["mask_mods"] == {"causal_mask_mod": "(q_idx >= kv_idx) & (attn_mask[batch_idx][head_idx][q_idx][kv_idx] > 0)"}
