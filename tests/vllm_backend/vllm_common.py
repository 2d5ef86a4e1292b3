"""What the vLLM tests share: prompts, engine arguments, engine and sampling helpers (a module name
unique across test folders; the ``colocated`` fixture that uses them is in ``conftest.py``)."""

from __future__ import annotations

import socket
from pathlib import Path

PROMPTS = [
    list(range(5, 45)),  # 40 tokens: 2 full blocks and a partial one
    [7, 300, 12, 999, 45, 45, 2, 81, 640],  # one partial block
    [int(11 + (i * 37) % 900) for i in range(70)],  # 5 blocks
    [int(900 - (i * 13) % 700) for i in range(32)],  # exactly 2 blocks
]
MAX_TOKENS = 16
ENGINE = dict(dtype="float32", max_model_len=256, enforce_eager=True, block_size=16, max_num_seqs=8,
              enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20,
              attention_backend="CPU_MLA")  # float32: not the AMX kernels (vllm_backend.engine.cpu_attention_backend)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _llm(model: Path, role: str | None = None, port: int = 0, **extra):
    from vllm import LLM

    kw = {**ENGINE, **extra}
    if role is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "PdKVConnector",
            "kv_connector_module_path": "vllm_backend.connector",
            "kv_role": role,
            "kv_connector_extra_config": {"side_channel_port": port, "lease_s": 60.0},
        }
    return LLM(model=str(model), **kw)


SAMPLED = dict(temperature=0.9, seed=1234)  # a sampled request the cluster test checks


def _params(max_tokens: int, kv: dict | None = None, **sampling):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv} if kv is not None else None
    kw = {"temperature": 0.0, **sampling}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra, **kw)




CHAT = [{"role": "user", "content": "What does a serving cluster do?"}]
