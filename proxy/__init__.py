"""The proxy: OpenAI-compatible HTTP front end of the cluster.

A request is validated and tokenized here (``protocol``), routed to a prefill replica and a decode
rank (``router``), prefilled and then decoded over gRPC (``pipeline``, ``clients``), and its token
ids are turned back into text (``detok``) and OpenAI's JSON or SSE shapes (``responses``,
``serving``). ``app.create_app`` assembles the FastAPI application; ``python -m proxy`` runs it.
"""
