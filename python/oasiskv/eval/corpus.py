"""A held-out text corpus that every machine already has: installed Python sources and docs.

The corpus is the ``.py``, ``.rst``, ``.md`` and ``.txt`` files of the running interpreter's
standard library and of its ``site-packages`` directories. Nothing is downloaded and nothing is
written to disk: texts are read and tokenized on demand.

Units and split
---------------
Every file belongs to a *package*: the first path component under its root, named
``stdlib/<top>`` or ``site/<top>`` (``stdlib/json`` for ``json/decoder.py``, ``stdlib/argparse``
for ``argparse.py``, ``site/torch`` for ``torch/nn/modules/linear.py``). A file's key is
``<package root>/<path relative to its root>`` (``stdlib/json/decoder.py``) and does not depend
on where the interpreter is installed.

The train/held-out split is by package: a package is held out when the first 8 hex digits of
``sha256(package name)`` read as an integer are ``< HELDOUT_PER_MILLE * 2**32 / 1000`` (10 %).
Splitting whole packages (rather than single files) keeps near-duplicate files of one package
on one side, so held-out text is really unseen by a head trained on the train side. The rule is
fixed: the same package is held out on every machine and every Python version.

What differs between machines is which packages exist (another Python version, other installed
packages); :func:`fingerprint` hashes the exact file list and sizes so results can say which
corpus they used. ``source="stdlib"`` (the default of the evaluation) restricts to the standard
library, the part that is the same on every machine with the same Python minor version.

Excluded: ``__pycache__``, ``*.dist-info``/``*.egg-info``, ``site-packages`` nested inside the
stdlib root, ``oasiskv`` itself, files larger than ``max_file_bytes`` and files that are not
valid UTF-8.

Long texts
----------
Held-out evaluation texts (:func:`heldout_texts`) are the files of one held-out package
concatenated in key order (each preceded by a ``# file: <key>`` line) and cut into windows of
exactly ``n_tokens`` tokens: first one window from each package (packages in hash order), then
further windows of the same packages, until ``n_texts`` are found. Packages too short for one
window are skipped, so every text is a real, contiguous stretch of one package.

Run ``python -m oasiskv.eval.corpus`` to print the split's statistics.
"""

from __future__ import annotations

import hashlib
import os
import site
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

EXTENSIONS = (".py", ".rst", ".md", ".txt")
HELDOUT_PER_MILLE = 100
EXCLUDED_PACKAGES = frozenset({"oasiskv", "__pycache__"})
_SKIP_DIR_SUFFIXES = (".dist-info", ".egg-info")


@dataclass(frozen=True)
class SourceFile:
    key: str  # "stdlib/json/decoder.py": machine-independent
    package: str  # "stdlib/json"
    path: Path
    size: int

    @property
    def split(self) -> str:
        return split_of(self.package)


def split_of(package: str) -> str:
    """``"heldout"`` or ``"train"``: a fixed function of the package name (see the module doc)."""
    h = int(hashlib.sha256(package.encode("utf-8")).hexdigest()[:8], 16)
    return "heldout" if h < HELDOUT_PER_MILLE * 2**32 // 1000 else "train"


def package_order(package: str, seed: int = 0) -> str:
    """A deterministic pseudo-random sort key for packages (mixes stdlib and site packages)."""
    return hashlib.sha256(f"{seed}:{package}".encode()).hexdigest()


