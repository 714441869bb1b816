"""The native module's Python surface.

python/oasiskv/_core.pyi describes the built module exactly: the same public names, and for every
function and method the same parameters (names, kinds, defaults) as the runtime signature. And the
CUDA entry points behave on any machine (these run on CI, which has no GPU): see the last section.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oasiskv import _core, errors, ops

# Private names read here: ``oasiskv._core``: the native module's surface is what this file checks.

STUB = Path(__file__).resolve().parents[2] / "python" / "oasiskv" / "_core.pyi"
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
        kind = (
            inspect.Parameter.POSITIONAL_OR_KEYWORD if p.kind == inspect.Parameter.POSITIONAL_ONLY else p.kind
        )
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
        if sk != rk and {sk, rk} != {
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        }:
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
    return sorted(
        n for n, node in names.items() if isinstance(node, ast.FunctionDef) and not n.startswith("_")
    )


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
    assert stub_public == runtime_public, (
        f"{name}: stub {sorted(stub_public)} != runtime {sorted(runtime_public)}"
    )
    new = members.get("__new__")
    assert isinstance(new, ast.FunctionDef), f"{name}: the stub declares the constructor as __new__"
    assert _same_params(_stub_params(new, skip_first=True), _runtime_params(cls)), name
    for m in sorted(stub_public):
        fn = members[m]
        is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)
        assert is_property == isinstance(vars(cls)[m], property | GETSET), f"{name}.{m}: property or not"
        if not is_property:
            assert _same_params(_stub_params(fn, skip_first=True), _runtime_params(getattr(cls, m))), (
                f"{name}.{m}"
            )


# ---------------------------------------------------------------- the CUDA surface, with or without a GPU
# These run everywhere (CI has no GPU): the native module imports without CUDA, says why the CUDA
# path cannot run, compiles every kernel with the NVRTC of the virtualenv, and answers a CUDA call
# it cannot serve with a typed error instead of a crash.
KERNEL_SOURCES = {
    "append_kv",
    "decode_attn",
    "score_blocks",
    "key_codes",
    "delta_select",
    "gather_blocks",
    "norm_rope",
    "wait_stamp",
}
# Variables that point oasis-cuda at libnvrtc; cleared to test the search from a bare environment.
NVRTC_HINTS = ("OASIS_NVRTC_LIB", "OASIS_PYTHON_SITE", "VIRTUAL_ENV", "CONDA_PREFIX")


class FakeTensor:
    """Duck-typed tensor claiming a device: lets a test reach the CUDA path without a GPU. Its data
    lives on the CPU, so it must never reach a launch (tests using it skip when a GPU is usable)."""

    def __init__(self, t: torch.Tensor, device: str = "cuda:0", pinned: bool = False):
        self.t, self.shape, self.dtype = t, t.shape, t.dtype
        self.device, self._pinned = torch.device(device), pinned

    def data_ptr(self) -> int:
        return self.t.data_ptr()

    def is_contiguous(self) -> bool:
        return self.t.is_contiguous()

    def element_size(self) -> int:
        return self.t.element_size()

    def is_pinned(self) -> bool:
        return self._pinned


def _attn_args(device: str = "cuda:0"):
    geo = _core.KvGeometry(4, 2, 16, 4)
    f = functools.partial(FakeTensor, device=device)
    i32 = functools.partial(torch.tensor, dtype=torch.int32)
    return geo, [
        f(torch.zeros(1, 2, 4, 16)),
        f(torch.zeros(3, 2, 4, 16)),
        f(torch.zeros(3, 2, 4, 16)),
        f(i32([0, 2])),
        f(i32([0, 1])),
        f(i32([3])),
    ]


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in NVRTC_HINTS}
    clean.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=600
    )


def test_cuda_status_says_why_not_or_none():
    status = _core.cuda_status()
    if torch.cuda.is_available():
        assert status is None, status
    else:
        assert isinstance(status, str) and status, status


def test_compile_kernels_compiles_every_source():
    got = _core.compile_kernels("sm_90")
    assert {name for name, _ in got} == KERNEL_SOURCES
    assert all(size > 1000 for _, size in got), got
    assert _core.nvrtc_version() >= (12, 0)
    with pytest.raises(errors.CudaUnavailableError, match="sm_80"):
        _core.compile_kernels("sm_75")
    with pytest.raises(ValueError, match="sm_XY"):
        _core.compile_kernels("hopper")


def test_nvrtc_is_found_after_import_oasiskv_alone(tmp_path):
    """No hint in the environment: the search finds the wheel's libnvrtc through the site-packages of
    the libraries already mapped (torch's), which `import oasiskv` loads."""
    code = "import oasiskv\nprint(sorted(n for n, _ in oasiskv._core.compile_kernels('sm_90')))"
    r = _run_python(code, OASIS_CACHE_DIR=str(tmp_path))  # a fresh cache: NVRTC really compiles
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(sorted(KERNEL_SOURCES))


def test_missing_nvrtc_is_cuda_unavailable(tmp_path):
    code = """
from oasiskv import _core, errors
status = _core.cuda_status()
assert isinstance(status, str) and "OASIS_NVRTC_LIB" in status, status
for call in (lambda: _core.compile_kernels("sm_90"), _core.nvrtc_version):
    try:
        call()
    except errors.CudaUnavailableError as e:
        assert "OASIS_NVRTC_LIB" in str(e), e
    else:
        raise SystemExit("no CudaUnavailableError")
print("ok")
"""
    r = _run_python(code, OASIS_NVRTC_LIB=str(tmp_path / "nowhere" / "libnvrtc.so.13"), OASIS_CACHE_DIR="")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_cuda_call_without_a_usable_gpu_is_cuda_unavailable():
    if torch.cuda.is_available() or _core.cuda_status() is None:
        pytest.skip("a usable GPU is present: the fake tensors would be launched")
    geo, (q, kp, vp, indptr, indices, last) = _attn_args()
    out = FakeTensor(torch.zeros(1, 2, 4, 16))
    with pytest.raises(errors.CudaUnavailableError):
        _core.decode_attention(geo, q, kp, vp, indptr, indices, last, None, None, None, 0.25, out)
    with pytest.raises(errors.CudaUnavailableError):
        _core.copy_pages(
            geo,
            kp,
            vp,
            indices,
            FakeTensor(torch.zeros(5, 2, 4, 16), "cpu", pinned=True),
            FakeTensor(torch.zeros(5, 2, 4, 16), "cpu", pinned=True),
            indices,
        )


def test_cuda_call_device_errors_name_the_tensors():
    """Raised before anything is launched, so safe with or without a GPU."""
    geo, (q, kp, vp, indptr, indices, last) = _attn_args()
    with pytest.raises(errors.DeviceError, match=r"out on cpu") as e:
        _core.decode_attention(
            geo, q, kp, vp, indptr, indices, last, None, None, None, 0.25, torch.zeros(1, 2, 4, 16)
        )
    assert "q, k_pages" in str(e.value) and "cuda:0" in str(e.value)
    with pytest.raises(errors.DeviceError, match=r"out on cuda:1"):
        _core.decode_attention(
            geo,
            q,
            kp,
            vp,
            indptr,
            indices,
            last,
            None,
            None,
            None,
            0.25,
            FakeTensor(torch.zeros(1, 2, 4, 16), "cuda:1"),
        )
    with pytest.raises(errors.ShapeError, match="v_pages"):
        _core.decode_attention(
            geo,
            q,
            kp,
            FakeTensor(torch.zeros(3, 2, 4, 15)),
            indptr,
            indices,
            last,
            None,
            None,
            None,
            0.25,
            FakeTensor(torch.zeros(1, 2, 4, 16)),
        )
    # The host pool of a CUDA call may be pinned CPU memory, never pageable memory.
    hk = torch.zeros(5, 2, 4, 16)
    plan = FakeTensor(torch.zeros(1, 2, 3, dtype=torch.int32))
    tables = [
        plan,
        plan,
        FakeTensor(torch.zeros(1, 4, dtype=torch.int32)),
        FakeTensor(torch.tensor([0, 5], dtype=torch.int32)),
        FakeTensor(torch.arange(5, dtype=torch.int32)),
    ]
    with pytest.raises(errors.DeviceError, match="pin_memory"):
        _core.gather_blocks(geo, *tables, hk, hk.clone(), kp, vp)
    with pytest.raises(errors.DeviceError, match="host pool"):
        _core.gather_blocks(geo, *tables, FakeTensor(hk, "cuda:1"), FakeTensor(hk.clone(), "cuda:1"), kp, vp)
    # Meta tensors, through ops and directly.
    meta = torch.zeros(1, 2, 4, 16, device="meta")
    with pytest.raises(errors.DeviceError, match="meta"):
        ops.decode_attention(geo, meta, meta, meta, meta, meta, meta)
    with pytest.raises(errors.DeviceError, match="meta"):
        _core.decode_attention(geo, meta, kp, vp, indptr, indices, last, None, None, None, 0.25, q)
