"""Upload a bundle folder to a Hugging Face Hub model repo (verified first, one atomic commit)."""

from __future__ import annotations

from pathlib import Path

from infinigen_prep import __version__
from infinigen_rt.bundle import BUNDLE_JSON, MODEL_CARD, TOKENIZER_JSON, Bundle, read_bundle
from infinigen_rt.errors import InfinigenError
from infinigen_rt.hub import hub_error, looks_like_repo_id


def bundle_files(bundle: Bundle) -> list[str]:
    """The files of a bundle folder: bundle.json, the model card, tokenizer.json, the *.safetensors files
    (weight shards, InfiniGen tensors) and whatever else bundle.json lists; never hidden files."""
    path = bundle.path
    names = {BUNDLE_JSON, *bundle.manifest.files}
    names.update(p.name for p in path.glob("*.safetensors") if p.is_file() and not p.name.startswith("."))
    names.update(n for n in (MODEL_CARD, TOKENIZER_JSON) if (path / n).is_file())
    return sorted(names)


def push(
    bundle_dir: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Verify the bundle at `bundle_dir` and upload it to the Hub model repo `repo_id` in one commit.

    Creates the repo (`private` applies only then) and the branch `revision` when missing. Only the bundle's
    own files are uploaded (hidden or other files in the folder are not); shards of an earlier bundle at that
    revision are deleted in the same commit. Returns huggingface_hub's CommitInfo: a str (the commit URL) with
    `.oid` (the commit sha) and `.repo_url`. Every failure is a one-line InfinigenError.
    """
    if not looks_like_repo_id(repo_id):
        raise InfinigenError(f"{repo_id!r} is not a Hub repo id; use OWNER/NAME, e.g. my-user/smollm2-infinigen")
    bundle = read_bundle(bundle_dir, verify=True)  # never upload a broken bundle
    files = bundle_files(bundle)
    name = bundle.path.resolve().name
    message = commit_message or f"Upload InfiniGen bundle {name} (infinigen-prep {__version__})"

    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    api = HfApi()  # created here, so HF_ENDPOINT / HF_TOKEN are those of this process
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.model_info(repo_id, revision=revision)
        remote = [s.rfilename for s in info.siblings or []]
        # safetensors of an earlier bundle at this revision that this one lacks (fewer shards, no InfiniGen
        # tensors) are deleted in the same commit: a pull must not fetch them
        stale = [f for f in remote if "/" not in f and f.endswith(".safetensors") and f not in files]
        operations = [CommitOperationDelete(path_in_repo=f) for f in stale]
        operations += [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(bundle.path / f)) for f in files]
        # create_commit, not upload_folder: with hf_xet installed upload_folder may split a long upload into
        # several commits, and a revision holding a new bundle.json next to old shards would be broken.
        # parent_commit: the deletions above were computed at this commit; fail rather than race a push.
        return api.create_commit(
            repo_id,
            operations,
            commit_message=message,
            repo_type="model",
            revision=revision,
            parent_commit=info.sha,
        )
    except InfinigenError:
        raise
    except Exception as e:  # huggingface_hub and httpx raise many types; all become one line
        raise hub_error(e, repo_id, revision, write=True) from None
