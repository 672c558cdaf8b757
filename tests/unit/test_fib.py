"""Policy matchers and the FIB (spec §6.2): first-match policy selection,
weighted-ECMP ordering, top-K, health exclusion, determinism."""

from __future__ import annotations

import operator
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from atp_router.policy.fib import FIT_FLOOR, NextHop, Route, compile_fib
from atp_router.policy.health import Health
from atp_router.policy.loader import load_rib, load_rib_text
from atp_router.policy.match import Compare, compile_match, compile_value
from atp_router.policy.rib import AgentSpec, PolicySpec, Rib, SpecError
from atp_router.wire.errors import AgentError, ErrorCode, PolicyError
from atp_router.wire.frame import QoS, RouteEntry

CASES = Path(__file__).parent / "policy_cases"
DEFAULT = Path(__file__).parents[2] / "policies" / "default.yaml"

OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne}


# -- matchers ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "value", "expected"),
    [
        (">150", 151, True),
        (">150", 150, False),
        (">150", "151", True),  # numeric string
        (">150", " 151 ", True),
        (">150", "lots", False),
        (">150", None, False),
        (">150", [200], False),  # a list is not a number
        (">0", True, False),  # a bool is not a number
        (">=1_000", 1000, True),
        ("<= 200", 200.0, True),
        ("<-1.5", -2, True),
        ("==3", 3.0, True),
        ("!=3", 4, True),
        (">1e3", 1001, True),
        ("code_review", "code_review", True),
        ("code_review", "summarize_repo", False),
        ("py", ["py", "ts"], True),  # membership when the meta value is a list
        ("go", ["py", "ts"], False),
        (3, 3, True),
        (3, 3.0, True),
        (True, True, True),
        (True, 1, False),  # bool equality is not int equality
        (1, True, False),
        (3, "3", False),  # equality does not coerce types
        (["py", "go"], "go", True),  # any of
        (["py", "go"], ["ts", "go"], True),
        (["py", "go"], ["ts"], False),
        (["<10", ">1000"], 5, True),
        (["<10", ">1000"], 500, False),
        (["<10", "huge"], "huge", True),
    ],
)
def test_matcher_table(pattern, value, expected):
    assert compile_value(pattern)(value) is expected


@pytest.mark.parametrize("pattern", [">>1", "=<5", ">", ">= ", "!5", "=5", "<1.", ">1,000", ">0x10", ">_1", "> 1_"])
def test_malformed_comparisons_refused(pattern):
    with pytest.raises(SpecError) as info:
        compile_value(pattern)
    assert info.value.reason == f"expected a comparison like '>150', got {pattern!r}"


def test_compiled_comparison_holds_parsed_number():
    m = compile_value(">=1_200_000")
    assert isinstance(m, Compare) and m.number == 1_200_000 and isinstance(m.number, int)
    assert compile_value("<2.5").number == 2.5  # type: ignore[union-attr]


def test_compiled_match_is_and_and_missing_key_fails():
    m = compile_match({"task_type": "code_review", "diff_loc": ">150"})
    assert m({"task_type": "code_review", "diff_loc": 151, "extra": 1})
    assert not m({"task_type": "code_review", "diff_loc": 150})
    assert not m({"task_type": "code_review"})  # missing key
    assert compile_match({})({})  # the empty match is a default route
    with pytest.raises(SpecError) as info:
        compile_match({"languages": ["py", "!py"]})
    assert info.value.field == "languages[1]"


numbers = st.one_of(
    st.integers(min_value=-(10**12), max_value=10**12),
    st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12),
)


@given(op=st.sampled_from(sorted(OPS)), threshold=numbers, value=numbers, as_text=st.booleans(), spaced=st.booleans())
def test_comparison_agrees_with_python_operators(op, threshold, value, as_text, spaced):
    pattern = f"{op}{' ' if spaced else ''}{threshold!r}"
    meta_value = repr(value) if as_text else value
    assert compile_value(pattern)(meta_value) is OPS[op](value, threshold)


