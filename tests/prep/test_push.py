"""`infinigen-prep push` against the loopback Hub server, through the real huggingface_hub client in subprocesses:
a round trip (push, pull into a fresh cache, generate the same tokens), branches, permissions, an upload cut off
midway and a failed commit (the remote revision is unchanged), and a corrupt bundle refused before any upload."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import run_cli
from tests.hubserver import OTHER_TOKEN, READ_ONLY_TOKEN, HubServer, hub_env
from tests.test_cli import one_line_error

pytestmark = pytest.mark.slow

PROMPT = "The king said"


def folder_files(path):
    """The bundle's files as pushed: every non-hidden file in the folder (bundles are flat)."""
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file() and not p.name.startswith(".")}


def remote_files(hub, repo_id, rev="main"):
    files = hub.files(repo_id, rev)
    files.pop(".gitattributes", None)  # written by create_repo
    return files


def repo_exists(hub, repo_id) -> bool:
    try:
        hub.revision_sha(repo_id)
        return True
    except KeyError:
        return False


def front_matter(card: str) -> str:
    assert card.startswith("---\n"), card[:200]
    return card.split("---\n", 2)[1]


def push(hub, tmp_path, *args, token=None):
    env = hub_env(hub, tmp_path, token=token) if token else hub_env(hub, tmp_path)
    return run_cli("prep", "push", *args, env=env)


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        yield server
        assert not server.errors


