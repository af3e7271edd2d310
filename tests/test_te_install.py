"""scripts/te_install.py's logic on the CPU: where the build's headers are, what the image lacks of the
carried packages' requirements, the built wheel cut into parts and rebuilt. The build itself runs on
the GPU machine (docs/gpu-transformer-engine.md)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import tarfile
import zipfile

import pytest

from varlen_workbench.workbench.provenance import REPO


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("te_install", REPO / "scripts" / "te_install.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _headers(directory, *names):
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_text("")
    return directory


def test_headers_come_from_the_toolkit_first_and_the_wheels_fill_in(script, tmp_path):
    """CUDA 13's wheels: the toolkit in nvidia/cu13, cuDNN in nvidia/cudnn, NCCL in nvidia/nccl."""
    toolkit = tmp_path / "cuda"
    _headers(toolkit / "include", "cuda.h", "cudaTypedefs.h", "cuda_runtime_api.h", "cuda_fp8.h", "cuda_fp4.h", "nvrtc.h")
    site = tmp_path / "site"
    _headers(site / "nvidia" / "cu13" / "include", "cuda.h", "cublas_v2.h", "nvrtc.h")
    _headers(site / "nvidia" / "cudnn" / "include", "cudnn.h")
    _headers(site / "nvidia" / "nccl" / "include", "nccl.h")
    (site / "nvidia" / "nvshmem").mkdir()  # a package without headers is no candidate
    candidates = script.include_candidates([site], toolkit)
    assert candidates[0] == toolkit / "include" and (site / "nvidia" / "nvshmem" / "include") not in candidates
    located = script.locate_headers(candidates)
    assert located["cuda.h"] == str(toolkit / "include")  # the toolkit's, though the wheel has one too
    assert located["cublas_v2.h"] == str(site / "nvidia" / "cu13" / "include")
    assert located["cudnn.h"] == str(site / "nvidia" / "cudnn" / "include")
    assert script.missing_headers(located) == []
    extra = script.extra_include_dirs(located, toolkit / "include")
    assert extra == [str(site / "nvidia" / d / "include") for d in ("cu13", "cudnn", "nccl")]
    (site / "nvidia" / "nccl" / "include" / "nccl.h").unlink()
    assert script.missing_headers(script.locate_headers(candidates)) == ["nccl.h"]


def _carried(tmp_path, requires_dist):
    sdist = tmp_path / "transformer_engine_torch-2.20.2.tar.gz"
    info = "".join(f"Requires-Dist: {r}\n" for r in requires_dist).encode()
    with tarfile.open(sdist, "w:gz") as tar:
        member = tarfile.TarInfo("transformer_engine_torch-2.20.2/PKG-INFO")
        member.size = len(info)
        tar.addfile(member, io.BytesIO(info))
    wheels = [
        {"file": "transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl", "requires": ["pydantic", "packaging"]},
        {"file": "pydantic-2.14.4-py3-none-any.whl", "requires": ["typing-extensions>=4.16.0", 'pytest; extra == "test"']},
        {"file": "typing_extensions-4.16.0-py3-none-any.whl", "requires": []},
    ]
    manifest = {"te": "2.20.2", "sdist": {"file": sdist.name}, "wheels": wheels}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def test_each_requirement_says_whether_the_image_or_the_carried_wheels_meet_it(script, tmp_path):
    _carried(tmp_path, ["torch>=2.1", "einops", "nvidia-cudnn-frontend>=1.29.0", "transformer_engine_cu13==2.20.2"])
    carried = script.manifest(tmp_path)
    carried["sdist"]["requires"] = script.sdist_requirements(tmp_path / carried["sdist"]["file"])
    image = {"torch": "2.11.0+cu130", "packaging": "25.0", "typing-extensions": "4.12.2", "einops": "0.8.1"}
    rows = {r["requirement"]: r for r in script.requirement_table(carried, image.get)}
    assert 'pytest; extra == "test"' not in rows  # an extra's requirement is not the install's
    assert rows["torch>=2.1"]["met_by"] == "image"
    assert rows["typing-extensions>=4.16.0"] == {
        "needed_by": "pydantic-2.14.4-py3-none-any.whl",
        "requirement": "typing-extensions>=4.16.0",
        "image": "4.12.2",
        "carried": "4.16.0",
        "met_by": "carried",  # the image's is too old
    }
    assert rows["pydantic"]["met_by"] == "carried" and rows["transformer_engine_cu13==2.20.2"]["met_by"] == "carried"
    assert rows["nvidia-cudnn-frontend>=1.29.0"]["met_by"] is None


