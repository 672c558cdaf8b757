"""How requests and frames reach the router: the HTTP control API
(:mod:`~atp_router.runtime.ingress.http_api`: its route table and handlers; the bodies'
Structs in :mod:`~atp_router.runtime.ingress.http_types`, the one authentication and
authorization wrapper in :mod:`~atp_router.runtime.ingress.authorized`), the WebSocket server
(:mod:`~atp_router.runtime.ingress.ws`, its handshake gate in
:mod:`~atp_router.runtime.ingress.ws_gate`), the OpenAI-compatible endpoints
(:mod:`~atp_router.runtime.ingress.openai`, its wire Structs in
:mod:`~atp_router.runtime.ingress.openai_schema`, its models in
:mod:`~atp_router.runtime.ingress.openai_models`) and the A2A server
(:mod:`~atp_router.runtime.ingress.a2a`, its tasks in :mod:`~atp_router.runtime.ingress.a2a_tasks`
and messages in :mod:`~atp_router.runtime.ingress.a2a_message`; the code-review files both read
from ``--repo`` in :mod:`~atp_router.runtime.ingress.repo_files`), with the bounded body reader they share
(:mod:`~atp_router.runtime.ingress.bodies`). Each authenticates its caller and hands
frames to the :class:`~atp_router.runtime.router.Router`; none routes by itself.
"""
