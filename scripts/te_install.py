"""TransformerEngine 2.20.2 on the GPU machine: probe the image, build its PyTorch extension, check the import.

    python3 scripts/te_install.py probe --src .whl/te-src --record $OUT/te-probe-h200.json
    python3 scripts/te_install.py build --src .whl/te-src --record $OUT/te-install-h200.json --out $OUT
    python3 scripts/te_install.py reuse --ext .whl/te-ext --record $OUT/te-install-h200.json
    python3 scripts/te_install.py check

Run on the device after the wheels of scripts/te_pack.sh are installed (`source /tmp/gpuw/env.sh`
puts them on PYTHONPATH); the steps, call by call, with their cost: docs/gpu-transformer-engine.md.

- probe (needs only the image and .whl/te-src): compilers and versions, where each header the
  build includes lies, which of the carried packages' requirements the image satisfies, and what
  `pip install --dry-run` of the three parts says (the wheels as metadata-only stubs, the sdist
  whose metadata TE's setup.py prepares with the image's torch).
- build: transformer-engine-torch's sdist compiled against the image's torch (`pip wheel
  --no-build-isolation`, MAX_JOBS = the machine's cores), installed beside the wheels in
  /tmp/site; the built wheel goes to --out cut into parts under 16 MiB (the device returns no
  larger file), so a later call carries it back (`reuse`) instead of compiling again. Then `check`.
- check: `import transformer_engine.pytorch` in a fresh process, with the versions TE reports.

Every step writes one JSON record (varlen_workbench.workbench.records, with provenance) and prints it. A failed
build records its command and the log's last lines, and exits 1.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = Path("/tmp/site")  # where gpu-wheels-install.sh installs the carried wheels (--target)
BUILD = Path("/tmp/te-build")
PART_BYTES = 15 << 20  # the device returns files of at most 16 MiB
# The headers transformer_engine_torch 2.20.2 includes beyond torch's own, read in its sdist:
# csrc/extensions.h (nccl.h), csrc/common.h -> common/util/logging.h (cublas_v2.h,
# cuda_runtime_api.h, cudnn.h, nvrtc.h), common/common.h (cuda.h, cudaTypedefs.h, cuda_fp8.h,
# cuda_fp4.h), common/cudnn_min_version.h (cudnn.h, >= 9.12).
HEADERS = (
    "cuda.h",
    "cudaTypedefs.h",
    "cuda_runtime_api.h",
    "cuda_fp8.h",
    "cuda_fp4.h",
    "cublas_v2.h",
    "nvrtc.h",
    "cudnn.h",
    "nccl.h",
)
# The build's environment, and why each variable:
BUILD_ENV = {
    "NVTE_FRAMEWORK": "pytorch",  # build (and later load) only the PyTorch extension
    # setup.py first tries to download a prebuilt wheel from GitHub; the device reaches no network.
    "NVTE_PYTORCH_FORCE_BUILD": "TRUE",
    # The expert-parallel bindings (ep.cpp) include torch's NCCL symmetric-memory headers; nothing
    # here uses them, and without the define the file compiles to nothing (pybind.cpp guards them).
    "NVTE_WITH_NCCL_EP": "0",
}


# -- where things are ---------------------------------------------------------------------


def nvcc() -> Path | None:
    """The nvcc TE's build would find: CUDA_HOME's, then PATH's, then /usr/local/cuda's."""
    for candidate in (
        Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc" if os.environ.get("CUDA_HOME") else None,
        Path(found) if (found := shutil.which("nvcc")) else None,
        Path("/usr/local/cuda/bin/nvcc"),
    ):
        if candidate is not None and candidate.is_file():
            return candidate.resolve()
    return None


def include_candidates(site_dirs: Iterable[str | Path], toolkit: Path | None) -> list[Path]:
    """Directories that may hold the build's headers, most preferred first: the toolkit of the nvcc
    found, /usr/local/cuda, every `nvidia/*/include` of the Python packages (CUDA 13's wheels put the
    toolkit in nvidia/cu13, cuDNN in nvidia/cudnn, NCCL in nvidia/nccl), then /usr/include."""
    found = [toolkit / "include"] if toolkit else []
    found.append(Path("/usr/local/cuda/include"))
    for site in site_dirs:
        found += sorted(Path(p) for p in glob.glob(str(Path(site) / "nvidia" / "*" / "include")))
    found.append(Path("/usr/include"))
    unique: list[Path] = []
    for path in found:
        if path.is_dir() and path not in unique:
            unique.append(path)
    return unique


def locate_headers(candidates: list[Path], headers: Iterable[str] = HEADERS) -> dict[str, str | None]:
    """Each header: the first candidate directory holding it, or None."""
    return {h: next((str(d) for d in candidates if (d / h).is_file()), None) for h in headers}


def extra_include_dirs(located: dict[str, str | None], toolkit_include: Path | None) -> list[str]:
    """The directories to add (CPATH) for headers the toolkit's own include lacks, in order.

    TE's setup.py puts only the toolkit's include on the command line; the compiler searches
    CPATH after it, so a header present in both still comes from the toolkit."""
    extra: list[str] = []
    for directory in located.values():
        if directory is not None and directory != str(toolkit_include) and directory not in extra:
            extra.append(directory)
    return extra


def missing_headers(located: dict[str, str | None]) -> list[str]:
    return [h for h, d in located.items() if d is None]


# -- carried parts ------------------------------------------------------------------------


def manifest(src: Path) -> dict:
    """scripts/te_pack.sh's manifest.json in `src`, checked to name an sdist that is there."""
    path = src / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run scripts/te_pack.sh here and carry .whl/te-src in the call")
    data = json.loads(path.read_text())
    if not (src / data["sdist"]["file"]).is_file():
        raise FileNotFoundError(f"{src / data['sdist']['file']} is missing: carry the whole .whl/te-src folder")
    return data


