"""The proxy: OpenAI-compatible HTTP front end of the cluster, in rooms.

A request is validated and tokenized in ``api`` (``api.protocol``, ``api.serving``), routed to a
prefill replica and a decode rank by ``routing`` (``routing.router``), prefilled and then decoded
over gRPC by ``pipeline`` through the node ``link`` (``link.clients``, ``link.mux_client``), and its
token ids are turned back into text and OpenAI's JSON or SSE shapes in ``api`` (``api.detok``,
``api.responses``). ``app.create_app`` assembles the FastAPI application; ``python -m proxy`` runs it
in worker processes (``workers``).

The rooms, bottom to top: a room imports only its own modules and the rooms below it, never one beside
it (``PROXY_ROOMS`` in ``tests/unit/test_layers.py`` checks every import).

    routing/  link/  errors  metrics  cli  affinity   the ground: each imports no other room
    pipeline                                          one request's trip over routing and the link
    api/  admin                                       the OpenAI surface; the operators' admin API
    app                                               the application, assembled from the rooms
    workers                                           the worker processes: started, tuned, each its app
    __main__                                          ``python -m proxy``: nothing imports it
"""