@given(op=st.sampled_from(sorted(OPS)), threshold=st.integers(min_value=0, max_value=10**15), value=st.integers())
def test_comparison_with_underscore_separators(op, threshold, value):
    assert compile_value(f"{op}{threshold:_}")(value) is OPS[op](value, threshold)


@given(text=st.text(alphabet="<>=!0123456789._eE+- x", min_size=1, max_size=8).filter(lambda s: s[0] in "<>=!"))
def test_operator_strings_either_compile_or_are_refused(text):
    try:
        m = compile_value(text)
    except SpecError as e:
        assert e.reason.startswith("expected a comparison")
    else:
        assert isinstance(m, Compare)


# -- FIB -----------------------------------------------------------------------


def score(fit, win30d, usd_per_mtok, p95_ms, error_rate=0.0):
    """The documented weighted-ECMP score (spec §6.2), written out."""
    return max(fit, FIT_FLOOR) * win30d * (1 / (1 + usd_per_mtok)) * (1 / (1 + p95_ms / 1000)) * (1 - error_rate)


@pytest.fixture
def spec_fib():
    return compile_fib(load_rib(CASES / "spec_6_1.yaml"), version=7)


def test_spec_6_1_route(spec_fib):
    route = spec_fib.lookup({"task_type": "code_review", "diff_loc": 151, "languages": ["py"]})
    assert route.policy == "policy[0]"
    assert [h.agent for h in route.next_hops] == ["reviewer.gemini", "summarizer.local"]
    gemini, summarizer = route.next_hops
    # gemini-pro lists code_review (fit 1); qwen2.5-7b does not (fit floor).
    assert gemini.weight == pytest.approx(score(1.0, 0.82, 3.0, 1200))
    assert summarizer.weight == pytest.approx(score(0.0, 0.61, 0.0, 350))
    assert gemini == NextHop(
        agent="reviewer.gemini",
        weight=gemini.weight,
        qos=QoS.GOLD,
        timeout_ms=60000,
        model="gemini-pro",
        tool=None,
        in_usd_micros_per_token=3.0,
        out_usd_micros_per_token=3.0,
    )
    assert route.escalation is not None and route.escalation.to == "reviewer.gpt5"
    assert route.escalation_hop is not None and route.escalation_hop.agent == "reviewer.gpt5"
    assert route.escalation_hop.in_usd_micros_per_token == 4.0
    assert route.budget is not None and (route.budget.usd, route.budget.tokens) == (2.5, 800000)
    assert (route.window, route.consensus, route.qos, route.deadline_ms) == (None, "union_tiebreak", None, 120000)
    assert spec_fib.version == 7


def test_no_route_raises_eagentdown(spec_fib):
    with pytest.raises(AgentError) as info:
        spec_fib.lookup({"task_type": "code_review", "diff_loc": 150})
    assert info.value.code is ErrorCode.EAGENTDOWN
    assert info.value.reason == "no route for task_type='code_review'"
    with pytest.raises(AgentError) as info:
        spec_fib.lookup({})
    assert info.value.reason == "no route for task_type=None"


def test_first_match_wins_in_rib_order():
    fib = compile_fib(load_rib(DEFAULT), version=1)
    assert fib.policy_names == ["code_review.large", "code_review"]
    assert fib.lookup({"task_type": "code_review", "diff_loc": 401}).policy == "code_review.large"
    assert fib.lookup({"task_type": "code_review", "diff_loc": "900"}).policy == "code_review.large"
    assert fib.lookup({"task_type": "code_review", "diff_loc": 400}).policy == "code_review"
    # No diff_loc: the large-diff policy cannot match, the general one does.
    route = fib.lookup({"task_type": "code_review"})
    assert route.policy == "code_review"
    assert route.window is not None and route.window.max_parallel == 4
    with pytest.raises(AgentError):
        fib.lookup({"task_type": "summarize_repo"})


