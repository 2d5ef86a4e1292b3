"""The node link: the gRPC channels to the nodes and the client half of the multiplexed calls.

A ground room: it imports no other room of the proxy, only ``cluster`` (the contract, and the
multiplexed calls' wire format ``cluster.mux_wire``); their server half is ``node_runtime.mux_server``.
"""
