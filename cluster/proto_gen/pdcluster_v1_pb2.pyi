from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "prompt_logprobs", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    structured_output: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "any_whitespace")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    any_whitespace: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., any_whitespace: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class LayerRegion(_message.Message):
    __slots__ = ("layer", "base", "num_blocks", "block_bytes")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    layer: int
    base: int
    num_blocks: int
    block_bytes: int
    def __init__(self, layer: _Optional[int] = ..., base: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class CacheLayout(_message.Message):
    __slots__ = ("rank", "endpoint", "regions")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    endpoint: str
    regions: _containers.RepeatedCompositeFieldContainer[LayerRegion]
    def __init__(self, rank: _Optional[int] = ..., endpoint: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[LayerRegion, _Mapping]]] = ...) -> None: ...

class RankBlocks(_message.Message):
    __slots__ = ("rank", "pcp", "pp", "layers", "logical", "physical")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PCP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pcp: int
    pp: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    logical: _containers.RepeatedScalarFieldContainer[int]
    physical: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., pcp: _Optional[int] = ..., pp: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., logical: _Optional[_Iterable[int]] = ..., physical: _Optional[_Iterable[int]] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("prefill_node_id", "prefill_address", "dp_rank", "num_blocks", "block_size", "transport", "sources", "holders", "lease_s", "kv_format")
    PREFILL_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    prefill_node_id: str
    prefill_address: str
    dp_rank: int
    num_blocks: int
    block_size: int
    transport: str
    sources: _containers.RepeatedCompositeFieldContainer[CacheLayout]
    holders: _containers.RepeatedCompositeFieldContainer[RankBlocks]
    lease_s: float
    kv_format: str
    def __init__(self, prefill_node_id: _Optional[str] = ..., prefill_address: _Optional[str] = ..., dp_rank: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., transport: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[CacheLayout, _Mapping]]] = ..., holders: _Optional[_Iterable[_Union[RankBlocks, _Mapping]]] = ..., lease_s: _Optional[float] = ..., kv_format: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "dp_rank")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    dp_rank: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., dp_rank: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "dp_rank", "first_token", "finish_reason", "queue_s", "prefill_s", "cached_tokens", "prompt_tokens", "mtp_drafts", "kv", "vllm_kv_params_json")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MTP_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    VLLM_KV_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    dp_rank: int
    first_token: Token
    finish_reason: str
    queue_s: float
    prefill_s: float
    cached_tokens: int
    prompt_tokens: _containers.RepeatedCompositeFieldContainer[Token]
    mtp_drafts: _containers.RepeatedScalarFieldContainer[int]
    kv: KVHandle
    vllm_kv_params_json: str
    def __init__(self, request_id: _Optional[str] = ..., dp_rank: _Optional[int] = ..., first_token: _Optional[_Union[Token, _Mapping]] = ..., finish_reason: _Optional[str] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., prompt_tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., mtp_drafts: _Optional[_Iterable[int]] = ..., kv: _Optional[_Union[KVHandle, _Mapping]] = ..., vllm_kv_params_json: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "first_token", "dp_rank", "mtp_drafts", "kv", "vllm_kv_params_json", "local_prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    MTP_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    VLLM_KV_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    first_token: Token
    dp_rank: int
    mtp_drafts: _containers.RepeatedScalarFieldContainer[int]
    kv: KVHandle
    vllm_kv_params_json: str
    local_prefill: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., first_token: _Optional[_Union[Token, _Mapping]] = ..., dp_rank: _Optional[int] = ..., mtp_drafts: _Optional[_Iterable[int]] = ..., kv: _Optional[_Union[KVHandle, _Mapping]] = ..., vllm_kv_params_json: _Optional[str] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class Admitted(_message.Message):
    __slots__ = ("dp_rank", "transfer_bytes", "transfer_s", "cached_tokens")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    transfer_bytes: int
    transfer_s: float
    cached_tokens: int
    def __init__(self, dp_rank: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfer_s: _Optional[float] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("tokens", "finish_reason")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    finish_reason: str
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("admitted", "tokens")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    admitted: Admitted
    tokens: Tokens
    def __init__(self, admitted: _Optional[_Union[Admitted, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ...) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("dp_rank", "waiting", "running", "queued_prefill_tokens", "used_blocks", "free_blocks", "held")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    waiting: int
    running: int
    queued_prefill_tokens: int
    used_blocks: int
    free_blocks: int
    held: int
    def __init__(self, dp_rank: _Optional[int] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., used_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., held: _Optional[int] = ...) -> None: ...

class TransferTotals(_message.Message):
    __slots__ = ("done", "bytes", "seconds", "failures", "leases_expired")
    class FailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    done: int
    bytes: int
    seconds: float
    failures: _containers.ScalarMap[str, int]
    leases_expired: int
    def __init__(self, done: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., failures: _Optional[_Mapping[str, int]] = ..., leases_expired: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "role", "replicas", "transfers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStats]
    transfers: TransferTotals
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStats, _Mapping]]] = ..., transfers: _Optional[_Union[TransferTotals, _Mapping]] = ...) -> None: ...

class PrefillCalls(_message.Message):
    __slots__ = ("calls", "cancel")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[PrefillRequest]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, calls: _Optional[_Iterable[_Union[PrefillRequest, _Mapping]]] = ..., cancel: _Optional[_Iterable[str]] = ...) -> None: ...

class DecodeCalls(_message.Message):
    __slots__ = ("calls", "cancel")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[DecodeRequest]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, calls: _Optional[_Iterable[_Union[DecodeRequest, _Mapping]]] = ..., cancel: _Optional[_Iterable[str]] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class MuxReply(_message.Message):
    __slots__ = ("request_id", "prefill", "event", "status")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill: PrefillResponse
    event: DecodeEvent
    status: CallStatus
    def __init__(self, request_id: _Optional[str] = ..., prefill: _Optional[_Union[PrefillResponse, _Mapping]] = ..., event: _Optional[_Union[DecodeEvent, _Mapping]] = ..., status: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class MuxReplies(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[MuxReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[MuxReply, _Mapping]]] = ...) -> None: ...
