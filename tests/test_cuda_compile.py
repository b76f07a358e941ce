"""CI without a GPU: every CUDA source compiles with NVRTC for sm_80 and sm_90, every kernel the
registry can ask for is declared and lowered, and the sources ship with the package.

NVRTC is a plain library (pip nvidia-cuda-nvrtc-cu12, loaded through CuPy's binding): no driver needed.
"""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cupyllm.cuda import nvrtc_check
from cupyllm.cuda.registry import (KernelRegistry, KernelSet, all_kernel_sets, cuda_include_dirs, kernel_source_dir,
                                   source_fingerprint)
from cupyllm.errors import DeviceError
from cupyllm.ops.kv_formats.formats import list_formats

REPO = Path(__file__).resolve().parents[1]
ARCHS = nvrtc_check.DEFAULT_ARCHS


@pytest.fixture(scope="module")
def nvrtc():
    return nvrtc_check.load_nvrtc()  # the dev extra installs libnvrtc: missing or unloadable is a failure


@pytest.fixture(scope="module")
def include_dirs(nvrtc):
    dirs = cuda_include_dirs()
    assert dirs, "cuda_fp16.h not found: pip install nvidia-cuda-runtime-cu12"
    return dirs


@pytest.fixture(scope="module")
def compiled_units(nvrtc, include_dirs):
    """Every kernel set and every .cu file, for every architecture, compiled once for this module.

    NVRTC releases the GIL, so the units compile in parallel threads."""
    source_dir = kernel_source_dir()
    units = nvrtc_check.units_to_check(source_dir, all_kernel_sets())
    jobs = [(unit, arch) for arch in ARCHS for unit in units]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(
            lambda job: nvrtc_check.compile_kernel_set(nvrtc, job[0], job[1], source_dir, include_dirs), jobs))
    return {(unit.description, arch): result for (unit, arch), result in zip(jobs, results)}


def test_every_cu_file_and_kernel_set_compiles(compiled_units):
    failed = {key: r.log for key, r in compiled_units.items() if not r.ok}
    assert not failed, "\n\n".join(f"{unit} sm_{arch}:\n{log}" for (unit, arch), log in failed.items())
    source_files = {p.name for p in kernel_source_dir().glob("*.cu")}
    compiled_files = {key[0].split(" ")[0] for key in compiled_units}
    assert source_files <= compiled_files
    assert {arch for _, arch in compiled_units} == set(ARCHS)


def test_every_declared_kernel_is_lowered(compiled_units):
    for kernel_set in all_kernel_sets():
        for arch in ARCHS:
            result = compiled_units[(kernel_set.description, arch)]
            assert set(result.lowered) == set(kernel_set.name_expressions)
            assert all(result.lowered.values()), f"{kernel_set.description}: a kernel has no symbol"
            assert result.cubin_bytes > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_the_trellis_size_encoders_compile(nvrtc, include_dirs, arch):
    """The TCQ encoder at the trellis sizes bench/kv_encode.py times beside the formats' (fewer threads than
    stream bytes at k = 3, L = 8)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("kv_encode_bench", REPO / "bench" / "kv_encode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from cupyllm.ops.kv_formats.gpu import trellis_encode_kernel, trellis_registry
    from cupyllm.ops.kv_formats import tcq
    names = [trellis_encode_kernel(tcq.trellis_format(k, L, 128, tcq.initial_codebook(L)))
             for k, L in bench.TRELLIS_SIZES]
    kernel_set = trellis_registry(names).sets[0]
    result = nvrtc_check.compile_kernel_set(nvrtc, kernel_set, arch, kernel_source_dir(), include_dirs)
    assert result.ok, result.log
    assert set(result.lowered) == set(names) and all(result.lowered.values())


def test_the_sass_count_probes_compile(nvrtc, include_dirs):
    """tools/sass_count.py's probe units (the KV readers, and the TCQ encoder instantiated by its kernel's
    signature): they compile here, so a kernel whose signature changes breaks this test, not the count."""
    sys.path.insert(0, str(REPO / "tools"))
    import sass_count
    options = nvrtc_check.compile_options(KernelSet("sass_probe.cu", ()), kernel_source_dir(), include_dirs)
    for name, source in (("readers", sass_count.probe_source()), ("tcq encode", sass_count.tcq_encode_source())):
        result = nvrtc_check.compile_source(nvrtc, source, "sass_probe.cu", options, 90)
        assert result.ok, f"{name}:\n{result.log}"


@pytest.mark.parametrize("arch", ARCHS)
def test_headers_compile_on_their_own(nvrtc, include_dirs, arch):
    source_dir = kernel_source_dir()
    headers = sorted(p.relative_to(source_dir).as_posix() for p in source_dir.rglob("*.cuh"))
    assert {"common/common.cuh", "kv_formats/kv_formats.cuh"} <= set(headers)
    for header in headers:
        result = nvrtc_check.compile_header(nvrtc, header, arch, source_dir, include_dirs)
        assert result.ok, f"{header} sm_{arch}:\n{result.log}"


def test_compile_failure_returns_the_nvrtc_log(nvrtc, include_dirs, tmp_path):
    (tmp_path / "broken.cu").write_text("template <int N> __global__ void k(float* x) { x[0] = undefined_name; }\n")
    result = nvrtc_check.compile_kernel_set(nvrtc, KernelSet("broken.cu", ("k<1>",)), 90, tmp_path, include_dirs)
    assert not result.ok
    assert "undefined_name" in result.log


def test_registry_declares_every_instantiation_the_kv_codec_asks_for():
    """Each format x source dtype x head_dim the engine supports maps to a declared kernel."""
    from cupyllm.ops.kv_formats import gpu as gpu_kv
    from cupyllm.ops.kv_formats.formats import group_values_for, is_rotated
    from cupyllm.ops.kv_formats.turbo import NORM_MODES

    registry = KernelRegistry()  # no CuPy needed until a kernel is requested
    for name in list_formats():
        for head_dim in (64, 128, 256):
            group = group_values_for(head_dim) if is_rotated(name) else None
            for src in gpu_kv.SOURCE_TYPES:
                for mode in (NORM_MODES if is_rotated(name) else ("raw",)):
                    kernel = gpu_kv.encode_kernel_name(name, src, group, mode)
                    assert registry.kernel_set_for(kernel).filename == gpu_kv.ENCODE_FILE
            for unrotate in (True, False):
                kernel = gpu_kv.decode_kernel_name(name, group, unrotate)
                assert registry.kernel_set_for(kernel).filename == gpu_kv.DECODE_FILE
    with pytest.raises(DeviceError, match="not declared"):
        registry.kernel_set_for("kv_encode<cupyllm::FmtQ8_0, double, 0>")


def test_unsupported_group_size_is_a_clear_error():
    from cupyllm.ops.kv_formats import gpu as gpu_kv
    from cupyllm.ops.kv_formats.formats import KVFormatError

    with pytest.raises(KVFormatError, match="head_dim"):
        gpu_kv.cpp_format_type("turbo3", 32)


def test_header_edits_change_the_compiled_source(tmp_path):
    """CuPy's disk cache keys on the .cu text only; the header fingerprint in it must follow .cuh edits."""
    (tmp_path / "a.cuh").write_text("#pragma once\n")
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n')
    before = source_fingerprint(tmp_path)
    (tmp_path / "a.cuh").write_text("#pragma once\n// edited\n")
    assert source_fingerprint(tmp_path) != before


