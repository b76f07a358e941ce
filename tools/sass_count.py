"""Static SASS instruction counts of the flash-attention KV readers, per format (no GPU needed).

fa_mma dequantizes staged cache rows into f16 tiles with Half8<Fmt> (fa_common.cuh); Half8FromFloats<Fmt> is
the definition it must equal bit for bit (Chunk8's floats rounded to f16). This tool compiles one probe kernel
per (format, reader) with NVRTC for one architecture, disassembles the cubin and counts the instructions of
each probe (rows and tables in shared memory, as in the kernels), less those of a probe that copies the same
16 bytes without decoding them (address arithmetic, the shared-memory load, the store): what the reader
itself issues for 8 values. The decode kernels were
measured issue-bound on an H200 (Nsight Compute: 94M instructions in a q8_0 decode launch against 33M on the
f16 path), so these counts are the first-order cost of a format in fa_mma's dequantizing pass. They are counts
of straight-line code, not timings.

    python tools/sass_count.py [--arch 90] [--out bench/results/dequant_sass.json]

Compiles with nvcc where there is one, else with NVRTC (CuPy's binding, the dev extra); disassembles with
nvdisasm (or cuobjdump) on PATH, or the pip package nvidia-cuda-nvdisasm (CUDA 13: it reads CUDA 13 cubins).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cupyllm.cuda.nvrtc_check import load_nvrtc  # noqa: E402
from cupyllm.cuda.registry import cuda_include_dirs, kernel_source_dir  # noqa: E402

# kv_formats.cuh types at group size 128, in cupyllm.kv.formats.list_formats() order
FORMATS = {
    "f32": "FmtF32", "f16": "FmtF16", "bf16": "FmtBF16", "q8_0": "FmtQ8_0", "q6_0": "FmtQ6_0", "q5_1": "FmtQ5_1",
    "q5_0": "FmtQ5_0", "q4_1": "FmtQ4_1", "q4_0": "FmtQ4_0", "turbo4": "FmtTurbo4<128>", "turbo3": "FmtTurbo3<128>",
    "turbo2": "FmtTurbo2<128>", "turbo3_tcq": "FmtTurbo3Tcq<128>", "turbo2_tcq": "FmtTurbo2Tcq<128>",
}
READERS = ("Half8FromFloats", "Half8")
ROW_STRIDE = 272  # bytes between the probe threads' rows: one hd128 row of any format fits

PROBE_HEAD = r"""
#include "fa_common.cuh"
using namespace cupyllm;
extern __shared__ __align__(16) u8 probe_rows[];
// Each thread reads chunk c of its own row of dynamic shared memory, the format's table in shared memory
// after the rows (as the kernels read their staged rows and tables).
template <template <class> class Reader, class Fmt>
__device__ __forceinline__ void probe(const float*, uint4* out, int c) {
    const float* table = reinterpret_cast<const float*>(probe_rows + 128 * %(stride)d);
    out[threadIdx.x] = Reader<Fmt>::read(probe_rows + threadIdx.x * %(stride)d, c, table);
}
extern "C" __global__ void probe_copy(const float*, uint4* out, int c) {
    out[threadIdx.x] = reinterpret_cast<const uint4*>(probe_rows + threadIdx.x * %(stride)d)[c];
}
"""
PROBE_KERNEL = """extern "C" __global__ void probe_%(name)s_%(reader)s(const float* t, uint4* o, int c) {
    probe<%(reader)s, %(fmt)s>(t, o, c); }
"""


def _disassembler() -> list[str]:
    """nvdisasm (or cuobjdump, which runs nvdisasm) from PATH or from the pip package nvidia-cuda-nvdisasm."""
    for name in ("nvdisasm", "cuobjdump"):
        found = shutil.which(name)
        if found:
            return [found]
    try:
        import nvidia
        for root in nvidia.__path__:
            for found in sorted(Path(root).glob("*/bin/nvdisasm")):
                return [str(found)]
    except ImportError:
        pass
    raise SystemExit("no disassembler: install the CUDA toolkit or `pip install nvidia-cuda-nvdisasm`")


def probe_source() -> str:
    text = PROBE_HEAD % {"stride": ROW_STRIDE}
    for name, fmt in FORMATS.items():
        for reader in READERS:
            text += PROBE_KERNEL % {"name": name, "reader": reader, "fmt": fmt}
    return text


def compile_probes(arch: int) -> tuple[bytes, str]:
    """The probe cubin for sm_`arch` and the compiler that made it: nvcc where there is one (its CUDA version
    matches the disassembler's, CUDA 13 on the device machine too), else NVRTC through CuPy's binding."""
    includes = [f"-I{d}" for d in [str(kernel_source_dir()), *cuda_include_dirs()]]
    nvcc = shutil.which("nvcc")
    if nvcc:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp, "sass_probe.cu"), Path(tmp, "sass_probe.cubin")
            src.write_text(probe_source())
            subprocess.run([nvcc, "-std=c++17", f"-arch=sm_{arch}", "-cubin", "-ftz=true",
                            f"-I{kernel_source_dir()}", "-o", str(out), str(src)], check=True)
            return out.read_bytes(), f"nvcc ({version})"
    nvrtc = load_nvrtc()
    prog = nvrtc.createProgram(probe_source(), "sass_probe.cu", [], [])
    try:
        try:  # -ftz=true: as CuPy compiles
            nvrtc.compileProgram(prog, ["-std=c++17", f"-arch=sm_{arch}", "-ftz=true", *includes])
        except Exception as exc:
            raise SystemExit(f"NVRTC failed: {exc}\n{nvrtc.getProgramLog(prog)}")
        major, minor = nvrtc.getVersion()
        return nvrtc.getCUBIN(prog), f"NVRTC {major}.{minor}"
    finally:
        nvrtc.destroyProgram(prog)


def count_instructions(cubin: bytes) -> dict[str, int]:
    """Instructions per kernel symbol, without the padding NOPs, EXIT and the trailing self-branch."""
    tool = _disassembler()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "probe.cubin")
        path.write_bytes(cubin)
        args = tool + (["-sass", str(path)] if tool[0].endswith("cuobjdump") else [str(path)])
        text = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    counts: dict[str, int] = {}
    name = None
    for line in text.splitlines():
        header = re.search(r"Function : (\S+)", line) or re.match(r"\s*\.text\.(\S+):", line)
        if header:
            name = header.group(1)
            counts[name] = 0
            continue
        insn = re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?);", line)
        if insn and name and not re.search(r"\b(NOP|EXIT|BRA)\b", insn.group(1)):
            counts[name] += 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "dequant_sass.json")
    args = parser.parse_args()
    cubin, compiler = compile_probes(args.arch)
    counts = count_instructions(cubin)
    baseline = counts["probe_copy"]
    rows = []
    print(f"sm_{args.arch}, {compiler}: instructions per 8 values beyond a 16-byte copy (the copy: {baseline})")
    print(f"{'format':<12} {'from floats':>12} {'Half8':>6} {'ratio':>6}")
    for name in FORMATS:
        floats, half8 = (counts[f"probe_{name}_{reader}"] - baseline for reader in READERS)
        rows.append({"format": name, "from_floats": floats, "half8": half8})
        ratio = f"{floats / half8:.2f}" if half8 > 0 else "-"
        print(f"{name:<12} {floats:>12} {half8:>6} {ratio:>6}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "static SASS instructions a reader issues for 8 values of a head-dim-128 row staged in shared "
                "memory, beyond a plain 16-byte copy (tools/sass_count.py); counts, not timings",
        "arch": f"sm_{args.arch}", "compiler": compiler, "copy_probe_instructions": baseline,
        "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
