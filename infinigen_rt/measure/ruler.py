"""RULER's synthetic tasks (Hsieh et al., 2024), generated here, seeded, over a held-out text as the haystack, and
scored as RULER scores them: each answer's reference strings looked for in the greedy answer (string_match_all:
the share found; string_match_part for QA: any), a task's mean over its samples, the average over the tasks; beside
it the same with cwe's and fwe's lists read only as far as the count asked (needle.score_asked), since
string_match_all credits a list that runs past the ten words asked with every value it happens to hold.

  niah_single, niah_multikey, niah_multivalue, niah_multiquery   needles.py's sentences at seeded random depths:
      one asked; one among 3 with other keys; 4 values of one key, all asked; 4 keys, all asked
  vt     variable tracking: a chain of 5 assignments (VAR A = 12345, VAR B = VAR A, ...) spread through the text
         after one solved chain (RULER's one-shot),
         asked which variables hold the value
  cwe    common words: a numbered list of the text's words, 10 of them 30 times each, the rest 3 times; the 10
         asked
  fwe    frequent words: coded words drawn with Zipf's law (exponent 2) among dots; the 3 most frequent asked
  qa     the text's passages as named documents, a sentence quoted from one: which document holds it

Every case is a needle.Case (its answer's tokens at most `max_new`, scored by `match`), answered through
needle.run: one prefill a prompt for every policy whose prefill is exact."""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from dataclasses import replace

from infinigen_rt.errors import InfinigenError
from infinigen_rt.files import pyplot, save_figure
from infinigen_rt.measure import needle
from infinigen_rt.measure.needle import ADJECTIVES, NEEDLE, NOUNS, Case, Result, compose
from infinigen_rt.measure.perplexity import label
from infinigen_rt.policies import BASELINE

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa")
MAX_NEW = {"niah_single": 24, "niah_multikey": 24, "niah_multivalue": 64, "niah_multiquery": 64, "vt": 40,
           "cwe": 100, "fwe": 40, "qa": 24}  # fmt: skip
QUERIES, HOPS, COMMON, COMMON_TIMES, RARE_TIMES, FREQUENT = 4, 4, 10, 30, 3, 3
WORD_TASKS = ("cwe", "fwe")  # answered with a list of words, scored within the count asked too (score_asked)
VT_HEADER = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
CWE_HEADER = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
              "ones that appear most often.\n")  # fmt: skip
FWE_HEADER = ("Read the following coded text and track the frequency of each coded word. Find the three most "
              "frequently appeared coded words.\n")  # fmt: skip
QA_HEADER = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
             "words.\n\nThe following are given documents.\n\n")  # fmt: skip


def keys(rng: random.Random, n: int) -> list[str]:
    return rng.sample([f"{a}-{b}" for a in ADJECTIVES for b in NOUNS], n)


def numbers(rng: random.Random, n: int) -> list[str]:
    return [str(v) for v in rng.sample(range(1_000_000, 10_000_000), n)]


def niah(tok, hay: list[int], task: str, context: int, rng: random.Random) -> tuple[list[int], str, list[str]]:
    """(ids, what is asked, the answers) of a needle task: needles at seeded random depths."""
    ks = keys(rng, QUERIES)
    if task == "niah_multivalue":
        asked, pairs = ks[0], [(ks[0], v) for v in numbers(rng, QUERIES)]
    else:
        asked, pairs = ks[0], list(zip(ks, numbers(rng, QUERIES), strict=True))
        if task == "niah_single":
            pairs = pairs[:1]
    needles = [(rng.random(), NEEDLE.format(key=k, value=v)) for k, v in pairs]
    if task == "niah_multiquery":
        asked = ", ".join(ks[:-1]) + f", and {ks[-1]}"
        answers = [v for _, v in pairs]
    else:
        answers = [v for k, v in pairs if k == ks[0]]
    question = needle.QUESTION["one" if len(answers) == 1 else "all"].format(key=asked)
    return compose(tok, hay, needle.HEADER, needles, question, context, rng, f"the {task} needles"), asked, answers


