"""A small Hugging Face Hub-compatible HTTP server for tests (standard library only).

The project has no network access except PyPI, so every Hub code path is tested against this server, which
speaks the subset of the Hub HTTP API that the real ``huggingface_hub`` client (checked against 2.4.0, which
uses ``httpx2``) needs for ``snapshot_download``, ``hf_hub_download``, ``HfApi.model_info``/``dataset_info``,
``list_repo_tree``, ``list_repo_refs``, ``list_repo_commits``, ``create_repo``/``delete_repo``,
``create_branch``/``delete_branch``, ``create_commit``/``upload_file``/``upload_folder`` (legacy LFS path, Xet
disabled) and ``whoami``.

Storage is in memory: repos (``model`` and ``dataset``) hold git-like commits (40-hex sha, parent, full file
tree) and branches. A file is stored with LFS when it is >= 10 MB, matches the default Hub ``.gitattributes``
patterns (``*.safetensors``, ``*.bin``, ``*.gguf``, ``*.pt``, ...) or looks binary (a NUL byte in its first
512 bytes); empty files are always regular. Tokens are a map ``token -> (username, can_write)``.

Usage in a test (in-process client)::

    from tests.hubserver import HubServer, apply_hub_env, hub_env

    def test_download(tmp_path, monkeypatch):
        with HubServer() as hub:
            hub.add_repo("test-user/tiny", {"config.json": b"{}", "model.safetensors": b"..."})
            apply_hub_env(monkeypatch, hub_env(hub, tmp_path))
            from huggingface_hub import snapshot_download
            folder = snapshot_download("test-user/tiny")

Usage with a subprocess (the most robust: the client reads everything at import time)::

    env = {**os.environ, **hub_env(hub, tmp_path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True)

Why ``monkeypatch.setenv`` alone is NOT enough in-process (huggingface_hub 2.4.0):

* ``huggingface_hub.constants`` evaluates ``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``,
  ``HF_HUB_DISABLE_XET``, ``HF_HUB_DISABLE_TELEMETRY``, ``HF_HUB_ETAG_TIMEOUT``... once, at import time.
* ``hf_hub_url`` (used by ``hf_hub_download``) formats ``constants.HUGGINGFACE_CO_URL_TEMPLATE``, a second
  copy of the endpoint made at import time: patching ``constants.ENDPOINT`` alone still downloads from
  huggingface.co.
* The top-level functions ``huggingface_hub.create_repo``, ``upload_folder``, ``model_info``, ``whoami``...
  are bound methods of a module-level ``HfApi()`` instance (``huggingface_hub.hf_api.api``) whose
  ``endpoint`` was fixed at import time.
* ``huggingface_hub.utils.tqdm`` holds its own copy of ``HF_HUB_DISABLE_PROGRESS_BARS``
  (``from ..constants import ...``), and ``huggingface_hub.utils._http._HUB_ORIGINS`` (the hosts the auth
  header may follow redirects to) is frozen at import time too.
* Unless telemetry is disabled, building the User-Agent fetches ``{constants.ENDPOINT}/api/agent-harnesses``
  (3 s timeout) once per process - against huggingface.co if the endpoint was not patched.
* ``HfApi`` and ``HfFileSystem`` instances (fsspec caches the latter) created before the patch keep the old
  endpoint: create them after ``apply_hub_env``, or pass ``endpoint=`` explicitly.

:func:`apply_hub_env` handles all of that: it sets the environment variables with ``monkeypatch.setenv``,
re-evaluates a fresh copy of ``constants.py`` under that environment and patches every constant that changed
(in ``constants`` and in every loaded ``huggingface_hub.*`` module holding a copy of it), re-points
``hf_api.api.endpoint`` and ``_HUB_ORIGINS`` and drops the shared HTTP client. ``monkeypatch`` undoes all of
it at teardown. Call it again (e.g. with ``{**env, "HF_HUB_OFFLINE": "1"}``) to switch to offline mode or to
another ``HF_HOME`` within a test.

Failure injection, to prove that an interrupted upload leaves the remote revision unchanged:

* ``server.fail_lfs_after_bytes = N``: every LFS upload (``PUT``) is treated as cut off after ``N`` bytes: the
  object is not stored and the upload is answered with HTTP 400 (a non-retried status, so the client fails
  fast instead of backing off for ~25 s as it does on 5xx or dropped connections).
* ``server.fail_next_commit = True``: the next ``/commit`` request is answered with HTTP 500 after it has been
  read and validated, and the branch is left unchanged (``create_commit`` does not retry commits).
* A commit referencing an LFS object that was never (completely) uploaded is rejected with HTTP 400 and the
  branch is left unchanged.

Set ``HUBSERVER_LOG=1`` to print every request the server answers to stderr; ``server.requests`` records them
too (method, route name, path, status).

Deliberate simplifications: no pagination, no Xet, no ``.gitignore`` handling in preupload (``shouldIgnore``
is always false), ``.gitattributes`` is written by ``create_repo`` but never parsed, no tags, no discussions
besides the ``refs/pr/N`` branch that ``create_pr=True`` creates.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import importlib.util
import json
import os
import re
import secrets
import socket
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

DEFAULT_USER = "test-user"
DEFAULT_TOKEN = "hf_hubserver_test_user_write"
READ_ONLY_TOKEN = "hf_hubserver_test_user_read"
OTHER_USER = "other-user"
OTHER_TOKEN = "hf_hubserver_other_user_write"

LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
# Patterns of the default `.gitattributes` the Hub writes in new model repos.
LFS_PATTERNS = (
    "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gguf", "*.gz", "*.h5", "*.joblib", "*.lfs.*",
    "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb", "*.pickle",
    "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*", "*.tar", "*.tflite",
    "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*",
)  # fmt: skip
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()

_REPO_TYPES = {"models": "model", "datasets": "dataset"}
_URL_PREFIX = {"model": "", "dataset": "datasets/"}
_HEX64 = re.compile(r"[0-9a-f]{64}")


# ----------------------------------------------------------------------------------------------------------
# Git-like helpers
# ----------------------------------------------------------------------------------------------------------


def git_blob_sha1(data: bytes) -> str:
    """Git object id of a blob (what the Hub uses as ETag of a regular file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """Content of the git-lfs pointer file stored in git in place of an LFS file."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def is_lfs_path(path: str, size: int, sample: bytes) -> bool:
    """Whether the Hub would store this file with LFS (size, default `.gitattributes` patterns, binary)."""
    if size == 0:
        return False
    if size >= LFS_SIZE_THRESHOLD or b"\0" in sample[:512]:
        return True
    name = path.rsplit("/", 1)[-1]
    for pattern in LFS_PATTERNS:
        if "/" in pattern:
            if fnmatch.fnmatch(path, pattern.replace("**/", "*")):
                return True
        elif fnmatch.fnmatch(name, pattern):
            return True
    return False


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _validate_path(path: Any) -> str:
    if not isinstance(path, str) or not path or path.startswith("/") or path.endswith("/"):
        raise _HubError(400, f"Invalid path in repo: {path!r}")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise _HubError(400, f"Invalid path in repo: {path!r}")
    return path


@dataclass(frozen=True)
class _FileEntry:
    """One file of a commit tree. Content is stored once, by sha256, in the server's blob store."""

    sha256: str
    size: int
    lfs: bool
    git_oid: str  # sha1 of the blob, or of the LFS pointer for LFS files

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid


@dataclass
class _Commit:
    oid: str
    parent: str | None
    tree: dict[str, _FileEntry]
    title: str
    message: str
    author: str
    date: str


@dataclass
class _Repo:
    repo_type: str
    repo_id: str
    private: bool = False
    gated: bool = False
    created_at: str = field(default_factory=_now)
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, _Commit] = field(default_factory=dict)
    lfs_objects: set[str] = field(default_factory=set)
    members: set[str] = field(default_factory=set)  # users with owner rights besides the namespace
    granted: set[str] = field(default_factory=set)  # users granted access to a gated repo
    next_pr: int = 1

    @property
    def namespace(self) -> str | None:
        return self.repo_id.split("/")[0] if "/" in self.repo_id else None


