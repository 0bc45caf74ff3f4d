"""`infinigen-rt eval --task needle`: RULER-style prompts are seeded, fit their context and hold their needles
where asked; answers are scored exactly; one shared prefill gives every policy the tokens its own generate
gives; infinigen at a 100 % budget answers as full does; the CLI's JSON, heatmap, resume and bad input."""

from __future__ import annotations

import json
import math
import re

import pytest

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.generate import generate
from infinigen_rt.measure import needle
from tests.conftest import TOKENIZER_TEXT, run_cli
from tests.test_cli import one_line_error

HAY = "\n".join(TOKENIZER_TEXT[:5] * 160)  # the plain sentences, not the needle templates the tokenizer saw


@pytest.fixture(scope="module")
def tiny(bundles):
    return Engine(read_bundle(bundles["llama31_gqa"]), device="cpu", dtype="float32")


def test_cases_are_seeded_fit_their_context_and_hold_their_needles(tiny):
    tok = tiny.tokenizer
    cases = needle.build_cases(tok, HAY, needle.TASKS, [250, 1200], [0.0, 0.5, 1.0], 2, seed=7)
    again = needle.build_cases(tok, HAY, needle.TASKS, [250, 1200], [0.0, 0.5, 1.0], 2, seed=7)
    other = needle.build_cases(tok, HAY, needle.TASKS, [250, 1200], [0.0, 0.5, 1.0], 2, seed=8)
    assert [c.ids for c in cases] == [c.ids for c in again]
    assert [c.ids for c in cases] != [c.ids for c in other]
    assert len(cases) == 3 * 2 * 3 * 2 and len({tuple(c.ids) for c in cases}) == len(cases)
    for c in cases:
        text = tok.decode(c.ids)
        assert len(c.ids) <= c.context and len(c.ids) >= c.context - 24, (len(c.ids), c.context)
        assert text.startswith(needle.HEADER.strip()[:40])
        first = f"for {c.key} is: {c.values[0]}."
        assert first in text and text.count("special magic number") >= 2
        assert text.rstrip().endswith(f"for {c.key} mentioned in the provided text " + (
            "are" if c.task == "multivalue" else "is"))  # fmt: skip
        assert all(f"for {c.key} is: {v}." in text for v in c.values)
        n_needles = text.count("One of the special magic numbers")
        assert n_needles == {"single": 1, "multikey": 1 + needle.DISTRACTORS, "multivalue": needle.VALUES}[c.task]
        body = text[len(needle.HEADER) : text.rindex("\nWhat")]
        plain = re.compile(r" ?One of the special magic numbers for [a-z-]+ is: \d+\. ?")  # the haystack alone
        before = body[: body.index("One of the special magic numbers " + first)]
        where = len(plain.sub("", before)) / len(plain.sub("", body))
        if c.context > 1000:  # a haystack of many sentences: the nearest sentence end is near the depth
            assert abs(where - c.depth) < 0.05, (c.task, c.depth, where)


def test_scoring_is_exact():
    one = needle.Case("single", 100, 0.5, 0, "k", ["1234567"], [])
    assert needle.score(one, " 1234567.") == 1.0
    assert needle.score(one, ": 1234567, 7654321") == 1.0
    assert needle.score(one, " 123456.") == 0.0  # a digit short is wrong
    assert needle.score(one, " 7654321 or 1234567") == 0.0  # the first number counts
    assert needle.score(one, " I do not know") == 0.0
    many = needle.Case("multivalue", 100, 0.5, 0, "k", ["1111111", "2222222", "3333333", "4444444"], [])
    assert needle.score(many, ": 2222222, 1111111, 4444444, 3333333.") == 1.0
    assert needle.score(many, ": 1111111, 2222222.") == 0.5
    assert needle.score(many, ": 11111111.") == 0.0


