"""Routing: which nodes exist (the registry's view), which are healthy (circuit breakers), where a
prompt's prefix is cached, and which prefill replica and decode rank take a request, with why.

A ground room: it imports no other room of the proxy (only ``cluster`` and the engine's block hash).
"""
