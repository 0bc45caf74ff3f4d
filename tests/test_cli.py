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
    one_line_error(
        run_cli("prep", "convert", src, "--out", tmp_path / "o"), "gpt_neox", "supported", "gemma3_text", "qwen3",
        "mistral",
    )  # fmt: skip


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


@pytest.mark.parametrize(
    "args, words",
    [
        (["--temperature", "nan"], ["temperature must be a finite number"]),  # was torch.multinomial's traceback
        (["--max-new-tokens", "-1"], ["--max-new-tokens must be >= 1, got -1"]),  # was a load, then --kv-tokens
        (["--stop", ""], ["--stop", "empty stop string"]),  # was one token, empty output, rc 0
        (["--policy", "full", "--budget", "0.1"], ["--budget applies to the infinigen and h2o policies", "not full"]),
        (["--policy", "h2o", "--capacity", "0.5"], ["--capacity applies to", "not h2o"]),
    ],
    ids=["nan-temperature", "negative-tokens", "empty-stop", "budget-under-full", "capacity-under-h2o"],
)
def test_generate_refuses_impossible_values_before_loading(bundles, tmp_path, args, words):
    """One line naming the option, from a real bundle; and from a missing one, so it is said before any load."""
    one_line_error(run_cli("rt", "generate", bundles["tied_hd64"], "hi", "--device", "cpu", *args), *words)
    one_line_error(run_cli("rt", "generate", tmp_path / "nothing", "hi", *args), *words)


def test_generate_stream_prints_what_the_result_is_with_a_stop_string(bundles):
    """--stream printed a stop string's first tokens (and text after it in the same token) that the result cut."""
    b, args = bundles["llama31_gqa"], ["The king said", "-n", "16", "--device", "cpu"]
    r = run_cli("rt", "generate", b, *args, "--json")
    text = json.loads(r.stdout)["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want = json.loads(run_cli("rt", "generate", b, *args, "--stop", stop, "--json").stdout)["text"]
    assert want == text[: text.index(stop)]
    streamed = run_cli("rt", "generate", b, *args, "--stop", stop, "--stream")
    assert streamed.returncode == 0 and streamed.stdout == want + "\n", (stop, streamed.stdout, want)


def test_serve_refuses_an_option_its_policy_does_not_read(tmp_path):
    one_line_error(run_cli("rt", "serve", tmp_path / "nothing", "--policy", "offload", "--alpha", "4"),
                   "--alpha applies to the infinigen policy", "not offload")  # fmt: skip


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

    from infinigen_rt.cli.console import run_app
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


# ---- nothing lost: --force, the source, outputs that cannot be written, a killed calibration ----


def tree(folder) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (to prove nothing changed)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_force_never_replaces_the_source_or_what_is_not_a_bundle(checkpoints, tmp_path, calib_file):
    src = tmp_path / "tiny"
    shutil.copytree(checkpoints["llama31_gqa"], src)
    before = tree(src)
    convert = ("prep", "convert", src, "--calib-text", calib_file, "--force", "--out")
    one_line_error(run_cli(*convert, src), "is the source")  # it was deleted, exit 0
    one_line_error(run_cli(*convert, tmp_path), "holds the source")
    assert tree(src) == before

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my own work")
    one_line_error(run_cli(*convert, mine), "replaces only an InfiniGen bundle", "folder")
    assert tree(mine) == {"notes.txt": b"my own work"}

    plain = tmp_path / "plain.txt"
    plain.write_text("keep me")
    one_line_error(run_cli(*convert, plain), "replaces only an InfiniGen bundle", "file")
    assert plain.read_text() == "keep me"
    assert not list(tmp_path.glob(".*")), "a hidden .old or .partial folder was left behind"

    bundle = tmp_path / "bundle"  # a real bundle is what --force replaces
    assert run_cli(*convert[:-2], "--out", bundle).returncode == 0
    r = run_cli(*convert, bundle, "--no-infinigen")
    assert r.returncode == 0, r.stderr
    assert "infinigen" not in json.loads((bundle / "bundle.json").read_text())
    assert not list(tmp_path.glob(".*")) and tree(src) == before


def test_bundle_json_records_no_local_path(checkpoints, tmp_path, calib_file):
    out = tmp_path / "b"
    r = run_cli(
        "prep", "convert", checkpoints["opt"], "--out", out, "--calib-text", calib_file, "--calib-tokens", "999"
    )
    assert r.returncode == 0, r.stderr
    # what push publishes: bundle.json and the model card name files, never where they were on this machine
    for name in ("bundle.json", "README.md"):
        text = (out / name).read_text()
        assert str(calib_file.parent) not in text and str(checkpoints["opt"].parent) not in text, name
    meta = json.loads((out / "bundle.json").read_text())
    assert meta["infinigen"]["calibration"]["name"] == calib_file.name
    assert meta["source"] == {"kind": "local", "name": "opt"}
    # the tiny model has 256 positions: the lowered --calib-tokens is said, on one line
    assert "warning: --calib-tokens 999 lowered to 256" in r.stderr
    assert meta["infinigen"]["calibration"]["tokens"] == 256


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="needs /sys, a folder nobody can write in")
def test_outputs_that_cannot_be_written_fail_before_any_work(bundles, checkpoints, tmp_path, calib_file):
    b = bundles["tied_hd64"]
    t0 = time.monotonic()
    one_line_error(run_cli("prep", "convert", checkpoints["opt"], "--out", "/sys/bundle"), "cannot write", "/sys")
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["the king said to the queen"] * 40))
    args = ("rt", "eval", b, "--text", text, "--seq-len", 64, "--score-from", 32, "--policies", "full")
    one_line_error(run_cli(*args, "--out", "/sys/x.json"), "cannot write --out /sys/x.json")
    one_line_error(run_cli(*args, "--plot", "/proc/nope/x.png"), "cannot write --plot")
    one_line_error(run_cli(*args, "--out", tmp_path), "is a folder")
    one_line_error(run_cli("rt", "bench", b, "--context", 32, "--batch", 1, "--out", "/sys/b.json"), "cannot write")
    offline = {"HF_HUB_OFFLINE": "1"}  # refused before the Hub is asked (offline, that would be another error)
    one_line_error(run_cli("rt", "pull", "owner/name", "--out", "/sys/b", env=offline), "cannot write", "/sys")
    assert time.monotonic() - t0 < 60  # refused at once, not after the sweep
    r = run_cli(*args, "--out", tmp_path / "deep" / "er" / "r.json")  # missing folders are made
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "deep" / "er" / "r.json").read_text())["rows"][0]["policy"] == "full"


