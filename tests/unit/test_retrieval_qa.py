"""Retrieval QA (spec §15.3): the BM25 retriever next-hop, the ``weak_citations``
trigger on citations, the escalation's evidence, and examples/retrieval_qa run
as a user runs it through a real ``atp-router`` process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from atp_router.adapters.base import Prompt
from atp_router.adapters.registry import build_adapter
from atp_router.adapters.tools.retriever import (
    RetrieverAdapter,
    RetrieverLimits,
    chunk,
    query_terms,
)
from atp_router.consensus.escalation import CITATION_RULE, should_escalate
from atp_router.consensus.strategies import merge
from atp_router.consensus.types import AgentFinding, AgentReport, Severity
from atp_router.policy.rib import AgentSpec
from atp_router.runtime.dataplane.dispatch import NEXT_HOP_FAILED
from atp_router.wire.errors import ClientInputError, ErrorCode
from tests.helpers import rib_with_root, router_process
from tests.peers import MODEL_ALIAS, start_llama_server

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "retrieval_qa"
SPECS = ROOT.parent / "shared" / "specs"

DOC_A = """# Alpha

Intro line about nothing.

## Budgets

The router stops a stream with EBUDGET when the budget is exhausted.
It then sends FIN.

## Windows

Windows grow by additive increase.
"""
DOC_B = "Plain text notes.\n\nGardening tips: water tomatoes daily.\n"


def corpus(tmp_path: Path) -> Path:
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "a.md").write_text(DOC_A)
    (d / "sub" / "b.txt").write_text(DOC_B)
    return d


# ------------------------------------------------------------------ the retriever


def test_chunks_start_at_headings_with_true_line_numbers():
    ps = chunk("a.md", DOC_A, chunk_lines=12, overlap=2)
    assert [(p.start, p.end, p.heading) for p in ps] == [(1, 3, "Alpha"), (5, 8, "Budgets"), (10, 12, "Windows")]
    lines = DOC_A.splitlines()
    for p in ps:
        assert p.text == "\n".join(lines[p.start - 1:p.end])


def test_long_sections_are_windowed_with_overlap():
    text = "\n".join(f"line {i}" for i in range(1, 26))
    ps = chunk("x.txt", text, chunk_lines=10, overlap=3)
    assert [(p.start, p.end) for p in ps] == [(1, 10), (8, 17), (15, 24), (22, 25)]


def test_ranks_the_passage_that_answers_and_cites_its_lines(tmp_path):
    r = RetrieverAdapter("r", docs=str(corpus(tmp_path)), k=3)
    rep = r.answer({"question": "What happens when the budget is exhausted?"})
    top = rep.findings[0]
    assert (top.file, top.start, top.end) == ("a.md", 5, 8)
    assert top.rule == CITATION_RULE and top.ref == "1" and top.severity is Severity.INFO
    assert "EBUDGET" in top.claim
    assert "[a.md:7-7]" in rep.summary  # the extractive answer cites the line it quotes
    assert rep.confidence == top.confidence > 0.5
    # a document in a sub-folder is cited by its path relative to the corpus root
    garden = r.answer({"question": "how often to water tomatoes"})
    assert (garden.findings[0].file, garden.findings[0].start, garden.findings[0].end) == ("sub/b.txt", 1, 3)
    assert "[sub/b.txt:3-3]" in garden.summary


def test_a_question_matching_nothing_is_an_empty_low_confidence_answer(tmp_path):
    r = RetrieverAdapter("r", docs=str(corpus(tmp_path)))
    rep = r.answer({"question": "quantum chromodynamics"})
    assert rep.findings == [] and rep.confidence == 0.0
    assert query_terms("What is the of a?") == []
    with pytest.raises(ClientInputError, match="no searchable term"):
        r.answer({"question": "what is it?"})


def test_weak_match_lowers_citation_strength(tmp_path):
    d = corpus(tmp_path)
    strong = RetrieverAdapter("r", docs=str(d), min_score=0.0).answer({"question": "budget exhausted EBUDGET"})
    weak = RetrieverAdapter("r", docs=str(d), min_score=1000.0).answer({"question": "budget exhausted EBUDGET"})
    assert strong.findings[0].confidence == 1.0
    assert weak.findings[0].confidence < 0.05 and weak.confidence < 0.05


def test_index_is_cached_and_rebuilt_when_the_folder_changes(tmp_path):
    d = corpus(tmp_path)
    r = RetrieverAdapter("r", docs=str(d))
    r.answer({"question": "budget"})
    r.answer({"question": "windows"})
    assert r.builds == 1
    (d / "c.md").write_text("# Zebras\n\nZebras have stripes.\n")
    rep = r.answer({"question": "zebras stripes"})
    assert r.builds == 2 and rep.findings[0].file == "c.md"


def test_paths_never_leave_the_roots(tmp_path):
    d = corpus(tmp_path)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "s.md").write_text("# Password\n\nthe password is hunter2\n")
    (d / "link.md").symlink_to(secret / "s.md")  # a symlink out of the corpus is not followed
    r = RetrieverAdapter("r", docs=str(d))
    assert all(f.file != "link.md" for f in r.answer({"question": "password hunter2"}).findings)
    for bad in (str(secret), str(d / ".." / "secret"), "docs", "/etc"):
        with pytest.raises(ClientInputError, match="outside the retriever's roots|absolute path"):
            r.answer({"question": "password", "docs": bad})
    # a folder under an allowed root may be chosen by the task
    wide = RetrieverAdapter("r", docs=str(d), roots=[str(tmp_path)])
    assert wide.answer({"question": "password hunter2", "docs": str(secret)}).findings[0].file == "s.md"


def test_documents_are_bounded_in_size_and_count(tmp_path):
    d = tmp_path / "many"
    d.mkdir()
    for i in range(5):
        (d / f"d{i}.md").write_text(f"# Doc {i}\n\nkeyword{i} text\n")
    (d / "big.md").write_text("# Big\n\n" + "bigword " * 200)
    r = RetrieverAdapter("r", docs=str(d), limits=RetrieverLimits(max_docs=3, max_doc_bytes=500))
    rep = r.answer({"question": "keyword4 bigword keyword0"})
    files = {f.file for f in rep.findings}
    assert files == {"d0.md"}  # big.md over max_doc_bytes, d3/d4 past max_docs
    assert "skipped 3 document(s)" in rep.summary and "max_doc_bytes" in rep.summary
    with pytest.raises(ClientInputError, match="max_question_chars"):
        RetrieverAdapter("r", docs=str(d), limits=RetrieverLimits(max_question_chars=10)).answer(
            {"question": "a very long question indeed"})


def test_registry_validates_retriever_options(tmp_path):
    d = str(corpus(tmp_path))
    ok = build_adapter("r", AgentSpec(layer="L1", p95_ms=100, tool="retriever", options={"docs": d, "k": 2, "chunk_lines": 8}))
    assert isinstance(ok, RetrieverAdapter) and ok.k == 2
    for options, err in [
        ({}, "options.docs: required"),
        ({"docs": d, "k": 0}, "options.k"),
        ({"docs": d, "overlap": 12}, "options.overlap"),
        ({"docs": d, "max_docs": 0}, "options.max_docs"),
        ({"docs": d, "colour": "red"}, "options.colour: unknown option"),
        ({"docs": str(tmp_path / "nope")}, "options.docs: not a directory"),
        ({"docs": d, "roots": "/"}, "options.roots: expected list of strings"),
    ]:
        with pytest.raises(ValueError, match=err):
            build_adapter("r", AgentSpec(layer="L1", p95_ms=100, tool="retriever", options=options))


async def test_stream_yields_one_final_report(tmp_path):
    r = RetrieverAdapter("r", docs=str(corpus(tmp_path)))
    frags = [f async for f in r.stream(Prompt(task_type="retrieval_qa", content={"question": "budget"}))]
    assert len(frags) == 1 and isinstance(frags[0].content, AgentReport)
    assert frags[0].usage is not None and frags[0].usage.tokens == 0


# ---------------------------------------------------------------- escalation


def _cite(conf: float, file: str = "a.md", start: int = 1) -> AgentFinding:
    return AgentFinding(file=file, start=start, end=start + 3, severity=Severity.INFO, claim="s",
                        confidence=conf, rule=CITATION_RULE)


def test_weak_citations_fires_on_weak_best_citations_without_files():
    weak = {"r1": AgentReport(findings=[_cite(0.3), _cite(0.1, start=20)]),
            "r2": AgentReport(findings=[_cite(0.4)])}
    strong = {"r1": AgentReport(findings=[_cite(0.9), _cite(0.1, start=20)]),
              "r2": AgentReport(findings=[_cite(0.8)])}
    for reports, fires in ((weak, True), (strong, False)):
        result = merge(reports, strategy="union_tiebreak", win_rates={}, costs_usd_micros={}, files=None)
        assert (should_escalate(result, reports, ["weak_citations"], threshold=0.5) == ["weak_citations"]) is fires
    # findings that are not citations keep the old rule: no files, no firing
    plain = {"r1": AgentReport(findings=[AgentFinding(file="a.py", start=1, end=1, severity=Severity.LOW,
                                                      claim="x", confidence=0.1)])}
    result = merge(plain, strategy="union_tiebreak", win_rates={}, costs_usd_micros={}, files=None)
    assert should_escalate(result, plain, ["weak_citations"], threshold=0.5) == []


def test_retrievers_citing_different_places_disagree():
    reports = {"r1": AgentReport(findings=[_cite(0.9, "a.md", 1)]), "r2": AgentReport(findings=[_cite(0.9, "b.md", 1)])}
    result = merge(reports, strategy="union_tiebreak", win_rates={}, costs_usd_micros={}, files=None)
    assert should_escalate(result, reports, ["disagreement"], threshold=0.5) == ["disagreement"]


# ------------------------------------------------------- the example, as a user runs it


def _run(script: str, args: list[str], url: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE / script), *args], check=False, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "ATP_ROUTER_URL": url})


@pytest.fixture
def example_router(tmp_path) -> Iterator[str]:
    """``atp-router --policies examples/retrieval_qa/rib.yaml`` from the repository
    root (no model server: an escalation fails, the retrievers' answer stands)."""
    if not SPECS.is_dir():
        pytest.skip(f"no specs at {SPECS}")
    with router_process(rib_with_root(EXAMPLE / "rib.yaml", tmp_path), tmp_path / "state", cwd=ROOT) as url:
        yield url


def test_ask_prints_answer_snippets_and_cost(example_router, tmp_path):
    r = _run("ask.py", ["What maximum message size should MQTT agents enforce?"], example_router, tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Answer (retriever." in out and "256KB" in out
    first = next(line for line in out.splitlines() if line.strip().startswith("[1] "))
    assert "agent-protocol-2389-mqtt.txt:" in first
    a, b = map(int, first.split("agent-protocol-2389-mqtt.txt:")[1].split()[0].split("-"))
    assert a <= 159 <= b  # the cited lines hold the answer
    assert "cost: tokens=" in out and "usd=" in out


def test_ask_with_docs_relative_to_the_callers_directory(example_router, tmp_path):
    d = corpus(tmp_path)
    r = _run("ask.py", ["--docs", d.name, "--json", "how often should tomatoes be watered"], example_router, tmp_path)
    assert r.returncode == 0, r.stderr
    final = json.loads(r.stdout)
    files = {f["file"] for f in final["result"]["findings"]}
    assert "sub/b.txt" in files
    bad = _run("ask.py", ["--docs", "missing", "x"], example_router, tmp_path)
    assert bad.returncode == 2 and "not a directory" in bad.stderr


def test_evaluate_reports_citation_accuracy(example_router, tmp_path):
    r = _run("evaluate.py", ["-v"], example_router, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("router "))
    top1 = int(line.split("top-1 ")[1].split("/")[0])
    topk = int(line.split("top-5 ")[1].split("/")[0])
    n = sum(1 for x in (EXAMPLE / "questions.jsonl").read_text().splitlines() if x.strip())
    assert n >= 20 and f"/{n} " in line
    # measured 18/23 top-1, 22/23 top-5 (README); a regression below these fails
    assert top1 >= 16 and topk >= 21, line


# ------------------------------------------------- with the model (escalation target)


@pytest.fixture(scope="module")
def llama_url() -> Iterator[str]:
    with start_llama_server(n_ctx=4096) as url:
        yield url


#: Asks of the model test (one, and again only after a synthesis timed out).
_MODEL_TRIES = 4


def _synth_retry(texts: list[str], timed_out: bool) -> tuple[bool, float]:
    """Whether to ask again, and after how many seconds: the uncertainties (or
    ask.py's printed answer) say the escalation to synth.local ran past its
    ``timeout_ms`` (ETIMEOUT) — or, once that happened (``timed_out``), that the
    breaker it opened is still open (EAGENTDOWN "circuit open (next probe in N
    ms)": asked again after N ms). Any other failure is the test's failure,
    never retried."""
    failed = f"{NEXT_HOP_FAILED}synth.local: "
    if any(failed + str(ErrorCode.ETIMEOUT) in t for t in texts):
        return True, 0.0
    probe = next((m for t in texts if (m := re.search(re.escape(failed) + r"EAGENTDOWN: circuit open "
                                                       r"\(next probe in (\d+) ms\)", t))), None)
    if timed_out and probe is not None:
        return True, int(probe.group(1)) / 1000 + 0.2
    return False, 0.0


@pytest.mark.model
def test_weak_question_escalates_to_the_model_with_the_snippets(llama_url, tmp_path):
    if not SPECS.is_dir():
        pytest.skip(f"no specs at {SPECS}")
    rib = rib_with_root(EXAMPLE / "rib.yaml", tmp_path).read_text()
    assert "http://127.0.0.1:8080/v1" in rib
    (tmp_path / "rib.yaml").write_text(rib.replace("http://127.0.0.1:8080/v1", llama_url))
    question = "Which colour are the routers painted in the data centre?"
    with router_process(tmp_path / "rib.yaml", tmp_path / "state", cwd=ROOT) as url:
        # Few of these terms occur together anywhere: weak citations, escalated.
        # The model answers within synth.local's timeout_ms (120 s) on any idle
        # machine, not always on a CPU-starved one: a run whose synthesis timed
        # out (and only that) is asked again (issue 20: retry the provocation).
        timed_out = False
        for _ in range(_MODEL_TRIES):
            r = _run("ask.py", ["--json", question], url, tmp_path)
            assert r.returncode == 0, r.stderr
            final = json.loads(r.stdout)
            cons = final["result"]["consensus"]
            assert any(u.startswith("escalated on ") and "weak_citations" in u for u in cons["uncertainties"]), cons
            synth = [a for a in final["result"]["answers"] if a["agent"] == "synth.local"]
            again, after = _synth_retry(cons["uncertainties"], timed_out)
            if synth or not again:
                break
            timed_out = True
            time.sleep(after)
        assert synth and synth[0]["text"].strip(), cons
        assert final["telemetry"]["tokens"] > 0  # the model's tokens are charged and reported
        # (A breaker the timeouts above opened may still be open: timed_out carries on.)
        for _ in range(_MODEL_TRIES):
            human = _run("ask.py", [question], url, tmp_path)
            again, after = _synth_retry([human.stdout], timed_out)
            if "Answer (synth.local, escalated on" in human.stdout or not again:
                break
            timed_out = True
            time.sleep(after)
        assert "Answer (synth.local, escalated on" in human.stdout and "cost: tokens=" in human.stdout, human.stdout
    assert MODEL_ALIAS in rib


# ------------------------------------- the escalation gets the snippets (evidence: true)


async def test_escalation_with_evidence_hands_the_snippets_to_the_synthesiser(nursery, tmp_path, scripted):
    """A real router: retriever → weak citations → the scripted synthesiser gets
    the retriever's citations as ``content["evidence"]``; without ``evidence``
    it gets the task alone."""
    import atp

    from atp_router.adapters.testing import ScriptedAdapter
    from tests.helpers import start_router_on
    from tests.unit.test_router_dispatch import scripted_agent

    d = corpus(tmp_path)
    for evidence in (True, False):
        scripted["synth"] = synth = ScriptedAdapter.returning("synth", summary="Water daily [sub/b.txt:3-3].")
        rib = {"agents": {"retr": {"layer": "L1", "p95_ms": 50, "tool": "retriever",
                                   "options": {"docs": str(d), "min_score": 1000.0}},
                          "synth": scripted_agent()},
               "policies": [{"name": "qa", "match": {"task_type": "retrieval_qa"}, "fanout": ["retr"],
                             "escalation": {"on": ["weak_citations"], "to": "synth", "threshold": 0.5,
                                            "evidence": evidence}}]}
        sub = tmp_path / f"run-{evidence}"
        sub.mkdir()
        env = await start_router_on(nursery, sub, rib)
        async with atp.Client(env.url) as c:
            _, st = await c.open_stream(task={"task_type": "retrieval_qa"},
                                        content={"question": "water tomatoes daily"})
            final = await c.result(st)
        assert "escalated on weak_citations" in final["result"]["consensus"]["uncertainties"]
        assert [a["agent"] for a in final["result"]["answers"]] == ["retr", "synth"]
        content = synth.calls[0].content
        assert content["question"] == "water tomatoes daily"
        if evidence:
            [ev] = content["evidence"]
            assert ev["agent"] == "retr" and "[sub/b.txt:3-3]" in ev["summary"]
            assert ev["findings"][0] | {"confidence": 0} == {"file": "sub/b.txt", "start": 1, "end": 3,
                                                              "claim": "Plain text notes. Gardening tips: water tomatoes daily.",
                                                              "confidence": 0}
        else:
            assert "evidence" not in content
