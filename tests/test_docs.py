"""The documentation against the code. README.md and docs/*.md: every `--option` they name for a command is in
that command's --help, every policy they list is in the runtime, every relative link resolves, the published
tables and headline numbers are the results JSON's; and the commands of the README's Use section and of the
serving page run as written, against tiny models, a loopback Hub, and tiny sizes where the real ones are slow."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from infinigen_rt.policies import POLICIES, RUNTIME_POLICIES, KVOptions
from tests.conftest import RESULTS, ROOT, TOKENIZER_TEXT, ServerProcess, run_cli

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOOLS = {"infinigen-prep": "prep", "infinigen-rt": "rt"}
SETUP = ["python3 -m pip install rust-just && just demo", "python3 -m pip install rust-just && just test"]


@cache
def cli_options() -> dict[tuple[str, str], set[str]]:
    """(tool, command) -> the options in the Options panel of its --help."""
    import typer.main
    from typer.testing import CliRunner

    from infinigen_prep.cli import app as prep_app
    from infinigen_rt.cli import app as rt_app

    row = re.compile(r"^│ \*?\s{0,3}((?:-{1,2}[a-z][\w-]*\s+)+)")  # '│ --verify  --no-verify  <bool> ...'
    out = {}
    for tool, app in (("prep", prep_app), ("rt", rt_app)):
        for name in typer.main.get_command(app).commands:
            r = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "250"})
            assert r.exit_code == 0, r.output
            out[(tool, name)] = {o for ln in r.output.splitlines() if (m := row.match(ln)) for o in m[1].split()}
            assert "--help" in out[(tool, name)], r.output  # the panel was parsed
    return out


@cache
def script_options(script: str) -> set[str]:
    """The options a benchmarks/ script's argparse parsers define (every subcommand's)."""
    tree = ast.parse((ROOT / script).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument"]
    opts = {a.value for c in calls for a in c.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return opts | {"--help", "-h"}


def command_tool(name: str) -> str | None:
    return next((tool for tool, cmd in cli_options() if cmd == name), None)


@dataclass
class Mention:
    """A command or an option the docs name: where, what, and the commands its options must belong to."""

    where: str
    tool: str | None = None  # 'prep', 'rt', 'script' or None (a bare option)
    command: str | None = None  # the command, or the script's path
    options: list[str] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)  # option -> the value written after it
    argv: list[str] | None = None  # a whole command line from a code block
    context: set[tuple[str, str]] = field(default_factory=set)  # for a bare option


def options_in(tokens: list[str]) -> tuple[list[str], dict[str, str]]:
    opts, values = [], {}
    for i, t in enumerate(tokens):
        if re.fullmatch(r"--[a-z][\w-]*(=.*)?|-[a-zA-Z]", t):
            name, _, val = t.partition("=")
            opts.append(name)
            nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
            values[name] = val or ("" if nxt.startswith("-") else nxt)
    return opts, values


def mention(tokens: list[str], where: str, argv: bool = False) -> Mention | None:
    """A command line or an inline code span, when it names a command of ours, a benchmark script or an option."""
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):  # INFINIGEN_API_KEY=secret infinigen-rt serve ...
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] in TOOLS and len(tokens) > 1:
        tool, cmd, rest = TOOLS[tokens[0]], tokens[1], tokens[2:]
    elif tokens[0] in ("python", "python3") and len(tokens) > 1 and tokens[1].startswith("benchmarks/"):
        tool, cmd, rest = "script", tokens[1], tokens[2:]
    elif command_tool(tokens[0]):  # a bare command name: `eval --policies`
        tool, cmd, rest = command_tool(tokens[0]), tokens[0], tokens[1:]
    elif tokens[0].startswith("--"):
        tool, cmd, rest = None, None, tokens
    else:
        return None
    opts, values = options_in(rest)
    return Mention(where, tool, cmd, opts, values, argv=tokens if argv else None)


def units(page: Path):
    """(heading, kind, text, line) for each code block and each paragraph or bullet, in order."""
    heading, buf, start, fence = "", [], 0, None
    lines = page.read_text().splitlines()
    for i, line in enumerate([*lines, ""], 1):
        if fence is not None:
            if line.startswith("```"):
                yield heading, fence, "\n".join(buf), start
                buf, fence = [], None
            else:
                buf.append(line)
            continue
        new_unit = line.startswith(("#", "```", "|")) or not line.strip() or re.match(r"\s*[-*] ", line)
        if new_unit and buf:
            yield heading, "prose", "\n".join(buf), start
            buf = []
        if line.startswith("```"):
            fence, start = line[3:].strip() or "text", i + 1
        elif line.startswith("#"):
            heading = line
        elif line.startswith("|"):  # a table row is a unit of its own
            yield heading, "prose", line, i
        elif line.strip():
            if not buf:
                start = i
            buf.append(line)


def shell_lines(block: str) -> list[tuple[int, list[str]]]:
    """A shell block's commands: continuations joined, comments dropped."""
    out, joined, first = [], "", 0
    for i, line in enumerate(block.splitlines()):
        if not joined:
            first = i
        joined += line.rstrip("\\") + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if joined.strip():
                out.append((first, shlex.split(joined, comments=True)))
            joined = ""
    return out


