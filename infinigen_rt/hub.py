"""Bundles on the Hugging Face Hub: resolve a folder-or-repo-id argument, pull, and one-line Hub errors.

huggingface_hub's own conventions apply: HF_TOKEN or the saved login, HF_ENDPOINT, HF_HOME (cache),
HF_HUB_OFFLINE=1 (cache only)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from infinigen_rt.errors import InfinigenError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
NETWORK_MODULES = ("httpx", "httpx2", "httpcore", "requests", "urllib3")  # whose errors are the connection's


def looks_like_repo_id(s: str) -> bool:
    return bool(REPO_ID.match(s)) and not s.startswith((".", "/")) and ".." not in s


def hub_error(e: Exception, repo_id: str, revision: str | None = None, write: bool = False) -> InfinigenError:
    """Translate a huggingface_hub / network exception into a one-line error with the fix.

    `write`: the failed call was an upload (create_repo/create_branch/create_commit), not a download."""
    from huggingface_hub import errors as he

    rev = f" at revision {revision!r}" if revision else ""
    if write:
        return _write_error(e, repo_id, rev)
    # LocalEntryNotFoundError subclasses EntryNotFoundError: test the offline/cache cases first
    if isinstance(e, (he.OfflineModeIsEnabled, he.LocalEntryNotFoundError)):
        return InfinigenError(
            f"cannot reach the Hub for {repo_id}{rev} and it is not (fully) in the local cache; "
            "check the network (or HF_ENDPOINT), or unset HF_HUB_OFFLINE after downloading it once"
        )
    if isinstance(e, he.GatedRepoError):
        return InfinigenError(
            f"{repo_id} is gated: accept its terms on the Hub, then set HF_TOKEN (or `hf auth login`)"
        )
    if isinstance(e, he.RevisionNotFoundError):
        return InfinigenError(f"{repo_id} has no revision {revision!r}; check --revision")
    if isinstance(e, he.EntryNotFoundError):
        return InfinigenError(f"{repo_id}{rev} lacks a file this command needs; is it the right repo?")
    if isinstance(e, he.RepositoryNotFoundError):
        return InfinigenError(
            f"repo {repo_id} not found on the Hub (or private): check the id, or set HF_TOKEN for private repos"
        )
    if isinstance(e, he.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            return InfinigenError(f"the Hub refused access to {repo_id} (HTTP {status}): check HF_TOKEN's permissions")
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        return InfinigenError(f"Hub request for {repo_id} failed: {first}")
    first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
    if isinstance(e, OSError) or type(e).__module__.split(".")[0] in NETWORK_MODULES:
        return InfinigenError(f"cannot reach the Hub for {repo_id} ({first}); check the network or HF_ENDPOINT")
    return InfinigenError(f"downloading {repo_id}{rev} from the Hub failed: {first}")


def _write_error(e: Exception, repo_id: str, rev: str) -> InfinigenError:
    from huggingface_hub import errors as he

    if isinstance(e, he.OfflineModeIsEnabled):
        return InfinigenError(f"cannot push to {repo_id}: HF_HUB_OFFLINE is set; unset it to upload")
    # LFS uploads fail as RuntimeError("Error while uploading 'f' to the Hub.") raised from the HTTP error
    http = e if isinstance(e, he.HfHubHTTPError) else e.__cause__
    status = getattr(getattr(http, "response", None), "status_code", None)
    what = (str(e).strip() or e.__class__.__name__).splitlines()[0]
    if status is None:
        cause = str(e.__cause__ or "").strip()
        if cause and cause.splitlines()[0] not in what:
            what += f" ({cause.splitlines()[0]})"
        return InfinigenError(f"pushing to {repo_id}{rev} failed: {what}; check the network or HF_ENDPOINT")
    detail = (getattr(http, "server_message", None) or "").strip().replace("\n", " ")
    code = f"HTTP {status}: {detail}" if detail else f"HTTP {status}"
    if status in (401, 403):
        owner = repo_id.split("/")[0]
        return InfinigenError(
            f"the Hub refused to write to {repo_id} ({code}); the token (HF_TOKEN or "
            f"`hf auth login`) needs write access to the namespace {owner!r}: use a write token of that user "
            "or of an org they belong to, or push to your own namespace"
        )
    return InfinigenError(f"pushing to {repo_id}{rev} failed: {what} ({code}); nothing was committed")


def download(repo_id: str, revision: str | None = None, allow_patterns=None, local_dir=None) -> Path:
    """snapshot_download with one-line errors; returns the local folder."""
    import huggingface_hub

    try:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, allow_patterns=allow_patterns, local_dir=local_dir
            )
        )
    except InfinigenError:
        raise
    except Exception as e:  # huggingface_hub and httpx raise many types; all become one line
        raise hub_error(e, repo_id, revision) from None


def download_bundle(repo_id: str, revision: str | None = None, local_dir: Path | None = None) -> Path:
    """A bundle's files from the Hub (into the cache, or `local_dir`): its bundle.json first, checked, then only the
    files it lists and its card; nothing else the repo holds is fetched (a stray file would sit unverified in a
    folder `pull` calls verified, and a name the client refuses, `../x`, would fail the whole download)."""
    from infinigen_rt.bundle import BUNDLE_JSON, MODEL_CARD, read_manifest

    folder = download(repo_id, revision, allow_patterns=[BUNDLE_JSON], local_dir=local_dir)
    if not (folder / BUNDLE_JSON).is_file():
        raise InfinigenError(f"{repo_id} has no {BUNDLE_JSON}: it is not an InfiniGen bundle (a checkpoint? convert it "
                             "with infinigen-prep)")  # fmt: skip
    _, manifest = read_manifest(folder / BUNDLE_JSON)
    names = [BUNDLE_JSON, MODEL_CARD, *manifest.files]
    exact = [re.sub(r"([*?[])", r"[\1]", n) for n in names]  # each name matches itself only, not as a pattern
    return download(repo_id, revision, allow_patterns=exact, local_dir=local_dir)


def from_hub(arg: str, fetch, what: str = "folder"):
    """`fetch()` for an argument that names no local path but looks like OWNER/NAME; a failure says both.

    When OWNER is a local folder the argument is a missing local path, not a repo id: no Hub request."""
    owner = arg.split("/")[0]
    if Path(owner).expanduser().is_dir():
        raise InfinigenError(f"{arg}: no such {what} (the folder {owner}/ is here, so this is a local path)")
    try:
        return fetch()
    except InfinigenError as e:
        raise InfinigenError(f"{arg}: no such local {what}, and as a Hub repo id: {e}") from None


def resolve_bundle(arg: str, revision: str | None = None) -> Path:
    """A bundle argument: an existing folder, or a Hub repo id to pull into the cache."""
    p = Path(arg).expanduser()
    if p.exists() or not looks_like_repo_id(arg):
        return p
    return from_hub(arg, lambda: download_bundle(arg, revision), "bundle folder")


def pull_into(repo_id: str, revision: str | None, out: str | Path) -> Path:
    """Download the bundle `repo_id` into the folder `out`, whole or not at all: it is built in a hidden sibling
    `.NAME.partial-PID`, verified there and renamed into place. `out` may be missing, an empty folder, or a bundle
    (then replaced); anything else is refused before any download, and a failed pull leaves nothing behind."""
    from infinigen_rt.bundle import is_bundle, read_bundle
    from infinigen_rt.files import check_writable_dir, clean_stale_partials, swap_into_place

    target = Path(os.path.abspath(Path(out).expanduser()))
    if os.path.lexists(target):
        if target.is_symlink() or not target.is_dir():
            raise InfinigenError(f"--out {out} is {'a link' if target.is_symlink() else 'a file'}; give a folder path")
        if not is_bundle(target) and any(target.iterdir()):
            raise InfinigenError(f"--out {out} is a folder of other files (no InfiniGen bundle); pulling would mix or "
                                 "overwrite them: choose an empty or new folder")  # fmt: skip
    made = [p for p in [target.parent, *target.parent.parents] if not p.exists()]  # removed again on failure
    check_writable_dir(target.parent, f"--out {out}")
    clean_stale_partials(target)
    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        download_bundle(repo_id, revision, local_dir=tmp)
        shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's notes on the download, not the bundle's
        read_bundle(tmp, verify=True)
        swap_into_place(tmp, target)  # over an empty folder, or the bundle this one replaces
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in made:  # the folders made for --out, innermost first, if nothing else went in them
            try:
                p.rmdir()
            except OSError:
                break
        raise
    return target
