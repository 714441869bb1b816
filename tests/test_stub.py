"""python/oasiskv/_core.pyi describes the built native module exactly: the same public names, and for
every function and method the same parameters (names, kinds, defaults) as the runtime signature."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from oasiskv import _core

STUB = Path(__file__).resolve().parents[1] / "python" / "oasiskv" / "_core.pyi"
# The type of a PyO3 #[getter] (a getset descriptor): a property in the stub.
GETSET = type(vars(_core.KvGeometry)["head_dim"])


def _stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text(), filename=str(STUB))


def _stub_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names[t.id] = node
    return names


def _public(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


_KINDS = {
    "posonly": inspect.Parameter.POSITIONAL_ONLY,
    "arg": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "kwonly": inspect.Parameter.KEYWORD_ONLY,
}
_NO_DEFAULT = object()


def _stub_params(fn: ast.FunctionDef, skip_first: bool) -> list[tuple[str, inspect._ParameterKind, object]]:
    a = fn.args
    positional = [(p, "posonly") for p in a.posonlyargs] + [(p, "arg") for p in a.args]
    defaults = [_NO_DEFAULT] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [
        (p.arg, _KINDS[kind], d if d is _NO_DEFAULT else ast.literal_eval(d))
        for (p, kind), d in zip(positional, defaults, strict=True)
    ]
    params += [
        (p.arg, _KINDS["kwonly"], _NO_DEFAULT if d is None else ast.literal_eval(d))
        for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
    ]
    assert a.vararg is None and a.kwarg is None, f"{fn.name}: *args/**kwargs are not used by _core"
    return params[1:] if skip_first else params


def _runtime_params(obj) -> list[tuple[str, inspect._ParameterKind, object]]:
    sig = inspect.signature(obj)
    out = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls"):
            continue
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if p.kind == inspect.Parameter.POSITIONAL_ONLY else p.kind
        out.append((p.name, kind, _NO_DEFAULT if p.default is inspect.Parameter.empty else p.default))
    return out


def _same_params(stub, runtime) -> bool:
    """Names and kinds equal; defaults equal where the runtime renders them (PyO3 writes ``...`` for
    defaults it cannot spell)."""
    if len(stub) != len(runtime):
        return False
    for (sn, sk, sd), (rn, rk, rd) in zip(stub, runtime, strict=True):
        if sn != rn:
            return False
        # PyO3 signatures of methods mark the leading parameters positional-only; the stub may too.
        if sk != rk and {sk, rk} != {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD}:
            return False
        if (sd is _NO_DEFAULT) != (rd is _NO_DEFAULT):
            return False
        if rd is not _NO_DEFAULT and rd is not Ellipsis and sd != rd:
            return False
    return True


def test_every_public_name_is_in_the_stub_and_back():
    stub = _public(_stub_names(_stub_tree().body))
    runtime = _public(dir(_core))
    assert runtime - stub == set(), f"missing from _core.pyi: {sorted(runtime - stub)}"
    assert stub - runtime == set(), f"in _core.pyi but not in the built module: {sorted(stub - runtime)}"
    assert "__version__" in _stub_names(_stub_tree().body) and isinstance(_core.__version__, str)


def _functions():
    names = _stub_names(_stub_tree().body)
    return sorted(n for n, node in names.items() if isinstance(node, ast.FunctionDef) and not n.startswith("_"))


def _classes():
    names = _stub_names(_stub_tree().body)
    return sorted(n for n, node in names.items() if isinstance(node, ast.ClassDef))


@pytest.mark.parametrize("name", _functions())
def test_function_signature_matches(name):
    node = _stub_names(_stub_tree().body)[name]
    stub = _stub_params(node, skip_first=False)
    runtime = _runtime_params(getattr(_core, name))
    assert _same_params(stub, runtime), f"{name}: stub {stub} != runtime {runtime}"
    assert ast.get_docstring(node), f"{name}: give the stub a one-line doc"
    assert (getattr(_core, name).__doc__ or "").strip(), f"{name}: document it on the Rust side"


@pytest.mark.parametrize("name", _classes())
def test_class_matches(name):
    node = _stub_names(_stub_tree().body)[name]
    cls = getattr(_core, name)
    members = _stub_names(node.body)
    stub_public = _public(members)
    runtime_public = _public(vars(cls))
    assert stub_public == runtime_public, f"{name}: stub {sorted(stub_public)} != runtime {sorted(runtime_public)}"
    new = members.get("__new__")
    assert isinstance(new, ast.FunctionDef), f"{name}: the stub declares the constructor as __new__"
    assert _same_params(_stub_params(new, skip_first=True), _runtime_params(cls)), name
    for m in sorted(stub_public):
        fn = members[m]
        is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)
        assert is_property == isinstance(vars(cls)[m], property | GETSET), f"{name}.{m}: property or not"
        if not is_property:
            assert _same_params(_stub_params(fn, skip_first=True), _runtime_params(getattr(cls, m))), f"{name}.{m}"