def test_one_shared_prefill_gives_each_policy_its_own_generate_tokens(tiny):
    case = needle.build_cases(tiny.tokenizer, HAY, ["multikey"], [230], [0.5], 1, seed=1)[0]
    todo = [("full", None, None, None, None, None, None), ("infinigen", 0.3, 4.0, "partial", 0.0, None, None),
            ("infinigen", 0.3, 4.0, "int4", 0.5, None, None), ("infinigen", 0.3, 4.0, "int4", 0.5, 8, None),
            ("infinigen", 0.3, 4.0, "int4", 0.5, None, 1.0),
            ("h2o", 0.3, None, None, None, None, None), ("int4", None, None, None, None, None, None),
            ("oracle", 0.3, None, None, None, None, None), ("offload", None, None, None, None, None, None)]  # fmt: skip
    shared = needle.answer_all(tiny, case, todo)
    for config, r in zip(todo, shared, strict=True):
        alone, _ = generate(tiny, [case.ids], needle.MAX_NEW[case.task], policy=config[0],
                            kv=needle.options(config))  # fmt: skip
        policy = config[0]
        said = alone[0].text.strip()
        assert r.answer and said.startswith(r.answer), (policy, r.answer, said)


def test_infinigen_at_a_full_budget_answers_as_full_does(tiny):
    cases = needle.build_cases(tiny.tokenizer, HAY, ["single", "multikey"], [236], [0.0, 1.0], 2, seed=3)
    todo = [("full", None, None, None, None, None, None), ("infinigen", 1.0, math.inf, "partial", 0.0, None, None),
            ("infinigen", 0.1, 4.0, "partial", 0.0, None, None)]  # fmt: skip
    res = needle.run(tiny, cases, todo, [])
    by = {}
    for r in res:
        by.setdefault((r.policy, r.budget), []).append(r.answer)
    assert by[("infinigen", 1.0)] == by[("full", None)]
    assert by[("infinigen", 0.1)] != by[("full", None)]  # a small budget does change a random model's answers
    fetched = [r.kv_fetched_share for r in res if r.budget == 0.1]
    assert all(0 < f <= 0.2 for f in fetched), fetched


def test_needle_cli_json_heatmap_resume_and_bad_input(bundles, tmp_path):
    b = bundles["llama2_mha"]
    hay = tmp_path / "hay.txt"
    hay.write_text(HAY)
    out, png = tmp_path / "needle.json", tmp_path / "needle.png"
    args = ["rt", "eval", b, "--task", "needle", "--text", hay, "--contexts", "230,240", "--depths", "0,1",
            "--needles", "1", "--needle-tasks", "single,multikey", "--policies", "full,infinigen,h2o",
            "--budgets", "0.2", "--device", "cpu"]  # fmt: skip
    r = run_cli(*args, "--out", out, "--plot", png, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data == json.loads(out.read_text())
    assert data["contexts"] == [230, 240] and data["tasks"] == ["single", "multikey"]
    assert len(data["results"]) == 2 * 2 * 2 * 3  # tasks x contexts x depths x policies
    assert {(s["policy"], s["context"]) for s in data["summary"]} == {
        (p, c) for p in ("full", "infinigen", "h2o") for c in (230, 240)}  # fmt: skip
    assert all(s["cases"] == 4 and 0 <= s["accuracy"] <= 1 for s in data["summary"])
    assert png.read_bytes().startswith(b"\x89PNG")

    r = run_cli(*args, "--out", out, "--resume", "--json")  # nothing left to do: the same results
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["results"] == data["results"]
    r = run_cli(*args[:-2], "--device", "cpu", "--out", out, "--resume", "--seed", "5")
    one_line_error(r, "another seed")

    one_line_error(run_cli(*args, "--contexts", "100000"), "--contexts must be at most")
    one_line_error(run_cli(*args, "--contexts", "40"), "too short")
    one_line_error(run_cli(*args, "--depths", "1.5"), "--depths")
    one_line_error(run_cli(*args, "--needle-tasks", "passkey"), "--needle-tasks")
    one_line_error(run_cli(*args, "--task", "passkey"), "--task")
    short = tmp_path / "short.txt"
    short.write_text("Too short a haystack.")
    one_line_error(run_cli(*args[:5], "--text", short, *args[7:]), "longer --text")