def test_default_rib_orders_by_latency_then_strengths_wanted():
    fib = compile_fib(load_rib(DEFAULT), version=1)
    route = fib.lookup({"task_type": "code_review"})
    assert [(h.agent, h.tool) for h in route.next_hops] == [
        ("lint.ruff", "ruff"), ("sec.bandit", "bandit"), ("types.mypy", "mypy"), ("rules.semgrep", "semgrep")]
    assert route.next_hops[0].weight == pytest.approx(score(1.0, 0.5, 0, 200))
    assert route.next_hops[3].weight == pytest.approx(score(1.0, 0.5, 0, 3500))
    # Asking for security halves ruff's and mypy's fit (neither lists it), so bandit
    # leads; semgrep has the fit but its p95 keeps it last.
    route = fib.lookup({"task_type": "code_review", "strengths_wanted": ["security"]})
    assert [h.agent for h in route.next_hops] == ["sec.bandit", "lint.ruff", "types.mypy", "rules.semgrep"]
    assert route.next_hops[1].weight == pytest.approx(score(0.5, 0.5, 0, 200))


RIB3 = """
models:
  cheap: { provider: ollama, ctx: 8k, cost: 0, strengths: [code_review] }
  dear:  { provider: openai, ctx: 128k, cost_in: 2.0, cost_out: 8.0, strengths: [code_review, security] }
agents:
  a.fast:  { layer: L2, model: cheap, p95_ms: 100, win30d: 0.6 }
  b.dear:  { layer: L3, model: dear, p95_ms: 100, win30d: 0.9, qos: gold, timeout_ms: 30000 }
  c.tool:  { layer: L1, tool: ruff, p95_ms: 5000, win30d: 0.6, strengths: [code_review] }
  d.twin:  { layer: L2, model: cheap, p95_ms: 100, win30d: 0.6 }
  e.esc:   { layer: L3, model: dear, p95_ms: 500, win30d: 0.9 }
policies:
  - name: top2
    match: { task_type: code_review }
    fanout: [c.tool, b.dear, a.fast]
    fanout_k: 2
    escalation: { on: [low_conf], to: e.esc, threshold: 0.7 }
    qos: gold
  - name: twins
    match: { task_type: [twins, pair] }
    fanout: [d.twin, a.fast]
  - name: anything
    match: {}
    fanout: [c.tool]
"""


@pytest.fixture
def fib3():
    return compile_fib(load_rib_text(RIB3), version=3)


def test_weights_and_top_k(fib3):
    meta = {"task_type": "code_review"}
    route = fib3.lookup(meta)
    expected = {
        "a.fast": score(1.0, 0.6, 0.0, 100),
        "b.dear": score(1.0, 0.9, 5.0, 100),  # blended cost = mean of in and out
        "c.tool": score(1.0, 0.6, 0.0, 5000),
    }
    assert expected["c.tool"] < expected["b.dear"]
    assert [h.agent for h in route.next_hops] == ["a.fast", "b.dear"]  # c.tool cut by fanout_k=2
    assert [h.weight for h in route.next_hops] == pytest.approx([expected["a.fast"], expected["b.dear"]])
    dear = route.next_hops[1]
    assert (dear.qos, dear.timeout_ms, dear.in_usd_micros_per_token, dear.out_usd_micros_per_token) == (
        QoS.GOLD,
        30000,
        2.0,
        8.0,
    )
    assert route.qos is QoS.GOLD
    assert route.escalation is not None and route.escalation.threshold == 0.7


def test_health_excludes_down_and_top_k_fails_over(fib3):
    meta = {"task_type": "code_review"}
    route = fib3.lookup(meta, health={"a.fast": Health(up=False)})
    assert [h.agent for h in route.next_hops] == ["b.dear", "c.tool"]