def spans(text: str) -> list[list[str]]:
    """The inline code spans of a paragraph (a span may break across lines), as words."""
    return [s.split() for s in re.findall(r"`([^`]+)`", text.replace("\n", " "))]


@cache
def mentions() -> list[Mention]:
    """Everything the docs name. A bare option belongs to the commands its section heading names, plus those of
    its paragraph, or else of the nearest paragraph or code block above it in the section that names any."""
    out = []
    for page in PAGES:
        section, last = None, set()
        for heading, kind, text, line in units(page):
            if heading != section:
                section, last = heading, set()
                named = [m for t in spans(heading) if (m := mention(t, page.name)) and m.tool in ("prep", "rt")]
                head_cmds = {(m.tool, m.command) for m in named}
            where = f"{page.relative_to(ROOT)}:{line}"
            if kind == "bash":
                found = [m for n, tokens in shell_lines(text) if (m := mention(tokens, f"{where}+{n}", argv=True))]
            elif kind == "prose":
                found = [m for t in spans(text) if (m := mention(t, where))]
            else:
                continue
            cmds = {(m.tool, m.command) for m in found if m.tool in ("prep", "rt")}
            last = cmds or last
            for m in found:
                m.context = head_cmds | last
            out += found
    return out


def test_setup_commands_are_the_two_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert all(c in readme for c in SETUP)


def test_every_option_the_docs_name_is_in_the_commands_help():
    bad = []
    for m in mentions():
        if m.tool in ("prep", "rt"):
            known = cli_options().get((m.tool, m.command))
            if known is None:
                bad.append(f"{m.where}: no command `{m.tool} {m.command}`")
                continue
        elif m.tool == "script":
            known = script_options(m.command)
        else:  # a bare option: one of the commands around it, or any command when none is named there
            ctx = m.context or cli_options().keys()
            known = set().union(*(cli_options()[c] for c in ctx if c in cli_options()))
        bad += [f"{m.where}: {o} ({m.command or sorted(m.context)})" for o in m.options if o not in known]
    assert not bad, "options the docs name that the commands do not have:\n" + "\n".join(bad)
    assert len(mentions()) > 80  # the parser found the docs' commands and options


def test_every_policy_the_docs_list_exists():
    bad = []
    for m in mentions():
        for opt in ("--policy", "--policies"):
            if opt in m.values and m.values[opt]:
                allowed = POLICIES if m.command == "eval" or m.tool is None else RUNTIME_POLICIES
                bad += [f"{m.where}: {p}" for p in re.split(r"[,|]", m.values[opt]) if p not in allowed]
    tables = {}
    for page in PAGES:
        for block in re.findall(r"^\| policy \|.*?\n(?:\|.*\n)+", page.read_text(), re.M):
            # a row's policy, less the options in its label ("infinigen (int4 keys, correct 0.25)", "infinigen c0")
            names = [row.split("|")[1].strip().strip("`*").split()[0] for row in block.splitlines()[2:]]
            bad += [f"{page.name} table: {p}" for p in names if p not in POLICIES]
            tables.setdefault(page.name, []).append(names)
    assert not bad, "policies the docs list that the runtime lacks:\n" + "\n".join(bad)
    # the policy table of usage.md lists exactly the runtime's policies
    assert tables["usage.md"][0] == list(RUNTIME_POLICIES)
    readme = PAGES[0].read_text()
    assert all(f"`{p}`" in readme for p in RUNTIME_POLICIES), "the README names every runtime policy"



