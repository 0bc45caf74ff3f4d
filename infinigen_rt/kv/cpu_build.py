"""Building the CPU's kernels (kv/_cpu_kernels.c, bound as typed torch operators by kv/_cpu_ops.cpp) and loading
them only where nothing another user wrote, or a damaged file, can be loaded (kv/cpu.py calls `load` once a process).

One library for every x86-64 machine: the C source compiled once per instruction set (VARIANTS: plain x86-64, AVX2,
AVX-512; elsewhere plain alone), each variant's kernels under names of their own (_cpu_kernels.h), linked with the
C++ operators, which run the variant chosen once a process (kv/cpu.py: the best this CPU runs, or
`$INFINIGEN_CPU_ISA`). Built with the machine's C compiler (`$CC`, read as make reads it: a program and its
arguments, split as a shell would; else cc, gcc or clang), whose driver compiles the C++ file too (-x c++, against
torch's headers) and links, into a cache keyed by the sources, the compiler's command and version, the flags, torch's
version and C++ ABI and the architecture (`$INFINIGEN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/infinigen` or
~/.cache/infinigen, made with mode 0o700). A build is written under a temporary name, proved to load in a child
process (a library that crashes the loader, or junk a compiler wrote and called a success, fails the build there),
then renamed into the cache with its sha256 and size recorded beside it (`<name>.sha256`, renamed in after it), so a
build killed half way leaves nothing that loads.

Nothing is loaded that another user could have written: the cache is used only where its folder, and the library
and record in it (lstat: regular files, not links), belong to this effective user and no group or other may write
them. A folder that fails is neither read nor written: the kernels are built into a private temporary folder for
this process, removed once they are loaded, with a warning that says so. A cached library that fails, or whose size
or sha256 is not its record's (cut short, damaged), is rebuilt over, with a warning; a library is loaded in this
process only after its sha256 has been checked in this process, and one build at most a process (its operators'
names are registered once: a second, other build is refused, one with the same sha256 is the one loaded)."""

from __future__ import annotations

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
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

