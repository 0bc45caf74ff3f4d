"""`infinigen-rt eval --task ruler`: RULER's tasks built here are seeded, fit their context and hold what they ask
for; answers are scored as RULER scores them; the CLI's table, JSON, plot, resume and bad input."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter

import pytest

from infinigen_rt.bundle import read_bundle
from infinigen_rt.measure import needle, ruler
from infinigen_rt.tokenizer import Tokenizer
from tests.conftest import TOKENIZER_TEXT, run_cli
from tests.test_cli import one_line_error

# passages of the plain sentences (blank lines between: qa's documents), the needle templates the tokenizer saw aside
HAY = "\n\n".join(" ".join(TOKENIZER_TEXT[(i + j) % 5] for j in range(3)) for i in range(200))
WORDS = ["".join(w) for w in itertools.product("bcdfghjklm", "aeiou", "prstv", "aeiou", "nxz")][:3000]


@pytest.fixture(scope="module")
def tok(smollm2_bundle):
    return Tokenizer(read_bundle(smollm2_bundle))


def test_cases_are_seeded_fit_their_context_and_hold_their_answers(tok):
    # passages each with a sentence of its own (qa's quote), and many distinct words (cwe's rare ones)
    text = "\n\n".join(f"{p} The passage of {WORDS[i]} and {WORDS[-i - 1]} ends here." for i, p in
                       enumerate(HAY.split("\n\n"))) + "\n\n" + " ".join(WORDS)  # fmt: skip
    cases = ruler.build_cases(tok, text, ruler.TASKS, [1024, 2048], 2, seed=7)
    again = ruler.build_cases(tok, text, ruler.TASKS, [1024, 2048], 2, seed=7)
    other = ruler.build_cases(tok, text, ruler.TASKS, [1024, 2048], 2, seed=8)
    assert [c.ids for c in cases] == [c.ids for c in again]
    assert all(a.ids != b.ids for a, b in zip(cases, other, strict=True))
    assert len(cases) == len(ruler.TASKS) * 2 * 2
    for c in cases:
        prompt = tok.decode(c.ids)
        assert len(c.ids) <= c.context and len(c.ids) >= c.context * 0.85, (c.task, len(c.ids), c.context)
        assert c.max_new == ruler.MAX_NEW[c.task] and c.match == ("part" if c.task == "qa" else "all")
        if c.task.startswith("niah"):
            n = {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 4, "niah_multiquery": 4}[c.task]
            assert prompt.count("One of the special magic numbers for") == n
            assert len(c.values) == (4 if c.task in ("niah_multivalue", "niah_multiquery") else 1)
            assert all(f" is: {v}." in prompt for v in c.values)
            assert re.search(f"numbers? for {re.escape(c.key)} mentioned in the provided text", prompt)
        elif c.task == "vt":  # the chain in order: the value, then each name from the one before
            first, *rest = c.values
            at = [prompt.index(f"VAR {first} = {c.key}.")]
            at += [prompt.index(f"VAR {b} = VAR {a}.") for a, b in zip(c.values, rest, strict=False)]
            assert at == sorted(at) and len(c.values) == ruler.HOPS + 1
            assert f"assigned the value {c.key}, they are:" in prompt
            example = prompt[: prompt.index(f"VAR {first} = {c.key}.")]  # one solved chain first, its names given
            assert example.count("they are:") == 1 and re.search(r"they are: [A-Z]{5}( [A-Z]{5}){4}\n", example)
        elif c.task == "cwe":
            counts = Counter(re.findall(r"^\d+\. (\S+)$", prompt, re.M))
            top = {w for w, _ in counts.most_common(ruler.COMMON)}
            assert top == set(c.values) and min(counts[w] for w in top) > ruler.RARE_TIMES
            assert max(n for w, n in counts.items() if w not in top) == ruler.RARE_TIMES
        elif c.task == "fwe":
            counts = Counter(prompt.split("coded words.\n", 1)[1].split("\nQuestion")[0].replace("....", "").split())
            ranked = counts.most_common(4)
            assert [w for w, _ in ranked[:3]] == c.values and ranked[2][1] > ranked[3][1]
        else:  # qa: the quote is in the document the answer names, and only there
            quote = prompt.split('contains the sentence "', 1)[1].rsplit('"?', 1)[0]
            docs = dict(re.findall(r"Document ([a-z]+-[a-z]+):\n(.*?)\n\n", prompt, re.S))
            assert len(docs) >= 2 and [n for n, d in docs.items() if quote in " ".join(d.split())] == c.values


def test_ruler_scores_by_containment():
    refs = ["GGIAZ", "QITOV", "ab"]
    every = needle.Case("vt", 100, -1.0, 0, "1", refs, [], 40, "all")
    assert needle.score(every, " ggiaz, QITOV and AB") == 1.0  # letter case aside
    assert needle.score(every, " GGIAZ, QITOV") == pytest.approx(2 / 3)
    assert needle.score(every, " none") == 0.0
    part = needle.Case("qa", 100, -1.0, 0, "q", ["amber-harbor", "quiet-lantern"], [], 24, "part")
    assert needle.score(part, " quiet-lantern.") == 1.0 and needle.score(part, " amber") == 0.0


def test_summary_averages_tasks_then_compares_with_full():
    def res(policy, budget, task, score):
        return needle.Result(policy, budget, None, task, 512, -1.0, 0, score, "", None, None)

    rows = ruler.summary([res("full", None, "vt", 1.0), res("full", None, "cwe", 0.5),
                          res("oracle", 0.1, "vt", 0.5), res("oracle", 0.1, "vt", 1.0),
                          res("oracle", 0.1, "cwe", 0.25)])  # fmt: skip
    by = {r["policy"]: r for r in rows}
    assert by["full"]["score"] == 0.75 and by["full"]["vs_full"] == 1.0
    assert by["oracle"]["tasks"] == {"vt": 0.75, "cwe": 0.25} and by["oracle"]["score"] == 0.5
    assert by["oracle"]["vs_full"] == round(0.5 / 0.75, 4) and by["oracle"]["cases"] == 3


def test_ruler_cli_table_json_plot_resume_and_bad_input(bundles, tmp_path):
    b = bundles["llama31_gqa"]  # (its 256 positions: the needle tasks, whose templates the tokenizer knows)
    hay = tmp_path / "hay.txt"
    hay.write_text(HAY)
    out, png = tmp_path / "ruler.json", tmp_path / "ruler.png"
    args = ["rt", "eval", b, "--task", "ruler", "--text", hay, "--contexts", "225,232", "--samples", "1",
            "--ruler-tasks", "niah_single,niah_multikey", "--policies", "full,infinigen,oracle",
            "--budgets", "0.1,0.3", "--device", "cpu"]  # fmt: skip
    r = run_cli(*args, "--out", out, "--plot", png, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data == json.loads(out.read_text()) and data["task"] == "ruler"
    assert len(data["results"]) == 2 * 2 * 5  # tasks x contexts x (full, two policies at two budgets)
    assert {(s["policy"], s["budget"], s["context"]) for s in data["summary"]} == {
        ("full", None, c) for c in (225, 232)} | {(p, x, c) for p in ("infinigen", "oracle") for x in (0.1, 0.3)
                                                   for c in (225, 232)}  # fmt: skip
    assert all(set(s["tasks"]) == {"niah_single", "niah_multikey"} and 0 <= s["score"] <= 1 for s in data["summary"])
    assert png.read_bytes().startswith(b"\x89PNG")
    r = run_cli(*args, "--out", out, "--resume")  # nothing left to do: the table from the same results
    assert r.returncode == 0, r.stderr
    assert "niah_multikey" in r.stdout and "average" in r.stdout
    assert json.loads(out.read_text())["results"] == data["results"]
    r = run_cli(*args, "--out", out, "--resume", "--runs", "1,8", "--contexts", "225", "--ruler-tasks", "niah_single")
    assert r.returncode == 0, r.stderr
    assert "infinigen r8" in r.stdout  # infinigen in runs of 8 beside it, at each budget; the oracle single tokens
    summary = json.loads(out.read_text())["summary"]
    runs = {(s["policy"], s["budget"], s["runs"]) for s in summary if s["context"] == 225}
    assert json.loads(out.read_text())["contexts"] == [225, 232]  # (this run named 225 alone)
    assert runs == {("full", None, None)} | {(p, x, None) for p in ("infinigen", "oracle") for x in (0.1, 0.3)} | {
        ("infinigen", x, 8) for x in (0.1, 0.3)}

    r = run_cli(*args, "--out", out, "--resume", "--layer-budgets", "0,1", "--contexts", "225", "--ruler-tasks",
                "niah_single", "--policies", "infinigen", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr  # 0 is the bundle's (its rows are there): only the exponent 1 is answered
    results = json.loads(out.read_text())["results"]
    assert {(x["budget"], x["runs"], x["layer_budget"]) for x in results if x["policy"] == "infinigen"
            and x["context"] == 225 and x["task"] == "niah_single"} == {
        (b, r, e) for b in (0.1, 0.3) for r, e in ((None, None), (8, None), (None, 1.0))}  # fmt: skip
    assert len(results) == 2 * 2 * 5 + 2 + 2
    one_line_error(run_cli(*args, "--layer-budgets", "3"), "layer-budgets")
    one_line_error(run_cli(*args[:3], "--text", hay, "--layer-budgets", "1"), "--layer-budgets applies to")
    one_line_error(run_cli(*args, "--runs", "0"), "runs")
    one_line_error(run_cli(*args, "--runs", "2.5"), "--runs takes whole numbers")
    one_line_error(run_cli(*args[:3], "--text", hay, "--runs", "8"), "--runs applies to")
    one_line_error(run_cli(*args, "--ruler-tasks", "passkey"), "--ruler-tasks")
    one_line_error(run_cli(*args, "--samples", "0"), "--samples")
    one_line_error(run_cli(*args, "--contexts", "100000"), "--contexts must be at most")
    one_line_error(run_cli(*args, "--ruler-tasks", "cwe", "--contexts", "150"), "too short for cwe")


def test_word_tasks_are_also_scored_within_the_count_asked(tok):
    # a list that runs past the ten asked gains under RULER's rule, not within the count asked
    common = [f"w{c}" for c in "abcdefghij"]
    pool = frozenset(common + ["rare", "other", "more"])
    case = needle.Case("cwe", 100, -1.0, 0, "", [w.replace("w", "") for w in common], [], 100, "all",
                       frozenset(w.replace("w", "") for w in pool))  # fmt: skip
    ten = ", ".join(["A", "b", "c", "d", "e", "rare", "other", "more", "rare", "f"])  # (repeats count once)
    rambling = ten + ", g, h, i, j, and so on"
    assert needle.score(case, rambling) == 1.0 and needle.score_asked(case, rambling) == 0.7  # (a to g)
    assert needle.score_asked(case, ten) == 0.6 and needle.score_asked(case, "1. a\n2. b") == 0.2
    assert needle.score_asked(case, "none of them") == 0.0
    assert needle.score_asked(needle.Case("vt", 100, -1.0, 0, "1", ["A"], []), "A") is None  # (no pool)
    # the pools are the words each prompt lists: every answer in it, and the prompt's list drawn from it
    text = " ".join(WORDS) + "\n\n" + HAY
    for c in ruler.build_cases(tok, text, ["cwe", "fwe", "vt"], [1024], 1, seed=3):
        if c.task == "vt":
            assert not c.pool
            continue
        prompt = tok.decode(c.ids)
        listed = re.findall(r"^\d+\. (\S+)$", prompt, re.M) if c.task == "cwe" else \
            prompt.split("coded words.\n", 1)[1].split("\nQuestion")[0].replace("....", "").split()  # fmt: skip
        assert set(listed) == c.pool and set(c.values) <= c.pool


def test_summary_within_asked_and_rescore():
    def res(policy, task, score, asked=None, index=0):
        return needle.Result(policy, None if policy == "full" else 0.1, None, task, 512, -1.0, index, score, "b, c",
                             None, None, asked=asked)  # fmt: skip

    rows = {r["policy"]: r for r in ruler.summary([
        res("full", "vt", 1.0), res("full", "cwe", 1.0, 0.5),
        res("oracle", "vt", 1.0), res("oracle", "cwe", 0.5, 0.5)])}  # fmt: skip
    assert rows["full"]["score"] == 1.0 and rows["full"]["asked"] == 0.75
    assert rows["oracle"]["vs_full"] == 0.75 and rows["oracle"]["asked_vs_full"] == 1.0
    old = [res("full", "vt", 1.0), res("full", "cwe", 1.0)]  # saved before the score within the count asked
    assert ruler.summary(old)[0]["asked"] is None
    case = needle.Case("cwe", 512, -1.0, 0, "", ["a", "b"], [], 100, "all", frozenset("abc"))
    other = needle.Case("cwe", 512, -1.0, 1, "", ["a", "b"], [], 100, "all", frozenset("abc"))
    again = ruler.rescore(old + [res("full", "cwe", 1.0, index=2)], [case, other])
    assert [r.asked for r in again] == [None, 0.5, None]  # (vt has no pool; index 2 is not among the cases)
    assert ruler.summary(again[:2])[0]["asked"] == 0.75
