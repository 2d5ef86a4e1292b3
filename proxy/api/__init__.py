"""The OpenAI surface: HTTP endpoints, request bodies, tokenizing, detokenizing, OpenAI's JSON and SSE shapes.

Everything a client's bytes meet before a request reaches the cluster, and after its tokens come back.
It may import ``proxy.pipeline`` (which runs the request), the rooms below it (``routing``, ``link``)
and the proxy's shared ``errors`` and ``metrics``; never ``admin``, ``app`` or the worker modules.
"""
