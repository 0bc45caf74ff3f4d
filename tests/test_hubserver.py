"""Tests of the local Hub server (tests/hubserver.py) driven by the REAL ``huggingface_hub`` client.

Every test but the subprocess one runs the client in-process, pointed at the server with ``apply_hub_env``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import (
    HfApi,
    create_repo,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
    upload_folder,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.hubserver import (
    DEFAULT_TOKEN,
    DEFAULT_USER,
    OTHER_TOKEN,
    READ_ONLY_TOKEN,
    HubServer,
    apply_hub_env,
    git_blob_sha1,
    hub_env,
    is_lfs_path,
)

# huggingface_hub 2.4.0 itself passes `data=<file>` to httpx2 for LFS uploads (lfs._upload_single_part).
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw:DeprecationWarning")

TINY = {
    "config.json": b'{"hidden_size": 8}\n',
    "model.safetensors": bytes(range(256)) * 64,  # LFS (extension and binary content)
    "tokenizer/vocab.txt": b"a\nb\nc\n",
}


@pytest.fixture
def hub():
    """A fresh server per test; fails the test if the server hit an internal error or an unknown URL."""
    with HubServer() as server:
        yield server
    assert server.errors == []
    assert [r for r in server.requests if r.route is None] == []


@pytest.fixture
def hf_env(hub, tmp_path, monkeypatch):
    """Point the in-process client at ``hub`` with a private HF_HOME; returns the env dict."""
    env = hub_env(hub, tmp_path)
    apply_hub_env(monkeypatch, env)
    return env


def read_tree(folder: str | Path) -> dict[str, bytes]:
    """``{relative posix path: content}`` of every file below ``folder`` (symlinks followed)."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def make_folder(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def raw_request(url: str, *, method: str = "GET", data: bytes | None = None, headers: dict | None = None):
    """Plain urllib request; returns ``(status, headers, body)`` also for HTTP errors."""
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


# ----------------------------------------------------------------------------------------------------------
# Downloads
# ----------------------------------------------------------------------------------------------------------


def test_snapshot_download_by_branch_and_sha(hub, hf_env, tmp_path):
    sha1 = hub.add_repo("test-user/tiny", TINY)
    assert hub.lfs_files("test-user/tiny") == {"model.safetensors"}

    folder = Path(snapshot_download("test-user/tiny"))
    assert folder.name == sha1
    assert read_tree(folder) == TINY
    repo_cache = Path(hf_env["HF_HUB_CACHE"]) / "models--test-user--tiny"
    assert (repo_cache / "refs" / "main").read_text() == sha1

    sha2 = hub.commit_files("test-user/tiny", {"config.json": b'{"hidden_size": 16}\n'})
    assert hub.history("test-user/tiny") == [sha2, sha1]
    latest = Path(snapshot_download("test-user/tiny"))
    assert latest.name == sha2
    assert (latest / "config.json").read_bytes() == b'{"hidden_size": 16}\n'
    assert read_tree(snapshot_download("test-user/tiny", revision=sha1)) == TINY

    hub.create_branch("test-user/tiny", "v1", from_rev=sha1)
    assert Path(snapshot_download("test-user/tiny", revision="v1")).name == sha1
    refs = HfApi().list_repo_refs("test-user/tiny")
    assert {b.name: b.target_commit for b in refs.branches} == {"main": sha2, "v1": sha1}


def test_snapshot_download_allow_patterns(hub, hf_env):
    hub.add_repo("test-user/tiny", TINY)
    folder = snapshot_download("test-user/tiny", allow_patterns=["*.json"])
    assert read_tree(folder) == {"config.json": TINY["config.json"]}
    served = [r.path for r in hub.requests if r.route == "resolve" and r.method == "GET"]
    assert served and all(p.endswith("/config.json") for p in served)


