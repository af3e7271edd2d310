"""How to get the fixed kernel: the facts the site's "Use the fixed kernel" page states, read from
the code and the environment at build time, never typed.

* `distribution()`: the name, extras and source address in pyproject.toml (no public address yet:
  the page says "from a clone of this repository");
* `supported()`: the dtypes and head dims `varlen_workbench.kernels.varlen.varlen_attention` takes
  (`varlen_workbench.kernels.varlen.DTYPES`, `HEAD_DIMS`), head dims said as runs ("8 to 256 in steps of 8");
* `transformers_range()`: the transformers versions the swap is tested on: the floor pyproject.toml
  declares and the lock's (tests/test_install.py installs both);
* `beside_hub_kernels()`: Hugging Face's `kernels` (which transformers 5.25 and later require) next to
  ours in this environment, as transformers sees it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import tomllib

from varlen_workbench.workbench.provenance import REPO

IMPORT_NAME = "varlen_workbench"  # our one top-level import name (pyproject.toml, [tool.setuptools])
HF_DISTRIBUTION = "kernels"  # Hugging Face's Hub-kernel loader on PyPI (`pip install kernels`; `from kernels import get_kernel`)
LOCK = REPO / "requirements" / "cpu.lock"
SOURCE_KEYS = ("Source", "Repository", "Homepage")  # [project.urls] keys that name where the code lives
# The extras a user of the kernel may want (the others, lab and test, serve the workbench's own tests).
USER_EXTRAS = {"fa4": "FlashAttention-4 behind the contract's wrapper on Hopper and Blackwell: backend='fa4' or 'auto'"}


@dataclass(frozen=True)
class Distribution:
    name: str
    extras: dict[str, list[str]]  # extra -> its requirements
    source: str | None  # the repository's address, None while it has no public home


def distribution(pyproject: Path = REPO / "pyproject.toml") -> Distribution:
    """Our distribution as pyproject.toml declares it."""
    with open(pyproject, "rb") as handle:
        project = tomllib.load(handle)["project"]
    urls = project.get("urls", {})
    source = next((urls[key] for key in SOURCE_KEYS if key in urls), None)
    return Distribution(project["name"], dict(project.get("optional-dependencies", {})), source)


def user_extras(dist: Distribution) -> dict[str, str]:
    """{extra: what it adds} for the extras a kernel user may install; an extra gone from pyproject.toml raises."""
    missing = set(USER_EXTRAS) - set(dist.extras)
    if missing:
        raise ValueError(
            f"pyproject.toml declares no extra {sorted(missing)}; update varlen_workbench.workbench.site.usage.USER_EXTRAS."
        )
    return dict(USER_EXTRAS)


def runs(values: tuple[int, ...]) -> str:
    """Sorted integers said briefly: arithmetic runs of 4 or more as "8 to 256 in steps of 8", the rest listed."""
    values = tuple(sorted(set(values)))
    parts, i = [], 0
    while i < len(values):
        j = i + 1
        if j < len(values):
            step = values[j] - values[i]
            while j + 1 < len(values) and values[j + 1] - values[j] == step:
                j += 1
            if j - i + 1 >= 4:
                parts.append(f"{values[i]} to {values[j]} in steps of {step}")
                i = j + 1
                continue
        parts.append(str(values[i]))
        i += 1
    return ", ".join(parts)


@dataclass(frozen=True)
class Supported:
    dtypes: tuple[str, ...]  # "float16", ...
    head_dims: str  # as `runs` says them


def supported() -> Supported:
    """What `varlen_workbench.kernels.varlen.varlen_attention` takes, from the constants its input checks use."""
    from varlen_workbench.kernels.varlen import DTYPES, HEAD_DIMS

    return Supported(tuple(str(dtype).removeprefix("torch.") for dtype in DTYPES), runs(tuple(HEAD_DIMS)))


@dataclass(frozen=True)
class TransformersRange:
    """The transformers versions the swap is tested on, both ends in CI (tests/test_install.py)."""

    oldest: str  # the floor pyproject.toml declares ("4.51": its newest patch release is installed)
    newest: str  # the lock's: what `make test` runs


def transformers_range(pyproject: Path = REPO / "pyproject.toml", lock: Path = LOCK) -> TransformersRange:
    """The floor of pyproject.toml's `transformers>=X` requirement, and the version the lock pins."""
    with open(pyproject, "rb") as handle:
        project = tomllib.load(handle)["project"]
    declared = [*project["dependencies"], *(r for extra in project.get("optional-dependencies", {}).values() for r in extra)]
    floors = {m[1] for r in declared if (m := re.fullmatch(r"transformers\s*>=\s*([\d.]+)(?:\s*[,;].*)?", r.strip()))}
    if len(floors) != 1:
        raise ValueError(
            f"pyproject.toml must declare transformers with one floor (transformers>=X), found {sorted(floors) or 'none'}."
        )
    pinned = re.search(r"^transformers==(\S+)$", lock.read_text(), flags=re.MULTILINE)
    if pinned is None:
        raise ValueError(f"{lock.name} pins no transformers; run `.venv/bin/python scripts/lock.py`.")
    return TransformersRange(floors.pop(), pinned[1])


@dataclass(frozen=True)
class Beside:
    """Hugging Face's `kernels` next to ours in this environment, as transformers sees it."""

    transformers: str | None  # transformers' version, None when it is not installed
    requires: str | None  # transformers' own requirement on Hugging Face's `kernels`, None where it has none
    hub_kernels: str | None  # Hugging Face's `kernels` distribution's version, None when it is not installed
    hub_kernels_available: bool | None  # transformers' verdict on Hub kernels here (None without transformers)


def beside_hub_kernels() -> Beside:
    """Asks transformers, as it asks itself, whether Hub kernels are available where ours is installed.
    `import kernels` must never find a folder of this repository: that is a packaging bug, raised."""
    spec = importlib.util.find_spec("kernels")
    if spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(REPO / "kernels"):
        raise RuntimeError(f"`import kernels` finds {spec.origin}, our folder: ours is {IMPORT_NAME}.kernels alone.")
    try:
        hub = importlib.metadata.version(HF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        hub = None
    try:
        import transformers
        from transformers.utils import import_utils
    except ImportError:
        return Beside(None, None, hub, None)
    needs = [r for r in importlib.metadata.requires("transformers") or [] if _named(r, HF_DISTRIBUTION) and "extra ==" not in r]
    probe = getattr(import_utils, "is_kernels_available", None)  # transformers before 4.54 does not ask
    return Beside(transformers.__version__, needs[0] if needs else None, hub, probe() if probe else None)


def _named(requirement: str, name: str) -> bool:
    """Whether a Requires-Dist line names distribution `name`."""
    found = re.match(r"[A-Za-z0-9._-]+", requirement)
    return found is not None and found[0].lower() == name


__all__ = [
    "HF_DISTRIBUTION",
    "IMPORT_NAME",
    "USER_EXTRAS",
    "Beside",
    "Distribution",
    "Supported",
    "TransformersRange",
    "beside_hub_kernels",
    "distribution",
    "runs",
    "supported",
    "transformers_range",
    "user_extras",
]
