"""FINAL carries each next-hop's prose answer beside the findings (§7.3; issue 9
item 5): an agent that answers in text is visible to the client. The agents are
:class:`~atp_router.adapters.testing.ScriptedAdapter` tools (RIB ``tool: scripted``)
reproducing a model's report shape (summary text, no findings)."""

from __future__ import annotations

import atp

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import ANSWER_CHARS
from tests.helpers import golden, start_router_on
from tests.unit.test_router_dispatch import scripted_agent


async def test_prose_answers_are_in_final_and_bounded(nursery, tmp_path, scripted):
    scripted["writer"] = ScriptedAdapter.returning("writer", summary="The change adds a pickle loader.",
                                                   confidence=0.7)
    scripted["verbose"] = ScriptedAdapter.returning("verbose", summary="x" * (ANSWER_CHARS + 10))
    scripted["silent"] = ScriptedAdapter.returning("silent")
    rib = {"agents": {a: scripted_agent() for a in ("writer", "verbose", "silent")},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["writer", "verbose", "silent"]}]}
    env = await start_router_on(nursery, tmp_path, rib)
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={"task_type": "code_review"}, content=golden())
        final = await c.result(st)
    answers = {a["agent"]: a for a in final["result"]["answers"]}
    assert set(answers) == {"writer", "verbose"}  # no prose, no answer entry
    assert answers["writer"] == {"agent": "writer", "text": "The change adds a pickle loader.", "confidence": 0.7}
    assert len(answers["verbose"]["text"]) == ANSWER_CHARS and answers["verbose"]["truncated"] is True
