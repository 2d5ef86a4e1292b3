"""``pdctl up --engine vllm``: a vLLM-backed cluster (1 prefill node, 1 decode node, DP 1 each) started
by the launcher, driven with the official ``openai`` client; greedy outputs = colocated vLLM."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
from vllm_common import CHAT, MAX_TOKENS, PROMPTS

from cluster.launcher import down, up
from cluster.topology import DecodeSpec, PrefillSpec, ProxySpec, RegistrySpec, Topology
from engine.tokenizer import Tokenizer

NODE = dict(dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def proxy_url(mla_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    run_dir = tmp_path_factory.mktemp("vllm-cluster")
    topo = Topology(model=str(mla_model), served_model_name="tiny", engine="vllm", vllm_python=sys.executable,
                    prefill=(PrefillSpec(max_num_batched_tokens=256, **NODE),), decode=(DecodeSpec(**NODE),),
                    proxy=ProxySpec(port=0), registry=RegistrySpec(cluster="vllmtest"))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    state = up(topo, run_dir, timeout_s=400)
    try:
        yield state.proxy_url
    finally:
        down(run_dir, grace_s=10)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left after down: {[(p.pid, p.name()) for p in left]}"


def test_openai_client_equals_colocated_vllm(proxy_url: str, colocated_all, mla_model: Path) -> None:
    colocated, chat_ids, chat_tokens = colocated_all
    tok = Tokenizer(str(mla_model))
    oa = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt, want in zip(PROMPTS, colocated, strict=True):
        r = oa.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                  extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == MAX_TOKENS
        assert r.choices[0].text == tok.decode(want)
    r = oa.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0,
                                   extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(chat_ids) and r.usage.completion_tokens == MAX_TOKENS
    assert r.choices[0].message.content == tok.decode(chat_tokens)
    stream = oa.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0,
                                        stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == tok.decode(chat_tokens)
