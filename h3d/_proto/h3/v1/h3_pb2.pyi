from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DDR: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DDR: Tier
TIER_SSD: Tier

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ...) -> None: ...

class TierResidency(_message.Message):
    __slots__ = ("hbm_blocks", "ddr_blocks", "ssd_blocks")
    HBM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DDR_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SSD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    hbm_blocks: int
    ddr_blocks: int
    ssd_blocks: int
    def __init__(self, hbm_blocks: _Optional[int] = ..., ddr_blocks: _Optional[int] = ..., ssd_blocks: _Optional[int] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "num_tokens", "cached_tokens", "policy", "created_at", "last_used_at", "busy", "pinned", "pinned_until", "sampling", "residency", "window_tokens", "token_ids", "text", "closed", "chat", "num_messages", "served_by")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_AT_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    PINNED_UNTIL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    NUM_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    cached_tokens: int
    policy: str
    created_at: float
    last_used_at: float
    busy: bool
    pinned: bool
    pinned_until: float
    sampling: SamplingParams
    residency: TierResidency
    window_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    closed: bool
    chat: bool
    num_messages: int
    served_by: str
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., policy: _Optional[str] = ..., created_at: _Optional[float] = ..., last_used_at: _Optional[float] = ..., busy: _Optional[bool] = ..., pinned: _Optional[bool] = ..., pinned_until: _Optional[float] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., residency: _Optional[_Union[TierResidency, _Mapping]] = ..., window_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., closed: _Optional[bool] = ..., chat: _Optional[bool] = ..., num_messages: _Optional[int] = ..., served_by: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("hbm_hit_rate", "hbm_hits", "hbm_misses", "ddr_evict_count", "hbm_evict_count", "ssd_read_count", "ssd_write_count", "hbf_latency_us_p50", "hbf_latency_us_p99", "hbm_used_bytes", "hbm_capacity_bytes", "ddr_used_bytes", "ddr_capacity_bytes", "ssd_used_bytes", "fetch_bytes", "kv_rebuild_blocks", "ssd_degraded", "ssd_degraded_reason", "ssd_write_errors", "recompute_evict_count", "hbm_rebalance_count", "dirty_bytes", "write_behind_bytes", "write_behind_in_flight_bytes", "write_behind_lag_s", "read_ahead_bytes", "read_ahead_in_flight_bytes", "window_freed_blocks", "window_hbm_bytes", "shared_blocks", "shared_hbm_saved_bytes", "shared_ddr_saved_bytes", "remote_on", "remote_degraded", "remote_degraded_reason", "remote_lag_bytes", "remote_kv_copied_bytes", "remote_kv_copy_queued_bytes", "remote_kv_copy_skipped_blocks", "digest_bytes", "digest_shared_saved_bytes", "digests_set_aside", "copy_up_bytes", "copy_down_bytes")
    HBM_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    HBM_HITS_FIELD_NUMBER: _ClassVar[int]
    HBM_MISSES_FIELD_NUMBER: _ClassVar[int]
    DDR_EVICT_COUNT_FIELD_NUMBER: _ClassVar[int]
    HBM_EVICT_COUNT_FIELD_NUMBER: _ClassVar[int]
    SSD_READ_COUNT_FIELD_NUMBER: _ClassVar[int]
    SSD_WRITE_COUNT_FIELD_NUMBER: _ClassVar[int]
    HBF_LATENCY_US_P50_FIELD_NUMBER: _ClassVar[int]
    HBF_LATENCY_US_P99_FIELD_NUMBER: _ClassVar[int]
    HBM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HBM_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DDR_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DDR_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_REBUILD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SSD_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    SSD_DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    SSD_WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_EVICT_COUNT_FIELD_NUMBER: _ClassVar[int]
    HBM_REBALANCE_COUNT_FIELD_NUMBER: _ClassVar[int]
    DIRTY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BEHIND_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BEHIND_IN_FLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BEHIND_LAG_S_FIELD_NUMBER: _ClassVar[int]
    READ_AHEAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_AHEAD_IN_FLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_HBM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_HBM_SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_DDR_SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ON_FIELD_NUMBER: _ClassVar[int]
    REMOTE_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    REMOTE_DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    REMOTE_LAG_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_KV_COPIED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_KV_COPY_QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_KV_COPY_SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_SHARED_SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_SET_ASIDE_FIELD_NUMBER: _ClassVar[int]
    COPY_UP_BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_DOWN_BYTES_FIELD_NUMBER: _ClassVar[int]
    hbm_hit_rate: float
    hbm_hits: int
    hbm_misses: int
    ddr_evict_count: int
    hbm_evict_count: int
    ssd_read_count: int
    ssd_write_count: int
    hbf_latency_us_p50: float
    hbf_latency_us_p99: float
    hbm_used_bytes: int
    hbm_capacity_bytes: int
    ddr_used_bytes: int
    ddr_capacity_bytes: int
    ssd_used_bytes: int
    fetch_bytes: int
    kv_rebuild_blocks: int
    ssd_degraded: bool
    ssd_degraded_reason: str
    ssd_write_errors: int
    recompute_evict_count: int
    hbm_rebalance_count: int
    dirty_bytes: int
    write_behind_bytes: int
    write_behind_in_flight_bytes: int
    write_behind_lag_s: float
    read_ahead_bytes: int
    read_ahead_in_flight_bytes: int
    window_freed_blocks: int
    window_hbm_bytes: int
    shared_blocks: int
    shared_hbm_saved_bytes: int
    shared_ddr_saved_bytes: int
    remote_on: bool
    remote_degraded: bool
    remote_degraded_reason: str
    remote_lag_bytes: int
    remote_kv_copied_bytes: int
    remote_kv_copy_queued_bytes: int
    remote_kv_copy_skipped_blocks: int
    digest_bytes: int
    digest_shared_saved_bytes: int
    digests_set_aside: int
    copy_up_bytes: int
    copy_down_bytes: int
    def __init__(self, hbm_hit_rate: _Optional[float] = ..., hbm_hits: _Optional[int] = ..., hbm_misses: _Optional[int] = ..., ddr_evict_count: _Optional[int] = ..., hbm_evict_count: _Optional[int] = ..., ssd_read_count: _Optional[int] = ..., ssd_write_count: _Optional[int] = ..., hbf_latency_us_p50: _Optional[float] = ..., hbf_latency_us_p99: _Optional[float] = ..., hbm_used_bytes: _Optional[int] = ..., hbm_capacity_bytes: _Optional[int] = ..., ddr_used_bytes: _Optional[int] = ..., ddr_capacity_bytes: _Optional[int] = ..., ssd_used_bytes: _Optional[int] = ..., fetch_bytes: _Optional[int] = ..., kv_rebuild_blocks: _Optional[int] = ..., ssd_degraded: _Optional[bool] = ..., ssd_degraded_reason: _Optional[str] = ..., ssd_write_errors: _Optional[int] = ..., recompute_evict_count: _Optional[int] = ..., hbm_rebalance_count: _Optional[int] = ..., dirty_bytes: _Optional[int] = ..., write_behind_bytes: _Optional[int] = ..., write_behind_in_flight_bytes: _Optional[int] = ..., write_behind_lag_s: _Optional[float] = ..., read_ahead_bytes: _Optional[int] = ..., read_ahead_in_flight_bytes: _Optional[int] = ..., window_freed_blocks: _Optional[int] = ..., window_hbm_bytes: _Optional[int] = ..., shared_blocks: _Optional[int] = ..., shared_hbm_saved_bytes: _Optional[int] = ..., shared_ddr_saved_bytes: _Optional[int] = ..., remote_on: _Optional[bool] = ..., remote_degraded: _Optional[bool] = ..., remote_degraded_reason: _Optional[str] = ..., remote_lag_bytes: _Optional[int] = ..., remote_kv_copied_bytes: _Optional[int] = ..., remote_kv_copy_queued_bytes: _Optional[int] = ..., remote_kv_copy_skipped_blocks: _Optional[int] = ..., digest_bytes: _Optional[int] = ..., digest_shared_saved_bytes: _Optional[int] = ..., digests_set_aside: _Optional[int] = ..., copy_up_bytes: _Optional[int] = ..., copy_down_bytes: _Optional[int] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("system_prompt", "policy", "sampling", "chat")
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    system_prompt: str
    policy: str
    sampling: SamplingParams
    chat: bool
    def __init__(self, system_prompt: _Optional[str] = ..., policy: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., chat: _Optional[bool] = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("session_id", "at_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    AT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    at_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., at_tokens: _Optional[int] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id", "with_tokens", "take_over")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WITH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TAKE_OVER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    with_tokens: bool
    take_over: bool
    def __init__(self, session_id: _Optional[str] = ..., with_tokens: _Optional[bool] = ..., take_over: _Optional[bool] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "all")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    all: bool
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., all: _Optional[bool] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "next_page_token", "total")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    next_page_token: str
    total: int
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "purge")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PURGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    purge: bool
    def __init__(self, session_id: _Optional[str] = ..., purge: _Optional[bool] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AppendContextRequest(_message.Message):
    __slots__ = ("session_id", "text", "token_ids", "role")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    role: str
    def __init__(self, session_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., role: _Optional[str] = ...) -> None: ...

class AppendProgress(_message.Message):
    __slots__ = ("tokens_done", "tokens_total")
    TOKENS_DONE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    tokens_done: int
    tokens_total: int
    def __init__(self, tokens_done: _Optional[int] = ..., tokens_total: _Optional[int] = ...) -> None: ...

class AppendSummary(_message.Message):
    __slots__ = ("tokens_added", "prefill_s", "num_tokens")
    TOKENS_ADDED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens_added: int
    prefill_s: float
    num_tokens: int
    def __init__(self, tokens_added: _Optional[int] = ..., prefill_s: _Optional[float] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class AppendContextResponse(_message.Message):
    __slots__ = ("progress", "done")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    progress: AppendProgress
    done: AppendSummary
    def __init__(self, progress: _Optional[_Union[AppendProgress, _Mapping]] = ..., done: _Optional[_Union[AppendSummary, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "prompt", "prompt_token_ids", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateSummary(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "ttft_s", "tokens_per_s", "residency", "tier_stats")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    TIER_STATS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    tokens_per_s: float
    residency: TierResidency
    tier_stats: TierStats
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., residency: _Optional[_Union[TierResidency, _Mapping]] = ..., tier_stats: _Optional[_Union[TierStats, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "done")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    delta: TokenDelta
    done: GenerateSummary
    def __init__(self, delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., done: _Optional[_Union[GenerateSummary, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionStats(_message.Message):
    __slots__ = ("session_id", "num_tokens", "residency", "hbm_hit_rate", "ssd_read_count", "window_tokens", "itl_ms_p50", "itl_ms_p99", "hbm_share_blocks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    HBM_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    SSD_READ_COUNT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ITL_MS_P50_FIELD_NUMBER: _ClassVar[int]
    ITL_MS_P99_FIELD_NUMBER: _ClassVar[int]
    HBM_SHARE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    residency: TierResidency
    hbm_hit_rate: float
    ssd_read_count: int
    window_tokens: int
    itl_ms_p50: float
    itl_ms_p99: float
    hbm_share_blocks: int
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., residency: _Optional[_Union[TierResidency, _Mapping]] = ..., hbm_hit_rate: _Optional[float] = ..., ssd_read_count: _Optional[int] = ..., window_tokens: _Optional[int] = ..., itl_ms_p50: _Optional[float] = ..., itl_ms_p99: _Optional[float] = ..., hbm_share_blocks: _Optional[int] = ...) -> None: ...

class Throughput(_message.Message):
    __slots__ = ("tokens_per_s", "window_s", "generated_tokens_total", "prefill_tokens_total", "active_requests", "queued_requests", "sessions", "steps_total", "prefix_queries_total", "prefix_hits_total", "prefix_reused_tokens_total", "prefix_cache_sessions")
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REUSED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    tokens_per_s: float
    window_s: float
    generated_tokens_total: int
    prefill_tokens_total: int
    active_requests: int
    queued_requests: int
    sessions: int
    steps_total: int
    prefix_queries_total: int
    prefix_hits_total: int
    prefix_reused_tokens_total: int
    prefix_cache_sessions: int
    def __init__(self, tokens_per_s: _Optional[float] = ..., window_s: _Optional[float] = ..., generated_tokens_total: _Optional[int] = ..., prefill_tokens_total: _Optional[int] = ..., active_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., sessions: _Optional[int] = ..., steps_total: _Optional[int] = ..., prefix_queries_total: _Optional[int] = ..., prefix_hits_total: _Optional[int] = ..., prefix_reused_tokens_total: _Optional[int] = ..., prefix_cache_sessions: _Optional[int] = ...) -> None: ...

class GraphStats(_message.Message):
    __slots__ = ("captures_total", "captures_after_ready", "replays_total", "eager_steps_total", "warm_graphs", "warm_s", "deferred", "captures_ahead")
    CAPTURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CAPTURES_AFTER_READY_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EAGER_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WARM_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    WARM_S_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    CAPTURES_AHEAD_FIELD_NUMBER: _ClassVar[int]
    captures_total: int
    captures_after_ready: int
    replays_total: int
    eager_steps_total: int
    warm_graphs: int
    warm_s: float
    deferred: int
    captures_ahead: int
    def __init__(self, captures_total: _Optional[int] = ..., captures_after_ready: _Optional[int] = ..., replays_total: _Optional[int] = ..., eager_steps_total: _Optional[int] = ..., warm_graphs: _Optional[int] = ..., warm_s: _Optional[float] = ..., deferred: _Optional[int] = ..., captures_ahead: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("sessions", "throughput", "uptime_s", "draining", "graphs")
    GLOBAL_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStats]
    throughput: Throughput
    uptime_s: float
    draining: bool
    graphs: GraphStats
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionStats, _Mapping]]] = ..., throughput: _Optional[_Union[Throughput, _Mapping]] = ..., uptime_s: _Optional[float] = ..., draining: _Optional[bool] = ..., graphs: _Optional[_Union[GraphStats, _Mapping]] = ..., **kwargs) -> None: ...

class EvictSessionRequest(_message.Message):
    __slots__ = ("session_id", "to")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    to: Tier
    def __init__(self, session_id: _Optional[str] = ..., to: _Optional[_Union[Tier, str]] = ...) -> None: ...

class EvictSessionResponse(_message.Message):
    __slots__ = ("blocks_moved", "residency")
    BLOCKS_MOVED_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    blocks_moved: int
    residency: TierResidency
    def __init__(self, blocks_moved: _Optional[int] = ..., residency: _Optional[_Union[TierResidency, _Mapping]] = ...) -> None: ...

class PinSessionRequest(_message.Message):
    __slots__ = ("session_id", "ttl_s", "unpin")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    UNPIN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttl_s: float
    unpin: bool
    def __init__(self, session_id: _Optional[str] = ..., ttl_s: _Optional[float] = ..., unpin: _Optional[bool] = ...) -> None: ...

class SnapshotSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SnapshotSessionResponse(_message.Message):
    __slots__ = ("blocks_written", "seconds")
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    blocks_written: int
    seconds: float
    def __init__(self, blocks_written: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("session_id", "policy")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    policy: str
    def __init__(self, session_id: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("requests_finished", "requests_cancelled")
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    requests_finished: int
    requests_cancelled: int
    def __init__(self, requests_finished: _Optional[int] = ..., requests_cancelled: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("was_draining",)
    WAS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    was_draining: bool
    def __init__(self, was_draining: _Optional[bool] = ...) -> None: ...

class GetConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetConfigResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