def default_roots() -> list[tuple[str, Path]]:
    """``[("stdlib", <stdlib dir>), ("site", <site-packages dir>), ...]`` of this interpreter."""
    roots: list[tuple[str, Path]] = []
    std = sysconfig.get_paths().get("stdlib")
    if std and Path(std).is_dir():
        roots.append(("stdlib", Path(std)))
    cands: list[str] = []
    try:
        cands += site.getsitepackages()
    except AttributeError:  # pragma: no cover - old virtualenv's site module
        pass
    cands += [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    for c in [sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"), *cands]:
        if not c:
            continue
        p = Path(c).resolve()
        if p.is_dir() and all(p != r for _, r in roots):
            roots.append(("site", p))
    return roots


def _walk(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in EXCLUDED_PACKAGES
            and d not in ("site-packages", "dist-packages")
            and not d.endswith(_SKIP_DIR_SUFFIXES)
            and not d.startswith(".")
        )
        for f in sorted(filenames):
            if f.endswith(EXTENSIONS):
                yield Path(dirpath) / f


def list_files(
    roots: Sequence[tuple[str, Path]] | None = None,
    *,
    source: str = "all",
    split: str | None = None,
    max_file_bytes: int = 1 << 20,
) -> list[SourceFile]:
    """Every corpus file, sorted by key; ``source`` is ``"all"``, ``"stdlib"`` or ``"site"``,
    ``split`` is ``None`` (both), ``"train"`` or ``"heldout"``. A key seen under two roots keeps
    the first root's file."""
    if source not in ("all", "stdlib", "site"):
        raise ValueError(f"source must be 'all', 'stdlib' or 'site', got {source!r}")
    if split not in (None, "train", "heldout"):
        raise ValueError(f"split must be None, 'train' or 'heldout', got {split!r}")
    out: dict[str, SourceFile] = {}
    for kind, root in roots if roots is not None else default_roots():
        if source != "all" and kind != source:
            continue
        for path in _walk(root):
            rel = path.relative_to(root)
            top = rel.parts[0]
            if len(rel.parts) == 1:
                top = Path(top).stem
            if top in EXCLUDED_PACKAGES:
                continue
            package = f"{kind}/{top}"
            if split is not None and split_of(package) != split:
                continue
            key = f"{kind}/{rel.as_posix()}"
            if key in out:
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if 0 < size <= max_file_bytes:
                out[key] = SourceFile(key, package, path, size)
    return [out[k] for k in sorted(out)]


def read_text(f: SourceFile) -> str | None:
    """The file's text, or None when it is not valid UTF-8 (or unreadable)."""
    try:
        return f.path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def fingerprint(files: Iterable[SourceFile]) -> str:
    """sha256 over (key, size) of the files: which corpus a result was measured on."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.key}\0{f.size}\n".encode())
    return h.hexdigest()[:16]


def by_package(files: Iterable[SourceFile]) -> dict[str, list[SourceFile]]:
    groups: dict[str, list[SourceFile]] = {}
    for f in files:
        groups.setdefault(f.package, []).append(f)
    return groups


def encode_many(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of several texts (batched through the Rust tokenizer when it is available)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "encode_batch"):
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    return [list(tokenizer.encode(t)) for t in texts]


def file_header(f: SourceFile) -> str:
    return f"# file: {f.key}\n"


def package_tokens(tokenizer, files: Sequence[SourceFile], limit: int | None = None) -> list[int]:
    """The package's files concatenated in key order (each behind a ``# file:`` line), as token
    ids; stops reading files once ``limit`` tokens are collected (then returns exactly ``limit``)."""
    ids: list[int] = []
    batch: list[str] = []

    def flush() -> None:
        for x in encode_many(tokenizer, batch):
            ids.extend(x)
        batch.clear()

    chars = 0
    for f in files:
        text = read_text(f)
        if text is None:
            continue
        piece = file_header(f) + text + ("\n" if not text.endswith("\n") else "") + "\n"
        batch.append(piece)
        chars += len(piece)
        # Tokens are never longer than ~1 char on average for source code: flush in chunks and stop
        # as soon as the limit is certainly reached.
        if chars >= 65536:
            flush()
            chars = 0
            if limit is not None and len(ids) >= limit:
                break
    if batch:
        flush()
    return ids[:limit] if limit is not None else ids


def heldout_texts(
    tokenizer,
    n_tokens: int,
    n_texts: int,
    *,
    source: str = "stdlib",
    seed: int = 0,
    files: Sequence[SourceFile] | None = None,
    max_windows_per_package: int = 4,
    split: str = "heldout",
) -> list[dict]:
    """``n_texts`` held-out token windows of exactly ``n_tokens`` tokens each (see the module doc).
    ``split="train"``: windows of the train split instead (calibration text, disjoint from every
    evaluation text).

    Returns dicts ``{"package", "window", "tokens"}``. Raises ValueError when the split has too
    little text (use ``source="all"`` or fewer/shorter texts).
    """
    if files is None:
        files = list_files(source=source, split=split)
    groups = by_package(f for f in files if f.split == split)
    order = sorted(groups, key=lambda p: package_order(p, seed))
    cache: dict[str, list[int]] = {}
    out: list[dict] = []
    for window in range(max_windows_per_package):
        for pkg in order:
            if len(out) >= n_texts:
                return out
            if pkg not in cache:
                cache[pkg] = package_tokens(tokenizer, groups[pkg], limit=max_windows_per_package * n_tokens)
            ids = cache[pkg]
            if len(ids) >= (window + 1) * n_tokens:
                out.append(
                    {
                        "package": pkg,
                        "window": window,
                        "tokens": ids[window * n_tokens : (window + 1) * n_tokens],
                    }
                )
    if len(out) < n_texts:
        raise ValueError(
            f"the {'held-out' if split == 'heldout' else split} split ({source}) holds only {len(out)} "
            f"windows of {n_tokens} tokens, "
            f"{n_texts} were asked for; lower --texts or use the 'all' source"
        )
    return out


def train_files(source: str = "all", seed: int = 0) -> list[SourceFile]:
    """The train split in a seeded, deterministic shuffled order (by hash of key and seed)."""
    files = list_files(source=source, split="train")
    return sorted(files, key=lambda f: hashlib.sha256(f"{seed}:{f.key}".encode()).hexdigest())


def stats(files: Sequence[SourceFile]) -> dict:
    groups = by_package(files)
    out = {"files": len(files), "bytes": sum(f.size for f in files), "packages": len(groups)}
    for split in ("train", "heldout"):
        fs = [f for f in files if f.split == split]
        out[split] = {
            "files": len(fs),
            "bytes": sum(f.size for f in fs),
            "packages": sorted({f.package for f in fs}),
        }
    out["fingerprint"] = fingerprint(files)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m oasiskv.eval.corpus", description=__doc__.split("\n")[0])
    ap.add_argument("--source", default="all", choices=["all", "stdlib", "site"])
    ap.add_argument("--packages", action="store_true", help="list the held-out packages")
    args = ap.parse_args(argv)
    s = stats(list_files(source=args.source))
    for split in ("train", "heldout"):
        d = s[split]
        print(f"{split:8s} {d['files']:7d} files {d['bytes'] / 1e6:8.1f} MB {len(d['packages']):5d} packages")
    print(f"fingerprint {s['fingerprint']}")
    if args.packages:
        print(json.dumps(s["heldout"]["packages"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
