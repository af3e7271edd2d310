"""The "Use the fixed kernel" page: install, call, the Hugging Face swap, the supported range and
Hugging Face's `kernels` beside ours, each read from the code or the environment
(varlen_workbench.workbench.site.usage), and linked from every page."""

from __future__ import annotations

import pytest

from varlen_workbench.workbench.site import usage
from varlen_workbench.workbench.site.build import USE_PAGE


@pytest.mark.parametrize(
    "values, said",
    [
        ((16, 32, 64, 128, 256), "16, 32, 64, 128, 256"),
        (tuple(range(8, 257, 8)), "8 to 256 in steps of 8"),
        ((*range(8, 129, 8), 192, 256), "8 to 128 in steps of 8, 192, 256"),
        ((64,), "64"),
        ((64, 128, 64), "64, 128"),
    ],
)
def test_head_dims_are_said_as_runs(values, said):
    assert usage.runs(values) == said


def test_the_supported_range_is_the_kernel_s_own():
    from varlen_workbench.kernels.varlen import DTYPES, HEAD_DIMS

    shown = usage.supported()
    assert [f"torch.{name}" for name in shown.dtypes] == [str(dtype) for dtype in DTYPES]
    # every head dim the kernel takes is named, and none it refuses
    named = {int(n) for n in shown.head_dims.replace(" to ", ",").replace(" in steps of ", ",").split(",")}
    assert set(HEAD_DIMS) <= set(range(min(named), max(named) + 1)) and {min(HEAD_DIMS), max(HEAD_DIMS)} <= named


def test_the_distribution_and_its_extras_come_from_pyproject(tmp_path):
    dist = usage.distribution()
    assert dist.name == "varlen-postmortem-workbench" and "fa4" in dist.extras
    assert usage.user_extras(dist) == usage.USER_EXTRAS
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\n[project.urls]\nSource = "https://example.org/x"\n')
    assert usage.distribution(pyproject).source == "https://example.org/x"
    with pytest.raises(ValueError, match=r"declares no extra \['fa4'\]"):
        usage.user_extras(usage.distribution(pyproject))


def test_the_transformers_range_is_pyprojects_floor_and_the_locks_pin(tmp_path):
    tested = usage.transformers_range()
    assert tested.oldest == "4.51" and f"transformers=={tested.newest}\n" in usage.LOCK.read_text()
    pyproject, lock = tmp_path / "pyproject.toml", tmp_path / "cpu.lock"
    pyproject.write_text(
        '[project]\ndependencies = ["torch"]\n[project.optional-dependencies]\nhf = ["transformers>=5.1; python_version>\'3\'"]\n'
    )
    lock.write_text("torch==2.13.0\ntransformers==5.9.0\n")
    assert usage.transformers_range(pyproject, lock) == usage.TransformersRange("5.1", "5.9.0")
    lock.write_text("torch==2.13.0\n")
    with pytest.raises(ValueError, match="pins no transformers"):
        usage.transformers_range(pyproject, lock)
    pyproject.write_text('[project]\ndependencies = ["transformers"]\n')
    with pytest.raises(ValueError, match="one floor"):
        usage.transformers_range(pyproject, lock)


def test_hugging_faces_kernels_is_never_our_folder():
    """From the repository root, where pytest runs: `kernels` is Hugging Face's where installed,
    and transformers' verdict on Hub kernels follows that distribution, not ours."""
    pytest.importorskip("transformers")
    beside = usage.beside_hub_kernels()
    installed = "kernels" in usage.importlib.metadata.packages_distributions().get("kernels", [])
    assert (beside.hub_kernels is not None) == installed
    if installed:
        assert beside.hub_kernels_available is True
    if beside.requires:  # transformers >= 5.25 requires it
        assert beside.hub_kernels is not None


def test_the_use_page_states_the_facts_and_every_page_links_it(published_site):
    page = (published_site / USE_PAGE).read_text()
    shown = usage.supported()
    tested = usage.transformers_range()
    assert ", ".join(shown.dtypes) in page and shown.head_dims in page
    assert "varlen_workbench.kernels.hf.register()" in page and 'attn_implementation="varlen_contract"' in page
    assert "from varlen_workbench.kernels.varlen import varlen_attention" in page
    assert f"<code>{usage.distribution().name}</code>" in page and 'pip install ".[fa4]"' in page
    assert "pip install . -c installed.txt" in page and f"{tested.oldest} to {tested.newest}" in page
    assert "from kernels import get_kernel" in page and "separate environments" not in page
    unlinked = [p.name for p in published_site.glob("*.html") if p.name != USE_PAGE and f'href="{USE_PAGE}"' not in p.read_text()]
    assert unlinked == []
