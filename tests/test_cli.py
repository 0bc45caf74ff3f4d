"""Both CLIs end to end in subprocesses: help, generate --json schema, and bad input as one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import make_checkpoint, run_cli

pytestmark = pytest.mark.slow


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    """A user error: non-zero exit, exactly one line on stderr starting 'error:', no traceback."""
    assert r.returncode != 0, r.stdout
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.stderr
    for w in words:
        assert w.lower() in lines[0].lower(), lines[0]


def test_help_of_both_tools():
    for tool, cmds in (("prep", ["convert"]), ("rt", ["generate", "pull"])):
        r = run_cli(tool, "--help")
        assert r.returncode == 0 and all(c in r.stdout for c in cmds), r.stdout + r.stderr
        for c in cmds:
            r = run_cli(tool, c, "--help")
            assert r.returncode == 0 and "Examples" in r.stdout, r.stdout + r.stderr


def test_runtime_never_imports_transformers_or_prep():
    code = (
        "import sys, infinigen_rt, infinigen_rt.cli, infinigen_rt.engine, infinigen_rt.hub;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'infinigen_prep')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_generate_json_schema(bundles):
    r = run_cli("rt", "generate", bundles["llama31_gqa"], "The king said", "-n", "8", "--json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"text", "token_ids", "prompt_token_ids", "finish_reason", "stats"}
    assert isinstance(out["text"], str) and out["finish_reason"] in ("stop", "length")
    assert all(isinstance(t, int) for t in out["token_ids"] + out["prompt_token_ids"])
    assert 1 <= len(out["token_ids"]) <= 8 and len(out["prompt_token_ids"]) > 0
    stats = out["stats"]
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "ms_per_step", "policy", "device"):
        assert key in stats
    assert stats["policy"] == "full" and stats["prefill_tokens_per_s"] > 0


def test_convert_cli_json_and_refuses_to_overwrite(checkpoints, tmp_path, calib_file):
    out = tmp_path / "b"
    r = run_cli("prep", "convert", checkpoints["opt"], "--out", out, "--json", "--calib-text", calib_file)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["architecture"] == "opt" and summary["layers"] == 4 and summary["bytes"] > 0
    assert (out / "bundle.json").is_file() and (out / "README.md").read_text().startswith(
        "---\nlibrary_name: infinigen"
    )
    one_line_error(run_cli("prep", "convert", checkpoints["opt"], "--out", out), "already exists", "--force")
    r = run_cli("prep", "convert", checkpoints["opt"], "--out", out, "--force", "--no-infinigen")
    assert r.returncode == 0, r.stderr
    assert "infinigen" not in json.loads((out / "bundle.json").read_text())


def test_missing_paths(tmp_path):
    one_line_error(run_cli("rt", "generate", tmp_path / "nope", "hi"), "no bundle", "does not exist")
    one_line_error(run_cli("prep", "convert", tmp_path / "nope", "--out", tmp_path / "o"), "no such file")
    one_line_error(run_cli("rt", "generate", tmp_path, "hi"), "not an infinigen bundle")


def test_corrupt_safetensors_source(checkpoints, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoints["llama2_mha"], src)
    (src / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    one_line_error(run_cli("prep", "convert", src, "--out", tmp_path / "o"), "model.safetensors")
    assert not (tmp_path / "o").exists()


def test_unknown_architecture(checkpoints, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoints["llama2_mha"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (src / "config.json").write_text(json.dumps(cfg))
    one_line_error(run_cli("prep", "convert", src, "--out", tmp_path / "o"), "gpt_neox", "supported")


def test_truncated_and_tampered_bundles(bundles, tmp_path):
    good = bundles["tied_hd64"]
    shard = next(p.name for p in good.glob("*.safetensors"))

    trunc = tmp_path / "trunc"
    shutil.copytree(good, trunc)
    data = (trunc / shard).read_bytes()
    (trunc / shard).write_bytes(data[: len(data) // 2])
    one_line_error(run_cli("rt", "generate", trunc, "hi"), shard, "truncated")

    tampered = tmp_path / "tampered"
    shutil.copytree(good, tampered)
    data = bytearray((tampered / shard).read_bytes())
    data[-10] ^= 0xFF
    (tampered / shard).write_bytes(bytes(data))
    one_line_error(run_cli("rt", "generate", tampered, "hi"), shard, "sha256")

    missing = tmp_path / "missing"
    shutil.copytree(good, missing)
    (missing / "tokenizer.json").unlink()
    one_line_error(run_cli("rt", "generate", missing, "hi"), "tokenizer.json", "missing")

    future = tmp_path / "future"
    shutil.copytree(good, future)
    meta = json.loads((future / "bundle.json").read_text())
    meta["format_version"] = 99
    (future / "bundle.json").write_text(json.dumps(meta))
    one_line_error(run_cli("rt", "generate", future, "hi"), "format version 99")


def test_impossible_options(bundles):
    b = bundles["tied_hd64"]
    one_line_error(run_cli("rt", "generate", b, "hi", "--temperature", "-1"), "temperature")
    one_line_error(run_cli("rt", "generate", b, "hi", "--top-p", "0"), "top-p")
    one_line_error(run_cli("rt", "generate", b, "hi", "--policy", "magic"), "policy", "full")
    one_line_error(run_cli("rt", "generate", b, "hi", "--device", "cuda"), "cuda")


def test_killed_convert_leaves_nothing_loadable(tmp_path, calib_file):
    """SIGKILL a convert while it writes shards: no bundle at --out; the next convert cleans up and works."""
    src = make_checkpoint(tmp_path / "big", "llama2_mha", layers=8)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "infinigen_prep.cli",
        "convert",
        str(src),
        "--out",
        str(out),
        "--shard-size",
        "300KB",
        "--calib-text",
        str(calib_file),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    partial = None
    while time.time() < deadline and proc.poll() is None:
        found = list(tmp_path.glob(".out.partial-*/model-*.safetensors"))
        if found:
            partial = found[0].parent
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert partial is not None, "convert finished before it could be killed"
    assert not out.exists()
    one_line_error(run_cli("rt", "generate", partial, "hi"), "not an infinigen bundle")
    r = run_cli("prep", "convert", src, "--out", out, "--shard-size", "300KB", "--calib-text", calib_file)
    assert r.returncode == 0, r.stderr
    assert not partial.exists(), "the stale partial folder of the killed convert was not cleaned up"
    assert len(list(out.glob("model-*.safetensors"))) > 3


def test_error_text_in_brackets_is_printed_not_taken_for_markup(capsys):
    import typer

    from infinigen_rt.console import run_app
    from infinigen_rt.errors import InfinigenError

    app = typer.Typer()

    @app.command()
    def boom():
        raise InfinigenError("serve needs fastapi: pip install 'infinigen[serve]'")

    with pytest.raises(SystemExit) as exit_info:
        import sys

        sys.argv = ["x"]
        run_app(app)
    assert exit_info.value.code == 1
    assert "pip install 'infinigen[serve]'" in capsys.readouterr().err