def test_health_error_rate_and_live_latency(fib3):
    meta = {"task_type": "code_review"}
    route = fib3.lookup(meta, health={"a.fast": Health(error_rate=0.8)})
    assert [h.agent for h in route.next_hops] == ["b.dear", "a.fast"]
    assert route.next_hops[1].weight == pytest.approx(score(1.0, 0.6, 0.0, 100, error_rate=0.8))
    # Live p95 replaces the RIB's: a.fast observed at 50 s drops below c.tool.
    route = fib3.lookup(meta, health={"a.fast": Health(p95_ms=50_000)})
    assert [h.agent for h in route.next_hops] == ["b.dear", "c.tool"]
    # An out-of-range error rate is clamped, never a negative weight.
    route = fib3.lookup(meta, health={"c.tool": Health(error_rate=7.0)})
    assert all(h.weight >= 0 for h in route.next_hops)


def test_all_next_hops_down(fib3):
    down = Health(up=False)
    with pytest.raises(AgentError) as info:
        fib3.lookup({"task_type": "anything"}, health={"c.tool": down})
    assert info.value.code is ErrorCode.EAGENTDOWN
    assert info.value.reason == "no healthy next-hop for policy anything"


def test_escalation_hop_is_reported_even_when_down(fib3):
    route = fib3.lookup({"task_type": "code_review"}, health={"e.esc": Health(up=False)})
    assert route.escalation_hop is not None
    assert (route.escalation_hop.agent, route.escalation_hop.weight) == ("e.esc", 0.0)


def test_ties_broken_by_name(fib3):
    route = fib3.lookup({"task_type": "twins"})
    assert route.next_hops[0].weight == route.next_hops[1].weight
    assert [h.agent for h in route.next_hops] == ["a.fast", "d.twin"]  # fanout lists d.twin first


healths = st.dictionaries(
    st.sampled_from(["a.fast", "b.dear", "c.tool", "d.twin", "e.esc"]),
    st.builds(
        Health,
        p95_ms=st.floats(min_value=0, max_value=1e5),
        error_rate=st.floats(min_value=0, max_value=1),
        up=st.booleans(),
    ),
)


@given(
    health=healths,
    task_type=st.sampled_from(["code_review", "twins", "pair", "other"]),
    wanted=st.lists(st.sampled_from(["security", "code_review", "lint"]), max_size=3),
)
def test_lookup_is_deterministic(health, task_type, wanted):
    fib = compile_fib(load_rib_text(RIB3), version=1)
    meta = {"task_type": task_type, "strengths_wanted": wanted}

    def outcome(h):
        try:
            return msgspec.to_builtins(fib.lookup(meta, health=h))
        except AgentError as e:
            return e.reason

    first = outcome(health)
    assert outcome(dict(reversed(list(health.items())))) == first
    assert outcome(health) == first
    if isinstance(first, dict):
        weights = [h["weight"] for h in first["next_hops"]]
        assert weights == sorted(weights, reverse=True)
        assert all(health.get(h["agent"], Health()).up for h in first["next_hops"])


def test_routes_for_route_update(fib3, spec_fib):
    routes = fib3.routes()
    assert [(r.task_type, r.next_hops) for r in routes] == [
        ("code_review", ["a.fast", "b.dear"]),
        ("twins", ["a.fast", "d.twin"]),
        ("pair", ["a.fast", "d.twin"]),
        ("*", ["c.tool"]),
    ]
    assert routes[0].weights == pytest.approx([score(1.0, 0.6, 0.0, 100), score(1.0, 0.9, 5.0, 100)])
    assert all(isinstance(r, RouteEntry) for r in routes)
    update = spec_fib.route_update(previous=fib3)
    assert update.version == 7
    assert [r.task_type for r in update.routes] == ["code_review", "summarize_repo"]
    assert update.withdrawn == ["*", "pair", "twins"]
    assert fib3.route_update().withdrawn == []