def _requirement_name(requirement: str) -> tuple[str, str]:
    """('pydantic', '>=2') from 'pydantic>=2' (markers already dropped)."""
    match = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(.*)", requirement)
    if not match:
        raise ValueError(f"cannot read the requirement {requirement!r}")
    return match.group(1), match.group(2).strip()


def requirement_table(carried: dict, installed: Callable[[str], str | None]) -> list[dict]:
    """Every unconditional requirement of the carried parts (the wheels' and the sdist's Requires-Dist),
    with the image's installed version (`installed(name)`) and the carried wheel that provides it."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    provided = {}
    for wheel in carried["wheels"]:
        name, version = wheel["file"].split("-")[:2]
        provided[canonicalize_name(name)] = version
    requirements = [(w["file"], r) for w in carried["wheels"] for r in w["requires"]]
    requirements += [(carried["sdist"]["file"], r) for r in carried["sdist"].get("requires", [])]
    rows = []
    for source, text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement, or another platform's
        name = canonicalize_name(requirement.name)
        image = installed(name)
        carried_version = provided.get(name)
        met_by = next(
            (
                where
                for where, v in (("image", image), ("carried", carried_version))
                if v and requirement.specifier.contains(v, prereleases=True)
            ),
            None,
        )
        rows.append({"needed_by": source, "requirement": text, "image": image, "carried": carried_version, "met_by": met_by})
    return rows


def sdist_requirements(sdist: Path) -> list[str]:
    """The sdist's PKG-INFO Requires-Dist lines."""
    with tarfile.open(sdist) as tar:
        info = next(m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
        handle = tar.extractfile(info)
        text = handle.read().decode() if handle else ""
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def split(path: Path, into: Path, part_bytes: int = PART_BYTES) -> list[str]:
    """`path` cut into `into/<name>.partNNofMM` files of at most `part_bytes`; the part names."""
    data, into = path.read_bytes(), Path(into)
    count = max(1, -(-len(data) // part_bytes))
    names = [f"{path.name}.part{i:02d}of{count:02d}" for i in range(count)]
    for i, name in enumerate(names):
        (into / name).write_bytes(data[i * part_bytes : (i + 1) * part_bytes])
    return names


def join(directory: Path, name: str, sha256: str, into: Path) -> Path:
    """The file `name` rebuilt from its parts in `directory`, checked against `sha256`."""
    parts = sorted(Path(directory).glob(f"{name}.part*of*"))
    if not parts:
        raise FileNotFoundError(f"no parts of {name} in {directory}: carry the folder the build call's parts were put in")
    expected = int(parts[0].name.rsplit("of", 1)[1])
    if len(parts) != expected:
        raise FileNotFoundError(f"{len(parts)} of {expected} parts of {name} in {directory}: carry all of them")
    data = b"".join(p.read_bytes() for p in parts)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(
            f"{name} rebuilt from {directory} does not match its recorded sha256 {sha256}: the parts are from another build"
        )
    target = Path(into) / name
    target.write_bytes(data)
    return target


# -- commands -----------------------------------------------------------------------------


def _run(command: list[str], **kwargs) -> tuple[int, str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=kwargs.pop("timeout", 300), **kwargs)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, f"{type(exc).__name__}: {exc}"
    return done.returncode, (done.stdout + done.stderr).strip()


def _first_line(command: list[str]) -> str | None:
    rc, text = _run(command)
    return text.splitlines()[0] if rc == 0 and text else None


def _last_line(command: list[str]) -> str | None:
    rc, text = _run(command)
    return text.splitlines()[-1] if rc == 0 and text else None


def _site_dirs() -> list[str]:
    import site

    return [p for p in [*site.getsitepackages(), *sys.path] if p and Path(p).is_dir()]


def _installed(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def toolchain() -> dict:
    """Compilers, CUDA and torch as the build sees them."""
    import torch

    found = nvcc()
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "torch_cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None,
        "nvcc": str(found) if found else None,
        "nvcc_version": _last_line([str(found), "--version"]) if found else None,
        "cxx": _first_line([os.environ.get("CXX", "c++"), "--version"]),
        "ninja": _first_line(["ninja", "--version"]),
        "cmake": _first_line(["cmake", "--version"]),
        "cores": os.cpu_count(),
    }


def headers() -> dict:
    found = nvcc()
    toolkit = found.parent.parent if found else None
    located = locate_headers(include_candidates(_site_dirs(), toolkit))
    return {
        "toolkit_include": str(toolkit / "include") if toolkit else None,
        "located": located,
        "missing": missing_headers(located),
        "cpath": extra_include_dirs(located, toolkit / "include" if toolkit else None),
    }


def dry_run(src: Path, carried: dict) -> dict:
    """`pip install --dry-run` of the core wheel, the metapackage and the sdist against the image,
    the wheels as metadata-only stubs, the sdist's metadata prepared by TE's setup.py."""
    te = carried["te"]
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--no-index", "--find-links", str(src / "stubs")]
    command += ["--no-build-isolation", "--report", "-", f"transformer-engine-cu13=={te}", f"transformer-engine=={te}"]
    command.append(str(src / carried["sdist"]["file"]))
    try:  # --quiet: stdout holds the report alone
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **BUILD_ENV}, timeout=240)
    except subprocess.TimeoutExpired:
        return {"command": shlex.join(command[1:]), "rc": None, "would_install": None, "tail": ["timed out after 240 s"]}
    try:
        install = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in json.loads(done.stdout)["install"]]
    except (ValueError, KeyError):
        install = None
    tail = (done.stderr or done.stdout).strip().splitlines()[-25:]
    return {"command": shlex.join(command[1:]), "rc": done.returncode, "would_install": install, "tail": tail}


