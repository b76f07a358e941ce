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
    python tools/sass_count.py --tcq-encode [--out bench/results/tcq_encode_sass.json]

--tcq-encode counts the instructions of one step of the TCQ Viterbi encoder (kv_encode.cu: the code between two
of its barriers, the barrier included, averaged over the unrolled steps; at the formats' and bench/kv_encode.py's
trellis sizes) and what they
come to at the H200's full issue rate for the K + V of one Qwen3-8B prefill layer of 8192 tokens, against that
layer's time measured on the H200 (bench/results/kv_encode_gpu.json): an estimate from counts, not a timing.

Compiles with nvcc where there is one, else with NVRTC (CuPy's binding, the dev extra); disassembles with
nvdisasm (or cuobjdump) on PATH, or the pip package nvidia-cuda-nvdisasm (CUDA 13: it reads CUDA 13 cubins).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cupyllm.cuda.nvrtc_check import load_nvrtc  # noqa: E402
from cupyllm.cuda.registry import cuda_include_dirs, kernel_source_dir  # noqa: E402

# kv_formats.cuh types at group size 128, in cupyllm.ops.kv_formats.formats.list_formats() order
FORMATS = {
    "f32": "FmtF32", "f16": "FmtF16", "bf16": "FmtBF16", "q8_0": "FmtQ8_0", "q6_0": "FmtQ6_0", "q5_1": "FmtQ5_1",
    "q5_0": "FmtQ5_0", "q4_1": "FmtQ4_1", "q4_0": "FmtQ4_0", "turbo4": "FmtTurbo4<128>", "turbo3": "FmtTurbo3<128>",
    "turbo2": "FmtTurbo2<128>", "turbo3_tcq": "FmtTurbo3Tcq<128>", "turbo2_tcq": "FmtTurbo2Tcq<128>",
}
READERS = ("Half8FromFloats", "Half8")
ROW_STRIDE = 272  # bytes between the probe threads' rows: one hd128 row of any format fits

PROBE_HEAD = r"""
#include "attention/fa_common.cuh"
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
    return compile_source(probe_source(), arch)


def compile_source(source: str, arch: int) -> tuple[bytes, str]:
    """The cubin of `source` for sm_`arch` and the compiler that made it: nvcc where there is one (its CUDA
    version matches the disassembler's, CUDA 13 on the device machine too), else NVRTC through CuPy's binding."""
    includes = [f"-I{d}" for d in [str(kernel_source_dir()), *cuda_include_dirs()]]
    nvcc = shutil.which("nvcc")
    if nvcc:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp, "sass_probe.cu"), Path(tmp, "sass_probe.cubin")
            src.write_text(source)
            subprocess.run([nvcc, "-std=c++17", f"-arch=sm_{arch}", "-cubin", "-ftz=true",
                            f"-I{kernel_source_dir()}", "-o", str(out), str(src)], check=True)
            return out.read_bytes(), f"nvcc ({version})"
    nvrtc = load_nvrtc()
    prog = nvrtc.createProgram(source, "sass_probe.cu", [], [])
    try:
        try:  # -ftz=true: as CuPy compiles
            nvrtc.compileProgram(prog, ["-std=c++17", f"-arch=sm_{arch}", "-ftz=true", *includes])
        except Exception as exc:
            raise SystemExit(f"NVRTC failed: {exc}\n{nvrtc.getProgramLog(prog)}")
        major, minor = nvrtc.getVersion()
        return nvrtc.getCUBIN(prog), f"NVRTC {major}.{minor}"
    finally:
        nvrtc.destroyProgram(prog)


def disassemble(cubin: bytes) -> str:
    tool = _disassembler()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "probe.cubin")
        path.write_bytes(cubin)
        args = tool + (["-sass", str(path)] if tool[0].endswith("cuobjdump") else [str(path)])
        return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def count_instructions(cubin: bytes) -> dict[str, int]:
    """Instructions per kernel symbol, without the padding NOPs, EXIT and the trailing self-branch."""
    text = disassemble(cubin)
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


# --- the TCQ encoder's Viterbi step ---------------------------------------------------------------------

TCQ_TRELLISES = [(3, 9), (3, 8), (3, 7), (3, 6), (2, 8), (2, 7), (2, 6), (2, 5)]  # (k, L): formats first
H200_WARP_ISSUE_PER_S = 132 * 4 * 1.98e9  # SMs x schedulers x boost clock, one warp instruction each a cycle
ENCODE_CASE = {"tokens": 8192, "n_kv_heads": 8, "head_dim": 128}  # bench/kv_encode.py's, K and V


def tcq_encode_source() -> str:
    lines = ['#include "kv_formats/kv_encode.cu"']
    for k, L in TCQ_TRELLISES:
        lines.append(f"template __global__ void kv_encode<cupyllm::FmtTcq<{k}, {L}, 128>, float, 1>(const float*, "
                     f"const float*, const int*, cupyllm::u8*, cupyllm::u8*, int*, int, int, int, int, int, int, int, "
                     f"const float*);")
    return "\n".join(lines) + "\n"


def barrier_gaps(text: str) -> dict[tuple[int, int], list[int]]:
    """(k, L) -> instructions from one BAR.SYNC to the next, that barrier included, in program order."""
    gaps: dict[tuple[int, int], list[int]] = {}
    key, since = None, None
    for line in text.splitlines():
        header = re.search(r"FmtTcqILi(\d+)ELi(\d+)ELi128", line) if ".text." in line or "Function" in line else None
        if header:
            key, since = (int(header.group(1)), int(header.group(2))), None
            gaps.setdefault(key, [])
            continue
        insn = re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?);", line)
        if not insn or key is None or re.search(r"\bNOP\b", insn.group(1)):
            continue
        if since is not None:
            since += 1
        if "BAR.SYNC" in insn.group(1):
            if since is not None:
                gaps[key].append(since)
            since = 0
    return gaps


def tcq_encode_main(args) -> int:
    cubin, compiler = compile_source(tcq_encode_source(), args.arch)
    gaps = barrier_gaps(disassemble(cubin))
    measured = json.loads((REPO / "bench" / "results" / "kv_encode_gpu.json").read_text())
    layer_s = measured["prefill_layer"]["seconds_per_layer"]
    groups = 2 * ENCODE_CASE["tokens"] * ENCODE_CASE["n_kv_heads"] * ENCODE_CASE["head_dim"] // 128
    rows = []
    print(f"sm_{args.arch}, {compiler}: one Viterbi step (barrier to barrier); K+V of {groups} groups of 128 at "
          f"{H200_WARP_ISSUE_PER_S / 1e12:.2f}e12 warp instructions/s, against the H200's measured "
          f"{layer_s * 1e3:.2f} ms prefill layer")
    print(f"{'k':>2} {'L':>3} {'states':>6} {'step':>6} {'warp instr':>11} {'ms':>6} {'share':>6}")
    for k, L in TCQ_TRELLISES:
        median = statistics.median(gaps[(k, L)])
        steady = [n for n in gaps[(k, L)] if 0.5 * median <= n <= 1.5 * median]  # not the set-up or the end
        step = round(sum(steady) / len(steady), 1)
        warps_per_group = (1 << (L - k)) / 32  # below 32 sets, groups share a warp
        warp_instructions = groups * 127 * step * warps_per_group
        seconds = warp_instructions / H200_WARP_ISSUE_PER_S
        rows.append({"k": k, "L": L, "states": 1 << L, "instructions_per_step": step,
                     "warp_instructions": warp_instructions, "full_issue_seconds": seconds,
                     "share_of_prefill_layer": seconds / layer_s})
        print(f"{k:>2} {L:>3} {1 << L:>6} {step:>6} {warp_instructions:>11.3g} {seconds * 1e3:>6.3f} "
              f"{seconds / layer_s:>6.1%}")
    out = args.out or REPO / "bench" / "results" / "tcq_encode_sass.json"
    out.write_text(json.dumps({
        "what": "static SASS instructions of one TCQ Viterbi step per thread (kv_encode.cu, barrier to barrier), "
                "and the time they take at the H200's full issue rate for the K+V encode of one Qwen3-8B "
                "prefill layer (tools/sass_count.py --tcq-encode); an estimate from counts, not a timing",
        "arch": f"sm_{args.arch}", "compiler": compiler, "warp_issue_per_s": H200_WARP_ISSUE_PER_S,
        "case": {**ENCODE_CASE, "groups": groups}, "prefill_layer_seconds_measured": layer_s,
        "prefill_layer_source": "bench/results/kv_encode_gpu.json (" + measured["device"] + ", "
                                + measured["created"] + ")",
        "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tcq-encode", action="store_true", help="count the TCQ encoder's Viterbi step instead")
    args = parser.parse_args()
    if args.tcq_encode:
        return tcq_encode_main(args)
    args.out = args.out or REPO / "bench" / "results" / "dequant_sass.json"
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