def test_round_trip_push_pull_generate(hub, bundles, tmp_path):
    local = bundles["tied_hd64"]
    r = push(hub, tmp_path / "pusher", local, "test-user/roundtrip", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    sha = hub.revision_sha("test-user/roundtrip")
    assert out["repo_id"] == "test-user/roundtrip" and out["revision"] == "main" and out["commit"] == sha
    assert out["commit_url"].endswith(f"/test-user/roundtrip/commit/{sha}")

    # the server holds exactly the bundle's bytes, shards and InfiniGen tensors in LFS
    assert remote_files(hub, "test-user/roundtrip") == folder_files(local)
    assert {n for n in folder_files(local) if n.endswith(".safetensors")} <= hub.lfs_files("test-user/roundtrip")
    front = front_matter(hub.files("test-user/roundtrip")["README.md"].decode())
    assert "library_name: infinigen" in front
    assert "- infinigen" in front and "- kv-cache" in front

    # a second machine: a fresh HF_HOME pulls, verifies and generates the same tokens as the local folder
    fresh = hub_env(hub, tmp_path / "fresh")
    r = run_cli("rt", "pull", "test-user/roundtrip", "--json", env=fresh)
    assert r.returncode == 0, r.stderr
    pulled = json.loads(r.stdout)
    assert pulled["verified"] is True and pulled["path"].startswith(str(tmp_path / "fresh"))
    want = run_cli("rt", "generate", local, PROMPT, "-n", "6", "--json")
    got = run_cli("rt", "generate", "test-user/roundtrip", PROMPT, "-n", "6", "--json", env=fresh)
    assert want.returncode == 0 and got.returncode == 0, want.stderr + got.stderr
    assert json.loads(got.stdout)["token_ids"] == json.loads(want.stdout)["token_ids"]


def test_push_to_a_new_branch_leaves_main_unchanged(hub, bundles, tmp_path):
    repo = "test-user/branchy"
    old = folder_files(bundles["tied_hd64"])
    main_sha = hub.add_repo(repo, {**old, "model-00002-of-00002.safetensors": b"a stale shard"})
    # the pushed folder has a hidden file and a stray file next to the bundle: neither is uploaded
    local = tmp_path / "opt-bundle"
    shutil.copytree(bundles["opt"], local)
    (local / ".DS_Store").write_bytes(b"junk")
    (local / "notes.txt").write_text("my notes")
    r = push(hub, tmp_path, local, repo, "--revision", "dev", "--commit-message", "try OPT")
    assert r.returncode == 0, r.stderr
    dev_sha = hub.revision_sha(repo, "dev")
    assert dev_sha in r.stdout and "/tree/dev" in r.stdout

    assert hub.revision_sha(repo, "main") == main_sha
    assert remote_files(hub, repo, "main")["bundle.json"] == old["bundle.json"]
    # dev holds exactly the new bundle: its files replaced the old ones, the stale shard is deleted
    assert remote_files(hub, repo, "dev") == folder_files(bundles["opt"])
    assert hub.history(repo, "dev")[1] == main_sha  # one commit on top of main

    # pushing the same bundle again changes nothing
    r = push(hub, tmp_path, local, repo, "--revision", "dev", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["commit"] == dev_sha == hub.revision_sha(repo, "dev")


def test_push_without_write_access_is_a_one_line_error(hub, bundles, tmp_path):
    local = bundles["tied_hd64"]
    # a read-only token cannot create a repo in its own namespace
    r = push(hub, tmp_path, local, "test-user/read-only", token=READ_ONLY_TOKEN)
    one_line_error(r, "403", "write", "token", "test-user")
    assert not repo_exists(hub, "test-user/read-only")
    # a write token cannot write into another user's existing repo
    sha = hub.add_repo("other-user/theirs", {"README.md": b"theirs"}, owner_token=OTHER_TOKEN)
    one_line_error(push(hub, tmp_path, local, "other-user/theirs"), "403", "write", "token", "other-user")
    assert hub.revision_sha("other-user/theirs") == sha


def test_pull_of_a_missing_repo_is_not_found(hub, tmp_path):
    one_line_error(run_cli("rt", "pull", "test-user/never-pushed", env=hub_env(hub, tmp_path)), "not found")


def test_an_interrupted_push_leaves_the_remote_unchanged(hub, bundles, tmp_path):
    repo = "test-user/cut"
    r = push(hub, tmp_path, bundles["tied_hd64"], repo)
    assert r.returncode == 0, r.stderr
    sha, before = hub.revision_sha(repo), hub.files(repo)

    # the weights upload is cut off after 1000 bytes: no commit
    hub.fail_lfs_after_bytes = 1000
    try:
        one_line_error(push(hub, tmp_path, bundles["opt"], repo), "failed", "safetensors", "HTTP 400")
    finally:
        hub.fail_lfs_after_bytes = None
    assert hub.revision_sha(repo) == sha and hub.files(repo) == before

    # the objects are uploaded but the commit fails: no commit either
    hub.fail_next_commit = True
    one_line_error(push(hub, tmp_path, bundles["opt"], repo), "nothing was committed", "HTTP 500")
    assert hub.revision_sha(repo) == sha and hub.files(repo) == before

    # pushing again then succeeds
    r = push(hub, tmp_path, bundles["opt"], repo, "--json")
    assert r.returncode == 0, r.stderr
    assert remote_files(hub, repo) == folder_files(bundles["opt"])
    assert hub.history(repo)[1] == sha


def test_a_corrupt_bundle_is_refused_before_any_upload(hub, bundles, tmp_path):
    local = tmp_path / "tampered"
    shutil.copytree(bundles["tied_hd64"], local)
    shard = local / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # same size: only the sha256 check catches it
    shard.write_bytes(bytes(data))
    seen = len(hub.requests)
    one_line_error(push(hub, tmp_path, local, "test-user/tampered"), "sha256")
    assert hub.requests[seen:] == []  # not even a request
    assert not repo_exists(hub, "test-user/tampered")

    one_line_error(push(hub, tmp_path, tmp_path / "nope", "test-user/tampered"), "does not exist")
    one_line_error(push(hub, tmp_path, bundles["opt"], "not a repo id"), "OWNER/NAME")


@pytest.mark.parametrize("name", ["../secret.txt", "/abs/secret.txt"])
def test_a_bundle_listing_a_file_outside_its_folder_is_refused_before_any_upload(hub, bundles, tmp_path, name):
    """bundle.json's `files` is the bundle's word only for names inside the folder: `../` and absolute entries were
    hashed from outside it and pushed (the repo received the outside file under its local path)."""
    import hashlib

    secret = tmp_path / "secret.txt"
    secret.write_text("not part of any bundle\n")
    local = tmp_path / "b"
    shutil.copytree(bundles["tied_hd64"], local)
    meta = json.loads((local / "bundle.json").read_text())
    entry = "../secret.txt" if name.startswith("..") else str(secret)
    meta["files"][entry] = {"sha256": hashlib.sha256(secret.read_bytes()).hexdigest(), "size": secret.stat().st_size}
    (local / "bundle.json").write_text(json.dumps(meta))
    seen = len(hub.requests)
    one_line_error(push(hub, tmp_path, local, "test-user/outside"), "not a file name inside the bundle folder")
    assert hub.requests[seen:] == [] and not repo_exists(hub, "test-user/outside")


def test_push_help_has_examples():
    r = run_cli("prep", "push", "--help")
    assert r.returncode == 0 and "Examples" in r.stdout and "--revision" in r.stdout, r.stdout + r.stderr


def test_convert_push_to_in_one_step(hub, checkpoints, calib_file, tmp_path):
    out = tmp_path / "b"
    env = hub_env(hub, tmp_path)
    r = run_cli(
        "prep",
        "convert",
        checkpoints["llama31_gqa"],
        "--out",
        out,
        "--calib-text",
        calib_file,
        "--push-to",
        "test-user/one-step",
        "--json",
        env=env,
    )
    assert r.returncode == 0, r.stderr
    pushed = json.loads(r.stdout)["pushed"]
    assert pushed["repo_id"] == "test-user/one-step" and pushed["commit"] == hub.revision_sha("test-user/one-step")
    assert remote_files(hub, "test-user/one-step") == folder_files(out)
    assert "infinigen.safetensors" in folder_files(out)
    card = front_matter(remote_files(hub, "test-user/one-step")["README.md"].decode())
    assert "library_name: infinigen" in card and "- infinigen" in card and "- kv-cache" in card
