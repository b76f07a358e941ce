"""Fuzz cupyllm's GGUF loader: seeded mutants of a model's header, metadata and tensor descriptions, each loaded
in a bounded worker process. Every mutant must either be refused with cupyllm's own error (a CupyllmError) or
load and give exactly the original's logits, unless its change is one a valid file may carry (below).

    python tools/fuzz_gguf.py                                   # the default model, 2000 mutants
    python tools/fuzz_gguf.py --model m.gguf --mutants 5000 --seed 3 --json counts.json
    python tools/fuzz_gguf.py --model m.gguf --seed 3 --only 1234 -v   # one mutant again, with its message

A mutant changes one field of the file in place (the byte layout stays): the header's counts, a metadata key's
name, value type or value (hyperparameters above all), an array's item type, count or items, a tensor's name,
dimension count, dimensions, type or data offset. Its change is either a byte corruption (1 to 8 bytes of the
field) or a typed edit (an integer set to 0, +-1, twice, a power of two ...; a float set to 0, NaN, inf, its
negative ...; a type id or a name swapped for another). Mutant i of seed s is drawn from its own generator, so
`--only i` reproduces it.

Outcomes. `refused`: cupyllm's own error. `exact`: loaded, logits bit-identical to the original's (the worker
computes both with one thread). `changed-semantic`: loaded, logits differ, and the change is a value a valid
file may have: a metadata value of a key in SEMANTIC_KEYS (rope bases and scaling, epsilon, soft caps,
context and sliding-window length, experts used per token, Gemma 4's sliding-layer rotary dims), of any
`general.*` key but the architecture and alignment, or of any `tokenizer.*` key (tokenization only), such a
key's removal (a rename: the default is legal), or a tensor type swapped for another of the same bytes per row
(F16 and BF16, Q4_0 and Q4_K, Q5_0 and Q5_K). `changed-warned`: loaded with a ModelFileWarning (a tensor of an
unknown name, ignored) and different logits: the rename of an optional tensor, reported. Failures: `WRONG`
(any other change that loads with other logits, silently), `crash` (an exception that is not cupyllm's),
`hang` (past the time limit), `died` (the worker process ended: a signal, the address-space limit).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TOKENS = [2, 5, 9, 17, 33, 100, 7, 3, 60, 41]  # every tiny vocabulary has these; past Gemma 3 tiny's window of 6
TEXT = "The quick brown fox, 42 times."
CTX = 64
FAILURES = ("WRONG", "crash", "hang", "died")

# Metadata whose values a valid file may set otherwise (the key after "<arch>."): a changed value is a
# different valid model, so its logits may differ. Everything else must be refused or give the same logits.
SEMANTIC_KEYS = ("rope.freq_base", "rope.freq_base_swa", "attention.layer_norm_rms_epsilon", "context_length",
                 "attention.sliding_window", "final_logit_softcapping", "attn_logit_softcapping",
                 "expert_used_count", "rope.dimension_count_swa")
SEMANTIC_PREFIXES = ("rope.scaling.",)
STRUCTURAL_GENERAL = ("general.architecture", "general.alignment")

# GGUF value types: id -> (struct format or None, size)
_VALUE_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                  12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class Field:
    """One field of the file: `kind` says what it is, [start, start + size) where, `owner` whose (a metadata
    key or tensor name), `value` its value (scalars), `vtype` its GGUF value type (metadata values)."""

    kind: str
    start: int
    size: int
    owner: str = ""
    value: Any = None
    vtype: int | None = None
    items: list = field(default_factory=list)  # array of strings: (start, size) of each item's bytes


def parse_layout(buf: bytes | memoryview) -> tuple[list[Field], dict]:
    """The fields of a valid GGUF's header (the original's; a mutant is never parsed here)."""
    fields: list[Field] = []
    pos = 0

    def take(kind, fmt, owner="", vtype=None):
        nonlocal pos
        size = struct.calcsize(fmt)
        value = struct.unpack_from(fmt, buf, pos)[0]
        fields.append(Field(kind, pos, size, owner, value, vtype))
        pos += size
        return value

    def string(kind_len, kind, owner=""):
        nonlocal pos
        n = take(kind_len, "<Q", owner)
        text = bytes(buf[pos:pos + n]).decode("utf-8", "surrogateescape")
        fields.append(Field(kind, pos, n, owner or text, text))
        pos += n
        return text

    take("magic", "<I")
    take("version", "<I")
    n_tensors = take("tensor-count", "<Q")
    n_kv = take("kv-count", "<Q")
    keys = []
    for _ in range(n_kv):
        key = string("key-length", "key")
        keys.append(key)
        vtype = take("value-type", "<I", key)
        if vtype == _STRING:
            string("string-length", "string", key)
            fields[-1].owner, fields[-1].vtype = key, _STRING
        elif vtype == _ARRAY:
            item_type = take("array-type", "<I", key)
            count = take("array-count", "<Q", key)
            if item_type == _STRING:
                items = []
                start = pos
                for _ in range(count):
                    n = struct.unpack_from("<Q", buf, pos)[0]
                    items.append((pos, n))
                    pos += 8 + n
                fields.append(Field("string-items", start, pos - start, key, None, _STRING, items))
            else:
                size = struct.calcsize(_VALUE_FORMATS[item_type])
                fields.append(Field("array-items", pos, size * count, key, None, item_type))
                pos += size * count
        else:
            take("value", _VALUE_FORMATS[vtype], key, vtype)
    tensors = []
    for _ in range(n_tensors):
        name = string("name-length", "name")
        fields[-2].owner = name
        n_dims = take("n-dims", "<I", name)
        dims = [take("dim", "<Q", name) for _ in range(n_dims)]
        qtype = take("tensor-type", "<I", name)
        offset = take("offset", "<Q", name)
        tensors.append((name, dims, qtype, offset))
    return fields, {"keys": keys, "tensors": tensors, "arch": _arch_of(buf, fields)}


def _arch_of(buf, fields: list[Field]) -> str:
    return next((f.value for f in fields if f.kind == "string" and f.owner == "general.architecture"), "")


def _key_is_semantic(key: str, arch: str) -> bool:
    if key.startswith("tokenizer."):
        return True
    if key.startswith("general."):
        return key not in STRUCTURAL_GENERAL
    if not key.startswith(arch + "."):
        return True  # a key no loader reads: unknown, so any value is legal
    rest = key[len(arch) + 1:]
    return rest in SEMANTIC_KEYS or rest.startswith(SEMANTIC_PREFIXES)


@dataclass
class Mutant:
    index: int
    patches: list[tuple[int, bytes]]
    op: str  # what was done, e.g. "set-int dim of 'blk.0.attn_q.weight' 64 -> 0"
    group: str  # the field group, for the counts
    semantic: bool


# Field groups a mutant targets, with their weights: hyperparameters and tensor descriptions above all.
_GROUPS = {
    "header": (4, ("version", "tensor-count", "kv-count")),
    "key": (16, ("key-length", "key")),
    "value-type": (7, ("value-type",)),
    "value": (30, ("value", "string-length", "string")),
    "array": (8, ("array-type", "array-count", "array-items", "string-items")),
    "tensor-name": (9, ("name-length", "name")),
    "n-dims": (5, ("n-dims",)),
    "dims": (8, ("dim",)),
    "tensor-type": (6, ("tensor-type",)),
    "offset": (7, ("offset",)),
}
_INT_FORMATS = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}


def _interesting_int(rng, value: int, bits: int) -> int:
    v = int(value) if isinstance(value, (int, np.integer)) else 0
    choices = [0, 1, 2, v - 1, v + 1, 2 * v, v // 2, v * 3 // 2, 0x7F, 0xFF, 0x7FFF, 0xFFFF, 2**31 - 1, 2**31,
               2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1, int(rng.integers(0, 2 * abs(v) + 3)),
               v ^ (1 << int(rng.integers(0, bits)))]
    return choices[int(rng.integers(len(choices)))] % (1 << bits)


def _interesting_float(rng, value: float) -> float:
    choices = [0.0, -value, math.nan, math.inf, -math.inf, value * 2, value / 2, 1e-30, 1e30, value * (1 + 1e-6),
               1.0, float(rng.standard_normal()) * 10]
    return choices[int(rng.integers(len(choices)))]


class Mutator:
    """Seeded mutants of one valid GGUF's header: mutant(i) depends only on (seed, i)."""

    def __init__(self, data: bytes, seed: int):
        self.data, self.seed = data, seed
        self.fields, self.info = parse_layout(data)
        self.arch = self.info["arch"]
        self.by_group = {g: [f for f in self.fields if f.kind in kinds] for g, (_, kinds) in _GROUPS.items()}
        self.groups = [g for g in _GROUPS if self.by_group[g]]
        weights = np.array([_GROUPS[g][0] for g in self.groups], float)
        self.weights = weights / weights.sum()
        self.names = [t[0] for t in self.info["tensors"]]
        self.alignment = 32

    def mutant(self, index: int) -> Mutant:
        rng = np.random.default_rng([self.seed, index])
        for _ in range(100):
            group = self.groups[int(rng.choice(len(self.groups), p=self.weights))]
            fld = self.by_group[group][int(rng.integers(len(self.by_group[group])))]
            made = self._mutate(rng, group, fld)
            if made is None:
                continue
            patches, op, semantic = made
            if any(bytes(self.data[o:o + len(b)]) != b for o, b in patches):
                return Mutant(index, patches, op, group, semantic)
        raise RuntimeError("no mutation found")

    def _mutate(self, rng, group: str, fld: Field):
        owner = f"'{fld.owner}'" if fld.owner else ""
        typed = rng.random() < 0.6
        if fld.kind == "key":
            return self._rename(rng, fld, [f.value for f in self.by_group["key"] if f.kind == "key"],
                                semantic=_key_is_semantic(fld.value, self.arch), what="key")
        if fld.kind == "name":
            return self._rename(rng, fld, self.names, semantic=False, what="tensor name")
        if fld.kind == "string-items":
            return self._string_item(rng, fld)
        if fld.kind == "array-items":
            return self._array_item(rng, fld)
        value_field = fld.kind in ("value", "string")
        semantic = value_field and _key_is_semantic(fld.owner, self.arch)
        if fld.kind == "value" and fld.vtype in (6, 12) and typed:
            new = _interesting_float(rng, fld.value)
            packed = struct.pack(_VALUE_FORMATS[fld.vtype], new)
            return [(fld.start, packed)], f"set-float {fld.kind} of {owner} {fld.value!r} -> {new!r}", semantic
        if fld.kind == "tensor-type" and typed:
            return self._retype_tensor(rng, fld)
        if fld.kind == "offset" and typed:
            others = [t[3] for t in self.info["tensors"]]
            new = [fld.value + self.alignment, fld.value - self.alignment, fld.value + 1, 0,
                   others[int(rng.integers(len(others)))]][int(rng.integers(5))] % (1 << 64)
            return [(fld.start, struct.pack("<Q", new))], f"move offset of {owner} {fld.value} -> {new}", False
        if fld.kind == "dim" and typed:
            dims = [f.value for f in self.by_group["dims"]]
            new = [fld.value + 1, fld.value - 1, fld.value * 2, fld.value // 2, dims[int(rng.integers(len(dims)))],
                   _interesting_int(rng, fld.value, 64)][int(rng.integers(6))] % (1 << 64)
            return [(fld.start, struct.pack("<Q", new))], f"set dim of {owner} {fld.value} -> {new}", False
        if fld.kind == "value-type" and typed:
            new = int(rng.choice([*range(13), 13, 255, 2**31]))
            return [(fld.start, struct.pack("<I", new))], f"value type of {owner} {fld.value} -> {new}", False
        if fld.size in _INT_FORMATS and fld.kind != "string" and typed and not (fld.vtype in (6, 7, 12)):
            fmt = _INT_FORMATS[fld.size]
            if fld.kind == "value":
                fmt = _VALUE_FORMATS.get(fld.vtype, fmt)
            new = _interesting_int(rng, fld.value, 8 * fld.size)
            packed = new.to_bytes(fld.size, "little")
            shown = struct.unpack(fmt, packed)[0]
            return [(fld.start, packed)], f"set-int {fld.kind} of {owner} {fld.value} -> {shown}", semantic
        return self._corrupt(rng, fld, f"corrupt {fld.kind} of {owner}".rstrip(" of"), semantic)

    def _corrupt(self, rng, fld: Field, what: str, semantic: bool, start: int | None = None, size: int | None = None):
        """1 to 8 random bytes of the field (or of [start, start + size)) set to random values."""
        start = fld.start if start is None else start
        size = fld.size if size is None else size
        if size <= 0:
            return None
        n = int(rng.integers(1, min(8, size) + 1))
        positions = sorted(set(int(p) for p in rng.integers(0, size, n)))
        patches = [(start + p, bytes([int(rng.integers(256))])) for p in positions]
        return patches, f"{what} ({len(patches)} bytes)", semantic

    def _rename(self, rng, fld: Field, others: list[str], semantic: bool, what: str):
        raw = fld.value.encode("utf-8", "surrogateescape")
        same_length = [o for o in others if o != fld.value and len(o.encode("utf-8", "surrogateescape")) == len(raw)]
        if same_length and rng.random() < 0.3:  # another's name: a duplicate
            new = same_length[int(rng.integers(len(same_length)))].encode("utf-8", "surrogateescape")
        else:
            chars = bytearray(raw)
            at = int(rng.integers(len(chars)))
            chars[at] = int(rng.choice(list(b"abcdefghijklmnopqrstuvwxyz0123456789._")))
            new = bytes(chars)
        shown = new.decode("utf-8", "surrogateescape")
        return [(fld.start, new)], f"rename {what} '{fld.value}' -> '{shown}'", semantic

    def _string_item(self, rng, fld: Field):
        start, n = fld.items[int(rng.integers(len(fld.items)))]
        if rng.random() < 0.3:  # the item's length: the array's layout
            new = _interesting_int(rng, n, 64)
            return [(start, new.to_bytes(8, "little"))], f"set-int item length of '{fld.owner}' {n} -> {new}", False
        return self._corrupt(rng, fld, f"corrupt an item of '{fld.owner}'", _key_is_semantic(fld.owner, self.arch),
                             start + 8, n)

    def _array_item(self, rng, fld: Field):
        size = struct.calcsize(_VALUE_FORMATS[fld.vtype])
        if fld.size == 0:
            return None
        at = fld.start + size * int(rng.integers(fld.size // size))
        old = struct.unpack_from(_VALUE_FORMATS[fld.vtype], self.data, at)[0]
        if fld.vtype in (6, 12):
            new = struct.pack(_VALUE_FORMATS[fld.vtype], _interesting_float(rng, float(old)))
        elif fld.vtype == 7:
            new = bytes([int(rng.integers(256))])
        else:
            new = _interesting_int(rng, int(old), 8 * size).to_bytes(size, "little")
        semantic = _key_is_semantic(fld.owner, self.arch)
        return [(at, new)], f"set an item of '{fld.owner}' {old!r} -> {new.hex()}", semantic

    def _retype_tensor(self, rng, fld: Field):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        from cupyllm.ops.matmul.reference import weight_format

        ids = [int(t) for t in GGML_QUANT_SIZES] + [4, 5, 40, 255, 2**31]  # 4, 5: removed Q4_2 / Q4_3
        new = int(ids[int(rng.integers(len(ids)))])
        name, dims, _, _ = next(t for t in self.info["tensors"] if t[0] == fld.owner)
        old_type = GGMLQuantizationType(fld.value)
        semantic = False
        try:
            new_type = GGMLQuantizationType(new)
            (ob, obytes), (nb, nbytes) = GGML_QUANT_SIZES[old_type], GGML_QUANT_SIZES[new_type]
            # a supported type of the same bytes per row: a valid file whose weights read otherwise
            semantic = (weight_format(new_type) is not None and dims[0] % nb == 0
                        and dims[0] // ob * obytes == dims[0] // nb * nbytes)
            shown = new_type.name
        except (ValueError, KeyError):
            shown = str(new)
        return [(fld.start, struct.pack("<I", new))], f"retype tensor '{name}' {old_type.name} -> {shown}", semantic


# --- the worker: loads one file at a time under an address-space limit --------------------------------------


def worker_main(as_limit: int) -> None:
    """Answer one JSON line per request line: {"path", "reference": bool}. The reference's logits are kept; a
    mutant's are compared with them here, so only the outcome crosses the pipe."""
    import resource
    import warnings

    if as_limit:
        resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr
    sys.stdout = sys.stderr
    import cupyllm
    from cupyllm.errors import CupyllmError, ModelFileWarning

    reference = None
    for line in sys.stdin:
        request = json.loads(line)
        started = time.perf_counter()
        result: dict[str, Any] = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                model = cupyllm.load(request["path"], device="cpu", ctx=CTX, threads=1, progress=False)
                tokens = [t % model.cfg.n_vocab for t in TOKENS]
                logits = np.asarray(model.logits(tokens))
                model.detokenize(model.tokenize(TEXT))
                del model
            except CupyllmError as exc:
                result = {"outcome": "refused", "message": str(exc)}
            except BaseException as exc:  # noqa: BLE001 - every other exception is what the fuzzer looks for
                import traceback

                where = traceback.extract_tb(exc.__traceback__)[-1]
                result = {"outcome": "crash", "message": f"{type(exc).__name__}: {str(exc)[:300]} "
                                                         f"({Path(where.filename).name}:{where.lineno})"}
        warned = any(issubclass(w.category, ModelFileWarning) for w in caught)
        if not result:
            if request.get("reference"):
                reference = logits
                result = {"outcome": "reference", "warned": warned}
            elif reference is not None and logits.shape == reference.shape and np.array_equal(logits, reference):
                result = {"outcome": "exact"}
            else:
                result = {"outcome": "changed-warned" if warned else "changed",
                          "message": "; ".join(str(w.message)[:200] for w in caught)}
        result["seconds"] = round(time.perf_counter() - started, 4)
        protocol.write(json.dumps(result) + "\n")
        protocol.flush()


class Worker:
    """A long-lived worker process; restarted (with the reference reloaded) when it hangs or dies."""

    def __init__(self, as_limit: int = 4 << 30, timeout: float = 30.0, first_timeout: float = 900.0,
                 log: str | os.PathLike = os.devnull):
        self.as_limit, self.timeout, self.first_timeout, self.log = as_limit, timeout, first_timeout, log
        self.proc: subprocess.Popen | None = None
        self.reference_path: str | None = None
        self.restarts = 0
        self._buf = b""

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", "--as-limit", str(self.as_limit)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "ab"),
                                     cwd=Path(__file__).resolve().parents[1])
        self._buf = b""

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _ask(self, request: dict, timeout: float) -> dict:
        if self.proc is None:
            self._start()
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            return self._lost("died", "the worker's pipe broke")
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                return self._lost("hang", f"no answer in {timeout:g} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait()
                return self._lost("died", f"the worker exited with {code}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _lost(self, outcome: str, message: str) -> dict:
        self.close()
        self.restarts += 1
        return {"outcome": outcome, "message": message}

    def reference(self, path: str) -> dict:
        self.reference_path = path
        answer = self._ask({"path": path, "reference": True}, self.first_timeout)
        if answer["outcome"] != "reference":
            raise RuntimeError(f"the original model does not load: {answer}")
        return answer

    def check(self, path: str) -> dict:
        if self.proc is None and self.reference_path is not None:  # a fresh worker: its reference first
            self.reference(self.reference_path)
        return self._ask({"path": path}, self.timeout)


@dataclass
class Report:
    model: str
    seed: int
    n_mutants: int
    counts: Counter = field(default_factory=Counter)
    by_group: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    seconds: float = 0.0
    restarts: int = 0

    def summary(self) -> str:
        lines = [f"{self.model}: {self.n_mutants} mutants (seed {self.seed}) in {self.seconds:.0f} s: "
                 + ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items(), key=lambda kv: -kv[1]))]
        for group, counts in sorted(self.by_group.items()):
            lines.append(f"  {group:12s} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        for failure in self.failures[:20]:
            lines.append(f"  FAIL mutant {failure['index']}: {failure['op']} -> {failure['outcome']}: "
                         f"{failure.get('message', '')[:300]}")
        return "\n".join(lines)


def classify(answer: dict, mutant: Mutant) -> str:
    outcome = answer["outcome"]
    if outcome == "changed":
        return "changed-semantic" if mutant.semantic else "WRONG"
    return outcome


def fuzz(model: str | os.PathLike, n_mutants: int, seed: int = 0, worker: Worker | None = None,
         workdir: str | os.PathLike | None = None, only: list[int] | None = None, progress=None) -> Report:
    """Run mutants 0 .. n_mutants - 1 (or `only` these) of `model` through `worker`; a working copy of the
    model in `workdir` is patched in place for each and restored after it."""
    model = Path(model)
    data = model.read_bytes() if model.stat().st_size < (64 << 20) else _header_bytes(model)
    mutator = Mutator(data, seed)
    own_worker = worker is None
    worker = worker or Worker()
    tmp = tempfile.mkdtemp(dir=workdir)
    copy = Path(tmp) / model.name
    shutil.copyfile(model, copy)
    report = Report(str(model), seed, n_mutants if only is None else len(only))
    started = time.perf_counter()
    restarts = worker.restarts
    try:
        worker.reference(str(copy))
        with open(copy, "r+b") as fh:
            for i in (only if only is not None else range(n_mutants)):
                mutant = mutator.mutant(i)
                for offset, raw in mutant.patches:
                    os.pwrite(fh.fileno(), raw, offset)
                fh.flush()
                try:
                    answer = worker.check(str(copy))
                finally:
                    for offset, raw in mutant.patches:
                        os.pwrite(fh.fileno(), data[offset:offset + len(raw)], offset)
                outcome = classify(answer, mutant)
                report.counts[outcome] += 1
                report.by_group.setdefault(mutant.group, Counter())[outcome] += 1
                if outcome in FAILURES:
                    report.failures.append({"index": i, "op": mutant.op, "outcome": outcome,
                                            "message": answer.get("message", "")})
                if progress is not None:
                    progress(i, mutant, outcome, answer)
    finally:
        if own_worker:
            worker.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report.seconds = time.perf_counter() - started
    report.restarts = worker.restarts - restarts
    return report


def _header_bytes(model: Path) -> bytes:
    """The bytes up to the end of the tensor table (a large model's data is never mutated)."""
    size = 1 << 20
    with open(model, "rb") as fh:
        while True:
            fh.seek(0)
            data = fh.read(size)
            try:
                fields, _ = parse_layout(data)
                return data
            except (struct.error, IndexError, UnicodeDecodeError):
                size *= 2
                if size > model.stat().st_size * 2:
                    raise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF to mutate (default: the default model)")
    parser.add_argument("--mutants", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, nargs="*", help="run these mutant indexes only (with their messages)")
    parser.add_argument("--json", type=Path, help="write the counts and failures here")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a mutant may take")
    parser.add_argument("--as-limit", type=float, default=8.0, help="worker address space limit, GiB")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("-v", "--verbose", action="store_true", help="print every mutant's outcome")
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(int(args.as_limit))
        return 0
    if args.model is None:
        from cupyllm.files.model_store import default_model_path

        args.model = default_model_path()
    worker = Worker(as_limit=int(args.as_limit * (1 << 30)), timeout=args.timeout)

    def progress(i, mutant, outcome, answer):
        if args.verbose or outcome in FAILURES:
            print(f"{i:6d} {outcome:16s} {mutant.op} :: {answer.get('message', '')[:200]}", flush=True)
        elif i % 100 == 0:
            print(f"{i:6d} ...", flush=True)

    try:
        report = fuzz(args.model, args.mutants, args.seed, worker, only=args.only, progress=progress)
    finally:
        worker.close()
    print(report.summary())
    if args.json:
        args.json.write_text(json.dumps({"model": report.model, "seed": report.seed, "mutants": report.n_mutants,
                                         "seconds": round(report.seconds, 1), "counts": dict(report.counts),
                                         "by_group": {g: dict(c) for g, c in report.by_group.items()},
                                         "failures": report.failures}, indent=1))
    return 1 if any(report.counts[f] for f in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