def test_a_missing_manifest_or_sdist_names_what_to_carry(script, tmp_path):
    with pytest.raises(FileNotFoundError, match="run scripts/te_pack.sh here and carry .whl/te-src"):
        script.manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"sdist": {"file": "x.tar.gz"}}))
    with pytest.raises(FileNotFoundError, match="carry the whole .whl/te-src folder"):
        script.manifest(tmp_path)


def test_the_built_wheel_is_cut_into_parts_under_16_mib_and_rebuilt(script, tmp_path):
    wheel = tmp_path / "transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl"
    wheel.write_bytes(bytes(range(256)) * 100)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    out = tmp_path / "out"
    out.mkdir()
    names = script.split(wheel, out, part_bytes=10_000)
    assert names == [f"{wheel.name}.part{i:02d}of03" for i in range(3)]
    assert max((out / n).stat().st_size for n in names) <= 10_000 and script.PART_BYTES < 16 << 20
    (tmp_path / "again").mkdir()
    rebuilt = script.join(out, wheel.name, sha, tmp_path / "again")
    assert rebuilt.read_bytes() == wheel.read_bytes()
    with pytest.raises(ValueError, match="does not match its recorded sha256"):
        script.join(out, wheel.name, "0" * 64, tmp_path / "again")
    (out / names[1]).unlink()
    with pytest.raises(FileNotFoundError, match="2 of 3 parts"):
        script.join(out, wheel.name, sha, tmp_path / "again")


def test_the_build_hands_pip_the_sdist_by_an_absolute_path(script, tmp_path, monkeypatch):
    """pip runs in the build folder: the runbook's relative `--src .whl/te-src` once made it look for
    /tmp/te-build/.whl/te-src/... (the first build call on the H200, 2026-12-07)."""
    src = tmp_path / "te-src"
    src.mkdir()
    (src / "transformer_engine_torch-2.20.2.tar.gz").write_bytes(b"")
    (src / "manifest.json").write_text(json.dumps({"sdist": {"file": "transformer_engine_torch-2.20.2.tar.gz"}}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(script, "BUILD", tmp_path / "build")
    monkeypatch.setattr(script, "headers", lambda: {"missing": [], "cpath": []})
    monkeypatch.setattr(script, "toolchain", lambda: {})
    ran = []
    monkeypatch.setattr(
        script.subprocess, "run", lambda command, **kw: ran.append((command, kw["cwd"])) or type("R", (), {"returncode": 1})
    )
    result = script.build(script.Path("te-src"), None, 1)
    assert result["built"] is False and result["stage"] == "compile"
    ((command, cwd),) = ran
    assert cwd == tmp_path / "build" and command[-1] == str(src / "transformer_engine_torch-2.20.2.tar.gz")


def test_a_step_fails_when_nothing_was_built_or_te_does_not_import(script):
    assert script.succeeded({"step": "probe", "headers": {}})
    assert not script.succeeded({"step": "build", "built": False, "stage": "compile"})
    assert script.succeeded({"step": "build", "built": True, "check": {"imports": True}})
    assert not script.succeeded({"step": "reuse", "check": {"imports": False, "rc": -11}})
    assert not script.succeeded({"step": "check", "imports": False})


def _wheel(path, files):
    info = "transformer_engine_torch-2.20.2.dist-info"
    files = {
        **files,
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: transformer_engine_torch\nVersion: 2.20.2\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            whl.writestr(name, text)
    return path


def test_the_built_extension_joins_the_core_package_without_replacing_it(script, tmp_path, monkeypatch):
    """The extension lies in transformer_engine/wheel_lib, inside the core wheel's package."""
    site = tmp_path / "site"
    _headers(site / "transformer_engine" / "wheel_lib", "libtransformer_engine.so")
    (site / "transformer_engine" / "__init__.py").write_text("# the core's\n")
    monkeypatch.setattr(script, "SITE", site)
    monkeypatch.setattr(script, "BUILD", tmp_path / "build")
    extension = "transformer_engine/wheel_lib/transformer_engine_torch.cpython-312-x86_64-linux-gnu.so"
    wheel = _wheel(tmp_path / "transformer_engine_torch-2.20.2-py3-none-any.whl", {extension: "built"})
    done = script.install(wheel)
    assert done["rc"] == 0 and done["extension"] == [extension], done
    assert (site / extension).read_text() == "built"
    assert (site / "transformer_engine" / "wheel_lib" / "libtransformer_engine.so").exists()
    assert (site / "transformer_engine" / "__init__.py").read_text() == "# the core's\n"
    assert (site / "transformer_engine_torch-2.20.2.dist-info" / "METADATA").exists()  # TE checks the versions