@dataclass(frozen=True)
class _Identity:
    token: str
    username: str
    can_write: bool


@dataclass(frozen=True)
class RequestRecord:
    """One request the server answered: method, route name (``None`` if unknown), raw path and status."""

    method: str
    route: str | None
    path: str
    status: int


class _HubError(Exception):
    """An error answered in the Hub's style: JSON ``{"error": ...}`` plus the X-Error-Code/Message headers."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}


@dataclass(frozen=True)
class _Request:
    """What a route handler gets: URL parameters (unquoted), query parameters (last value), body, caller."""

    method: str
    headers: Any
    params: dict[str, str]
    query: dict[str, str]
    body: bytes
    ident: _Identity | None


@dataclass
class _Response:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    content_length: int | None = None  # for HEAD: the length the GET would have


def _json(obj: Any, status: int = 200, headers: dict | None = None) -> _Response:
    hdrs = {"Content-Type": "application/json; charset=utf-8", **(headers or {})}
    return _Response(status, json.dumps(obj).encode(), hdrs)


# ----------------------------------------------------------------------------------------------------------
# HTTP plumbing
# ----------------------------------------------------------------------------------------------------------

_REPO = r"[^/]+(?:/[^/]+)?"
_API = rf"/api/(?P<rtype>models|datasets)/(?P<repo>{_REPO})"
_GIT = rf"/(?:(?P<rprefix>datasets)/)?(?P<repo>{_REPO})\.git/info/lfs/objects"
_ROUTES: list[tuple[tuple[str, ...], str, str]] = [
    (("GET",), r"/api/whoami-v2", "whoami"),
    (("GET",), r"/api/agent-harnesses", "agent_harnesses"),
    (("POST",), r"/api/validate-yaml", "validate_yaml"),
    (("POST",), r"/api/repos/create", "repo_create"),
    (("DELETE",), r"/api/repos/delete", "repo_delete"),
    (("GET",), _API + r"/revision/(?P<rev>[^/]+)", "repo_info"),
    (("GET",), _API + r"/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "tree"),
    (("GET",), _API + r"/refs", "refs"),
    (("GET",), _API + r"/commits/(?P<rev>[^/]+)", "commits"),
    (("POST",), _API + r"/preupload/(?P<rev>[^/]+)", "preupload"),
    (("POST",), _API + r"/commit/(?P<rev>[^/]+)", "commit"),
    (("POST", "DELETE"), _API + r"/branch/(?P<branch>[^/]+)", "branch"),
    (("GET",), _API, "repo_info"),
    (("POST",), _GIT + r"/batch", "lfs_batch"),
    (("POST",), _GIT + r"/verify", "lfs_verify"),
    (("PUT",), r"/__lfs__/(?P<ticket>[A-Za-z0-9_-]+)", "lfs_upload"),
    (
        ("GET",),
        rf"/(?:(?P<rprefix>datasets)/)?(?P<repo>{_REPO})/resolve/(?P<rev>[^/]+)/(?P<path>.+)",
        "resolve",
    ),
]
_COMPILED_ROUTES = [(methods, re.compile(pattern), name) for methods, pattern, name in _ROUTES]


class _Handler(BaseHTTPRequestHandler):
    """Request handler; ``hub`` is bound per server (see :meth:`HubServer.start`)."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the real Hub (httpx2 pools connections)
    server_version = "HubServer/1.0"
    timeout = 30  # idle keep-alive connections are closed after this many seconds
    hub: HubServer

    def setup(self) -> None:
        super().setup()
        self.hub._track_connection(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.hub._track_connection(self.connection, add=False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if os.environ.get("HUBSERVER_LOG"):
            sys.stderr.write("hubserver: " + (format % args) + "\n")

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self.hub._handle(self, "GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self.hub._handle(self, "HEAD")

    def do_POST(self) -> None:  # noqa: N802
        self.hub._handle(self, "POST")

    def do_PUT(self) -> None:  # noqa: N802
        self.hub._handle(self, "PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self.hub._handle(self, "DELETE")

    def read_body(self) -> bytes:
        """Read the whole request body (``Content-Length`` or chunked transfer encoding)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline(65537).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF after each chunk
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""


# ----------------------------------------------------------------------------------------------------------
# The server
# ----------------------------------------------------------------------------------------------------------


class HubServer:
    """In-memory Hub-compatible server on ``127.0.0.1`` (random free port); see the module docstring.

    Args:
        tokens: ``token -> (username, can_write)``. Defaults to :data:`DEFAULT_TOKEN` (``test-user``,
            write), :data:`READ_ONLY_TOKEN` (``test-user``, read-only) and :data:`OTHER_TOKEN`
            (``other-user``, write).
        orgs: ``organization -> members``; members may write to repos of that namespace.

    Attributes:
        requests: every answered request, as :class:`RequestRecord` (``route`` is ``None`` for unknown URLs).
        errors: unexpected server-side exceptions (answered with HTTP 500); a healthy test leaves it empty.
        fail_lfs_after_bytes: see the module docstring.
        fail_next_commit: see the module docstring.
    """

    def __init__(
        self,
        tokens: Mapping[str, tuple[str, bool]] | None = None,
        orgs: Mapping[str, set[str]] | None = None,
    ) -> None:
        if tokens is None:
            tokens = {
                DEFAULT_TOKEN: (DEFAULT_USER, True),
                READ_ONLY_TOKEN: (DEFAULT_USER, False),
                OTHER_TOKEN: (OTHER_USER, True),
            }
        self.tokens: dict[str, tuple[str, bool]] = dict(tokens)
        self.orgs: dict[str, set[str]] = {name: set(members) for name, members in (orgs or {}).items()}
        self.requests: list[RequestRecord] = []
        self.errors: list[str] = []
        self.fail_lfs_after_bytes: int | None = None
        self.fail_next_commit: bool = False
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._blobs: dict[str, bytes] = {}  # sha256 -> content, shared by all repos
        # LFS upload ticket (the credential in the upload URL) -> (repo key, oid, size)
        self._tickets: dict[str, tuple[tuple[str, str], str, int]] = {}
        self._lock = threading.RLock()
        self._commit_counter = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()

    # -- lifecycle -----------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` (only valid once started)."""
        if self._httpd is None:
            raise RuntimeError("HubServer is not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        """Bind a random free port on 127.0.0.1 and serve in a daemon thread."""
        if self._httpd is not None:
            return self
        handler = type("_BoundHandler", (_Handler,), {"hub": self})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        httpd.daemon_threads = True
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="HubServer", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket and every open (keep-alive) connection."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _track_connection(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    # -- helpers for tests ---------------------------------------------------------------------------------

    def add_token(self, token: str, username: str, can_write: bool = True) -> None:
        """Register (or replace) a token."""
        self.tokens[token] = (username, can_write)

    def add_repo(
        self,
        repo_id: str,
        files: Mapping[str, bytes | str | Path] | None = None,
        *,
        repo_type: str = "model",
        private: bool = False,
        gated: bool = False,
        owner_token: str | None = None,
        message: str = "initial commit",
    ) -> str:
        """Create a repo whose ``main`` branch has one commit holding exactly ``files``; return its sha.

        ``owner_token``: a token whose user gets owner rights (read when private, write, gated access). An
        unknown token is registered as a write token of the repo's namespace user.
        """
        with self._lock:
            key = (repo_type, repo_id)
            if key in self._repos:
                raise ValueError(f"repo {repo_type}:{repo_id} already exists")
            repo = _Repo(repo_type=repo_type, repo_id=repo_id, private=private, gated=gated)
            if owner_token is not None:
                if owner_token not in self.tokens:
                    self.tokens[owner_token] = (repo.namespace or repo_id, True)
                repo.members.add(self.tokens[owner_token][0])
            self._repos[key] = repo
            tree = {path: self._store(path, self._as_bytes(data)) for path, data in (files or {}).items()}
            return self._new_commit(repo, "main", tree, message, author=repo.namespace or "hubserver")

    def commit_files(
        self,
        repo_id: str,
        files: Mapping[str, bytes | str | Path | None],
        *,
        repo_type: str = "model",
        branch: str = "main",
        message: str = "update files",
    ) -> str:
        """Commit on ``branch`` (created from ``main`` if missing): add or replace files, ``None`` deletes."""
        with self._lock:
            repo = self._repo(repo_id, repo_type)
            parent = repo.branches.get(branch) or repo.branches["main"]
            tree = dict(repo.commits[parent].tree)
            for path, data in files.items():
                if data is None:
                    tree.pop(path, None)
                else:
                    tree[_validate_path(path)] = self._store(path, self._as_bytes(data))
            repo.branches.setdefault(branch, parent)
            return self._new_commit(repo, branch, tree, message, author=repo.namespace or "hubserver")

    def create_branch(self, repo_id: str, branch: str, from_rev: str = "main", *, repo_type: str = "model") -> str:
        """Create ``branch`` pointing at ``from_rev``; return the commit sha."""
        with self._lock:
            repo = self._repo(repo_id, repo_type)
            sha = self._resolve(repo, from_rev)
            if sha is None:
                raise KeyError(from_rev)
            repo.branches[branch] = sha
            return sha

    def grant_access(self, repo_id: str, username: str, *, repo_type: str = "model") -> None:
        """Grant ``username`` access to a gated repo."""
        with self._lock:
            self._repo(repo_id, repo_type).granted.add(username)

    def revision_sha(self, repo_id: str, rev: str = "main", *, repo_type: str = "model") -> str:
        """Commit sha ``rev`` (branch, sha or sha prefix) points to."""
        with self._lock:
            sha = self._resolve(self._repo(repo_id, repo_type), rev)
            if sha is None:
                raise KeyError(f"unknown revision {rev!r} in {repo_id}")
            return sha

    def files(self, repo_id: str, rev: str = "main", *, repo_type: str = "model") -> dict[str, bytes]:
        """Full content of the tree at ``rev``."""
        with self._lock:
            commit = self._repo(repo_id, repo_type).commits[self.revision_sha(repo_id, rev, repo_type=repo_type)]
            return {path: self._blobs[entry.sha256] for path, entry in commit.tree.items()}

    def lfs_files(self, repo_id: str, rev: str = "main", *, repo_type: str = "model") -> set[str]:
        """Paths stored with LFS at ``rev``."""
        with self._lock:
            commit = self._repo(repo_id, repo_type).commits[self.revision_sha(repo_id, rev, repo_type=repo_type)]
            return {path for path, entry in commit.tree.items() if entry.lfs}

    def history(self, repo_id: str, rev: str = "main", *, repo_type: str = "model") -> list[str]:
        """Commit shas from ``rev`` back to the first commit."""
        with self._lock:
            repo = self._repo(repo_id, repo_type)
            shas, sha = [], self._resolve(repo, rev)
            while sha is not None:
                shas.append(sha)
                sha = repo.commits[sha].parent
            return shas

    def has_lfs_object(self, repo_id: str, oid: str, *, repo_type: str = "model") -> bool:
        """Whether an LFS object (sha256) has been completely uploaded to the repo."""
        with self._lock:
            return oid in self._repo(repo_id, repo_type).lfs_objects

    def routes_hit(self) -> set[tuple[str, str | None]]:
        """Distinct ``(method, route)`` pairs answered so far."""
        return {(r.method, r.route) for r in self.requests}

    # -- storage internals ---------------------------------------------------------------------------------

    @staticmethod
    def _as_bytes(data: bytes | str | Path) -> bytes:
        if isinstance(data, Path):
            return data.read_bytes()
        if isinstance(data, str):
            return data.encode()
        return bytes(data)

    def _repo(self, repo_id: str, repo_type: str) -> _Repo:
        try:
            return self._repos[(repo_type, repo_id)]
        except KeyError:
            raise KeyError(f"no {repo_type} repo {repo_id!r}") from None

    def _store(self, path: str, data: bytes, lfs: bool | None = None) -> _FileEntry:
        """Store content in the blob store; returns the tree entry (LFS decided by :func:`is_lfs_path`)."""
        sha256 = hashlib.sha256(data).hexdigest()
        self._blobs[sha256] = data
        if lfs is None:
            lfs = is_lfs_path(path, len(data), data[:512])
        git_oid = git_blob_sha1(lfs_pointer(sha256, len(data)) if lfs else data)
        return _FileEntry(sha256=sha256, size=len(data), lfs=lfs, git_oid=git_oid)

    def _new_commit(self, repo: _Repo, branch: str, tree: dict[str, _FileEntry], title: str, author: str) -> str:
        """Commit on top of ``branch`` (or a root commit) and move the branch; the caller holds the lock."""
        parent = repo.branches.get(branch)
        self._commit_counter += 1
        manifest = "\n".join(f"{p} {e.git_oid}" for p, e in sorted(tree.items()))
        seed = f"{repo.repo_type}:{repo.repo_id}\n{parent}\n{self._commit_counter}\n{title}\n{manifest}"
        oid = hashlib.sha1(seed.encode()).hexdigest()
        repo.commits[oid] = _Commit(oid, parent, tree, title, title, author, _now())
        for entry in tree.values():
            if entry.lfs:
                repo.lfs_objects.add(entry.sha256)
        repo.branches[branch] = oid
        return oid

    @staticmethod
    def _resolve(repo: _Repo, rev: str) -> str | None:
        """Branch name (``refs/heads/`` optional), full sha or unambiguous sha prefix (>= 7) -> sha."""
        name = rev[len("refs/heads/") :] if rev.startswith("refs/heads/") else rev
        if name in repo.branches:
            return repo.branches[name]
        if re.fullmatch(r"[0-9a-f]{7,40}", rev):
            matches = [sha for sha in repo.commits if sha.startswith(rev)]
            if len(matches) == 1:
                return matches[0]
        return None

    # -- request handling ----------------------------------------------------------------------------------

    def _handle(self, h: _Handler, method: str) -> None:
        """Route a request, turn errors into Hub-style responses, log it."""
        split = urlsplit(h.path)
        route: str | None = None
        try:
            if method in ("POST", "PUT", "DELETE") or h.headers.get("Content-Length"):
                body = h.read_body()  # always drain the body: the connection is kept alive
            else:
                body = b""
            lookup = "GET" if method == "HEAD" else method
            for methods, regex, name in _COMPILED_ROUTES:
                match = regex.fullmatch(split.path)
                if match and lookup in methods:
                    route = name
                    break
            else:
                raise _HubError(404, "Sorry, we can't find the page you are looking for.")
            req = _Request(
                method=method,
                headers=h.headers,
                params={k: unquote(v) for k, v in match.groupdict().items() if v is not None},
                query={k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()},
                body=body,
                ident=self._identity(h),
            )
            response: _Response = getattr(self, f"_route_{route}")(req)
        except _HubError as err:
            headers = {"X-Error-Message": err.message, **err.headers}
            if err.code:
                headers["X-Error-Code"] = err.code
            response = _json({"error": err.message}, err.status, headers)
        except Exception as err:  # noqa: BLE001 - report, never kill the server thread
            self.errors.append(f"{method} {h.path}: {type(err).__name__}: {err}")
            response = _json({"error": f"Internal error: {err}"}, 500)
        with self._lock:
            self.requests.append(RequestRecord(method, route, h.path, response.status))
        self._send(h, method, response)

    @staticmethod
    def _send(h: _Handler, method: str, response: _Response) -> None:
        try:
            h.send_response(response.status)
            for key, value in response.headers.items():
                h.send_header(key, value)
            length = response.content_length if response.content_length is not None else len(response.body)
            h.send_header("Content-Length", str(length))
            h.end_headers()
            if method != "HEAD" and response.body:
                h.wfile.write(response.body)
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True

    def _identity(self, h: _Handler) -> _Identity | None:
        """Token from ``Authorization: Bearer``; unknown tokens are rejected with 401 like the Hub does."""
        header = h.headers.get("Authorization")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or token not in self.tokens:
            raise _HubError(401, "Invalid credentials in Authorization header")
        username, can_write = self.tokens[token]
        return _Identity(token, username, can_write)

    def _is_owner(self, repo: _Repo, ident: _Identity | None) -> bool:
        if ident is None:
            return False
        ns = repo.namespace
        return ident.username in repo.members or ident.username == ns or ident.username in self.orgs.get(ns, ())

    def _readable_repo(self, repo_type: str, repo_id: str, ident: _Identity | None) -> _Repo:
        """The repo, or 404 ``RepoNotFound`` when missing or private and not owned by the token's user."""
        repo = self._repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not self._is_owner(repo, ident)):
            raise _HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _check_write(self, repo: _Repo, ident: _Identity | None) -> None:
        if ident is None:
            raise _HubError(401, "You must be authenticated to write to a repository")
        if not ident.can_write:
            raise _HubError(403, "Forbidden: you must use a write token to write to a repository")
        if not self._is_owner(repo, ident):
            raise _HubError(403, f"Forbidden: you don't have the rights to write to {repo.repo_id}")

    def _check_gated(self, repo: _Repo, ident: _Identity | None) -> None:
        if not repo.gated or self._is_owner(repo, ident) or (ident and ident.username in repo.granted):
            return
        if ident is None:
            raise _HubError(401, "Access to this gated repo requires authentication", "GatedRepo")
        raise _HubError(403, f"Access to gated repo {repo.repo_id} is restricted", "GatedRepo")

    def _commit_of(self, repo: _Repo, rev: str) -> _Commit:
        sha = self._resolve(repo, rev)
        if sha is None:
            raise _HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return repo.commits[sha]

    def _repo_url(self, repo: _Repo) -> str:
        return f"{self.endpoint}/{_URL_PREFIX[repo.repo_type]}{repo.repo_id}"

    @staticmethod
    def _json_body(body: bytes) -> Any:
        try:
            return json.loads(body or b"{}")
        except ValueError:
            raise _HubError(400, "Invalid JSON body") from None

    # -- routes: account -----------------------------------------------------------------------------------

    def _route_whoami(self, req: _Request) -> _Response:
        ident = req.ident
        if ident is None:
            raise _HubError(401, "Invalid username or password.")
        orgs = [{"type": "org", "name": org} for org, members in sorted(self.orgs.items()) if ident.username in members]
        role = "write" if ident.can_write else "read"
        return _json(
            {
                "type": "user",
                "id": hashlib.sha1(ident.username.encode()).hexdigest()[:24],
                "name": ident.username,
                "fullname": ident.username,
                "email": f"{ident.username}@example.invalid",
                "emailVerified": True,
                "isPro": False,
                "orgs": orgs,
                "auth": {"type": "access_token", "accessToken": {"displayName": "hubserver", "role": role}},
            }
        )

    def _route_agent_harnesses(self, req: _Request) -> _Response:
        return _json({"standardEnvVars": [], "harnesses": {}})

    def _route_validate_yaml(self, req: _Request) -> _Response:
        return _json({"errors": [], "warnings": []})

    # -- routes: repos -------------------------------------------------------------------------------------

    def _route_repo_create(self, req: _Request) -> _Response:
        ident = req.ident
        payload = self._json_body(req.body)
        name, namespace = payload.get("name"), payload.get("organization")
        repo_type = payload.get("type") or "model"
        if repo_type not in _URL_PREFIX:
            raise _HubError(400, f"Unsupported repo type: {repo_type}")
        if ident is None:
            raise _HubError(401, "You must be authenticated to create a repo")
        namespace = namespace or ident.username
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise _HubError(400, f"Invalid repo name: {name!r}")
        if not ident.can_write or (namespace != ident.username and ident.username not in self.orgs.get(namespace, ())):
            raise _HubError(403, f"You don't have the rights to create a {repo_type} under the namespace {namespace}")
        repo_id = f"{namespace}/{name}"
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        with self._lock:
            if (repo_type, repo_id) in self._repos:
                url = self._repo_url(self._repos[(repo_type, repo_id)])
                return _json({"error": f"You already created this {repo_type} repo", "url": url}, 409)
            repo = _Repo(repo_type=repo_type, repo_id=repo_id, private=private)
            self._repos[(repo_type, repo_id)] = repo
            tree = {".gitattributes": self._store(".gitattributes", GITATTRIBUTES, lfs=False)}
            self._new_commit(repo, "main", tree, "initial commit", author=ident.username)
        return _json({"url": self._repo_url(repo), "name": repo_id, "id": repo_id})

    def _route_repo_delete(self, req: _Request) -> _Response:
        ident = req.ident
        payload = self._json_body(req.body)
        namespace = payload.get("organization") or (ident.username if ident else None)
        repo_id = f"{namespace}/{payload.get('name')}"
        repo_type = payload.get("type") or "model"
        with self._lock:
            repo = self._readable_repo(repo_type, repo_id, ident)
            self._check_write(repo, ident)
            del self._repos[(repo_type, repo_id)]
        return _Response(200)

    def _route_repo_info(self, req: _Request) -> _Response:
        ident = req.ident
        repo_type = _REPO_TYPES[req.params["rtype"]]
        with self._lock:
            repo = self._readable_repo(repo_type, req.params["repo"], ident)
            commit = self._commit_of(repo, req.params.get("rev", "main"))
            with_blobs = req.query.get("blobs", "").lower() in ("1", "true")
            siblings = []
            for path, entry in sorted(commit.tree.items()):
                sibling: dict[str, Any] = {"rfilename": path}
                if with_blobs:
                    sibling.update(size=entry.size, blobId=entry.git_oid)
                    if entry.lfs:
                        pointer_size = len(lfs_pointer(entry.sha256, entry.size))
                        sibling["lfs"] = {
                            "sha256": entry.sha256,
                            "size": entry.size,
                            "pointerSize": pointer_size,
                        }
                siblings.append(sibling)
            info: dict[str, Any] = {
                "_id": hashlib.sha1(f"{repo_type}:{repo.repo_id}".encode()).hexdigest()[:24],
                "id": repo.repo_id,
                "author": repo.namespace,
                "sha": commit.oid,
                "lastModified": commit.date,
                "createdAt": repo.created_at,
                "private": repo.private,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": siblings,
                "usedStorage": sum(e.size for e in commit.tree.values()),
            }
            if repo_type == "model":
                info["modelId"] = repo.repo_id
        return _json(info)

    def _route_tree(self, req: _Request) -> _Response:
        ident = req.ident
        recursive = req.query.get("recursive", "").lower() in ("1", "true")
        prefix = req.params.get("path", "").strip("/")
        with self._lock:
            repo = self._readable_repo(_REPO_TYPES[req.params["rtype"]], req.params["repo"], ident)
            tree = self._commit_of(repo, req.params["rev"]).tree
        base = f"{prefix}/" if prefix else ""
        below = {path: entry for path, entry in tree.items() if path.startswith(base)}
        if prefix and not below:
            raise _HubError(404, f"Entry not found: {prefix}", "EntryNotFound")
        files: dict[str, _FileEntry] = {}
        dirs: set[str] = set()
        for path, entry in below.items():
            parts = path[len(base) :].split("/")
            if recursive:
                files[path] = entry
                dirs.update(base + "/".join(parts[:i]) for i in range(1, len(parts)))
            elif len(parts) == 1:
                files[path] = entry
            else:
                dirs.add(base + parts[0])
        entries: list[dict[str, Any]] = []
        for d in sorted(dirs):
            manifest = "\n".join(f"{p} {e.git_oid}" for p, e in sorted(tree.items()) if p.startswith(d + "/"))
            entries.append(
                {
                    "type": "directory",
                    "oid": hashlib.sha1(manifest.encode()).hexdigest(),
                    "size": 0,
                    "path": d,
                }
            )
        for path, entry in sorted(files.items()):
            item: dict[str, Any] = {"type": "file", "oid": entry.git_oid, "size": entry.size, "path": path}
            if entry.lfs:
                pointer_size = len(lfs_pointer(entry.sha256, entry.size))
                item["lfs"] = {"oid": entry.sha256, "size": entry.size, "pointerSize": pointer_size}
            entries.append(item)
        return _json(entries)

    def _route_refs(self, req: _Request) -> _Response:
        ident = req.ident
        with self._lock:
            repo = self._readable_repo(_REPO_TYPES[req.params["rtype"]], req.params["repo"], ident)
            branches, prs = [], []
            for name, sha in sorted(repo.branches.items()):
                if name.startswith("refs/pr/"):
                    prs.append({"name": name, "ref": name, "targetCommit": sha})
                else:
                    branches.append({"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha})
        out: dict[str, Any] = {"branches": branches, "converts": [], "tags": []}
        if req.query.get("include_prs"):
            out["pullRequests"] = prs
        return _json(out)

    def _route_commits(self, req: _Request) -> _Response:
        ident = req.ident
        with self._lock:
            repo = self._readable_repo(_REPO_TYPES[req.params["rtype"]], req.params["repo"], ident)
            commit: _Commit | None = self._commit_of(repo, req.params["rev"])
            items = []
            while commit is not None:
                items.append(
                    {
                        "id": commit.oid,
                        "title": commit.title,
                        "message": commit.message,
                        "authors": [{"user": commit.author}],
                        "date": commit.date,
                    }
                )
                commit = repo.commits[commit.parent] if commit.parent else None
        return _json(items)

    def _route_branch(self, req: _Request) -> _Response:
        ident = req.ident
        branch = req.params["branch"]
        with self._lock:
            repo = self._readable_repo(_REPO_TYPES[req.params["rtype"]], req.params["repo"], ident)
            self._check_write(repo, ident)
            if req.method == "DELETE":
                if branch == "main":
                    raise _HubError(403, "Cannot delete the default branch")
                if branch not in repo.branches:
                    raise _HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
                del repo.branches[branch]
                return _json({})
            if branch in repo.branches:
                raise _HubError(409, f"Branch {branch} already exists")
            start = self._json_body(req.body).get("startingPoint") or "main"
            repo.branches[branch] = self._commit_of(repo, start).oid
        return _json({})

    # -- routes: downloads ---------------------------------------------------------------------------------

    def _route_resolve(self, req: _Request) -> _Response:
        ident = req.ident
        repo_type = "dataset" if req.params.get("rprefix") else "model"
        with self._lock:
            repo = self._readable_repo(repo_type, req.params["repo"], ident)
            self._check_gated(repo, ident)
            commit = self._commit_of(repo, req.params["rev"])
            entry = commit.tree.get(req.params["path"])
            if entry is None:
                raise _HubError(
                    404,
                    f"Entry not found: {req.params['path']}",
                    "EntryNotFound",
                    {"X-Repo-Commit": commit.oid},
                )
            data = self._blobs[entry.sha256]
        headers = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
            "ETag": f'"{entry.etag}"',
            "X-Repo-Commit": commit.oid,
        }
        if entry.lfs:
            headers["X-Linked-Etag"] = f'"{entry.sha256}"'
            headers["X-Linked-Size"] = str(entry.size)
        status, start, end = 200, 0, len(data)
        range_header = req.headers.get("Range")
        if range_header:
            match = re.fullmatch(r"bytes=(\d*)-(\d*)", range_header.strip())
            if match and (match.group(1) or match.group(2)):
                if match.group(1):
                    start = int(match.group(1))
                    end = min(int(match.group(2)) + 1, len(data)) if match.group(2) else len(data)
                else:  # suffix range: last N bytes
                    start = max(len(data) - int(match.group(2)), 0)
                if start >= len(data) or start >= end:
                    raise _HubError(
                        416,
                        "Requested range not satisfiable",
                        headers={"Content-Range": f"bytes */{len(data)}"},
                    )
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        payload = data[start:end]
        return _Response(status, b"" if req.method == "HEAD" else payload, headers, content_length=len(payload))

    # -- routes: uploads -----------------------------------------------------------------------------------

    def _route_preupload(self, req: _Request) -> _Response:
        ident = req.ident
        create_pr = req.query.get("create_pr") == "1"
        with self._lock:
            repo = self._readable_repo(_REPO_TYPES[req.params["rtype"]], req.params["repo"], ident)
            if not create_pr:
                self._check_write(repo, ident)
            commit = self._commit_of(repo, req.params["rev"])
            files = []
            for item in self._json_body(req.body).get("files", []):
                path = _validate_path(item.get("path"))
                sample = base64.b64decode(item.get("sample") or "")
                mode = "lfs" if is_lfs_path(path, int(item.get("size") or 0), sample) else "regular"
                remote = commit.tree.get(path)
                files.append(
                    {
                        "path": path,
                        "uploadMode": mode,
                        "shouldIgnore": False,
                        "oid": remote.etag if remote is not None else None,
                    }
                )
        return _json({"files": files, "commitOid": commit.oid})

    def _route_lfs_batch(self, req: _Request) -> _Response:
        ident = req.ident
        repo_type = "dataset" if req.params.get("rprefix") else "model"
        payload = self._json_body(req.body)
        if payload.get("operation") != "upload":
            raise _HubError(400, "Only the 'upload' operation is supported")
        objects = []
        with self._lock:
            repo = self._readable_repo(repo_type, req.params["repo"], ident)
            # `ref` is omitted for create_pr uploads (read access is enough then)
            if payload.get("ref") is not None:
                self._check_write(repo, ident)
            verify_href = f"{self.endpoint}/{_URL_PREFIX[repo_type]}{repo.repo_id}.git/info/lfs/objects/verify"
            for obj in payload.get("objects", []):
                oid, size = obj.get("oid"), obj.get("size")
                if not isinstance(oid, str) or not _HEX64.fullmatch(oid) or not isinstance(size, int) or size < 0:
                    objects.append(
                        {
                            "oid": str(oid),
                            "size": int(size or 0),
                            "error": {"code": 422, "message": "Invalid object"},
                        }
                    )
                elif oid in repo.lfs_objects:
                    objects.append({"oid": oid, "size": size})
                else:
                    ticket = secrets.token_urlsafe(16)
                    self._tickets[ticket] = ((repo_type, repo.repo_id), oid, size)
                    objects.append(
                        {
                            "oid": oid,
                            "size": size,
                            "authenticated": True,
                            "actions": {
                                "upload": {"href": f"{self.endpoint}/__lfs__/{ticket}"},
                                "verify": {"href": verify_href},
                            },
                        }
                    )
        return _json(
            {"transfer": "basic", "objects": objects},
            headers={"Content-Type": "application/vnd.git-lfs+json"},
        )

    def _route_lfs_upload(self, req: _Request) -> _Response:
        """Presigned-URL style upload: the client sends no auth header, the ticket is the credential."""
        with self._lock:
            ticket = self._tickets.get(req.params["ticket"])
            if ticket is None:
                raise _HubError(403, "Invalid or expired upload URL")
            repo_key, oid, size = ticket
            cut = self.fail_lfs_after_bytes
        if cut is not None and len(req.body) > cut:
            raise _HubError(400, f"Upload interrupted after {cut} of {len(req.body)} bytes; object discarded")
        if len(req.body) != size or hashlib.sha256(req.body).hexdigest() != oid:
            raise _HubError(400, f"Uploaded content does not match the announced oid/size ({oid}, {size})")
        with self._lock:
            self._blobs[oid] = req.body
            repo = self._repos.get(repo_key)
            if repo is not None:
                repo.lfs_objects.add(oid)
            self._tickets.pop(req.params["ticket"], None)
        return _Response(200, headers={"ETag": f'"{hashlib.md5(req.body).hexdigest()}"'})

    def _route_lfs_verify(self, req: _Request) -> _Response:
        ident = req.ident
        repo_type = "dataset" if req.params.get("rprefix") else "model"
        payload = self._json_body(req.body)
        with self._lock:
            repo = self._readable_repo(repo_type, req.params["repo"], ident)
            if payload.get("oid") not in repo.lfs_objects:
                raise _HubError(404, f"LFS object {payload.get('oid')} not found")
        return _json({"success": True})

    def _route_commit(self, req: _Request) -> _Response:
        """Apply an NDJSON commit atomically: validate everything, then move the branch, or change nothing."""
        ident = req.ident
        repo_type = _REPO_TYPES[req.params["rtype"]]
        create_pr = req.query.get("create_pr") == "1"
        try:
            lines = [json.loads(line) for line in req.body.decode().splitlines() if line.strip()]
        except ValueError:
            raise _HubError(400, "Invalid NDJSON body") from None
        with self._lock:
            repo = self._readable_repo(repo_type, req.params["repo"], ident)
            if not create_pr:
                self._check_write(repo, ident)
            rev = req.params["rev"]
            if rev not in repo.branches:
                if self._resolve(repo, rev) is not None:
                    raise _HubError(400, f"Cannot commit to {rev}: not a branch")
                raise _HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            head = repo.branches[rev]
            tree = dict(repo.commits[head].tree)
            summary = None
            for line in lines:
                key, value = line.get("key"), line.get("value") or {}
                if key == "header":
                    summary = value.get("summary")
                    parent = value.get("parentCommit")
                    if parent and not head.startswith(parent):
                        raise _HubError(412, f"A commit has happened since {parent}: {rev} is at {head}")
                elif key == "file":
                    path = _validate_path(value.get("path"))
                    if value.get("encoding", "base64") != "base64":
                        raise _HubError(400, f"Unsupported encoding for {path}")
                    tree[path] = self._store(path, base64.b64decode(value.get("content", "")), lfs=False)
                elif key == "lfsFile":
                    path, oid = _validate_path(value.get("path")), value.get("oid")
                    if oid not in repo.lfs_objects or oid not in self._blobs:
                        raise _HubError(400, f"LFS object {oid} for {path} was not uploaded: commit rejected")
                    data = self._blobs[oid]
                    if value.get("size") is not None and value["size"] != len(data):
                        raise _HubError(400, f"Size mismatch for LFS file {path}")
                    tree[path] = self._store(path, data, lfs=True)
                elif key == "deletedFile":
                    if tree.pop(value.get("path"), None) is None:
                        raise _HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                elif key == "deletedFolder":
                    folder = str(value.get("path", "")).strip("/") + "/"
                    doomed = [p for p in tree if p.startswith(folder)]
                    if not doomed:
                        raise _HubError(404, "A folder with this name doesn't exist", "EntryNotFound")
                    for p in doomed:
                        del tree[p]
                else:
                    raise _HubError(400, f"Unknown commit operation: {key!r}")
            if not summary:
                raise _HubError(400, "Commit summary (header line) is required")
            if self.fail_next_commit:
                self.fail_next_commit = False
                raise _HubError(500, "Simulated failure: the commit was interrupted")
            author = ident.username if ident else "anonymous"
            pr_url = None
            if create_pr:
                number = repo.next_pr
                repo.next_pr += 1
                branch = f"refs/pr/{number}"
                repo.branches[branch] = head
                pr_url = f"{self._repo_url(repo)}/discussions/{number}"
            else:
                branch = rev
            oid = self._new_commit(repo, branch, tree, summary, author)
        return _json(
            {
                "success": True,
                "commitOid": oid,
                "commitUrl": f"{self._repo_url(repo)}/commit/{oid}",
                "hookOutput": "",
                "pullRequestUrl": pr_url,
            }
        )


# ----------------------------------------------------------------------------------------------------------
# Pointing the real client at the server
# ----------------------------------------------------------------------------------------------------------


def hub_env(server: HubServer, tmp_path: Path | str, token: str = DEFAULT_TOKEN) -> dict[str, str]:
    """Environment variables that point ``huggingface_hub`` at ``server``, with caches under ``tmp_path``.

    Use it as-is for a subprocess (``env={**os.environ, **hub_env(...)}``), or in-process with
    :func:`apply_hub_env`.
    """
    home = Path(tmp_path) / "hf_home"
    return {
        "HF_ENDPOINT": server.endpoint,
        "HF_TOKEN": token,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),  # explicit: beats HUGGINGFACE_HUB_CACHE / HF_HUB_CACHE set outside
        "HF_ASSETS_CACHE": str(home / "assets"),
        "HF_XET_CACHE": str(home / "xet"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_HUB_DISABLE_XET": "1",  # the server has no Xet/CAS: use the legacy LFS upload/download paths
        "HF_HUB_DISABLE_TELEMETRY": "1",  # also skips the /api/agent-harnesses fetch when building User-Agent
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_DISABLE_SYMLINKS_WARNING": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "0",
        "HF_HUB_ETAG_TIMEOUT": "5",
        "HF_HUB_DOWNLOAD_TIMEOUT": "10",
        "HF_HUB_OFFLINE": "0",  # "0" also overrides an inherited TRANSFORMERS_OFFLINE=1
        "HUGGINGFACE_CO_STAGING": "0",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


_MISSING = object()


def apply_hub_env(monkeypatch: Any, env: Mapping[str, str]) -> None:
    """Apply :func:`hub_env` variables to the running process, including everything read at import time.

    Sets the variables with ``monkeypatch.setenv``, then re-evaluates a private copy of
    ``huggingface_hub/constants.py`` under the new environment and patches every constant whose value
    changed, in ``huggingface_hub.constants`` and in any loaded ``huggingface_hub.*`` module that copied it
    (``from ..constants import X``). Also re-points the module-level ``HfApi`` used by the top-level
    functions and the trusted redirect origins, and drops the shared ``httpx2`` client. ``monkeypatch``
    undoes everything at teardown.
    """
    # Import first, so that the values recorded (and restored at teardown) are the pre-test ones.
    import huggingface_hub
    from huggingface_hub import constants, hf_api
    from huggingface_hub.utils import _http

    for key, value in env.items():
        monkeypatch.setenv(key, value)

    spec = importlib.util.spec_from_file_location("_hubserver_constants_probe", constants.__file__)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    changed = {}
    for name, new in vars(probe).items():
        if not name.isupper() or callable(new) or type(new).__module__ == "typing":
            continue
        old = getattr(constants, name, _MISSING)
        if old is _MISSING or old != new:
            changed[name] = (old, new)

    modules = [m for n, m in list(sys.modules.items()) if m is not None and n.startswith("huggingface_hub")]
    for name, (old, new) in changed.items():
        monkeypatch.setattr(constants, name, new, raising=False)
        for module in modules:
            if module is constants or module is huggingface_hub:
                continue
            attrs = vars(module)  # no getattr: do not trigger lazy imports
            if name in attrs and old is not _MISSING and type(attrs[name]) is type(old) and attrs[name] == old:
                monkeypatch.setattr(module, name, new)

    api = getattr(hf_api, "api", None)
    if api is not None:
        monkeypatch.setattr(api, "endpoint", constants.ENDPOINT)
    if hasattr(_http, "_HUB_ORIGINS") and hasattr(_http, "_url_origin"):
        monkeypatch.setattr(
            _http, "_HUB_ORIGINS", frozenset(_http._HUB_ORIGINS | {_http._url_origin(constants.ENDPOINT)})
        )
    detect_agent = sys.modules.get("huggingface_hub.utils._detect_agent")
    if detect_agent is not None and hasattr(detect_agent, "_registry"):
        monkeypatch.setattr(detect_agent, "_registry", None)
    _http.close_session()  # pooled connections and proxy settings belong to the previous environment
