"""RIB loading (spec §6.1, §23): YAML → normalized Structs, and every refusal
with its exact file and dotted key."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import msgspec
import pytest

from atp_router.policy.loader import load_rib, load_rib_text
from atp_router.policy.rib import AgentSpec, ModelSpec, PolicySpec, Rib, parse_tokens
from atp_router.wire.errors import ErrorCode, PolicyError

CASES = Path(__file__).parent / "policy_cases"
DEFAULT = Path(__file__).parents[2] / "policies" / "default.yaml"

KI = 1024
MI = 1024 * 1024


def _model(provider, ctx, cost, speed, strengths, model):
    return {
        "provider": provider,
        "ctx": ctx,
        "cost": cost,
        "cost_in": None,
        "cost_out": None,
        "speed": speed,
        "strengths": strengths,
        "base_url": None,
        "model": model,
        "api_key_env": None,
        "max_out_tokens": 512,
        "temperature": 0.0,
        "tls": None,
        "slots": None,
    }


def _agent(layer, model, qos, p95_ms, win30d):
    return {
        "layer": layer,
        "p95_ms": p95_ms,
        "model": model,
        "tool": None,
        "remote": None,
        "qos": qos,
        "win30d": win30d,
        "strengths": [],
        "timeout_ms": 60000,
        "scope": "changed",
        "options": {},
        "window": None,
        "fallback": None,
        "data_scope": None,
        "calibration": None,
    }


def _policy(name, match, fanout, escalation, budget):
    if escalation is not None:
        escalation = {"evidence": False, **escalation}  # the default: no first-stage evidence handed on
    return {
        "match": match,
        "fanout": fanout,
        "name": name,
        "fanout_k": None,
        "escalation": escalation,
        "budget": budget,
        "window": None,
        "consensus": "union_tiebreak",
        "quorum": None,
        "qos": None,
        "deadline_ms": 120000,
        "bandit": None,
        "shadow": None,
        "cache": None,
    }


SPEC_6_1_MODELS = {
    "qwen2.5-7b": _model("ollama", 32 * KI, 0.0, "fast", ["summarize", "classify", "quick_review"], "qwen2.5-7b"),
    "llama3.1-8b": _model("ollama", 32 * KI, 0.0, "fast", ["summarize", "draft", "extract"], "llama3.1-8b"),
    "gemini-pro": _model("google", 2 * MI, 3.0, "medium", ["long_context", "code_review", "reasoning"], "gemini-pro"),
    "gpt5": _model("openai", 1 * MI, 4.0, "medium", ["complex_refactor", "test_gen", "planning"], "gpt5"),
}
SPEC_6_1_AGENTS = {
    "summarizer.local": _agent("L2", "qwen2.5-7b", "bronze", 350.0, 0.61),
    "reviewer.gemini": _agent("L3", "gemini-pro", "gold", 1200.0, 0.82),
    "reviewer.gpt5": _agent("L3", "gpt5", "gold", 1400.0, 0.86),
}


def test_spec_6_1_snapshot():
    rib = load_rib(CASES / "spec_6_1.yaml")
    assert msgspec.to_builtins(rib) == {
        "models": SPEC_6_1_MODELS,
        "agents": SPEC_6_1_AGENTS,
        "policies": [
            _policy(
                "policy[0]",
                {"task_type": "code_review", "diff_loc": ">150"},
                ["summarizer.local", "reviewer.gemini"],
                {"on": ["low_conf", "test_fail", "disagree_high"], "to": "reviewer.gpt5", "threshold": 0.5},
                {"usd": 2.5, "tokens": 800000},
            ),
            _policy(
                "policy[1]",
                {"task_type": "summarize_repo"},
                ["summarizer.local"],
                None,
                {"usd": 0.1, "tokens": 60000},
            ),
        ],
        "clients": {},
    }


def test_spec_23_1_snapshot_directory_merge():
    rib = load_rib(CASES / "spec_23_1")
    assert msgspec.to_builtins(rib.models) == SPEC_6_1_MODELS
    assert msgspec.to_builtins(rib.agents) == SPEC_6_1_AGENTS
    assert msgspec.to_builtins(rib.policies) == [
        _policy(
            "policy[0]",
            {"task_type": "code_review", "diff_loc": ">200", "repo_risk": "high"},
            ["summarizer.local", "reviewer.gemini"],
            {"on": ["low_conf", "test_fail"], "to": "reviewer.gpt5", "threshold": 0.5},
            {"usd": 3.0, "tokens": 1_200_000},
        ),
        _policy(
            "policy[1]",
            {"task_type": "code_review", "diff_loc": "<=200"},
            ["summarizer.local"],
            {"on": ["low_conf"], "to": "reviewer.gemini", "threshold": 0.5},
            {"usd": 0.25, "tokens": 120_000},
        ),
    ]


def test_spec_23_2_snapshot():
    rib = load_rib(CASES / "spec_23_2")
    assert sorted(rib.agents) == ["retriever.local", "synthesizer.gemini", "synthesizer.local"]
    assert msgspec.to_builtins(rib.policies) == [
        _policy(
            "policy[0]",
            {"task_type": "retrieval_qa"},
            ["retriever.local", "synthesizer.local"],
            {"on": ["weak_citations", "disagreement"], "to": "synthesizer.gemini", "threshold": 0.5},
            {"usd": 0.5, "tokens": 200_000},
        )
    ]


def test_default_yaml_snapshot():
    rib = load_rib(DEFAULT)
    assert rib.models == {}
    assert {n: (a.layer, a.tool, a.model) for n, a in rib.agents.items()} == {
        "lint.ruff": ("L1", "ruff", None),
        "sec.bandit": ("L1", "bandit", None),
        "types.mypy": ("L1", "mypy", None),
        "rules.semgrep": ("L1", "semgrep", None),
    }
    analysers = ["lint.ruff", "sec.bandit", "types.mypy", "rules.semgrep"]
    assert msgspec.to_builtins(rib.policies) == [
        {
            "match": {"task_type": "code_review", "diff_loc": ">400"},
            "fanout": analysers,
            "name": "code_review.large",
            "fanout_k": None,
            "escalation": None,
            "budget": {"usd": 0.05, "tokens": 400_000},
            "window": {"max_parallel": 2, "max_tokens": 400_000, "max_usd_micros": 50_000},
            "consensus": "union_tiebreak",
            "quorum": None,
            "qos": None,
            "deadline_ms": 300_000,
            "bandit": None,
            "shadow": None,
            "cache": None,
        },
        {
            "match": {"task_type": "code_review"},
            "fanout": analysers,
            "name": "code_review",
            "fanout_k": None,
            "escalation": None,
            "budget": {"usd": 0.05, "tokens": 200_000},
            "window": {"max_parallel": 4, "max_tokens": 200_000, "max_usd_micros": 50_000},
            "consensus": "union_tiebreak",
            "quorum": None,
            "qos": None,
            "deadline_ms": 120_000,
            "bandit": None,
            "shadow": None,
            "cache": None,
        },
    ]


def test_default_yaml_commented_openai_compat_example_loads(tmp_path):
    """The prose in default.yaml tells operators how to add a model reviewer;
    uncommented, that block must load next to the default RIB."""
    text = DEFAULT.read_text()
    block = re.search(r"# BEGIN openai_compat example\n(.*?)# END openai_compat example", text, re.DOTALL)
    assert block is not None
    example = "".join(line[2:] + "\n" for line in block.group(1).splitlines())
    shutil.copy(DEFAULT, tmp_path / "00_default.yaml")
    (tmp_path / "10_local_model.yaml").write_text(
        example
        + "policies:\n"
        + "  - match: { task_type: code_review }\n"
        + "    fanout: [lint.ruff]\n"
        + "    escalation: { on: [low_conf, no_findings], to: reviewer.local }\n"
    )
    rib = load_rib(tmp_path)
    model = rib.models["smollm2-135m"]
    assert (model.provider, model.base_url, model.model, model.api_key_env, model.ctx) == (
        "openai_compat",
        "http://127.0.0.1:8080/v1",
        "smollm2-135m-instruct",
        "LOCAL_MODEL_KEY",
        8 * KI,
    )
    assert rib.agents["reviewer.local"].model == "smollm2-135m"
    assert [p.name for p in rib.policies] == ["code_review.large", "code_review", "policy[2]"]


# -- refusals ------------------------------------------------------------------


def _detail(err: PolicyError) -> str:
    """The reason without the ``<file>: <key>: `` prefix PolicyError adds."""
    prefix = f"{err.file}: {err.key}: "
    assert err.reason.startswith(prefix)
    return err.reason[len(prefix) :]


def _expectation(path: Path) -> tuple[str, str]:
    head = dict(line[2:].split(": ", 1) for line in path.read_text().splitlines()[:2])
    return head["expect-key"], head["expect-reason"]


BAD = sorted((CASES / "bad").glob("*.yaml"))


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_policy_refused_with_exact_key(path):
    key, reason = _expectation(path)
    with pytest.raises(PolicyError) as info:
        load_rib(path)
    err = info.value
    assert (err.file, err.key) == (str(path), key)
    assert reason in _detail(err)
    assert err.code is ErrorCode.EPROTO
    assert str(err) == f"EPROTO: {err.reason}"


def test_bad_cases_cover_every_error_class():
    assert len(BAD) >= 30


def test_duplicate_agent_across_files_names_both_files():
    d = CASES / "bad_dirs" / "duplicate_agent"
    with pytest.raises(PolicyError) as info:
        load_rib(d)
    assert (info.value.file, info.value.key) == (str(d / "b.yaml"), "agents.sec.bandit")
    assert _detail(info.value) == f"duplicate agent 'sec.bandit' (also defined in {d / 'a.yaml'})"


def test_cross_file_reference_error_points_at_policy_in_its_file():
    d = CASES / "bad_dirs" / "cross_file_ref"
    with pytest.raises(PolicyError) as info:
        load_rib(d)
    assert (info.value.file, info.value.key) == (str(d / "b.yaml"), "policies[2].fanout[0]")
    assert _detail(info.value) == "unknown agent 'sec.semgrep' (known: lint.ruff, sec.bandit)"


def test_missing_path_and_empty_directory(tmp_path):
    with pytest.raises(PolicyError) as info:
        load_rib(tmp_path / "nope.yaml")
    assert (info.value.key, _detail(info.value)) == ("$", "no such file or directory")
    with pytest.raises(PolicyError) as info:
        load_rib(tmp_path)
    assert (info.value.file, _detail(info.value)) == (str(tmp_path), "no *.yaml or *.yml files in directory")


def test_directory_without_policies_is_refused_at_the_directory(tmp_path):
    (tmp_path / "a.yaml").write_text("agents:\n  lint.ruff: { layer: L1, tool: ruff, p95_ms: 1 }\n")
    with pytest.raises(PolicyError) as info:
        load_rib(tmp_path)
    assert (info.value.file, info.value.key) == (str(tmp_path), "policies")


def test_directory_order_yml_and_dotfiles(tmp_path):
    (tmp_path / "b.yml").write_text("policies:\n  - { name: second, match: {}, fanout: [lint.ruff] }\n")
    (tmp_path / "a.yaml").write_text(
        "agents:\n  lint.ruff: { layer: L1, tool: ruff, p95_ms: 1 }\n"
        "policies:\n  - { name: first, match: { task_type: x }, fanout: [lint.ruff] }\n"
    )
    (tmp_path / ".#a.yaml").write_text("not: [valid")  # an editor's lock file
    (tmp_path / "notes.txt").write_text("ignored")
    rib = load_rib(tmp_path)
    assert [p.name for p in rib.policies] == ["first", "second"]


def test_alias_bomb_refused():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    with pytest.raises(PolicyError) as info:
        load_rib_text("\n".join(lines) + "\n")
    assert info.value.key == "$"
    assert "document too large" in _detail(info.value)


# -- text loading, dialect, purity ---------------------------------------------


def test_load_rib_text_equals_file_and_names_the_source():
    path = CASES / "spec_6_1.yaml"
    assert load_rib_text(path.read_text()) == load_rib(path)
    with pytest.raises(PolicyError) as info:
        load_rib_text("policies: 3\n", file="POST /v1/policies/reload")
    assert (info.value.file, info.value.key) == ("POST /v1/policies/reload", "policies")


def test_json_body_loads_like_yaml():
    rib = load_rib(CASES / "spec_6_1.yaml")
    assert load_rib_text(msgspec.json.encode(rib).decode()) == rib


def test_yaml_dialect_booleans_ints_floats():
    rib = load_rib_text(
        """
