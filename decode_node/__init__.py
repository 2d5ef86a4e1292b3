"""Decode node: DP replicas with continuous batching behind the gRPC DecodeService."""