def chain(rng: random.Random) -> tuple[list[str], str, list[str], str]:
    """A chain VAR A = value, VAR B = VAR A, ... of HOPS + 1 names of five capitals: (names, value, its sentences,
    the question that asks for the names)."""
    names = ["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(HOPS + 1)]
    while len(set(names)) <= HOPS:
        names = ["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(HOPS + 1)]
    value = str(rng.randrange(10_000, 100_000))
    said = [f" VAR {names[0]} = {value}. "] + [f" VAR {b} = VAR {a}. " for a, b in zip(names, names[1:], strict=False)]
    question = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
                f"According to the chain(s) of variable assignment in the text above, {len(names)} variables are "
                f"assigned the value {value}, they are:")  # fmt: skip
    return names, value, said, question


def variable_tracking(tok, hay: list[int], context: int, rng: random.Random) -> tuple[list[int], str, list[str]]:
    """A chain through the text in order, after one solved example without a haystack (RULER's one-shot: the
    answer's form, the names one after another)."""
    ex_names, _, ex_said, ex_question = chain(rng)
    example = VT_HEADER + " ".join(s.strip() for s in ex_said) + "\n" + ex_question + " " + " ".join(ex_names) + "\n\n"
    names, value, said, question = chain(rng)
    depths = sorted(rng.random() for _ in said)
    ids = compose(tok, hay, example + VT_HEADER, list(zip(depths, said, strict=True)), question, context, rng,
                  "a chain of variables")  # fmt: skip
    return ids, value, names


def words_of(text: str) -> list[str]:
    """The text's distinct words, lower-case letters only, 4 to 12 long, in their first order."""
    return list(dict.fromkeys(w.lower() for w in re.findall(r"[A-Za-z]{4,12}", text)))


def common_words(
    tok, vocab: list[str], context: int, rng: random.Random,
) -> tuple[list[int], str, list[str], frozenset]:  # fmt: skip
    """A numbered list of the vocabulary's words: COMMON of them COMMON_TIMES times each (fewer below 4k tokens, at
    least twice RARE_TIMES), as many others as fit RARE_TIMES times each, shuffled; the words listed (the pool)."""
    times = max(2 * RARE_TIMES, min(COMMON_TIMES, COMMON_TIMES * context // 4096))
    question = (f"\nQuestion: What are the {COMMON} most common words in the above list? Answer: The top "
                f"{COMMON} words that appear most often in the list are:")  # fmt: skip
    picked = rng.sample(vocab, len(vocab))
    common, rare, order = picked[:COMMON], picked[COMMON:], rng.random()

    def ids_for(n_rare: int) -> list[int]:
        items = common * times + rare[:n_rare] * RARE_TIMES
        random.Random(order).shuffle(items)
        return tok.encode(CWE_HEADER + "".join(f"{i}. {w}\n" for i, w in enumerate(items, 1)) + question)

    lo, hi = 0, len(rare)  # the most rare words that fit
    if len(ids_for(0)) > context:
        raise InfinigenError(f"context {context} is too short for cwe; use at least {len(ids_for(0)) + 16}")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(ids_for(mid)) <= context else (lo, mid - 1)
    if lo == len(rare) and len(ids_for(lo)) < context * 0.9:
        raise InfinigenError(f"the haystack text has {len(vocab)} distinct words, too few to fill a {context}-token "
                             "list of words (cwe); give a longer --text")  # fmt: skip
    return ids_for(lo), "", common, frozenset(common + rare[:lo])


def frequent_words(tok, context: int, rng: random.Random) -> tuple[list[int], str, list[str], frozenset]:
    """Coded words (three to six letters) drawn by rank with Zipf's law (exponent 2) among dots, as many as fit; the
    words drawn (the pool)."""
    vocab = list(dict.fromkeys("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6)))
                               for _ in range(2000)))  # fmt: skip
    question = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text? Answer: According to the coded text above, the "
                "three most frequently appeared words are:")  # fmt: skip
    weights = [1 / (r + 1) ** 2 for r in range(len(vocab))]
    draws = rng.random()  # (one seed for every length tried: the first n of a longer draw are a shorter one)

    def ids_for(n: int) -> tuple[list[int], Counter]:
        draw = random.Random(draws).choices(vocab, weights, k=n)
        text = " ".join(w if i % 4 else f"{w} ...." for i, w in enumerate(draw))
        return tok.encode(FWE_HEADER + text + question), Counter(draw)

    lo, hi = 1, context  # the most words that fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(ids_for(mid)[0]) <= context else (lo, mid - 1)
    ids, counts = ids_for(lo)
    ranked = counts.most_common(FREQUENT + 1)
    if len(ranked) <= FREQUENT or ranked[FREQUENT - 1][1] == ranked[FREQUENT][1]:
        raise InfinigenError(f"context {context} is too short for fwe (its third and fourth words as frequent); "
                             "use at least 512")  # fmt: skip
    return ids, "", [w for w, _ in ranked[:FREQUENT]], frozenset(counts)


def documents(tok, text: str, context: int, rng: random.Random) -> tuple[list[int], str, list[str]]:
    """The text's passages (blank-line separated, 200-2,000 characters) from a seeded start, each a document named
    by a key, as many as fit; a sentence of one of them quoted: which document holds it (its name the answer)."""
    passages = [p.strip() for p in re.split(r"\n\s*\n", text) if 200 <= len(p.strip()) <= 2000]
    if len(passages) < 4:
        raise InfinigenError("the haystack text has fewer than 4 passages of 200-2,000 characters between blank "
                             "lines (qa's documents); give a longer --text")  # fmt: skip
    start = rng.randrange(len(passages))
    names = keys(rng, len(ADJECTIVES) * len(NOUNS))
    docs: list[str] = []
    used = len(tok.encode(QA_HEADER)) + 150  # (the question: its quote at most 200 characters)
    while len(docs) < min(len(names), len(passages)):
        doc = f"Document {names[len(docs)]}:\n{passages[(start + len(docs)) % len(passages)]}\n\n"
        used += len(tok.encode(doc, add_special_tokens=False))
        if used > context:
            break
        docs.append(doc)
    if len(docs) < 2:
        raise InfinigenError(f"context {context} is too short for qa's documents; use at least 1024")
    quote, flat = None, [" ".join(d.split()) for d in docs]
    for gold in rng.sample(range(len(docs)), len(docs)):  # a document holding a sentence no other one holds
        body = docs[gold].split(":\n", 1)[1]
        sentences = [x for x in (" ".join(t.split()) for t in re.split(r"(?<=[.!?])\s+", body))
                     if 30 <= len(x) <= 200 and not any(x in f for j, f in enumerate(flat) if j != gold)]
        if sentences:
            quote = rng.choice(sentences)
            break
    if quote is None:
        raise InfinigenError("the haystack text's passages hold no sentence of 30-200 characters found in one of them "
                             "alone (qa quotes one); give a --text whose passages differ")  # fmt: skip
    question = (f"Answer the question based on the given documents.\n\nQuestion: Which document contains the "
                f'sentence "{quote}"? Answer: Document')  # fmt: skip
    ids = tok.encode(QA_HEADER + "".join(docs) + question)
    while len(docs) < min(len(names), len(passages)):  # more documents while they fit (the question is known now)
        doc = f"Document {names[len(docs)]}:\n{passages[(start + len(docs)) % len(passages)]}\n\n"
        more = tok.encode(QA_HEADER + "".join(docs) + doc + question)
        if len(more) > context or quote in " ".join(doc.split()):
            break
        docs.append(doc)
        ids = more
    while len(ids) > context and len(docs) > 2:  # (the joins merged fewer tokens than counted apart)
        drop = 0 if gold == len(docs) - 1 else len(docs) - 1
        docs.pop(drop)
        gold -= drop < gold
        ids = tok.encode(QA_HEADER + "".join(docs) + question)
    return ids, quote, [docs[gold].split(":", 1)[0].removeprefix("Document ")]


def build_cases(tok, hay_text: str, tasks, contexts, samples: int, seed: int) -> list[Case]:
    """Every (task, context, sample) case, seeded: the same arguments give the same prompts."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise InfinigenError(f"--ruler-tasks takes {', '.join(TASKS)}, got {unknown[0]!r}")
    hay = tok.encode(hay_text, add_special_tokens=False)
    vocab = words_of(hay_text)
    out = []
    for task in tasks:
        for context in contexts:
            for i in range(samples):
                rng = random.Random(f"{seed}/{task}/{context}/{i}")
                pool: frozenset[str] = frozenset()  # the words an answer lists from (cwe, fwe): needle.score_asked
                if task.startswith("niah"):
                    ids, asked, answers = niah(tok, hay, task, context, rng)
                elif task == "vt":
                    ids, asked, answers = variable_tracking(tok, hay, context, rng)
                elif task == "cwe":
                    ids, asked, answers, pool = common_words(tok, vocab, context, rng)
                elif task == "fwe":
                    ids, asked, answers, pool = frequent_words(tok, context, rng)
                else:
                    ids, asked, answers = documents(tok, hay_text, context, rng)
                out.append(Case(task, context, -1.0, i, asked, answers, ids, MAX_NEW[task],
                                "part" if task == "qa" else "all", pool))  # fmt: skip
    return out


def summary(results: list[Result]) -> list[dict]:
    """Per (policy, budget, ...) and context: each task's mean score, their average (RULER's), and that against
    full's at the context; beside them the same within the count asked (`asked`: cwe's and fwe's lists read to the
    words the question asks for, needle.score_asked; None where a word task's result predates that score)."""
    groups: dict[tuple, dict[str, list[Result]]] = {}
    for r in results:
        groups.setdefault((*r.config(), r.context), {}).setdefault(r.task, []).append(r)
    rows = []
    for (policy, budget, alpha, keys_, correct, runs, lb, context), by_task in groups.items():
        tasks = {t: round(sum(r.score for r in v) / len(v), 4) for t, v in by_task.items()}
        within = {t: [r.asked if t in WORD_TASKS else r.score for r in v] for t, v in by_task.items()}
        asked = None if any(None in v for v in within.values()) else \
            round(sum(sum(v) / len(v) for v in within.values()) / len(within), 4)  # fmt: skip
        rows.append({"policy": policy, "budget": budget, "alpha": alpha, "spec_keys": keys_, "correct": correct,
                     "runs": runs, "layer_budget": lb,
                     "context": context, "cases": sum(len(v) for v in by_task.values()), "tasks": tasks,
                     "score": round(sum(tasks.values()) / len(tasks), 4), "asked": asked})  # fmt: skip
    full = {r["context"]: r for r in rows if r["policy"] == BASELINE}
    for r in rows:
        f = full.get(r["context"])
        r["vs_full"] = round(r["score"] / f["score"], 4) if f and f["score"] else None
        r["asked_vs_full"] = round(r["asked"] / f["asked"], 4) if f and f["asked"] and r["asked"] is not None \
            else None  # fmt: skip
    return rows


def rescore(results: list[Result], cases: list[Case]) -> list[Result]:
    """Word-task results saved before needle.score_asked existed, scored within the count asked from their answers
    and these cases' pools (the same seeded prompts); the others as they are."""
    by_cell = {c.cell(): c for c in cases if c.pool}
    return [replace(r, asked=needle.score_asked(by_cell[r.cell()], r.answer))
            if r.asked is None and r.cell() in by_cell else r for r in results]  # fmt: skip


def plot(rows: list[dict], path, title: str) -> None:
    """RULER's average against the budget, a panel per context: a line per policy, `full` a level line."""
    plt = pyplot()
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(max(6.0, 0.8 + 3.4 * len(contexts)), 3.6), squeeze=False,
                             sharey=True, layout="constrained")  # fmt: skip
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    for ax, context in zip(axes[0], contexts, strict=True):
        here = [r for r in rows if r["context"] == context]
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in here:
            if r["policy"] == BASELINE or r["budget"] is None:
                ax.axhline(100 * r["score"], ls="--", lw=1, color="gray" if r["policy"] == BASELINE else None,
                           label=label(r["policy"], r["spec_keys"], r["correct"], r["alpha"]))  # fmt: skip
                continue
            name = label(r["policy"], r["spec_keys"], r["correct"], r["alpha"], runs=r.get("runs"),
                         layer_budget=r.get("layer_budget"))  # fmt: skip
            lines.setdefault(name, []).append((r["budget"], r["score"]))
        for name, pts in lines.items():
            pts.sort()
            ax.plot([100 * b for b, _ in pts], [100 * s for _, s in pts], marker="o", label=name)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks([100 * b for b in budgets], [f"{100 * b:g}" for b in budgets])
        ax.set_title(f"{context / 1024:g}k" if context >= 1024 else str(context), fontsize=9)
        ax.set_xlabel("KV fetched (% of the context)")
    axes[0][0].set_ylabel("RULER average (%)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path, dpi=120)