agents:
  a: { layer: L1, tool: ruff, p95_ms: 1.5e2, options: { fix: yes, strict: true, when: 2024-01-01, n: 0x10 } }
  b: { layer: L1, tool: bandit, p95_ms: 1 }
policies:
  - match: { flag: on, tests: false }
    fanout: [a]
    escalation:
      on: [low_conf]
      to: b
    budget: { usd: 1e-3, tokens: 1_200_000 }
"""
    )
    a = rib.agents["a"]
    assert a.p95_ms == 150.0
    assert a.options == {"fix": "yes", "strict": True, "when": "2024-01-01", "n": 16}
    p = rib.policies[0]
    assert p.match == {"flag": "on", "tests": False}
    assert p.escalation is not None and p.escalation.on == ["low_conf"]
    assert p.budget is not None and (p.budget.usd, p.budget.tokens) == (0.001, 1_200_000)


def test_refused_reload_leaves_loaded_rib_untouched():
    good = load_rib(DEFAULT)
    before = msgspec.to_builtins(good)
    with pytest.raises(PolicyError):
        load_rib(CASES / "bad" / "unknown_fanout_agent.yaml")
    assert msgspec.to_builtins(good) == before
    assert load_rib(DEFAULT) == good


def test_rib_round_trips_through_builtins_and_has_a_json_schema():
    rib = load_rib(CASES / "spec_23_1")
    assert msgspec.convert(msgspec.to_builtins(rib), Rib) == rib
    schema = msgspec.json.schema(Rib)
    defs = schema["$defs"]
    assert set(defs["ModelSpec"]["properties"]["provider"]["enum"]) == {"openai", "openai_compat", "ollama", "google"}
    assert set(defs["Rib"]["properties"]) == {"models", "agents", "policies", "clients"}


@pytest.mark.parametrize(
    ("value", "tokens"),
    [
        (8192, 8192),
        ("32k", 32 * KI),
        ("32K", 32 * KI),
        ("2M", 2 * MI),
        ("1.5k", 1536),
        ("128_000", 128_000),
        (" 4k ", 4 * KI),
        ("0", 0),
    ],
)
def test_parse_tokens(value, tokens):
    assert parse_tokens(value) == tokens


@pytest.mark.parametrize("value", ["2G", "k", "", "-1", "1e3", "32 kb", -5, True])
def test_parse_tokens_refuses(value):
    with pytest.raises(ValueError):
        parse_tokens(value)


def test_model_costs_and_defaults():
    m = msgspec.convert({"provider": "openai", "ctx": "128k", "cost_in": 1.25, "cost_out": 10.0}, ModelSpec)
    assert (m.ctx, m.usd_per_mtok_in, m.usd_per_mtok_out, m.usd_per_mtok) == (128 * KI, 1.25, 10.0, 5.625)
    m = msgspec.convert({"provider": "openai", "ctx": 1, "cost": 3.0, "cost_out": 12.0}, ModelSpec)
    assert (m.usd_per_mtok_in, m.usd_per_mtok_out, m.usd_per_mtok) == (3.0, 12.0, 3.0)
    assert (m.max_out_tokens, m.temperature, m.speed) == (512, 0.0, "medium")


def test_agent_and_policy_defaults():
    a = msgspec.convert({"layer": "L1", "tool": "ruff", "p95_ms": 5}, AgentSpec)
    assert (a.qos, a.win30d, a.strengths, a.timeout_ms, a.scope, a.options) == ("silver", 0.5, [], 60000, "changed", {})
    p = msgspec.convert({"match": {}, "fanout": ["x"]}, PolicySpec)
    assert (p.name, p.fanout_k, p.consensus, p.qos, p.deadline_ms) == (None, None, "union_tiebreak", None, 120000)


# -- clients: tenant scopes (spec §11 AuthZ) ------------------------------------

_CLIENTS_BASE = """
agents: {lint.ruff: {layer: L0, tool: ruff, p95_ms: 100}}
policies: [{match: {task_type: code_review}, fanout: [lint.ruff]}]
clients:
  alice: """


def test_client_scopes_load_to_a_snapshot():
    rib = load_rib_text(_CLIENTS_BASE + """
    budget: {usd: 5.0}
    qos_max: silver
    task_types: [code_review, summarize]
    max_stream_budget: {usd: 0.25, tokens: 51200}
    max_streams: 4
    rate: {per_s: 0.5, burst: 3}
    data_categories: [public, internal]
  bob: {}
