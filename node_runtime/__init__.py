"""What every node process shares at run time: flags, the gRPC server's life and registry heartbeat,
the engine thread, and the KV confirmation call."""
