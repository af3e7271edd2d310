#!/usr/bin/env bash
# Creates .venv and installs the project into it. Idempotent; run by `make setup`.
#
# Versions come from requirements/cpu.lock (pip constraints, `-c`): every fresh machine gets
# the same environment. torch: on a machine that already has torch >= 2.10 (the GPU box) the
# venv sees it through --system-site-packages and nothing is reinstalled (the lock's torch and
# triton lines are dropped there). Otherwise the lock pins PyTorch's CPU wheel of torch 2.13.0
# (PyPI's is a multi-GB CUDA build; the lock's header names where the CPU wheel comes from)
# and triton 3.6.0, the version on the GPU machine, so the interpreter and the native compiler
# agree. After changing a dependency: `.venv/bin/python scripts/lock.py` rewrites the lock.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
has_torch() {
    "$1" - <<'PY' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 10) else 1)
PY
}

if [ ! -x .venv/bin/python ]; then
    if has_torch "$PYTHON"; then
        "$PYTHON" -m venv --system-site-packages .venv
    else
        "$PYTHON" -m venv .venv
    fi
fi
LOCK=requirements/cpu.lock
if has_torch "$PYTHON" && has_torch .venv/bin/python; then
    # The machine's own torch and triton stay; everything else as locked.
    CONSTRAINTS=.venv/constraints.txt
    grep -Ev '^(torch|triton)==' "$LOCK" >"$CONSTRAINTS"
else
    CONSTRAINTS=$LOCK
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q -c "$CONSTRAINTS")
if ! has_torch .venv/bin/python; then
    "${PIP[@]}" torch triton
fi
"${PIP[@]}" -e ".[lab,test]"
# The `upstream` extra (pyproject.toml): the upstream code a post-mortem runs. --no-deps keeps pip
# from replacing torch; the environment builds flash-dmattn's pure-Python backends without CUDA.
UPSTREAM=$(.venv/bin/python - <<'PY'
import re
extras = open("pyproject.toml").read().split("[project.optional-dependencies]")[1]
block = re.search(r"^upstream = \[(.*?)^\]", extras, re.S | re.M).group(1)
print(" ".join(re.findall(r'^\s*"([^"]+)"', block, re.M)))
PY
)
"${PIP[@]}" setuptools wheel packaging  # what flash-dmattn's setup.py imports (no build isolation)
FLASH_DMATTN_SKIP_CUDA_BUILD=TRUE FLASH_DMATTN_FORCE_BUILD=TRUE \
    "${PIP[@]}" --no-deps --no-build-isolation $UPSTREAM
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
# mypy does not follow setuptools' editable finder: it reads the folders under their import
# names through these links (pyproject.toml, [tool.mypy] mypy_path).
mkdir -p .venv/typecheck/varlen_workbench
for folder in kernels workbench postmortems; do
    ln -sfn "../../../$folder" ".venv/typecheck/varlen_workbench/$folder"
done
touch .venv/.installed