def probe(src: Path) -> dict:
    carried = manifest(src)
    carried["sdist"]["requires"] = sdist_requirements(src / carried["sdist"]["file"])
    _, df = _run(["df", "-h", "/tmp", str(ROOT)])
    _, cache = _run(["ldconfig", "-p"])
    return {
        "toolchain": toolchain(),
        "headers": headers(),
        # TE's core library needs these at load time (cudnn, nvrtc and curand it loads itself)
        "loader_sees": [
            line.strip() for line in cache.splitlines() if re.search(r"lib(cudnn|nccl|nvrtc|curand|cublas|cudart)\.so", line)
        ],
        "requirements": requirement_table(carried, _installed),
        "dry_run": dry_run(src, carried),
        "disk": df.splitlines(),
    }


def check() -> dict:
    """`import transformer_engine.pytorch` in a fresh process (a crash is an answer, not a lost run)."""
    code = (
        "import json, importlib.metadata as m, torch, transformer_engine.pytorch as te\n"
        "fp8, why = te.is_fp8_available(return_reason=True)\n"
        "print(json.dumps({'transformer_engine': {n: m.version(n) for n in "
        "('transformer-engine', 'transformer-engine-cu13', 'transformer-engine-torch')}, "
        "'extension': __import__('transformer_engine_torch').__file__, "
        "'cudnn': list(te.get_cudnn_version()), 'fp8_available': [fp8, why], "
        "'fp8_block_scaling_available': list(te.is_fp8_block_scaling_available(return_reason=True))}))\n"
    )
    began = time.perf_counter()
    rc, text = _run([sys.executable, "-c", code], timeout=300)
    seconds = round(time.perf_counter() - began, 1)
    lines = text.splitlines()
    if rc == 0 and lines and lines[-1].startswith("{"):
        return {"imports": True, "seconds": seconds, **json.loads(lines[-1])}
    return {"imports": False, "rc": rc, "seconds": seconds, "tail": lines[-25:]}


