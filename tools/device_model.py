"""Take a model file to the GPU machine in pieces: each device call carries at most 64 MiB with the working tree,
so a larger GGUF travels one part per call into the machine's /tmp and is joined there.

Here (the parts go into .carry/, which .git/info/exclude must list: ``echo /.carry/ >> .git/info/exclude``):

    python tools/device_model.py split MODEL.gguf .carry --part-mib 48

On the device, one call per part while the machine stays warm (30 s idle), each carrying ``.carry/NAME.partK``
and ``.carry/NAME.manifest.json``:

    python3 tools/device_model.py stash .carry /tmp/model_parts

then, in the call that uses it:

    python3 tools/device_model.py join /tmp/model_parts /tmp/NAME     # checks size and sha256

`join` refuses a missing part or a wrong checksum (a part from a machine that was given back in between is
gone: carry the missing parts again). tools/gpu_niah.sh runs the needle-in-a-haystack sweep on the joined file.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def split(model: Path, out_dir: Path, part_mib: int) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    part_bytes = part_mib << 20
    digest, parts, total = hashlib.sha256(), [], 0
    with model.open("rb") as src:
        while block := src.read(part_bytes):
            part = out_dir / f"{model.name}.part{len(parts)}"
            part.write_bytes(block)
            digest.update(block)
            parts.append(part)
            total += len(block)
    manifest = {"name": model.name, "bytes": total, "sha256": digest.hexdigest(), "parts": [p.name for p in parts]}
    (out_dir / f"{model.name}.manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return parts


def stash(carry_dir: Path, parts_dir: Path) -> list[str]:
    """Copy whatever parts and manifests this call carried into `parts_dir` (outside the repository, so the
    next call's working tree does not replace them)."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(carry_dir.glob("*.part*")) + sorted(carry_dir.glob("*.manifest.json")):
        shutil.copy2(f, parts_dir / f.name)
        copied.append(f.name)
    return copied


def join(parts_dir: Path, target: Path) -> Path:
    from cupyllm.errors import ModelFileError
    from cupyllm.files.model_store import assemble_chunks

    manifest = json.loads((parts_dir / f"{target.name}.manifest.json").read_text())
    missing = [p for p in manifest["parts"] if not (parts_dir / p).exists()]
    if missing:
        raise ModelFileError(f"parts not on this machine: {', '.join(missing)}; carry them again (stash)")
    return assemble_chunks([parts_dir / p for p in manifest["parts"]], target, expected_sha256=manifest["sha256"],
                           expected_bytes=manifest["bytes"], desc=f"joining {target.name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split")
    s.add_argument("model", type=Path)
    s.add_argument("out_dir", type=Path)
    s.add_argument("--part-mib", type=int, default=48, help="part size (the working tree travels too: leave room)")
    t = sub.add_parser("stash")
    t.add_argument("carry_dir", type=Path)
    t.add_argument("parts_dir", type=Path)
    j = sub.add_parser("join")
    j.add_argument("parts_dir", type=Path)
    j.add_argument("target", type=Path)
    args = ap.parse_args(argv)
    if args.command == "split":
        for p in split(args.model, args.out_dir, args.part_mib):
            print(p)
    elif args.command == "stash":
        print("stashed:", ", ".join(stash(args.carry_dir, args.parts_dir)) or "nothing")
    else:
        print(join(args.parts_dir, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