def test_the_docs_list_every_kv_option_with_its_default_and_choices():
    """usage.md's list of KV options names every flag of the commands that run one policy, with the default and
    the choices policies/options.py declares (`--spec-keys partial|int4|int2` (int4)); serving.md names the KV
    options a request may override."""
    from infinigen_rt.policies.options import DEFAULTS, OPTS, flag
    from infinigen_rt.serve.protocol import KV_REQUEST

    usage = (ROOT / "docs" / "usage.md").read_text()
    bullets = usage[usage.index("\n- ", usage.index("KV options (`generate` and `serve`")) :].split("\n\n")[0]
    # `--flag`, `--flag a|b|c` or `--flag X`, then its default in parentheses when it has one; the first mention
    mention = re.compile(r"`(--[\w-]+)( [^`]*)?`(?: \(([^;):]+))?")
    written = {}
    for m in mention.finditer(bullets):
        written.setdefault(m[1], ((m[2] or "").strip(), m[3]))
    bad = []
    for name, o in OPTS.items():
        if not o.cli:
            continue
        if flag(name) not in written:
            bad.append(f"{flag(name)}: not listed")
            continue
        arg, default = written[flag(name)]
        if o.choices is not None and arg != "|".join(o.choices):
            bad.append(f"{flag(name)}: choices {arg!r}, declared {'|'.join(o.choices)}")
        if DEFAULTS[name] is not None and default != str(DEFAULTS[name]):
            bad.append(f"{flag(name)}: default {default!r}, declared {DEFAULTS[name]}")
    assert not bad, "usage.md's KV options against policies/options.py:\n" + "\n".join(bad)
    serving = (ROOT / "docs" / "serving.md").read_text()
    listed = re.search(r"`infinigen`:\s*`\{([^}]*)\}` overrides", serving)
    assert listed and tuple(re.findall(r'"(\w+)"', listed[1])) == KV_REQUEST, listed


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_links_resolve():
    bad = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target}")
            elif anchor and anchor not in {slug(h) for h in re.findall(r"^#+ .*", dest.read_text(), re.M)}:
                bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, bad