def test_compile_fib_checks_a_rib_built_in_code():
    agents = {"lint.ruff": AgentSpec(layer="L1", tool="ruff", p95_ms=1)}
    rib = Rib(agents=agents, policies=[PolicySpec(match={"x": ">>2"}, fanout=["lint.ruff"])])
    with pytest.raises(PolicyError) as info:
        compile_fib(rib, version=1)
    assert (info.value.file, info.value.key) == ("<rib>", "policies[0].match.x")
    rib = Rib(agents=agents, policies=[PolicySpec(match={}, fanout=["lint.ghost"])])
    with pytest.raises(PolicyError) as info:
        compile_fib(rib, version=1)
    assert info.value.key == "policies[0].fanout[0]"
    with pytest.raises(PolicyError) as info:
        compile_fib(Rib(agents=agents), version=1)
    assert info.value.key == "policies"
    fib = compile_fib(Rib(agents=agents, policies=[PolicySpec(match={}, fanout=["lint.ruff"])]), version=2)
    assert fib.lookup({}).policy == "policy[0]"


def test_route_is_frozen(spec_fib):
    route = spec_fib.lookup({"task_type": "summarize_repo"})
    assert isinstance(route, Route)
    with pytest.raises(AttributeError):
        route.policy = "other"  # type: ignore[misc]


# -- data scope (spec §11) -----------------------------------------------------

SCOPED = """
agents:
  m.public:  {layer: L1, p95_ms: 100, tool: ruff, data_scope: [public]}
  m.secrets: {layer: L1, p95_ms: 200, tool: ruff, data_scope: [secrets, acp.policy:P001]}
  m.any:     {layer: L1, p95_ms: 300, tool: ruff}
policies:
  - {name: p, match: {task_type: code_review}, fanout: [m.public, m.secrets, m.any]}
  - {name: only_public, match: {task_type: public_review}, fanout: [m.public]}
"""


def test_covered_labels_exclude_no_next_hop_and_opaque_labels_fail_closed():
    """Labels a detector covers (secrets, personal data; redact or forbidden) keep
    every candidate: the dispatcher's guard redacts or refuses per agent. An opaque
    label (no detector) keeps only the agents cleared for it — and those without
    ``data_scope`` — and refuses with ESEC when none is."""
    fib = compile_fib(load_rib_text(SCOPED), version=1)
    hops = lambda meta: [h.agent for h in fib.lookup(meta).next_hops]
    everyone = ["m.public", "m.secrets", "m.any"]
    for scope in (["no_secrets"], ["secrets:forbidden", "us_personal_data:forbidden"], "pii", []):
        assert hops({"task_type": "code_review", "data_scope": scope}) == everyone, scope
    assert hops({"task_type": "code_review", "data_scope": ["acp.policy:P001", "no_secrets"]}) == ["m.secrets", "m.any"]
    assert hops({"task_type": "code_review", "data_scope": "public:forbidden"}) == ["m.public", "m.any"]
    assert hops({"task_type": "public_review", "data_scope": ["no_secrets", "pii:forbidden"]}) == ["m.public"]
    with pytest.raises(AgentError) as ei:
        fib.lookup({"task_type": "public_review", "data_scope": ["acp.policy:P001", "no_secrets"]})
    assert ei.value.code is ErrorCode.ESEC
    assert "data_scope ['acp.policy:P001'] is not cleared for any next-hop of policy only_public" in ei.value.reason
    # Reroutes follow the same rule, and the clearance the guard needs is the FIB's.
    assert fib.next_hop("m.public", {"data_scope": ["acp.policy:P001"]}) is None
    assert fib.next_hop("m.public", {"data_scope": ["no_secrets"]}) is not None
    assert fib.clearance("m.secrets") == {"secrets", "acp.policy:P001"}
    assert fib.clearance("m.any") is None and fib.clearance("nobody") is None
