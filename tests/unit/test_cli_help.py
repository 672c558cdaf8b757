"""``atp-router --help`` and its subcommands' help show each option's default
(atp_router/cliutil/helpfmt.py)."""

from __future__ import annotations

import argparse

import pytest

from atp_router.deploy import cli


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_every_router_option_with_a_value_shows_its_default(capsys):
    out = " ".join(_help(capsys, []).split())  # argparse wraps lines anywhere
    parser = cli._parser()
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or action.default == []:
            continue  # flags and options without a default have none to show
        # argparse prints nothing, default included, for an option without help text
        if not action.help or "default" not in formatter._get_help_string(action):
            missing.append(action.option_strings[0])
    assert not missing, f"options whose --help shows no default (give them a help text): {missing}"
    assert "--slots SLOTS next-hop calls in flight across all streams (QoS capacity) (default: 64)" in out
    assert "--log-level LOG_LEVEL DEBUG, INFO, WARNING or ERROR (default: INFO)" in out
    # a flag has no default to show
    assert "--no-watch do not reload the RIB when a --policies file changes (POST /v1/policies/reload still " \
           "does) --host" in out


def test_subcommands_show_their_defaults(capsys):
    assert "(default: client)" in _help(capsys, ["keys", "new"])
    assert "(default: 8080)" in _help(capsys, ["model-server"])
    assert "(default: 4096)" in _help(capsys, ["model-server"])
    assert "(default: eval-results.png)" in " ".join(_help(capsys, ["eval"]).split()).replace("eval- results", "eval-results")


def test_a_default_read_from_the_environment_is_not_printed(capsys, monkeypatch):
    monkeypatch.setenv("ATP_TOKEN", "tok-very-secret-1234")
    out = _help(capsys, ["eval"])
    assert "--token TOKEN" in out
    assert "tok-very-secret-1234" not in out