def test_hf_hub_download_model_info_and_lfs_metadata(hub, hf_env):
    sha = hub.add_repo("test-user/tiny", TINY)
    path = hf_hub_download("test-user/tiny", "tokenizer/vocab.txt")
    assert Path(path).read_bytes() == TINY["tokenizer/vocab.txt"]
    assert hf_hub_download("test-user/tiny", "model.safetensors", revision=sha[:10]).endswith("model.safetensors")

    info = HfApi().model_info("test-user/tiny", files_metadata=True)
    assert info.sha == sha
    assert sorted(s.rfilename for s in info.siblings) == sorted(TINY)
    weights = next(s for s in info.siblings if s.rfilename == "model.safetensors")
    assert weights.lfs is not None and weights.lfs.sha256 == hashlib.sha256(TINY["model.safetensors"]).hexdigest()

    tree = {f.path: f for f in HfApi().list_repo_tree("test-user/tiny", recursive=True)}
    assert set(tree) == {"config.json", "model.safetensors", "tokenizer", "tokenizer/vocab.txt"}
    assert tree["config.json"].blob_id == git_blob_sha1(TINY["config.json"]) and tree["config.json"].lfs is None
    assert tree["model.safetensors"].lfs.size == len(TINY["model.safetensors"])

    # ETag: git sha1 for regular files, sha256 (X-Linked-Etag) for LFS files
    regular = get_hf_file_metadata(hf_hub_url("test-user/tiny", "config.json"))
    assert (regular.etag, regular.commit_hash, regular.size) == (
        git_blob_sha1(TINY["config.json"]),
        sha,
        len(TINY["config.json"]),
    )
    lfs = get_hf_file_metadata(hf_hub_url("test-user/tiny", "model.safetensors"))
    assert lfs.etag == hashlib.sha256(TINY["model.safetensors"]).hexdigest()
    assert lfs.size == len(TINY["model.safetensors"])

    # datasets work the same way
    hub.add_repo("test-user/data", {"train.csv": b"x,y\n1,2\n"}, repo_type="dataset")
    path = hf_hub_download("test-user/data", "train.csv", repo_type="dataset")
    assert Path(path).read_bytes() == b"x,y\n1,2\n"
    assert HfApi().dataset_info("test-user/data").sha == hub.revision_sha("test-user/data", repo_type="dataset")
    assert HfApi().whoami()["name"] == DEFAULT_USER


def test_server_lfs_rules_and_range_requests(hub):
    assert is_lfs_path("big.txt", 10 * 1024 * 1024, b"text")
    assert is_lfs_path("w.gguf", 10, b"GGUF") and is_lfs_path("x.dat", 10, b"\x00\x01")
    assert not is_lfs_path("README.md", 100, b"# hi") and not is_lfs_path("empty.bin", 0, b"")
    big = b"0123456789" * (1024 * 1024)  # 10 MiB of text: LFS because of its size
    hub.add_repo("test-user/big", {"big.txt": big})
    assert hub.lfs_files("test-user/big") == {"big.txt"}

    url = f"{hub.endpoint}/test-user/big/resolve/main/big.txt"
    status, headers, body = raw_request(url, method="HEAD")
    assert status == 200 and body == b""
    assert headers["X-Linked-Size"] == str(len(big)) and headers["Content-Length"] == str(len(big))
    assert headers["X-Linked-Etag"] == f'"{hashlib.sha256(big).hexdigest()}"'
    status, headers, body = raw_request(url, headers={"Range": "bytes=5-14"})
    assert (status, body) == (206, big[5:15])
    assert headers["Content-Range"] == f"bytes 5-14/{len(big)}"
    status, headers, _ = raw_request(f"{hub.endpoint}/test-user/big/resolve/main/nope.txt", method="HEAD")
    assert (status, headers["X-Error-Code"], headers["X-Repo-Commit"]) == (
        404,
        "EntryNotFound",
        hub.revision_sha("test-user/big"),
    )


# ----------------------------------------------------------------------------------------------------------
# Uploads
# ----------------------------------------------------------------------------------------------------------


def test_create_repo_upload_folder_round_trip(hub, hf_env, tmp_path, monkeypatch):
    files = {
        "config.json": b'{"n": 1}\n',
        "weights/model.safetensors": os.urandom(300_000),
        "data.bin": b"\x00\x01" * 1000,
        "notes/empty.txt": b"",
    }
    folder = make_folder(tmp_path / "to_upload", files)

    url = create_repo("roundtrip")  # no namespace: the token's user
    assert url.repo_id == "test-user/roundtrip"
    create_repo("test-user/roundtrip", exist_ok=True)  # 409 swallowed by the client
    with pytest.raises(HfHubHTTPError) as excinfo:
        create_repo("test-user/roundtrip")
    assert excinfo.value.response.status_code == 409

    info = upload_folder(repo_id="test-user/roundtrip", folder_path=folder, commit_message="upload")
    assert info.oid == hub.revision_sha("test-user/roundtrip")
    assert hub.lfs_files("test-user/roundtrip") == {"weights/model.safetensors", "data.bin"}
    assert ("PUT", "lfs_upload") in hub.routes_hit()

    fresh = tmp_path / "fresh"
    apply_hub_env(monkeypatch, hub_env(hub, fresh))
    out = Path(snapshot_download("test-user/roundtrip"))
    assert out.is_relative_to(fresh)
    downloaded = read_tree(out)
    assert downloaded.pop(".gitattributes").startswith(b"*.7z filter=lfs")  # written by create_repo
    assert downloaded == files

    # Unchanged files are skipped thanks to the `oid` returned by /preupload: no empty commit.
    upload_folder(repo_id="test-user/roundtrip", folder_path=folder)
    assert hub.revision_sha("test-user/roundtrip") == info.oid


