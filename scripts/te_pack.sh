#!/usr/bin/env bash
# TransformerEngine 2.20.2 packed for the GPU machine, which reaches no package index (this one does).
# The steps on the device, call by call: docs/gpu-transformer-engine.md.
#
#   scripts/te_pack.sh [OUT]        # OUT: .whl (git-ignored); writes OUT/te/1..N and OUT/te-src
#
# OUT/te/1..N   ../shared/tools/gpu-wheels.sh's folders (one device call each, <= 48 MB): the core
#               library transformer-engine-cu13 (a 276 MB wheel, cut into 40 MB parts), the
#               metapackage transformer-engine (TE's import asserts it is installed from a wheel at
#               the core's version), and what the image lacks of their runtime dependencies.
# OUT/te-src    the transformer-engine-torch sdist (compiled on the device against the image's
#               torch by scripts/te_install.py build), metadata-only copies of every wheel above
#               (stubs/: the same METADATA, no files) for the probe's `pip install --dry-run`, and
#               manifest.json (file names, sizes, sha256, Requires-Dist, how the sdist was fetched).
#
# Not carried: nvidia-cudnn-frontend, which transformer-engine-torch's metadata names (>= 1.29):
# TE 2.20.2 imports it only inside its grouped-MLP and MLA (sm100) paths, never for
# DotProductAttention, and its own dependencies (nvidia-cutlass-dsl) would add device calls. The
# probe's dry run shows it missing; the packages are installed with --no-deps.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/.whl}
TE=2.20.2
# TE's runtime dependencies the image lacks, pinned (resolved for CPython 3.12 on 2026-12-05):
# pydantic (transformer_engine.common.recipe imports it) with what it needs; typing-extensions
# because pydantic-core 2.50 needs >= 4.16 (a newer one on PYTHONPATH is harmless to the image);
# nvdlfw-inspect (named by transformer-engine-torch; TE's debug features import it); importlib-metadata
# (named by transformer-engine-cu13, which imports the standard library's importlib.metadata instead;
# 8.7.0, the last release that needs no more than zipp, which the image has).
DEPS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      typing-extensions==4.16.0 nvdlfw-inspect==0.2.2 importlib-metadata==8.7.0)

wheels=""
for candidate in "${GPU_WHEELS:-}" "$root/../shared/tools/gpu-wheels.sh" "$root/../../shared/tools/gpu-wheels.sh"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ]; then wheels=$candidate; break; fi
done
[ -n "$wheels" ] || { echo "te_pack: gpu-wheels.sh not found beside the repository; set GPU_WHEELS=/path/to/gpu-wheels.sh" >&2; exit 2; }

"$wheels" "$out/te" "transformer-engine-cu13==$TE" "transformer-engine==$TE" "${DEPS[@]}"

src=$out/te-src
rm -rf "$src" && mkdir -p "$src/stubs"
# pip download of an sdist first prepares its metadata, which runs TE's setup.py: it imports torch
# and looks for CUDA, so it fails on a machine without them (the log says how). Then the file is
# fetched as pip would: the index's JSON page (PEP 691) gives its URL and sha256, checked here.
if python3 -m pip download -q --no-deps --no-binary :all: -d "$src" "transformer-engine-torch==$TE" >"$src/pip-download.log" 2>&1; then
  how="pip download --no-deps --no-binary :all:"
else
  how="the index's JSON page (PEP 691) and sha256, after pip download failed preparing its metadata"
  echo "te_pack: pip download of the sdist failed (last lines below); fetching it from the index's JSON page" >&2
  tail -n 5 "$src/pip-download.log" >&2
fi
python3 - "$out" "$TE" "$how" <<'PY'
import hashlib, json, sys, urllib.request, zipfile
from pathlib import Path

out, te, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
src = out / "te-src"
sdist = src / f"transformer_engine_torch-{te}.tar.gz"
page = None
if not sdist.exists():
    request = urllib.request.Request(
        "https://pypi.org/simple/transformer-engine-torch/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    page = json.load(urllib.request.urlopen(request, timeout=120))
    entry = next(f for f in page["files"] if f["filename"] == sdist.name)
    data = urllib.request.urlopen(entry["url"], timeout=300).read()
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        sys.exit(f"te_pack: {sdist.name}: sha256 differs from the index's {entry['hashes']['sha256']}")
    sdist.write_bytes(data)


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stub(wheel: Path) -> list[str]:
    """A copy of `wheel` holding only its METADATA and WHEEL files (pip resolves from METADATA alone)."""
    with zipfile.ZipFile(wheel) as whl:
        info = next(n.split("/")[0] for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        metadata, tags = whl.read(f"{info}/METADATA"), whl.read(f"{info}/WHEEL")
    with zipfile.ZipFile(src / "stubs" / wheel.name, "w") as copy:
        copy.writestr(f"{info}/METADATA", metadata)
        copy.writestr(f"{info}/WHEEL", tags)
        copy.writestr(f"{info}/RECORD", f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return [line.split(":", 1)[1].strip() for line in metadata.decode().splitlines() if line.startswith("Requires-Dist:")]


wheels = sorted((out / "te" / "all").glob("*.whl"))
manifest = {
    "te": te,
    "sdist": {"file": sdist.name, "bytes": sdist.stat().st_size, "sha256": sha256(sdist), "fetched_by": how},
    "wheels": [{"file": w.name, "bytes": w.stat().st_size, "sha256": sha256(w), "requires": stub(w)} for w in wheels],
    "calls": sorted(int(p.name) for p in (out / "te").iterdir() if p.name.isdigit()),
}
(src / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
print(f"{src}: the sdist, {len(wheels)} stub wheel(s) and manifest.json, {size / 2**20:.1f} MB")
PY
