"""Building the CPU's kernels (kv/_cpu_kernels.c) and loading them only where nothing another user wrote, or a
damaged file, can be loaded (kv/cpu.py calls `load` once a process).

Built with the machine's C compiler (`$CC`, read as make reads it: a program and its arguments, split as a shell
would; else cc, gcc or clang; -O3 -march=native) into a cache keyed by the source, the compiler's command and
version, the flags and the machine (`$INFINIGEN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/infinigen` or
~/.cache/infinigen, made with mode 0o700). A build is written under a temporary name, proved to load in a child
process (a library that crashes the loader, or junk a compiler wrote and called a success, fails the build there),
then renamed into the cache with its sha256 and size recorded beside it (`<name>.sha256`, renamed in after it), so a
build killed half way leaves nothing that loads.

Nothing is loaded that another user could have written: the cache is used only where its folder, and the library
and record in it (lstat: regular files, not links), belong to this effective user and no group or other may write
them. A folder that fails is neither read nor written: the kernels are built into a private temporary folder for
this process, removed once they are loaded, with a warning that says so. A cached library that fails, or whose size
or sha256 is not its record's (cut short, damaged), is rebuilt over, with a warning; a library is loaded in this
process only after its sha256 has been checked in this process."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

SRC = Path(__file__).with_name("_cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-shared", "-fPIC"]  # fmt: skip
CACHE_ENV = "INFINIGEN_KERNEL_CACHE"
LOCK_NAME = "infinigen-cpu-kernels.lock"
CHECK_TIMEOUT = 60  # seconds the child process that proves a build loads may take

_P, _I = ctypes.c_void_p, ctypes.c_int64
# each exported kernel's arguments (each returns an int): what cpu.library() declares, and what a build must export
SIGNATURES: dict[str, list] = {
    "infinigen_score_codes": [_P] * 4 + [_I, _P] + [_I] * 12,
    "infinigen_score_channel": [_P] * 4 + [_I, _P] + [_I] * 12,
    "infinigen_quantize_rows": [_P] * 4 + [_I] * 5,
    "infinigen_quantize_channel": [_P] * 3 + [_I] + [_P] * 3 + [_I] * 5 + [ctypes.c_float],
    "infinigen_group_softmax": [_P] * 3 + [_I] * 3 + [ctypes.c_float] + [_I] * 2,
    "infinigen_topk": [_P] * 3 + [_I] * 3 + [ctypes.c_int] + [_I] * 2,
    "infinigen_correct_pick": [_P] * 3 + [_I] + [_P] * 3 + [_I] * 4 + [ctypes.c_int] + [_I] * 2,
    "infinigen_gather_rows": [_P] * 5 + [_I] * 8,
    "infinigen_correct_channel": [_P] * 7 + [_I] + [_P] * 10 + [_I] * 13 + [ctypes.c_int, _P, _I, _P] + [_I] * 2,
    "infinigen_speculate_channel": [_P] * 6 + [_I] * 12 + [_P] + [_I] * 2,
    "infinigen_linear": [_P] * 3 + [_I] * 3 + [_P] + [_I] * 3,
    "infinigen_integer_scores": [],
    "infinigen_attend_rows": [_P] * 4 + [_I, _P, _I] + [_P] * 3 + [_I] * 4 + [_P] + [_I] * 2,
}
# run in a child process on a fresh build (argv: the library, then the names it must export): a library that kills
# the loader (SIGBUS, SIGSEGV) or that the loader refuses fails the build there, not in the process that uses it
_PROVE = ("import ctypes, sys\nlib = ctypes.CDLL(sys.argv[1])\nfor name in sys.argv[2:]:\n    getattr(lib, name)\n"
          "lib.infinigen_integer_scores.restype = ctypes.c_int\nlib.infinigen_integer_scores()\n")  # fmt: skip

def cc_missing() -> str | None:
    """Why `$CC` names no program to run ("CC=...: not found"), or None: it does, or it is not set (or blank)."""
    cc = os.environ.get("CC", "")
    if not cc.strip():
        return None
    try:
        argv = shlex.split(cc)
    except ValueError as e:
        return f"CC={cc}: not found (not a command a shell could split: {e})"
    return None if argv and argv[0] and shutil.which(argv[0]) else f"CC={cc}: not found"


def compiler() -> list[str] | None:
    """The C compiler's command (a program and its arguments): `$CC` split as a shell would, else the first of cc,
    gcc and clang found. None where there is none, or where `$CC`'s program is not found (`_cc_missing`): no other
    compiler is taken in its place."""
    if cc_missing() is not None:
        return None
    if os.environ.get("CC", "").strip():
        return shlex.split(os.environ["CC"])
    return next(([c] for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "infinigen"


def kernel_name(cc: list[str]) -> str:
    """The library's file name in the cache: keyed by the source, the compiler's command and `--version`, the flags
    and the machine."""
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    parts = (SRC.read_text(), shlex.join(cc), version, " ".join(FLAGS), platform.machine(), _cpu_flags())
    key = hashlib.sha256(b"\0".join(x.encode() for x in parts)).hexdigest()[:16]
    return f"infinigen-cpu-kernels-{key}.so"


def record_of(lib: Path) -> Path:
    """Where the library's sha256 and size are recorded: `<name>.sha256` beside it."""
    return lib.with_name(lib.name + ".sha256")