def test_write_without_permission_is_403(hub, hf_env, tmp_path):
    folder = make_folder(tmp_path / "up", {"a.txt": b"mine", "w.safetensors": b"\x00" * 100})
    theirs = hub.add_repo("other-user/theirs", {"a.txt": b"theirs"})
    with pytest.raises(HfHubHTTPError) as excinfo:
        upload_folder(repo_id="other-user/theirs", folder_path=folder)
    assert excinfo.value.response.status_code == 403
    assert not isinstance(excinfo.value, RepositoryNotFoundError)
    with pytest.raises(HfHubHTTPError) as excinfo:
        create_repo("other-user/new-one")
    assert excinfo.value.response.status_code == 403
    # quirk: exist_ok=True turns the 403 into a repo_info call, which succeeds on a public repo
    assert create_repo("other-user/theirs", exist_ok=True).repo_id == "other-user/theirs"

    mine = hub.add_repo("test-user/mine", {"a.txt": b"v1"})
    with pytest.raises(HfHubHTTPError) as excinfo:
        upload_folder(repo_id="test-user/mine", folder_path=folder, token=READ_ONLY_TOKEN)
    assert excinfo.value.response.status_code == 403
    assert hub.revision_sha("other-user/theirs") == theirs and hub.revision_sha("test-user/mine") == mine

    with pytest.raises(HfHubHTTPError) as excinfo:
        HfApi().whoami(token="hf_not_a_known_token")
    assert excinfo.value.response.status_code == 401


def test_interrupted_upload_leaves_revision_unchanged(hub, hf_env, tmp_path):
    repo = "test-user/resilient"
    base = hub.add_repo(repo, {"a.txt": b"v1"})
    weights = os.urandom(200_000)
    oid = hashlib.sha256(weights).hexdigest()
    folder = make_folder(tmp_path / "up", {"a.txt": b"v2", "model.safetensors": weights})

    # 1. LFS upload cut off midway: the client gives up before committing, nothing is stored.
    hub.fail_lfs_after_bytes = 64 * 1024
    with pytest.raises((RuntimeError, HfHubHTTPError)):
        upload_folder(repo_id=repo, folder_path=folder)
    assert hub.revision_sha(repo) == base and hub.files(repo) == {"a.txt": b"v1"}
    assert not hub.has_lfs_object(repo, oid)
    hub.fail_lfs_after_bytes = None

    # 2. The commit request itself fails: the uploaded object is orphaned, the branch does not move.
    hub.fail_next_commit = True
    with pytest.raises(HfHubHTTPError) as excinfo:
        upload_folder(repo_id=repo, folder_path=folder)
    assert excinfo.value.response.status_code == 500
    assert hub.revision_sha(repo) == base and hub.has_lfs_object(repo, oid)

    # 3. A commit that references an LFS object the server does not have is rejected as a whole.
    lines = [
        {"key": "header", "value": {"summary": "partial"}},
        {
            "key": "file",
            "value": {"path": "a.txt", "content": base64.b64encode(b"v3").decode(), "encoding": "base64"},
        },
        {"key": "lfsFile", "value": {"path": "big.bin", "algo": "sha256", "oid": "ab" * 32, "size": 5}},
    ]
    status, _, body = raw_request(
        f"{hub.endpoint}/api/models/{repo}/commit/main",
        method="POST",
        data=b"".join(json.dumps(line).encode() + b"\n" for line in lines),
        headers={"Authorization": f"Bearer {DEFAULT_TOKEN}", "Content-Type": "application/x-ndjson"},
    )
    assert status == 400 and b"was not uploaded" in body
    assert hub.revision_sha(repo) == base and hub.files(repo) == {"a.txt": b"v1"}

    # 4. Once the "network" is back, the same upload goes through.
    info = upload_folder(repo_id=repo, folder_path=folder)
    assert hub.revision_sha(repo) == info.oid != base
    assert hub.files(repo) == {"a.txt": b"v2", "model.safetensors": weights}


# ----------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------