def test_killed_calibration_leaves_nothing_loadable(tmp_path, calib_file):
    """SIGKILL a convert once its weights are written and calibration has begun: the hidden folder holds a dense
    model, but no bundle.json, so nothing loads it; the next convert cleans it up."""
    src = make_checkpoint(tmp_path / "big", "llama2_mha", layers=8)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "infinigen_prep.cli", "convert", str(src), "--out", str(out),
           "--calib-text", str(calib_file)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, partial = time.time() + 120, None
    while time.time() < deadline and proc.poll() is None:
        found = list(tmp_path.glob(".out.partial-*/bundle.partial.json"))
        if found:
            os.kill(proc.pid, signal.SIGKILL)
            partial = found[0].parent
            break
        time.sleep(0.002)
    proc.wait()
    assert partial is not None, "convert finished before it could be killed"
    assert not out.exists() and partial.is_dir() and not (partial / "bundle.json").exists()
    one_line_error(run_cli("rt", "generate", partial, "hi"), "unfinished bundle", "convert again")
    one_line_error(run_cli("prep", "inspect", partial), "unfinished bundle")
    r = run_cli("prep", "convert", src, "--out", out, "--calib-text", calib_file)
    assert r.returncode == 0, r.stderr
    assert not partial.exists() and (out / "bundle.json").is_file() and not (out / "bundle.partial.json").exists()


# ---- prompts: longer than the context, more new tokens than it leaves, not UTF-8 ----


def test_prompt_beyond_the_context_is_refused_at_once(bundles):
    b = bundles["llama31_gqa"]  # 256 positions
    t0 = time.monotonic()
    one_line_error(run_cli("rt", "generate", b, "king " * 400, "-n", 4), "context is 256", "shorten")
    one_line_error(run_cli("rt", "generate", b, "-", "-n", 4, input="king " * 400), "context is 256")
    assert time.monotonic() - t0 < 60


