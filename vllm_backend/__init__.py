"""The vLLM engine backend in one place: the engine wrapper, its node services, ``PdKVConnector``
(scheduler and worker halves) and its layout mapping. Only ``--engine vllm`` nodes and vLLM import it."""
