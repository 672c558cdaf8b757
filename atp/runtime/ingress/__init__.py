"""How requests and frames reach the router: the HTTP control API
(:mod:`~atp.runtime.ingress.http_api`), the WebSocket server
(:mod:`~atp.runtime.ingress.ws`), the OpenAI-compatible endpoints
(:mod:`~atp.runtime.ingress.openai`) and the A2A server
(:mod:`~atp.runtime.ingress.a2a`), with the bounded body reader they share
(:mod:`~atp.runtime.ingress.bodies`). Each authenticates its caller and hands
frames to the :class:`~atp.runtime.router.Router`; none routes by itself.
"""