""", "clients.yaml")
    assert msgspec.to_builtins(rib.clients) == {
        "alice": {
            "budget": {"usd": 5.0},
            "qos_max": "silver",
            "task_types": ["code_review", "summarize"],
            "max_stream_budget": {"usd": 0.25, "tokens": 51200},
            "max_streams": 4,
            "rate": {"per_s": 0.5, "burst": 3},
            "data_categories": ["public", "internal"],
            "feedback": "tenant",
        },
        # Unset scopes keep today's behaviour: any task type and label, the router's defaults for quotas.
        "bob": {"budget": None, "qos_max": "gold", "task_types": None, "max_stream_budget": None,
                "max_streams": None, "rate": None, "data_categories": None, "feedback": "tenant"},
    }


@pytest.mark.parametrize(
    ("entry", "key", "reason"),
    [
        ("{rate: {per_s: 0, burst: 1}}", "clients.alice.rate.per_s", "Expected float > 0.0"),
        ("{rate: {per_s: 1, burst: 0}}", "clients.alice.rate.burst", "Expected int >= 1"),
        ("{rate: {per_s: 1}}", "clients.alice.rate.burst", "missing required field"),
        ("{rate: {per_s: 1, burst: 2, per_min: 1}}", "clients.alice.rate.per_min", "unknown field 'per_min'"),
        ("{max_streams: 0}", "clients.alice.max_streams", "Expected int >= 1"),
        ("{task_types: ['']}", "clients.alice.task_types[0]", "Expected str of length >= 1"),
        ("{max_stream_budget: {usd: -1}}", "clients.alice.max_stream_budget.usd", "Expected float >= 0.0"),
        ("{data_categories: public}", "clients.alice.data_categories", "Expected array | null, got str"),
        ("{scopes: {}}", "clients.alice.scopes", "unknown field 'scopes'"),
    ],
)
def test_client_scope_refused_with_exact_key(entry, key, reason):
    with pytest.raises(PolicyError) as info:
        load_rib_text(_CLIENTS_BASE + entry, "clients.yaml")
    assert (info.value.file, info.value.key) == ("clients.yaml", key)
    assert reason in _detail(info.value)


def test_client_spec_schema_lists_the_scopes():
    defs = msgspec.json.schema(Rib)["$defs"]
    assert set(defs["ClientSpec"]["properties"]) == {
        "budget", "qos_max", "task_types", "max_stream_budget", "max_streams", "rate", "data_categories", "feedback",
    }
    assert defs["RateSpec"]["required"] == ["per_s", "burst"]


def test_independence_source_names_what_stands_behind_each_agent():
    """Consensus counts agents on one model once (spec §19): the source is the
    provider's model id, the tool, or the remote endpoint — not the agent name."""
    from atp_router.policy.rib import independence_source

    rib = load_rib_text(
        "models:\n"
        "  small: {provider: openai_compat, ctx: 8k, cost: 0, base_url: 'http://127.0.0.1:1/v1', model: smol}\n"
        "  small-alias: {provider: openai_compat, ctx: 8k, cost: 0, base_url: 'http://127.0.0.1:2/v1', model: smol}\n"
        "agents:\n"
        "  rev.a: {layer: L2, p95_ms: 1, model: small}\n"
        "  rev.b: {layer: L2, p95_ms: 1, model: small-alias}\n"
        "  lint: {layer: L1, p95_ms: 1, tool: ruff}\n"
        "  far: {layer: L2, p95_ms: 1, remote: {protocol: a2a, url: 'http://127.0.0.1:3/a2a', agent_id: x}}\n"
        "policies:\n"
        "  - {match: {task_type: code_review}, fanout: [rev.a, rev.b, lint, far]}\n"
    )
    assert independence_source(rib, "rev.a") == independence_source(rib, "rev.b") == "model:openai_compat:smol"
    assert independence_source(rib, "lint") == "tool:ruff"
    assert independence_source(rib, "far") == "remote:a2a:http://127.0.0.1:3/a2a#x"
    assert independence_source(rib, "nobody") == "agent:nobody"
