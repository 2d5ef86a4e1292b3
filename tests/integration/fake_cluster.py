"""The proxy against fake prefill/decode gRPC nodes, shared by the ``test_proxy_fake_*`` modules.

One proxy (in a thread) and three fake nodes (grpc.aio servers on a background loop) serve a whole
module (``fake_cluster``, in conftest.py); each test gets them reset (``c``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
from proxy_fakes import FakeDecode, FakeNodes, FakePrefill, Script, node_state, running_proxy, settled

from cluster.config import ProxyConfig
from engine.tokenizer import Tokenizer
from proxy.routing.discovery import StaticNodeSource

MODEL = "tiny-test"
MAX_MODEL_LEN = 512
LONG_PROMPT = list(range(10, 10 + MAX_MODEL_LEN))
TINY_VOCAB = 1024  # >= the tiny model's vocab_size (pdctl/tiny_model.py trains at most 1024 tokens)
API_KEY = "sk-test"
ADMIN_KEY = "admin-test"
# Multi-byte characters (2, 3 and 4 bytes) split across byte-level tokens, and words for stop strings.
SCRIPT_TEXT = "Hello world! The cluster serves héllo 日本 🎉 tokens quickly."


@dataclass
class Cluster:
    url: str
    tokenizer: Tokenizer
    script: Script
    p0: FakePrefill  # PCP 1
    p1: FakePrefill  # PCP 2
    d0: FakeDecode
    source: StaticNodeSource
    app: object

    @property
    def prefills(self) -> list[FakePrefill]:
        return [self.p0, self.p1]

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=10, **kw)

    def http(self, key: str | None = API_KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)

    def aborts(self) -> list[str]:
        return self.p0.aborts + self.p1.aborts

    def text(self, n: int | None = None) -> str:
        ids = self.script.tokens if n is None else [self.script.token_at(i) for i in range(n)]
        return self.tokenizer.decode(ids)


PREFILL_TIMEOUT_S = 4.0
TOKEN_TIMEOUT_S = 3.0


@contextmanager
def fake_cluster(tiny_model: Path) -> Iterator[Cluster]:
    """A proxy in front of two fake prefill nodes (PCP 1 and 2) and a fake decode node."""
    tok = Tokenizer(tiny_model)
    script = Script(tok.encode(SCRIPT_TEXT, add_special_tokens=False), tok.eos_token_id)
    fakes = FakeNodes()
    try:
        p0, p1, d0 = FakePrefill("p0", script), FakePrefill("p1", script), FakeDecode("d0", script)
        source = StaticNodeSource([
            node_state("p0", "prefill", fakes.serve(p0), model=MODEL, max_model_len=MAX_MODEL_LEN, pcp=1),
            node_state("p1", "prefill", fakes.serve(p1), model=MODEL, max_model_len=MAX_MODEL_LEN, pcp=2),
            node_state("d0", "decode", fakes.serve(d0), model=MODEL, max_model_len=MAX_MODEL_LEN),
        ])
        config = ProxyConfig(model=str(tiny_model), served_model_name=MODEL, api_key=API_KEY, admin_key=ADMIN_KEY,
                             # Short enough for the timeout tests, long enough that a stall of CI's 2-core VM
                             # does not time out the others (1 s / 0.5 s did, twice).
                             prefill_timeout_s=PREFILL_TIMEOUT_S, token_timeout_s=TOKEN_TIMEOUT_S)
        with running_proxy(config, tok, source) as (url, app):
            yield Cluster(url, tok, script, p0, p1, d0, source, app)
    finally:
        fakes.stop()


@contextmanager
def reset(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster for one test: no node draining, and the fakes' knobs and records reset."""
    for node_id in ("p0", "p1", "d0"):
        cluster.source.set_draining(node_id, False)
    with settled(cluster.app, cluster.prefills, [cluster.d0]):
        yield cluster


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