def _private_problem(st: os.stat_result) -> str | None:
    """Why what another user wrote could be in a file or folder with this lstat/stat, or None: only this effective
    user can write it."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def file_problem(path: Path) -> str | None:
    """Why the file at path (not followed: a link fails) is not to be trusted as this user's own; FileNotFoundError
    where there is none."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return _private_problem(st)


def _sha256(path: Path, st: os.stat_result) -> str:
    """The sha256 of the file at path, read without following a link, and only if it is still the file st is of."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        now = os.fstat(f.fileno())
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise OSError(f"{path} changed while it was checked")
        h = hashlib.sha256()
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def damage(lib: Path) -> str | None:
    """Why the library at lib (present, and this user's own) is not what was recorded when it was built, or None:
    its size and sha256 are its record's."""
    rec = record_of(lib)
    try:
        problem = file_problem(rec)
        text = rec.read_text(errors="replace")[:200] if problem is None else ""
    except FileNotFoundError:
        return "no checksum record beside it"
    if problem is not None:
        return f"its checksum record is {problem}"
    fields = text.split()
    if len(fields) != 2 or not fields[1].isdigit():
        return "its checksum record is unreadable"
    st = os.lstat(lib)
    if st.st_size != int(fields[1]):
        return f"{st.st_size} bytes where {fields[1]} were recorded"
    if _sha256(lib, st) != fields[0]:
        return "its sha256 is not the one recorded"
    return None


def _prove_loads(part: Path, cc: list[str]) -> None:
    """RuntimeError unless a child process loads the library at part and calls a kernel of it."""
    if not sys.executable:
        raise RuntimeError("no Python interpreter to prove the library loads in")
    r = subprocess.run([sys.executable, "-I", "-c", _PROVE, str(part), *SIGNATURES], capture_output=True, text=True,
                       timeout=CHECK_TIMEOUT)  # fmt: skip
    if r.returncode < 0:
        try:
            how = signal.Signals(-r.returncode).name
        except ValueError:
            how = f"signal {-r.returncode}"
        raise RuntimeError(f"what {shlex.join(cc)} built kills the process that loads it ({how})")
    if r.returncode:
        last = (r.stderr or r.stdout).strip().splitlines()
        raise RuntimeError(f"what {shlex.join(cc)} built does not load: {last[-1][-300:] if last else r.returncode}")


def build(cc: list[str], out_dir: Path, name: str | None = None) -> Path:
    """Build the library for this machine into out_dir as `name` (kernel_name(cc)), replacing what is there, its
    record beside it: compiled under a temporary name, proved to load in a child process, then renamed in (the
    record after it). RuntimeError where the compiler fails or what it wrote does not load: nothing left."""
    lib = out_dir / (name or kernel_name(cc))
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        part, rec = Path(tmp) / lib.name, Path(tmp) / "record"
        r = subprocess.run([*cc, *FLAGS, str(SRC), "-o", str(part)], capture_output=True, text=True, timeout=300)
        if r.returncode:
            raise RuntimeError(f"{shlex.join(cc)} failed: {(r.stderr or r.stdout).strip()[-400:]}")
        if not part.is_file():
            raise RuntimeError(f"{shlex.join(cc)} wrote no library")
        os.chmod(part, 0o755)
        st = os.lstat(part)
        digest = _sha256(part, st)
        _prove_loads(part, cc)
        rec.write_text(f"{digest} {st.st_size}\n")
        os.chmod(rec, 0o644)
        os.replace(part, lib)
        os.replace(rec, record_of(lib))
    return lib


def _open(lib: Path) -> ctypes.CDLL:
    """The library at lib, loaded only once its sha256 has been checked against its record here."""
    why = file_problem(lib) or damage(lib)
    if why is not None:
        raise RuntimeError(f"{lib}, just built: {why}")
    return ctypes.CDLL(str(lib))


def load(cc: list[str], notes: list[str]) -> ctypes.CDLL:
    """The kernels cc builds: from the cache where it is this user's alone, built there where they are missing or
    not to be trusted; else built into a private temporary folder for this process. The user's warnings appended
    to notes."""
    folder = cache_dir().absolute()  # (a bare name would have the loader search the library path)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(folder)
    why = _private_problem(st) if stat.S_ISDIR(st.st_mode) else "not a folder"
    if why is not None:
        notes.append(f"the kernel cache {folder} is {why}, so it is neither read nor written: the CPU kernels are "
                     f"built for this run alone; set {CACHE_ENV} to a folder only you can write")  # fmt: skip
        tmp = Path(tempfile.mkdtemp(prefix="infinigen-kernels-"))  # (mode 0o700)
        try:
            return _open(build(cc, tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # (a loaded library stays mapped)
    lib = folder / kernel_name(cc)
    with _locked(folder):  # another process's first build renames the library in before its record
        try:
            foreign = file_problem(lib)
        except FileNotFoundError:  # not built yet
            build(cc, folder, lib.name)
            return _open(lib)
        if foreign is not None:
            notes.append(f"the cached kernel library {lib} is {foreign}: not loaded; built again in its place")
            build(cc, folder, lib.name)
        elif (why := damage(lib)) is not None:
            notes.append(f"the cached kernel library {lib} was damaged ({why}): rebuilt")
            build(cc, folder, lib.name)
        return _open(lib)


@contextmanager
def _locked(folder: Path):
    """The cache's lock, held while a process checks, builds and opens its library: two first builds at once (two
    servers started together) each see the other's library whole, with its record."""
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)
