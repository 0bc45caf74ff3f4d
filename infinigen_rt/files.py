"""Files a user names on the command line: read as UTF-8, checked writable before any work, written atomically.

Every failure is a one-line InfinigenError that names the option and the path."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from infinigen_rt.errors import InfinigenError


def read_utf8(path, label: str) -> tuple[str, str]:
    """A UTF-8 text file's text and sha256; `label` names it in the one-line error when it is not UTF-8."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InfinigenError(f"cannot read {label} ({e.strerror or e})") from None
    try:
        return data.decode("utf-8"), hashlib.sha256(data).hexdigest()
    except UnicodeDecodeError:
        raise InfinigenError(f"{label} is not UTF-8 text") from None


JSON_MAX_BYTES = 64 << 20  # a bundle.json with a long chat template and thousands of tensors is well under 1 MiB
JSON_MAX_DEPTH = 32  # bundle.json nests 4 deep; a result file 3


def read_json(path, what: str, fix: str, max_bytes: int = JSON_MAX_BYTES):
    """A JSON file's value, or a one-line InfinigenError naming `what` with `fix` (what to do): a file that cannot
    be read, is larger than `max_bytes`, is not UTF-8 JSON, or nests deeper than JSON_MAX_DEPTH (json's parser
    raises RecursionError on a deep one, and what reads the value after it would recurse as deep)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise InfinigenError(f"{what} is {size:,} bytes, more than the {max_bytes:,} such a file can be; {fix}")
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise InfinigenError(f"cannot read {what} ({e.strerror or e}); {fix}") from None
    except UnicodeDecodeError:
        raise InfinigenError(f"{what} is corrupt: not UTF-8 text; {fix}") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise InfinigenError(f"{what} is corrupt: it nests deeper than {JSON_MAX_DEPTH} levels; {fix}") from None
    except ValueError as e:  # json.JSONDecodeError, or a number too long for int()
        raise InfinigenError(f"{what} is corrupt: not valid JSON ({e}); {fix}") from None
    if json_depth(value) > JSON_MAX_DEPTH:
        raise InfinigenError(f"{what} is corrupt: it nests deeper than {JSON_MAX_DEPTH} levels; {fix}")
    return value


def json_depth(value) -> int:
    """How deep a parsed JSON value nests (a scalar: 0), counted without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is not None:
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in items if isinstance(x, (dict, list)))
    return deepest


def check_writable_dir(folder: Path, what: str) -> None:
    """Create `folder` (and its parents) if needed and prove a file can be made in it, before any work;
    `what` names the output in the error ("--out results.json")."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # names the first folder it could not make
        raise InfinigenError(f"cannot write {what} ({e.filename}: {e.strerror}); choose a writable path") from None
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".infinigen-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InfinigenError(f"cannot write {what} ({folder}: {e.strerror}); choose a writable path") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_partials(out: Path) -> None:
    """Remove `.NAME.partial-PID` folders beside `out` left by a killed convert or pull (their process is gone)."""
    for d in out.parent.glob(f".{out.name}.partial-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def swap_into_place(tmp: Path, target: Path) -> None:
    """Rename the finished folder `tmp` to `target`, so that it appears whole or not at all; what is at `target` (the
    caller has checked it may go) is renamed aside first, then dropped."""
    if not os.path.lexists(target):
        tmp.rename(target)
        return
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def check_writable_file(path: Path, option: str) -> None:
    """`path` can be written by `write_atomic` (its folder is writable; it is not a folder itself)."""
    if path.is_dir():
        raise InfinigenError(f"{option} {path} is a folder; give a file path")
    check_writable_dir(path.parent, f"{option} {path}")


def write_atomic(path: Path, data: str | bytes, option: str) -> None:
    """Write through a hidden temporary file renamed over `path`: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InfinigenError(f"cannot write {option} {path} ({e.strerror or e})") from None


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; a one-line error naming the extra when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InfinigenError("--plot needs matplotlib: pip install 'infinigen[plot]'") from None
    return plt


def save_figure(fig, path: Path, dpi: int) -> None:
    """A matplotlib figure as a PNG at `path`, written atomically; the figure is closed."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    pyplot().close(fig)
    write_atomic(Path(path), buf.getvalue(), "--plot")


def check_outputs(out: Path | None, plot: Path | None) -> None:
    """Before any work: --out and --plot can be written, and --plot has matplotlib."""
    if out is not None:
        check_writable_file(out, "--out")
    if plot is not None:
        pyplot()
        check_writable_file(plot, "--plot")
