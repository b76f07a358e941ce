"""What CPU a benchmark ran on, for its JSON: the model name, AMD's core generation where the x86 family says it,
the widest integer dot-product instructions (what the CPU GEMV and GEMM use), and the core count."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _amd_generation(family: int, flags: set[str]) -> str | None:
    """Zen generation from the x86 family (25 = 0x19 spans Zen 3 and Zen 4; only Zen 4 has AVX-512)."""
    if family == 23:
        return "Zen / Zen 2"
    if family == 25:
        return "Zen 4" if "avx512f" in flags else "Zen 3"
    if family == 26:
        return "Zen 5"
    return None


def cpu_description() -> str:
    """e.g. 'CPU: AMD EPYC (Zen 5, family 26 model 2), AVX-512 VNNI, 2 cores'."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    name = info.get("model name") or platform.processor() or platform.machine()
    details = []
    if info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family", "").isdigit():
        generation = _amd_generation(int(info["cpu family"]), flags)
        details.append(f"{generation + ', ' if generation else ''}family {info['cpu family']} model {info.get('model', '?')}")
    elif info.get("cpu family"):
        details.append(f"family {info['cpu family']} model {info.get('model', '?')}")
    isa = ("AVX-512 VNNI" if "avx512_vnni" in flags else "AVX-VNNI" if "avx_vnni" in flags
           else "AVX2" if "avx2" in flags else None)
    described = name + (f" ({', '.join(details)})" if details else "")
    return f"CPU: {described}{', ' + isa if isa else ''}, {os.cpu_count()} cores"


if __name__ == "__main__":
    print(cpu_description())