SRC = Path(__file__).with_name("_cpu_kernels.c")
HEADER = SRC.with_name("_cpu_kernels.h")
OPS_SRC = SRC.with_name("_cpu_ops.cpp")
FAST_MATH = ["-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
C_FLAGS = ["-x", "c", "-O3", *FAST_MATH, "-fPIC", "-fvisibility=hidden"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mpopcnt"]
# each variant's instruction sets (the C++ file's runs_here checks the same on the CPU that loads the library); the
# source's `#if defined(__AVX512...)` branches are the AVX-512 variant's, its integer scores need VNNI
VARIANTS = {"plain": [], "avx2": _AVX2,
            "avx512": [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]}  # fmt: skip
CXX_FLAGS = ["-x", "c++", "-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden"]  # (and torch's headers, its ABI)
# (after -L torch's libraries' folder) torch's libraries and the C++ runtime
LINK_FLAGS = ["-shared", "-lc10", "-ltorch_cpu", "-lc++" if sys.platform == "darwin" else "-lstdc++"]
OPERATORS = ("variants", "choose", "isa", "integer_scores", "score_codes", "score_channel", "quantize_rows",
             "quantize_channel", "group_softmax", "topk", "correct_pick", "gather_rows", "correct_channel",
             "speculate_channel", "attend_rows", "linear")  # fmt: skip
CACHE_ENV = "INFINIGEN_KERNEL_CACHE"
LOCK_NAME = "infinigen-cpu-kernels.lock"
CHECK_TIMEOUT = 120  # seconds the child process that proves a build loads may take (it imports torch)

# run in a child process on a fresh build (argv: the folder torch is imported from, the library, the operators it
# must register): a library that kills the loader (SIGBUS, SIGSEGV) or that the loader refuses fails the build
# there, not in the process that uses it
_PROVE = ("import sys\nsys.path.insert(0, sys.argv[1])\nimport torch\ntorch.ops.load_library(sys.argv[2])\n"
          "for name in sys.argv[3:]:\n    getattr(torch.ops.infinigen, name)\ntorch.ops.infinigen.integer_scores()\n")
_loaded: Path | None = None  # the build this process loaded (one a process)


def variants() -> dict[str, list[str]]:
    """The variants built on this machine's architecture, and their flags: all three on x86-64, else plain."""
    return VARIANTS if platform.machine().lower() in ("x86_64", "amd64") else {"plain": []}


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


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "infinigen"


def _torch_flags() -> tuple[list[str], list[str]]:
    """(the C++ file's flags for torch's headers and C++ ABI, the link's for where torch's libraries are)."""
    from torch.utils.cpp_extension import include_paths  # (only to build)

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    return [abi, *(f"-I{p}" for p in include_paths())], [f"-L{Path(torch.__file__).parent / 'lib'}"]


def kernel_name(cc: list[str]) -> str:
    """The library's file name in the cache: keyed by the sources, the compiler's command and `--version`, the
    flags, torch's version and C++ ABI, and the architecture (not the CPU: each variant is chosen where it runs)."""
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    flags = [*C_FLAGS, *(f"{k}: {' '.join(v)}" for k, v in variants().items()), *CXX_FLAGS, *LINK_FLAGS]
    parts = (SRC.read_text(), HEADER.read_text(), OPS_SRC.read_text(), shlex.join(cc), version, " ".join(flags),
             torch.__version__, str(torch.compiled_with_cxx11_abi()), platform.machine())  # fmt: skip
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
    """RuntimeError unless a child process loads the library at part, finds its operators and calls one."""
    if not sys.executable:
        raise RuntimeError("no Python interpreter to prove the library loads in")
    site = str(Path(torch.__file__).parent.parent)  # (the child imports the torch this process runs)
    r = subprocess.run([sys.executable, "-I", "-c", _PROVE, site, str(part), *OPERATORS], capture_output=True,
                       text=True, timeout=CHECK_TIMEOUT)  # fmt: skip
    if r.returncode < 0:
        try:
            how = signal.Signals(-r.returncode).name
        except ValueError:
            how = f"signal {-r.returncode}"
        raise RuntimeError(f"what {shlex.join(cc)} built kills the process that loads it ({how})")
    if r.returncode:
        last = (r.stderr or r.stdout).strip().splitlines()
        raise RuntimeError(f"what {shlex.join(cc)} built does not load: {last[-1][-300:] if last else r.returncode}")


def _compile(cc: list[str], tmp: Path, part: Path) -> None:
    """The C source once per variant and the C++ operators, at once (each its own process), then linked at part.
    RuntimeError where the compiler fails."""
    cxx, where = _torch_flags()
    jobs = [[*cc, *C_FLAGS, f"-DINFINIGEN_ISA={isa}", *flags, "-c", str(SRC), "-o", str(tmp / f"{isa}.o")]
            for isa, flags in variants().items()]  # fmt: skip
    jobs.append([*cc, *CXX_FLAGS, *cxx, "-c", str(OPS_SRC), "-o", str(tmp / "ops.o")])
    link = [*cc, *(cmd[-1] for cmd in jobs), "-o", str(part), *where, *LINK_FLAGS]

    def run(cmd: list[str]) -> None:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise RuntimeError(f"{shlex.join(cc)} failed: {(r.stderr or r.stdout).strip()[-400:]}")

    with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        list(pool.map(run, jobs))
    run(link)


def build(cc: list[str], out_dir: Path, name: str | None = None) -> Path:
    """Build the library into out_dir as `name` (kernel_name(cc)), replacing what is there, its record beside it:
    compiled under a temporary name, proved to load in a child process, then renamed in (the record after it).
    RuntimeError where the compiler fails or what it wrote does not load: nothing left."""
    lib = out_dir / (name or kernel_name(cc))
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        part, rec = Path(tmp) / lib.name, Path(tmp) / "record"
        _compile(cc, Path(tmp), part)
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


def _open(lib: Path) -> Path:
    """Load the library at lib (its operators: torch.ops.infinigen), once its sha256 has been checked against its
    record here. A process holds one build (its operators are registered once): the same key again (its file name:
    the sources, compiler, flags and torch it was built from; the bytes of two builds may differ) is the one loaded;
    another, RuntimeError."""
    global _loaded
    why = file_problem(lib) or damage(lib)
    if why is not None:
        raise RuntimeError(f"{lib}, just built: {why}")
    if _loaded is not None:
        if _loaded.name != lib.name:
            raise RuntimeError(f"another build of the kernels ({_loaded}) is loaded in this process")
        return _loaded
    torch.ops.load_library(str(lib))
    _loaded = lib
    return lib


def load(cc: list[str], notes: list[str]) -> Path:
    """Load the kernels cc builds (torch.ops.infinigen), returning where from: the cache where it is this user's
    alone, built there where they are missing or not to be trusted; else built into a private temporary folder for
    this process. The user's warnings appended to notes."""
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