def build(src: Path, out: Path | None, jobs: int) -> dict:
    carried = manifest(src)
    shutil.rmtree(BUILD, ignore_errors=True)
    BUILD.mkdir(parents=True)
    found = headers()
    if found["missing"]:
        return {"built": False, "stage": "headers", "headers": found, "why": f"no directory holds {found['missing']}"}
    env = {**os.environ, **BUILD_ENV, "MAX_JOBS": str(jobs)}
    env["CPATH"] = os.pathsep.join([*found["cpath"], *filter(None, [os.environ.get("CPATH")])])
    command = [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "--no-index"]
    # pip runs in BUILD, so a relative --src (the runbook's `.whl/te-src`) must be made absolute.
    command += ["-w", str(BUILD / "dist"), str((src / carried["sdist"]["file"]).resolve())]
    log = (out or BUILD) / "te-build.log"
    began = time.perf_counter()
    with log.open("w") as sink:
        rc = subprocess.run(command, cwd=BUILD, env=env, stdout=sink, stderr=subprocess.STDOUT).returncode
    seconds = round(time.perf_counter() - began, 1)
    record = {
        "toolchain": toolchain(),
        "headers": found,
        "env": {k: env[k] for k in [*BUILD_ENV, "MAX_JOBS", "CPATH"]},
        "command": " ".join(command[1:]),
        "seconds": seconds,
        "rc": rc,
        "log": log.name,
    }
    built = sorted((BUILD / "dist").glob("transformer_engine_torch-*.whl"))
    if rc != 0 or not built:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        return {**record, "built": False, "stage": "compile", "tail": tail}
    wheel = built[0]
    record |= {"built": True, "wheel": wheel.name, "wheel_bytes": wheel.stat().st_size}
    record["wheel_sha256"] = hashlib.sha256(wheel.read_bytes()).hexdigest()
    record["install"] = install(wheel)
    if out is not None:
        record["parts"] = split(wheel, out)
    return {**record, "check": check()}


def install(wheel: Path) -> dict:
    """The built wheel merged into SITE. Its extension lies in transformer_engine/wheel_lib (where TE
    looks for it), inside the core wheel's package: `pip install --target --upgrade` would replace
    that whole folder, so the wheel goes to a folder of its own and is copied over, merging."""
    alone = BUILD / "installed"
    shutil.rmtree(alone, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(alone)]
    rc, text = _run([*command, str(wheel)])
    if rc == 0:
        shutil.copytree(alone, SITE, dirs_exist_ok=True)
    files = sorted(str(p.relative_to(alone)) for p in alone.rglob("*.so")) if alone.exists() else []
    return {"rc": rc, "into": str(SITE), "extension": files, "tail": text.splitlines()[-5:]}


def reuse(ext: Path) -> dict:
    """The wheel of an earlier build, from its parts and record in `ext`, installed and checked."""
    records = sorted(ext.glob("te-install-*.json"))
    if not records:
        raise FileNotFoundError(f"no te-install-*.json in {ext}: put the build call's record beside its parts")
    built = json.loads(records[-1].read_text())
    BUILD.mkdir(parents=True, exist_ok=True)
    wheel = join(ext, built["wheel"], built["wheel_sha256"], BUILD)
    return {"reused": records[-1].name, "wheel": wheel.name, "install": install(wheel), "check": check()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("probe", "build", "reuse", "check"))
    parser.add_argument("--src", type=Path, default=ROOT / ".whl" / "te-src", help="scripts/te_pack.sh's te-src folder")
    parser.add_argument("--ext", type=Path, default=ROOT / ".whl" / "te-ext", help="an earlier build's parts and record")
    parser.add_argument("--out", type=Path, help="where the build's log and wheel parts go ($OUT on the device)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compilations (default: every core)")
    parser.add_argument("--record", type=Path, help="write the step's JSON record here (with provenance)")
    args = parser.parse_args()
    if args.step == "probe":
        result = probe(args.src)
    elif args.step == "build":
        result = build(args.src, args.out, args.jobs)
    elif args.step == "reuse":
        result = reuse(args.ext)
    else:
        result = check()
    result = {"step": args.step, **result}
    print(json.dumps(result, indent=1))
    if args.record:
        from varlen_workbench.workbench.records import write_record

        write_record(args.record, result, command=shlex.join(["python3", "scripts/te_install.py", *sys.argv[1:]]))
    return 0 if succeeded(result) else 1


def succeeded(result: dict) -> bool:
    """A probe always succeeds (its record is the answer); a build must build, and every step that
    imports TE must import it."""
    if result.get("built") is False:
        return False
    imported = result.get("check", result).get("imports")
    return imported is not False


if __name__ == "__main__":
    sys.exit(main())
