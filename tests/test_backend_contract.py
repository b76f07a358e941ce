"""Both backends implement backend/base.py's contract, parameter for parameter, and the model code calls nothing
outside it."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from cupyllm.backend.base import Backend, contract_operations
from cupyllm.backend.cpu import CPUBackend
from cupyllm.backend.gpu import GPUBackend

REPO = Path(__file__).resolve().parents[1]
ATTRIBUTES = ("name", "xp", "can_mirror_kv", "rows_independent_from")


def parameters(function) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter but `self`."""
    found = [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]
    return found[1:] if found and found[0][0] == "self" else found


@pytest.mark.parametrize("backend", [CPUBackend, GPUBackend], ids=lambda b: b.__name__)
@pytest.mark.parametrize("operation", contract_operations())
def test_the_backend_implements_the_operation_as_written(backend, operation):
    implemented = getattr(backend, operation, None)
    assert callable(implemented), f"{backend.__name__} lacks {operation}"
    want, got = parameters(getattr(Backend, operation)), parameters(implemented)
    assert got[:len(want)] == want, f"{backend.__name__}.{operation}{inspect.signature(implemented)}: the contract " \
                                    f"says {operation}{inspect.signature(getattr(Backend, operation))}"
    extra = got[len(want):]
    assert all(default is not inspect.Parameter.empty for _, _, default in extra), \
        f"{backend.__name__}.{operation}: parameters past the contract's must be optional, got {extra}"


def test_the_cpu_backend_is_a_backend():
    backend = CPUBackend(threads=1)
    assert isinstance(backend, Backend)
    for attribute in ATTRIBUTES:
        assert hasattr(backend, attribute)


def test_the_contract_lists_its_operations():
    assert {"linear", "rms_norm", "add_rms_norm", "add_rms_norm_and_norm", "softcap", "attention"} <= \
        set(contract_operations())


def backend_calls(path: Path) -> set[str]:
    """The attributes read of the name `ops` in a model file (ops.linear(...) -> "linear")."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ops"}


@pytest.mark.parametrize("path", sorted((REPO / "cupyllm" / "models").glob("*.py")), ids=lambda p: p.name)
def test_the_model_code_calls_only_the_contract(path):
    allowed = set(contract_operations()) | set(ATTRIBUTES)
    outside = backend_calls(path) - allowed
    assert not outside, f"{path.name} calls {sorted(outside)}, which backend/base.py does not define"