def test_huge_max_new_tokens_is_capped_with_a_notice(bundles):
    r = run_cli("rt", "generate", bundles["llama31_gqa"], "The king said", "-n", 1_000_000_000, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    room = 256 - len(out["prompt_token_ids"])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [
        f"warning: --max-new-tokens 1000000000 capped to {room}: what the prompt leaves of the 256 positions"
    ]
    assert 1 <= len(out["token_ids"]) <= room


def test_non_utf8_prompts_are_one_line_errors(bundles):
    b = str(bundles["tied_hd64"])
    cmd = [sys.executable, "-m", "infinigen_rt.cli", "generate", b]
    env = {**os.environ, "COLUMNS": "200"}
    r = subprocess.run([*cmd, b"caf\xff"], capture_output=True, text=True, env=env)  # argv: raw bytes
    one_line_error(r, "not UTF-8", "0xFF")
    r = subprocess.run([*cmd, "-"], input=b"caf\xff\xfe", capture_output=True, env=env)
    one_line_error(subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode()),
                   "standard input is not UTF-8")  # fmt: skip


def test_missing_local_path_shaped_like_a_repo_id(bundles, tmp_path):
    (tmp_path / "bundles").mkdir()
    env = {"HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "infinigen_rt.cli", "generate", "bundles/smol", "hi"],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, **env, "COLUMNS": "200"},
    )  # fmt: skip
    one_line_error(r, "bundles/smol: no such bundle folder", "local path")
    # OWNER is no local folder: the Hub is asked, and the error says both
    one_line_error(run_cli("rt", "generate", "nobody-here/smol", "hi", env=env), "no such local", "Hub")
    one_line_error(run_cli("prep", "convert", "nobody-here/ckpt", "--out", tmp_path / "o", env=env), "no such local")


def _bundle_copy(src, dst, template: str | None = None):
    """A copy of bundle `src` at `dst`, with bundle.json's tokenizer.chat_template replaced when `template` is given."""
    shutil.copytree(src, dst)
    if template is not None:
        meta = json.loads((dst / "bundle.json").read_text())
        meta["tokenizer"]["chat_template"] = template
        (dst / "bundle.json").write_text(json.dumps(meta))
    return dst


def test_generate_chat_with_a_raising_or_hostile_template_is_one_line(bundles, tmp_path):
    """A template that raises (a traceback: only jinja's TemplateError was caught) or builds a 400 MB string (1.5 GB
    in this process): one line naming the template, and nothing large is built here."""
    for i, (template, words) in enumerate([
        ("{{ 1/0 }}", ["the bundle's chat template failed to render", "ZeroDivisionError", "bundle.json"]),
        ("{{ 'a' * 400000000 }}", ["the bundle's chat template needed more than 256 MiB"]),
    ]):  # fmt: skip
        b = _bundle_copy(bundles["llama31_gqa"], tmp_path / f"b{i}", template)
        one_line_error(run_cli("rt", "generate", b, "hi", "--chat", "-n", 2, "--device", "cpu"), *words)


def test_generate_refuses_a_tokenizer_with_an_id_past_the_models_vocabulary(bundles, tmp_path):
    """One added token past the model's rows: a prompt holding it was an IndexError traceback; now the load says
    so, whatever the prompt."""
    from tokenizers import Tokenizer as HFTokenizer

    from infinigen_rt.bundle import sha256_file

    b = _bundle_copy(bundles["llama31_gqa"], tmp_path / "b")
    hf = HFTokenizer.from_file(str(b / "tokenizer.json"))
    n = hf.get_vocab_size(with_added_tokens=True)
    hf.add_tokens(["<extra>"])
    hf.save(str(b / "tokenizer.json"))
    meta = json.loads((b / "bundle.json").read_text())
    meta["files"]["tokenizer.json"] = {"size": (b / "tokenizer.json").stat().st_size,
                                       "sha256": sha256_file(b / "tokenizer.json")}  # fmt: skip
    (b / "bundle.json").write_text(json.dumps(meta))
    r = run_cli("rt", "generate", b, "hi <extra>", "-n", 2, "--device", "cpu")
    one_line_error(r, f"tokenizer has token id {n} ('<extra>')", f"vocabulary of {n} rows", "re-convert the bundle")
