"""Provenance: the versions, device and commit that every recorded result carries."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch
import triton

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.runtime import interpreted

REPO = Path(__file__).resolve().parent.parent
GPU_DATA = REPO / "data" / "gpu"  # results recorded on GPU machines, each with its provenance


def git_commit() -> str:
    """The short commit, with "-dirty" when the working tree differs from it (a copied tree's
    stale .git says so too, instead of naming a commit that is not what ran).

    `WORKBENCH_COMMIT` overrides it: a GPU machine receives a copy of the working tree whose .git
    may be older than the tree, so the caller names the commit it sent.
    """
    if os.environ.get("WORKBENCH_COMMIT"):
        return os.environ["WORKBENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def provenance(device: torch.device | str | None = None) -> dict[str, str]:
    """Where and with what a result was produced, on `device` (default: the default device)."""
    device = torch.device(device) if device is not None else default_device()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": device_name(device),
        "mode": "Triton interpreter" if interpreted(device) else "native",
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
