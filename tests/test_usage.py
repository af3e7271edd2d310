"""The "Use the fixed kernel" page: install, call, the Hugging Face swap, the supported range and the
name clash, each read from the code or the environment (workbench.usage), and linked from every page."""

from __future__ import annotations

import pytest

from workbench import usage
from workbench.site import USE_PAGE


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
    from kernels.varlen import DTYPES, HEAD_DIMS

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


def test_transformers_reads_our_package_as_its_hub_kernels():
    """Our import name is Hugging Face's too: transformers finds ours, reads our distribution's
    version, and (below its minimum) treats Hub kernels as absent."""
    pytest.importorskip("transformers")
    from packaging.version import Version

    clash = usage.name_clash()
    assert clash.our_version == usage.importlib.metadata.version(usage.distribution().name)
    assert clash.hub_kernels_available == (Version(clash.our_version) >= Version(clash.hub_min_version))


def test_the_use_page_states_the_facts_and_every_page_links_it(published_site):
    page = (published_site / USE_PAGE).read_text()
    shown = usage.supported()
    assert ", ".join(shown.dtypes) in page and shown.head_dims in page
    assert "kernels.hf.register()" in page and 'attn_implementation="varlen_contract"' in page
    assert f"<code>{usage.distribution().name}</code>" in page and 'pip install ".[fa4]"' in page
    assert "pip install kernels" in page and "separate environments" in page
    unlinked = [p.name for p in published_site.glob("*.html") if p.name != USE_PAGE and f'href="{USE_PAGE}"' not in p.read_text()]
    assert unlinked == []
