"""Pieces of the vLLM KV connector (``kv_transfer.vllm_connector``) that do not import vLLM."""
