"""Print the path of the newest libnvrtc the Python environment's NVIDIA wheels hold.

    .venv/bin/python scripts/find_nvrtc.py [SITE_PACKAGES ...]   # exit 1 when there is none

The Makefile exports it as ``OASIS_NVRTC_LIB`` for the kernel compile check. The wheels put the
library in ``site-packages/nvidia/<pkg>/lib/libnvrtc.so.<major>``: ``cu13/`` for CUDA 13,
``cuda_nvrtc/`` or ``cu12/`` for CUDA 12, and a later major under its own folder. Any folder and
any major is accepted and the highest major wins, which is the order ``oasis-cuda`` searches its
known layouts in (``crates/oasis-cuda/src/nvrtc.rs``, ``WHEEL_LIBS``: newest first), so both pick
the same library; a CUDA version the crate does not list yet is still found here. The
``libnvrtc-builtins`` companion is never picked.
"""

from __future__ import annotations

import re
import site
import sys
import sysconfig
from pathlib import Path

#: ``libnvrtc.so.13`` or ``libnvrtc.so.13.2`` (not ``libnvrtc-builtins.so.13.2``).
SONAME = re.compile(r"^libnvrtc\.so\.(\d+)(?:\.(\d+))*$")


def site_dirs() -> list[Path]:
    """This interpreter's site-packages (the venv's when run with the venv's python)."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    seen: list[Path] = []
    for d in map(Path, dirs):
        if d not in seen:
            seen.append(d)
    return seen


def find_nvrtc(dirs: list[Path]) -> Path | None:
    """The libnvrtc with the highest CUDA major under ``DIR/nvidia/*/lib/`` of any of ``dirs``
    (the first directory wins a tie), or None."""
    best: tuple[int, int, Path] | None = None
    for rank, d in enumerate(dirs):
        for f in sorted((d / "nvidia").glob("*/lib/libnvrtc.so.*")):
            m = SONAME.match(f.name)
            if m is None or not f.is_file():
                continue
            key = (int(m.group(1)), -rank, f)
            if best is None or key[:2] > best[:2]:
                best = key
    return None if best is None else best[2]


def main(argv: list[str]) -> int:
    found = find_nvrtc([Path(a) for a in argv] if argv else site_dirs())
    if found is None:
        print("no libnvrtc.so.* under nvidia/*/lib/ (pip install nvidia-cuda-nvrtc)", file=sys.stderr)
        return 1
    print(found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
