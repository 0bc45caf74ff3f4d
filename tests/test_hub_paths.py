"""Every Hub path of issue 2 against the loopback Hub server, through the real huggingface_hub client in
subprocesses (the CLIs as a user runs them): convert from a repo id, generate and pull a bundle by repo id,
and the one-line errors for a missing repo, a gated repo, a missing revision, a missing config, no network
and offline mode."""

from __future__ import annotations

import hashlib
import json
import socket

import pytest

from tests.conftest import run_cli
from tests.hubserver import HubServer, hub_env
from tests.test_cli import one_line_error

pytestmark = pytest.mark.slow


def folder_files(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def visible(path):
    """A pulled folder's own files, less the hidden .cache/ huggingface_hub keeps beside them."""
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file() and not p.name.startswith(".")}


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        yield server


def test_convert_from_repo_id_records_the_exact_revision(hub, checkpoints, bundles, tmp_path, calib_file):
    sha = hub.add_repo("test-user/tiny-llama-conv", folder_files(checkpoints["llama31_gqa"]))
    env = hub_env(hub, tmp_path)
    out = tmp_path / "from-hub"
    r = run_cli(
        "prep",
        "convert",
        "test-user/tiny-llama-conv",
        "--out",
        out,
        "--dtype",
        "float32",
        "--json",
        "--calib-text",
        calib_file,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "bundle.json").read_text())
    assert meta["source"] == {"kind": "hub", "repo_id": "test-user/tiny-llama-conv", "revision": sha}
    assert "base_model: test-user/tiny-llama-conv" in (out / "README.md").read_text()
    # the same weights as converting the local folder
    local = json.loads((bundles["llama31_gqa"] / "bundle.json").read_text())
    assert meta["files"] == local["files"]

    # a revision by sha, after main moved on
    hub.commit_files("test-user/tiny-llama-conv", {"README.md": b"---\nlicense: mit\n---\n"})
    out2 = tmp_path / "pinned"
    r = run_cli(
        "prep", "convert", "test-user/tiny-llama-conv", "--out", out2, "--revision", sha, "--no-infinigen", env=env
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((out2 / "bundle.json").read_text())["source"]["revision"] == sha


def test_generate_and_pull_a_bundle_by_repo_id(hub, bundles, tmp_path):
    local = bundles["tied_hd64"]
    hub.add_repo("test-user/tiny-bundle", folder_files(local))
    env = hub_env(hub, tmp_path)
    want = run_cli("rt", "generate", local, "The king said", "-n", "6", "--json")
    got = run_cli("rt", "generate", "test-user/tiny-bundle", "The king said", "-n", "6", "--json", env=env)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["token_ids"] == json.loads(want.stdout)["token_ids"]

    out = tmp_path / "pulled"
    r = run_cli("rt", "pull", "test-user/tiny-bundle", "--out", out, "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verified"] is True and (out / "bundle.json").is_file()

    # offline: served from the cache that the generate above filled
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    r = run_cli("rt", "generate", "test-user/tiny-bundle", "The king said", "-n", "6", "--json", env=offline)
    assert r.returncode == 0, r.stderr


def test_pull_out_never_overwrites_what_is_not_a_bundle_and_a_failed_pull_leaves_nothing(hub, bundles, tmp_path):
    """`pull --out d` into a folder of the user's own files replaced them (rc 0); a failed pull left an empty
    folder. Now: refused before any download; a bundle there is replaced whole; a failure leaves nothing."""
    hub.add_repo("test-user/out-bundle", folder_files(bundles["tied_hd64"]))
    env = hub_env(hub, tmp_path)
    mine = tmp_path / "d"
    mine.mkdir()
    (mine / "README.md").write_text("mine\n")
    seen = len(hub.requests)
    one_line_error(run_cli("rt", "pull", "test-user/out-bundle", "--out", mine, env=env), "other files", "empty")
    assert hub.requests[seen:] == [] and [p.name for p in mine.iterdir()] == ["README.md"]
    assert (mine / "README.md").read_text() == "mine\n"
    (tmp_path / "f").write_text("a file")
    one_line_error(run_cli("rt", "pull", "test-user/out-bundle", "--out", tmp_path / "f", env=env), "a file")

    # a failed pull (no such repo; a tampered one) leaves no folder, no partial folder and no new parents
    files = folder_files(bundles["tied_hd64"])
    shard = next(n for n in files if n.endswith(".safetensors"))
    files[shard] = files[shard][:-3] + bytes(b ^ 0xFF for b in files[shard][-3:])
    hub.add_repo("test-user/out-tampered", files)
    root = tmp_path / "fresh"
    root.mkdir()
    for repo, words in (("test-user/out-nothing", "not found"), ("test-user/out-tampered", "sha256")):
        one_line_error(run_cli("rt", "pull", repo, "--out", root / "a" / "b", env=env), words)
        assert list(root.iterdir()) == [], list(root.rglob("*"))

    # into an empty folder; then over the bundle it holds, replaced whole (a file only the old one had goes); a
    # failed pull over it leaves it as it was
    empty = root / "e"
    empty.mkdir()
    for _ in range(2):
        r = run_cli("rt", "pull", "test-user/out-bundle", "--out", empty, "--json", env=env)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["path"] == str(empty) and not (empty / "stray.txt").exists()
        assert visible(empty) == folder_files(bundles["tied_hd64"])
        (empty / "stray.txt").write_text("only in the old one")
    before = folder_files(empty)
    one_line_error(run_cli("rt", "pull", "test-user/out-tampered", "--out", empty, env=env), "sha256")
    assert folder_files(empty) == before and sorted(p.name for p in root.iterdir()) == ["e"]


def test_tampered_bundle_on_the_hub_is_refused(hub, bundles, tmp_path):
    files = folder_files(bundles["tied_hd64"])
    shard = next(n for n in files if n.endswith(".safetensors"))
    data = bytearray(files[shard])
    data[-3] ^= 0xFF
    files[shard] = bytes(data)
    hub.add_repo("test-user/tampered", files)
    one_line_error(run_cli("rt", "pull", "test-user/tampered", env=hub_env(hub, tmp_path)), "sha256")


def test_hub_errors_are_one_line(hub, checkpoints, tmp_path):
    env = hub_env(hub, tmp_path)
    out = tmp_path / "o"
    one_line_error(run_cli("prep", "convert", "test-user/no-such-repo", "--out", out, env=env), "not found")
    one_line_error(run_cli("rt", "generate", "test-user/no-such-repo", "hi", env=env), "not found")

    hub.add_repo("other-user/gated-llama", folder_files(checkpoints["llama2_mha"]), gated=True)
    one_line_error(run_cli("prep", "convert", "other-user/gated-llama", "--out", out, env=env), "gated", "HF_TOKEN")

    hub.add_repo("test-user/weights-only", {"model.safetensors": b"\x00" * 64})
    one_line_error(run_cli("prep", "convert", "test-user/weights-only", "--out", out, env=env), "config.json")

    hub.add_repo("test-user/has-main", folder_files(checkpoints["opt"]))
    one_line_error(
        run_cli("prep", "convert", "test-user/has-main", "--out", out, "--revision", "nope", env=env), "revision"
    )

    with socket.socket() as s:  # a port nobody listens on: no network
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    no_net = {**env, "HF_ENDPOINT": dead}
    one_line_error(run_cli("prep", "convert", "test-user/has-main", "--out", out, env=no_net), "cannot reach")

    offline = {
        **env,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "empty-home"),
        "HF_HUB_CACHE": str(tmp_path / "empty-home" / "hub"),
    }
    one_line_error(run_cli("rt", "generate", "test-user/has-main", "hi", env=offline), "cache")
    assert not out.exists()
    assert not hub.errors


def test_default_calibration_text_comes_from_the_hub(hub, checkpoints, calib_file, tmp_path):
    """With no --calib-text, convert fetches the default corpus file through huggingface_hub and records it."""
    from infinigen_prep.calibrate import DEFAULT_CALIB

    repo, path = "roneneldan/TinyStories", "TinyStories-valid.txt"
    assert DEFAULT_CALIB == f"hf://datasets/{repo}/{path}"
    hub.add_repo(repo, {path: calib_file.read_bytes()}, repo_type="dataset")
    out = tmp_path / "b"
    r = run_cli("prep", "convert", checkpoints["tied_hd64"], "--out", out, "--json", env=hub_env(hub, tmp_path))
    assert r.returncode == 0, r.stderr
    cal = json.loads((out / "bundle.json").read_text())["infinigen"]["calibration"]
    assert cal["name"] == DEFAULT_CALIB and cal["sha256"] == hashlib.sha256(calib_file.read_bytes()).hexdigest()