def test_published_numbers_are_the_results_json():
    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "benchmarks" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    acc = json.loads((RESULTS / "accuracy-smollm2-hamlet.json").read_text())
    peer = json.loads((RESULTS / "bench-cpu-vs-transformers.json").read_text())
    accuracy, performance = (ROOT / "docs" / "accuracy.md").read_text(), (ROOT / "docs" / "performance.md").read_text()
    assert tables.accuracy(acc) in accuracy, "docs/accuracy.md: the table is not tables.py's rendering of the JSON"
    gemma = json.loads((RESULTS / "bench-cpu-context-gemma3.json").read_text())
    ms = {pol: [p["ms_per_step"] for p in gemma["points"] if p["policy"] == pol] for pol in ("infinigen", "full")}
    assert (f"the defaults took {min(ms['infinigen']):.1f}-{max(ms['infinigen']):.1f} ms a step, `full` "
            f"{min(ms['full']):.1f}-{max(ms['full']):.1f}") in " ".join(performance.split()), "Gemma 3's figures"
    qwen = json.loads((RESULTS / "bench-cpu-context-qwen2.5-coder-0.5b.json").read_text())
    assert tables.bench(qwen) in performance, "docs/performance.md: Qwen's context table is not tables.py's"
    for n in (2048, 16384, 32768):
        long = json.loads((RESULTS / f"accuracy-gemma3-alice-{n}.json").read_text())
        assert tables.accuracy(long) in accuracy, f"docs/accuracy.md: Gemma 3's {n}-token table is not tables.py's"
    assert tables.needle(json.loads((RESULTS / "needle-gemma3.json").read_text())) in accuracy, "Gemma 3's needles"
    # the current CPU table: every policy against the tree before the one KV path (benchmarks/ab_trees.py's files)
    ab = {f: json.loads((RESULTS / f"ab-cpu-smollm2-{f}.json").read_text()) for f in
          ("8k-b1", "4k-b4", "4k-b4-rerun", "8k-b8", "2k-b1-h2o")}  # fmt: skip
    points = {**ab["8k-b1"]["points"], **tables.ab_merged([ab["4k-b4"], ab["4k-b4-rerun"]]),
              **ab["8k-b8"]["points"], **ab["2k-b1-h2o"]["points"]}  # fmt: skip
    assert tables.ab(points) in performance, "docs/performance.md: the CPU table is not tables.py's rendering"
    one, eight = ab["8k-b1"]["points"], ab["8k-b8"]["points"]
    full1, full8 = one["full b1 x 8160"]["a_ms"], eight["full b8 x 8160"]["a_ms"]
    ig1, ig8 = one["infinigen int4c b1 x 8160"]["a_ms"], eight["infinigen int4c b8 x 8160"]["a_ms"]
    # the projection held to the H100's measurement, and this tree's steps projected eager and from a graph
    h100 = [json.loads((RESULTS / "gpu-h100-2026-11-26" / f).read_text()) for f in
            ("bench-llama-3.1-8b-32k.json", "bench-llama-2-7b-b8-8k.json")]  # fmt: skip
    replayed = json.loads((RESULTS / "projected-h100-replay-5a5a7e7.json").read_text())
    assert tables.held(replayed, h100, "llama-2-7b") in performance, "docs/performance.md: the held projection"
    rehearsed = [json.loads((RESULTS / f).read_text()) for f in
                 ("projected-h100-llama31-8b-32k.json", "projected-h100-llama2-7b-b8-8k.json")]  # fmt: skip
    assert tables.graphed(*rehearsed) in performance, "docs/performance.md: the eager and graphed projection"

    med = {w: statistics.median(r["ms_per_step"] for r in peer["rows"] if r["peer"] == w) for w in
           ("infinigen-rt full", "transformers")}  # fmt: skip
    ours, theirs = med["infinigen-rt full"], med["transformers"]
    assert f"{ours:.1f} ms per step for `full`, {theirs:.1f} for transformers ({theirs / ours:.2f}x)" in performance

    spec = importlib.util.spec_from_file_location("doc_heldout", ROOT / "benchmarks" / "heldout.py")
    heldout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heldout)
    names = ("alice", "constitution", "rst-spec", "rainbow", "pytest-fixtures", "psf-license")
    held = [heldout.load(str(RESULTS / f"accuracy-smollm2-{t}.json")) for t in names]
    mean = heldout.mean_rows(held)
    assert mean == json.loads((RESULTS / "accuracy-heldout-smollm2.json").read_text())["mean"]
    table = heldout.markdown(held, [heldout.load(str(RESULTS / "accuracy-smollm2-hamlet.json"))], mean)
    assert table in accuracy, "docs/accuracy.md: the held-out table is not heldout.py's rendering of the JSON"
    qwen = [heldout.load(str(RESULTS / f"accuracy-qwen2.5-coder-0.5b-{t}.json"))
            for t in ("rst-spec", "pytest-fixtures", "psf-license")]  # fmt: skip
    qwen_mean = heldout.mean_rows(qwen)
    assert qwen_mean == json.loads((RESULTS / "accuracy-heldout-qwen2.5-coder-0.5b.json").read_text())["mean"]
    assert heldout.markdown(qwen, [], qwen_mean) in accuracy, "docs/accuracy.md: Qwen's held-out table"
    assert tables.needle(json.loads((RESULTS / "needle-qwen2.5-coder-0.5b.json").read_text())) in accuracy, "Qwen's"
    first = held[:3]  # the first round's texts, with every policy run on them
    hamlet = [heldout.load(str(RESULTS / "accuracy-smollm2-hamlet.json"))]
    assert heldout.markdown(first, hamlet, heldout.mean_rows(first)) in accuracy, "docs/accuracy.md: first round"
    needles = json.loads((RESULTS / "needle-smollm2.json").read_text())
    assert tables.needle(needles) in accuracy, "docs/accuracy.md: the needle table is not tables.py's rendering"

    default = KVOptions()  # the published infinigen rows: the default options, the keys SmolLM2's bundle chose
    smol_keys = json.loads((RESULTS / "keys-choice.json").read_text())["models"]["smollm2-135m"]["spec_keys"]
    row = {(r["policy"], r["budget"]): r for r in mean if r["policy"] != "infinigen" or (
        (r["alpha"], r["spec_keys"], r["correct"]) == (default.alpha, smol_keys, default.correct))}  # fmt: skip
    ig20, ig10 = row[("infinigen", 0.2)], row[("infinigen", 0.1)]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"fetches {100 * ig20['kv_fetched_share']:.1f} % of the KV" in readme
    assert f"**{ig20['delta_pct']:+.2f} %** above `full`; at 10 %, {ig10['delta_pct']:+.2f} %" in readme
    assert f"the defaults {ig1:.1f} ms a step, `full` {full1:.1f}: **{full1 / ig1:.2f}x**" in readme
    assert f"the defaults {ig8:.1f} ms a step, `full` {full8:.1f}: **{full8 / ig8:.2f}x**" in readme


