"""Engine settings (the knobs of ``LLM(...)``), validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig
from engine.kv_format import KV_CACHE_DTYPES, KVFormat
from engine.parallel.grid import KV_LAYOUTS, ParallelConfig
from engine.speculative import SpeculativeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    # Each field is a flag of the node processes and a key of a pdctl topology's nodes (cluster.flags):
    # add a knob by adding a field, its help in metadata. Defaults and helps must be literals (pdctl
    # reads them from this source: it does not import torch).
    model: str = field(metadata={"help": "model directory (Hugging Face format)", "metavar": "DIR"})
    dtype: str = field(default="auto", metadata={
        "help": "auto = the checkpoint's torch_dtype", "choices": ("auto", *DTYPES)})
    device: str = field(default="auto", metadata={"help": "cpu, cuda or cuda:N; auto = cuda if available, else cpu"})
    gpus: str | None = field(default=None, metadata={
        "help": "the GPUs of this engine's ranks (or a decode node's DP replicas), in order, e.g. 2,3 "
                "(default: K, K+1, ... from --device cuda:K)", "metavar": "LIST"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context limit (default: the model's max_position_embeddings)"})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "per-step token budget; longer prompts prefill in chunks"})
    max_num_seqs: int = field(default=256, metadata={"help": "most sequences in one batch"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "on GPU: run every step eagerly instead of replaying CUDA graphs captured at start-up"})
    max_cudagraph_capture_size: int = field(default=512, metadata={
        "help": "on GPU: the most token rows a CUDA graph captures (at least max_num_seqs): decode steps, "
                "and prefills of up to this many new tokens (engine/cuda_graphs.py)"})
    async_scheduling: bool | None = field(default=None, metadata={
        "help": "in-process models: launch the next decode step before the host has the current one's tokens "
                "(engine/overlap.py), so the host's work between steps overlaps the GPU's (default: on GPUs; on "
                "a CPU a step runs as it is launched, so it would only hold each token back one step)"})
    speculative_config: str | None = field(default=None, metadata={
        "help": 'speculative decoding in vLLM\'s JSON form, {"method": "mtp", "num_speculative_tokens": K}: the '
                "model's multi-token prediction layer drafts K tokens and one target step verifies them "
                "(engine/speculative.py), in process and on rank processes (DP, PCP, PP; expert parallelism too); a "
                "prefill node hands its draft and the MTP layer's KV to the decode side",
                "metavar": "JSON"})
    mtp_recompute: bool = field(default=True, metadata={
        "help": "decode, with speculative_config: a request from a prefill node without it (its KV lacks the MTP "
                "layer's) has its prompt computed again here for the MTP layer's KV, and drafts after that; off: it "
                "decodes without drafts (its prompt's KV is pulled)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "how the KV cache stores each token's latent row (engine/kv_format.py): auto = the model's dtype; "
                "fp8 = e4m3 with one scale; fp8_ds_mla = DeepSeek's 656-byte row (e4m3 latent, a scale per 128, "
                "bf16 rope). Prefill and decode nodes pair only on the same format",
        "choices": ("auto", "fp8", "fp8_ds_mla")})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "keep the KV of full blocks after use and share it between prompts with the same prefix "
                "(engine/prefix_cache.py; a decode node pulls only the blocks it lacks)"})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "KV cache blocks per rank (default: sized from memory: --gpu-memory-utilization, --cpu-kv-cache-gb)"})
    cpu_kv_cache_gb: float = field(default=0.5, metadata={"help": "on CPU: the KV cache's size per rank in GiB"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "on GPU: the share of the device's memory this engine's weights, KV cache and workspace may "
                "use, whatever other processes use (two nodes can share a GPU with 0.4 each)"})
    load_format: str = field(default="auto", metadata={
        "help": "dummy = random weights from config.json alone (benchmarks)", "choices": LOAD_FORMATS})
    seed: int = field(default=0, metadata={"help": "seed of the sampler (and of dummy weights)"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer directory (default: the model's)"})
    skip_tokenizer_init: bool = field(default=False, metadata={"help": "load no tokenizer: token ids in and out"})
    # torch intra-op threads of the engine's processes. 1 by default: a node runs several rank
    # processes, and torch's OpenMP pool slows by 10-100x when processes oversubscribe the cores
    # (measured on 2 cores); on GPUs the host work (step plans, sampling) is small and ran 5x
    # faster with 1 thread than with 32 (H200 host).
    cpu_threads: int = field(default=1, metadata={"help": "torch intra-op threads of each rank process"})
    # Topology (engine.parallel): DP replicas x PCP x PP rank processes; 1 x 1 x 1 runs in-process.
    dp: int = field(default=1, metadata={"help": "data-parallel replicas"})
    pcp: int = field(default=1, metadata={"help": "prefill context parallel size"})
    pp: int = field(default=1, metadata={"help": "pipeline stages"})
    kv_layout: str = field(default="sharded", metadata={
        "help": "sharded: each KV block on one PCP rank; replicated: on all of them", "choices": KV_LAYOUTS})
    enable_expert_parallel: bool = field(default=False, metadata={
        "help": "MoE models: each of a PP stage's DP x PCP ranks (a decode node: each DP replica) holds 1/(DP x "
                "PCP) of the routed experts, and every MoE layer dispatches tokens to their owners "
                "(engine/parallel/expert_parallel.py); DP replicas then step in lockstep"})
    kv_interleave: int | None = field(default=None, metadata={
        "help": "sharded: tokens per run on one PCP rank (default: one block)"})
    dist_host: str = field(default="127.0.0.1", metadata={"help": "torch.distributed rendezvous of the rank processes"})
    dist_port: int | None = field(default=None, metadata={"help": "the rendezvous port (default: a free one)"})
    rank_timeout_s: float = field(default=600.0, metadata={
        "help": "longest wait for a rank's answer (one step; startup waits at least 120 s) before failing"})

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            self._check_speculative()
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.gpus is not None:
            self.gpu_list()  # validates
            if self.device == "cpu":
                raise ValueError("gpus lists GPUs, but device is cpu")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if self.max_cudagraph_capture_size <= 0:
            raise ValueError(f"max_cudagraph_capture_size must be > 0, got {self.max_cudagraph_capture_size}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be > 0, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_threads <= 0:
            raise ValueError(f"cpu_threads must be > 0, got {self.cpu_threads}")
        if self.rank_timeout_s <= 0:
            raise ValueError(f"rank_timeout_s must be > 0, got {self.rank_timeout_s}")
        self.parallel().interleave(self.block_size)  # validates the topology and the interleave
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")

    def parallel(self) -> ParallelConfig:
        return ParallelConfig(
            dp=self.dp, pcp=self.pcp, pp=self.pp, kv_layout=self.kv_layout, kv_interleave=self.kv_interleave
        )

    def first_gpu(self) -> int:
        """The first of ``gpus``, else K of ``cuda:K`` (else 0)."""
        if self.gpus is not None:
            return self.gpu_list()[0]
        return int(self.device.split(":", 1)[1]) if self.device.startswith("cuda:") else 0

    def gpu_list(self) -> list[int]:
        """``gpus`` parsed ("2,3" -> [2, 3]); [] when unset."""
        if self.gpus is None:
            return []
        try:
            ids = [int(x) for x in self.gpus.split(",")]
        except ValueError:
            raise ValueError(f"gpus must be GPU indices separated by commas (e.g. 2,3), got {self.gpus!r}") from None
        if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"gpus must list distinct GPU indices >= 0, got {self.gpus!r}")
        return ids

    def gpu_ids(self, n: int) -> list[int]:
        """The GPUs of ``n`` ranks or replicas: ``gpus`` (which must list at least n), else K, K+1, ... of
        ``cuda:K``, as vLLM's workers take K.. of a ``cuda:K`` node."""
        ids = self.gpu_list()
        if ids:
            if len(ids) < n:
                raise ValueError(f"gpus {self.gpus} lists {len(ids)} GPUs; this engine needs {n} (one per rank "
                                 "or DP replica)")
            return ids[:n]
        k = self.first_gpu()
        return list(range(k, k + n))

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed (None: off)."""
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

    def _check_speculative(self) -> None:
        self.speculative  # noqa: B018 (parses: a bad form raises)

    def torch_device(self) -> torch.device:
        if self.gpus is not None:
            return torch.device("cuda", self.first_gpu())
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: str) -> torch.dtype:
        name = checkpoint_dtype if self.dtype == "auto" else self.dtype
        return DTYPES.get(name, torch.bfloat16)

    def kv_format(self, mc: ModelConfig) -> KVFormat:
        """The KV cache's row format for this model (``kv_cache_dtype`` over the compute dtype)."""
        return KVFormat(self.kv_cache_dtype, mc.kv_lora_rank, mc.qk_rope_head_dim, self.torch_dtype(mc.torch_dtype))
