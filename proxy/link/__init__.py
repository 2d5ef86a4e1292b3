"""The node link: the gRPC channels to the nodes and the client half of the multiplexed calls.

A ground room: it imports no other room of the proxy, only ``cluster`` (the contract); the server
half of the multiplexed calls is ``node_runtime.mux``.
"""
