"""Prefill node: DP x PCP x PP ranks behind the gRPC PrefillService."""
