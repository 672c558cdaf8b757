"""``GET /v1/ready``'s decision (:func:`atp_router.runtime.admin.readiness.decide`):
facts in, verdict out — a table of cases."""

from __future__ import annotations

import pytest

from atp_router.runtime.admin.readiness import Check, ReadyFacts, decide

OK = {"store": None, "rib_version": 3, "rib_policies": 2, "state_dir": None}
FULL = "state store full: /s/state.db: no space left on device"


@pytest.mark.parametrize(("facts", "status", "failing"), [
    (OK, "ready", []),
    ({**OK, "store": FULL}, "not_ready", ["store"]),
    ({**OK, "rib_policies": 0}, "not_ready", ["rib"]),
    ({**OK, "state_dir": "state directory /s takes no write: No space left on device"}, "not_ready", ["state_dir"]),
    ({**OK, "audit_spooled": 5, "audit_spool_max": 10}, "not_ready", ["audit"]),
    ({**OK, "audit_dropped": 7}, "ready", []),
    ({**OK, "draining": 3}, "not_ready", ["drain"]),
    ({**OK, "draining": 0}, "not_ready", ["drain"]),  # nothing left running, still stopping  # dropped earlier, the chain is current now: ready (the count is said)
    ({**OK, "store": FULL, "state_dir": "state directory /s takes no write: No space left on device",
      "audit_spooled": 1, "audit_spool_max": 10, "rib_policies": 0}, "not_ready", ["store", "rib", "state_dir", "audit"]),
])
def test_the_verdict_of_each_set_of_facts(facts, status, failing):
    verdict = decide(ReadyFacts(**facts))
    assert verdict.status == status
    assert verdict.ready is (status == "ready")
    assert verdict.failing == failing
    assert [c.name for c in verdict.checks][:len(failing)] == failing  # failing checks first
    assert {c.name for c in verdict.checks} == {"store", "rib", "state_dir", "audit", "drain"}


def test_reasons_name_the_fault_and_the_public_verdict_has_none():
    verdict = decide(ReadyFacts(**{**OK, "store": FULL, "audit_spooled": 2, "audit_spool_max": 10,
                                   "audit_dropped": 3}))
    by = {c.name: c for c in verdict.checks}
    assert by["store"].reason == FULL
    assert by["audit"].reason == ("2 audit records wait for the store (spool bound 10); 3 dropped since start "
                                  "(the spool was full)")
    assert by["rib"].reason == "generation 3, 2 policies"
    assert by["drain"].reason == "serving"
    draining = {c.name: c for c in decide(ReadyFacts(**{**OK, "draining": 2})).checks}["drain"]
    assert draining.reason == "draining before a stop: 2 streams still running, new ones refused"
    public = verdict.public()
    assert public.status == "not_ready"
    assert public.checks == [Check(c.name, c.ok) for c in verdict.checks]
    assert all(c.reason == "" for c in public.checks)