# ---- the commands run ------------------------------------------------------------------------------------------

# what the docs' real sizes become on the tiny models (256 positions): option -> tiny value
TINY = {"eval": {"--seq-len": "48", "--score-from": "40"},
        "bench": {"--context": "32", "--gen": "2", "--warmup": "1"}}
CHAT = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}" \
       "<s>assistant:{% endif %}"  # fmt: skip


def block_commands(page: str, heading: str) -> list[list[str]]:
    """The command lines of the first shell block under `heading` in `page`."""
    for head, kind, text, _ in units(ROOT / page):
        if head == heading and kind == "bash":
            return [tokens for _, tokens in shell_lines(text)]
    raise AssertionError(f"{page} has no shell block under {heading!r}")


def tiny(argv: list[str]) -> list[str]:
    """argv with the sizes of TINY (replaced where given, added where not)."""
    sizes = dict(TINY.get(argv[1], {}))
    out = []
    for i, t in enumerate(argv):
        if i and argv[i - 1] in sizes:
            t = sizes.pop(argv[i - 1])
        out.append(t)
    return out + [x for kv in sizes.items() for x in kv]


def folder_files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


class Server(ServerProcess):
    """A `serve` command line from the docs, on a free port, in `cwd`."""

    def __init__(self, argv: list[str], cwd: Path, env: dict):
        assert TOOLS[argv[0]] == "rt"
        env = {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        super().__init__(argv[1:], cwd / "serve.log", cwd=cwd, env=env)


@pytest.mark.slow
def test_readme_use_commands_run(tmp_path, checkpoints, bundles, calib_file):
    from tests.hubserver import HubServer, hub_env
    from tests.prep.test_gguf_source import _write_tiny

    pytest.importorskip("fastapi")
    commands = block_commands("README.md", "## Use")
    assert [c[:2] for c in commands if c[0] in TOOLS] == [c[:2] for c in commands]  # only our commands
    work = tmp_path / "work"  # the relative paths the commands name, with tiny stand-ins
    shutil.copytree(checkpoints["llama31_gqa"], work / "my-local-hf-checkpoint")
    _write_tiny(work / "SmolLM2-135M-Instruct.Q4_1.gguf", "llama", chat_template=CHAT)
    (work / "book.txt").write_text(calib_file.read_text())
    (work / "hamlet.txt").write_text(calib_file.read_text() * 2)
    with HubServer() as hub:  # the Hub repos the commands name, the default calibration text among them
        hub.add_repo("meta-llama/Llama-2-7b-hf", folder_files(checkpoints["llama31_gqa"]))
        hub.add_repo("owner/some-bundle", folder_files(bundles["tied_hd64"]))
        hub.add_repo("roneneldan/TinyStories", {"TinyStories-valid.txt": "\n".join(TOKENIZER_TEXT * 3)},
                     repo_type="dataset")  # fmt: skip
        hub.add_token("hf_me_write", "me")
        env = {**hub_env(hub, tmp_path, token="hf_me_write"), "OMP_NUM_THREADS": "1"}
        seen = set()
        for argv in commands:
            argv = tiny(argv)
            seen.add(argv[1])
            if argv[1] == "serve":
                Server(argv, work, env).stop()
                continue
            r = run_cli(TOOLS[argv[0]], *argv[1:], env=env, cwd=work)
            assert r.returncode == 0, f"{shlex.join(argv)}\n{r.stdout}\n{r.stderr}"
            if "--json" in argv and argv[1] == "generate":
                assert json.loads(r.stdout)["finish_reason"] in ("length", "stop")
            if argv[1] in ("eval", "bench"):
                assert "infinigen" in r.stdout and "…" not in r.stdout, r.stdout
    assert seen == {"convert", "inspect", "push", "generate", "pull", "eval", "bench", "serve"}
    assert (work / "bundles" / "smol" / "bundle.json").is_file() and (work / "accuracy.json").is_file()


@pytest.mark.slow
def test_serving_examples_run(tmp_path, bundles):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    page = "docs/serving.md"
    text = (ROOT / page).read_text()
    serve_lines = [c for c in block_commands(page, "# Serving: `infinigen-rt serve`") if c[0] in TOOLS]
    work = tmp_path / "work"
    (work / "artifacts" / "bundles").mkdir(parents=True)
    (work / "artifacts" / "bundles" / "smollm2-135m").symlink_to(bundles["llama31_gqa"])  # has a chat template
    server = Server(serve_lines[-1], work, {})  # the one the examples below talk to
    try:
        curls = [c for c in shell_lines(re.search(r"```bash\n(curl .*?)```", text, re.S)[1])]
        assert len(curls) >= 4
        for _, argv in curls:
            url = next(a for a in argv if a.startswith("http")).replace("http://127.0.0.1:8000", server.url)
            headers = dict(argv[i + 1].split(": ", 1) for i, a in enumerate(argv) if a == "-H")
            data = next((argv[i + 1] for i, a in enumerate(argv) if a == "-d"), None)
            r = httpx.request("POST" if data else "GET", url, headers=headers, content=data, timeout=60)
            assert r.status_code == 200, f"{shlex.join(argv)}: {r.status_code} {r.text}"
            assert "data: [DONE]" in r.text if '"stream": true' in (data or "") else True
        code = re.search(r"```python\n(.*?)```", text, re.S)[1].replace("http://127.0.0.1:8000", server.url)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    finally:
        server.stop()


@pytest.mark.slow
def test_the_demos_long_prompt_runs_both_policies_and_reports_what_infinigen_fetched(tmp_path, bundles, calib_file):
    """`just demo`'s last command (examples/long_prompt.py), at a tiny model's sizes: both policies continue the
    prompt, and the report gives infinigen's fetched share, both speeds and their ratio."""
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "long_prompt.py"), str(bundles["llama31_gqa"]),
                        str(calib_file), "--tokens", "96", "--new", "4", "--rounds", "1", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, env={**os.environ,
                       "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert re.search(r"prompt: 96 tokens of calib\.txt", r.stdout), r.stdout
    assert re.search(r"^\s+full: [\d.]+ ms a step .*all of its KV", r.stdout, re.M), r.stdout
    share = re.search(r"^infinigen: [\d.]+ ms a step .*fetched ([\d.]+) % of its speculated layers' KV", r.stdout, re.M)
    assert share and 0 < float(share[1]) < 100, r.stdout
    assert re.search(r"^infinigen / full: [\d.]+x the speed", r.stdout, re.M), r.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "examples" / "long_prompt.py"), str(bundles["llama31_gqa"]),
                          str(calib_file), "--tokens", "100000", "--device", "cpu"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert bad.returncode != 0 and "past the model's context" in bad.stderr, bad.stderr