def test_import_without_cupy():
    """`import cupyllm.cuda` and the KV codec module must not need CuPy."""
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['cupy_backends'] = None\n"
            "import cupyllm, cupyllm.cuda, cupyllm.ops.kv_formats.gpu as g\n"
            "from cupyllm.cuda import gpu_count\n"
            "assert gpu_count() == 0\n"
            "assert g.kernel_sets()\n"
            "from cupyllm.errors import DeviceError\n"
            "from cupyllm.ops.kv_formats.formats import get_format\n"
            "try:\n    g.GpuKVCodec(get_format('q8_0'), 128, 8)\n    raise SystemExit('codec built without CuPy')\n"
            "except DeviceError:\n    pass\n"
            "from cupyllm.cuda import require_cupy\n"
            "try:\n    require_cupy()\n    raise SystemExit('require_cupy passed without CuPy')\n"
            "except DeviceError as e:\n    assert 'pip install' in str(e)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_kernel_sources_ship_as_package_data():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["cupyllm.kernels_cu"] == "kernels_cu"
    assert set(config["package-data"]["cupyllm.kernels_cu"]) >= {"*/*.cu", "*/*.cuh"}
    listed = set(config["packages"])
    on_disk = {"cupyllm"} | {
        "cupyllm." + ".".join(p.relative_to(REPO / "cupyllm").parts)
        for p in (REPO / "cupyllm").rglob("*") if p.is_dir() and p.name != "__pycache__"
        and "__pycache__" not in p.parts}
    missing = on_disk - listed
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"
    assert kernel_source_dir() in (REPO / "kernels_cu", REPO / "cupyllm" / "kernels_cu")


def test_a_slow_first_compile_says_so_once(tmp_path, capsys):
    """A kernel set whose compile takes longer than slow_compile_seconds (NVRTC on a first run; CuPy's disk cache
    is fast) prints one line; later sets, slow or not, print nothing more."""
    import time
    import types

    from cupyllm.cuda.registry import KernelSet

    class SlowModule:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def compile(self):
            time.sleep(0.05)

    (tmp_path / "a.cu").write_text("// a")
    (tmp_path / "b.cu").write_text("// b")
    sets = [KernelSet("a.cu", ("ka<1>",)), KernelSet("b.cu", ("kb<1>",))]
    fake_cp = types.SimpleNamespace(RawModule=SlowModule)
    registry = KernelRegistry(sets=sets, source_dir=tmp_path, slow_compile_seconds=0.01)
    registry._module(sets[0], "90", fake_cp)
    registry._module(sets[1], "90", fake_cp)
    err = capsys.readouterr().err
    assert err.count("compiling the CUDA kernels for sm_90") == 1
    quiet = KernelRegistry(sets=sets, source_dir=tmp_path, slow_compile_seconds=60.0)
    quiet._module(sets[0], "90", fake_cp)
    assert capsys.readouterr().err == ""