def test_missing_repo_file_and_revision(hub, hf_env):
    for call in (
        lambda: snapshot_download("test-user/missing"),
        lambda: hf_hub_download("test-user/missing", "config.json"),
        lambda: HfApi().model_info("test-user/missing"),
    ):
        with pytest.raises(RepositoryNotFoundError) as excinfo:
            call()
        assert not isinstance(excinfo.value, GatedRepoError)
        assert excinfo.value.response.status_code == 404

    hub.add_repo("test-user/tiny", TINY)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("test-user/tiny", "nope.txt")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("test-user/tiny", "config.json", revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download("test-user/tiny", revision="no-such-branch")

    # Private repos are invisible (404) without the owner's token.
    hub.add_repo("other-user/secret", {"a.txt": b"s"}, private=True)
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("other-user/secret")
    assert Path(hf_hub_download("other-user/secret", "a.txt", token=OTHER_TOKEN)).read_bytes() == b"s"


def test_gated_repo(hub, hf_env):
    hub.add_repo("other-user/gated", {"a.txt": b"g"}, gated=True)
    assert HfApi().model_info("other-user/gated").gated == "manual"  # metadata stays public
    with pytest.raises(GatedRepoError) as excinfo:
        hf_hub_download("other-user/gated", "a.txt")
    assert excinfo.value.response.status_code == 403
    with pytest.raises(GatedRepoError):
        snapshot_download("other-user/gated")
    hub.grant_access("other-user/gated", DEFAULT_USER)
    assert Path(hf_hub_download("other-user/gated", "a.txt")).read_bytes() == b"g"


# ----------------------------------------------------------------------------------------------------------
# Offline mode, environment handling, subprocess
# ----------------------------------------------------------------------------------------------------------


def test_offline_mode_serves_from_cache(hub, hf_env, monkeypatch):
    hub.add_repo("test-user/tiny", TINY)
    offline = {**hf_env, "HF_HUB_OFFLINE": "1"}

    snapshot_download("test-user/tiny", allow_patterns=["*.json"])
    apply_hub_env(monkeypatch, offline)
    with pytest.raises(IncompleteSnapshotError):  # the cached tree listing knows files are missing
        snapshot_download("test-user/tiny")

    apply_hub_env(monkeypatch, hf_env)
    folder = snapshot_download("test-user/tiny")
    path = hf_hub_download("test-user/tiny", "config.json")
    seen = len(hub.requests)

    apply_hub_env(monkeypatch, offline)
    assert snapshot_download("test-user/tiny") == folder
    assert hf_hub_download("test-user/tiny", "config.json") == path
    assert read_tree(folder) == TINY
    with pytest.raises(LocalEntryNotFoundError):
        hf_hub_download("test-user/tiny", "not-in-cache.txt")
    assert len(hub.requests) == seen  # nothing reached the server


def test_apply_hub_env_patches_import_time_state_and_is_undone(hub, tmp_path):
    import importlib

    from huggingface_hub import constants, hf_api

    hf_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")  # the module, not the class

    def snapshot():
        return (
            constants.ENDPOINT,
            constants.HUGGINGFACE_CO_URL_TEMPLATE,
            constants.HF_HUB_CACHE,
            constants.HF_HUB_DISABLE_XET,
            hf_api.api.endpoint,
            hf_tqdm.HF_HUB_DISABLE_PROGRESS_BARS,
        )

    before = snapshot()
    mp = pytest.MonkeyPatch()
    try:
        apply_hub_env(mp, hub_env(hub, tmp_path))
        assert snapshot() == (
            hub.endpoint,
            hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
            str(tmp_path / "hf_home" / "hub"),
            True,
            hub.endpoint,
            True,
        )
        assert hf_hub_url("a/b", "c.txt").startswith(hub.endpoint + "/a/b/resolve/main/")
    finally:
        mp.undo()
    assert snapshot() == before


def test_client_in_subprocess_with_env_vars_only(hub, tmp_path):
    hub.add_repo("test-user/tiny", TINY)
    upload = make_folder(tmp_path / "up", {"hello.txt": b"hi", "w.safetensors": b"\x00\x01" * 300})
    script = textwrap.dedent(
        """
        import json, pathlib, sys
        from huggingface_hub import constants, create_repo, snapshot_download, upload_folder
        folder = pathlib.Path(snapshot_download("test-user/tiny"))
        files = {p.relative_to(folder).as_posix(): p.read_bytes().hex() for p in folder.rglob("*")
                 if p.is_file()}
        create_repo("from-subprocess")
        info = upload_folder(repo_id="test-user/from-subprocess", folder_path=sys.argv[1])
        out = {"endpoint": constants.ENDPOINT, "folder": str(folder), "files": files, "oid": info.oid}
        print(json.dumps(out))
        """
    )
    env = {**os.environ, **hub_env(hub, tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(upload)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["endpoint"] == hub.endpoint
    assert Path(out["folder"]).is_relative_to(tmp_path / "hf_home" / "hub")
    assert {k: bytes.fromhex(v) for k, v in out["files"].items()} == TINY
    assert out["oid"] == hub.revision_sha("test-user/from-subprocess")
    uploaded = hub.files("test-user/from-subprocess")
    assert uploaded["hello.txt"] == b"hi" and uploaded["w.safetensors"] == b"\x00\x01" * 300
