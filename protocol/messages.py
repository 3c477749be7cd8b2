"""Every message kind on the wire: one frozen dataclass per kind.

Ring kinds travel between stages (`reqs`, `proxy`, `output`, `share`, `ctrl`) and between
stage 0 and the frontend (`submit` and `stop_serving` in, `deltas` and `ctrl` out); client kinds
travel between a client and the frontend (`generate`, `abort`, `ping`, `pong`, `chunk`, `done`,
`error`). Fields typed
`Tensor` travel as raw frames after the msgpack header (protocol/codec.py); every other field
travels inside the header and is type-checked on decode (protocol/schema.py).

The ring's ordering rule (DESIGN.md §6): every stage walks the micro-batch slots in order, and
on iteration `step` it handles slot `step % pp_loop_size`. It sends exactly one `reqs`, one
`proxy` and one `output` per step (an empty batch sends zero-length tensors and empty lists), so
per kind the steps a stage receives are consecutive and a gap is a lost message
(protocol/demux.py checks this).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from protocol.errors import ProtocolError
from protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from torch import Tensor

FINISH_REASONS = ("stop", "length", "abort", "error")
CHAT_ROLES = ("system", "user", "assistant", "tool")


# ---------------------------------------------------------------------------------------------
# Ring messages
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NewRequest:
    """A request as the ring sees it: token ids in, sampling parameters; no text."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    # A replay into a re-formed ring: the last this many input_ids are tokens the request
    # generated before, which the presence and frequency penalties count as its output.
    num_generated: int = 0

    def __post_init__(self) -> None:
        if not self.rid:
            raise ProtocolError("rid must be a non-empty string")
        if not self.input_ids:
            raise ProtocolError(f"request {self.rid} has no input tokens")
        if any(token_id < 0 for token_id in self.input_ids):
            raise ProtocolError(f"request {self.rid} has a negative token id")
        if not 0 <= self.num_generated < len(self.input_ids):
            raise ProtocolError(
                f"request {self.rid}: num_generated must be in [0, {len(self.input_ids)})"
            )


@dataclass(frozen=True)
class Reqs:
    """New requests and aborts that enter the ring at one step; forwarded unchanged."""

    kind: ClassVar[str] = "reqs"
    slot: int
    step: int
    new: list[NewRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    epoch: int = 0  # the ring's incarnation (RingConfig.epoch): older ones are dropped


@dataclass(frozen=True)
class Proxy:
    """The seam tensors of one micro-batch, sent from stage r to stage r+1."""

    kind: ClassVar[str] = "proxy"
    slot: int
    step: int
    digest: str  # the sender's digest of the batch decision; the receiver must compute the same
    hidden_states: Tensor  # [T, d]
    residual: Tensor  # [T, d]; the un-added residual of the fused add+RMSNorm (DESIGN.md §3)
    epoch: int = 0


@dataclass(frozen=True)
class Output:
    """Sampled tokens of one micro-batch, from the last stage around the ring to every stage."""

    kind: ClassVar[str] = "output"
    slot: int
    step: int
    digest: str
    token_ids: list[int]  # one per sampled row, in batch order
    logprobs: list[float] | None = None
    epoch: int = 0
    # per sampled row, its top_logprobs alternatives (stages/batch.py SampleResult)
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclass(frozen=True)
class Share:
    """With the lm_head split (RingConfig.split_lm_head), the last stage's part of one
    micro-batch's logits, sent to stage 0, which finishes them and samples (stages/contract.py
    `LogitsShare`: the tensors' shapes and when `logits` is empty)."""

    kind: ClassVar[str] = "share"
    slot: int
    step: int
    digest: str
    hidden: Tensor  # [N, d]
    logits: Tensor  # [N, V - cut] or [0]
    best_logit: Tensor  # [N] or [0]
    best_token: Tensor  # [N] or [0]
    epoch: int = 0


class Control:
    """Control messages: one frozen dataclass per `op`, all of kind `ctrl` on the wire (the
    header names the op). Not numbered per slot: any stage may originate one (e.g. an error).
    `rank` is the stage that originated it."""

    kind: ClassVar[str] = "ctrl"
    op: ClassVar[str]


@dataclass(frozen=True)
class StageHello(Control):
    """Ring start-up, from stage 0 round the ring: each stage checks the model and ring shape
    are its own and lowers `num_kv_blocks` to what it can hold, so stage 0 gets the minimum."""

    op: ClassVar[str] = "hello"
    rank: int
    num_kv_blocks: int
    config_hash: str
    pp_loop_size: int
    context_length: int
    # Every stage's scheduler replica must decide the same batches from the same inputs, so
    # the flags they decide by must agree as each stage resolved them (a CPU and a GPU node
    # resolve an unset --chunked-prefill-size differently).
    max_running_requests: int
    pp_max_micro_batch_size: int | None
    chunked_prefill_size: int
    split_lm_head: bool = False
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"
    # what each stage's KV cache stores (ring/control.py ModelInfo): a ring stores alike, so
    # its capacity and its accuracy are what the flag says on every stage
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class RingReady(Control):
    """The agreed KV capacity, round the ring from stage 0 (twice: first to have every stage
    allocate it, then, `allocated`, once each has), and then to the frontend."""

    op: ClassVar[str] = "ready"
    rank: int
    num_kv_blocks: int
    epoch: int = 0
    allocated: bool = False


@dataclass(frozen=True)
class Heartbeat(Control):
    """Stage 0, idle: proves the ring is alive when it comes back round."""

    op: ClassVar[str] = "heartbeat"
    rank: int
    seq: int = 0


@dataclass(frozen=True)
class Shutdown(Control):
    """Drains the ring: round it from stage 0 after `step`, then to the frontend."""

    op: ClassVar[str] = "shutdown"
    rank: int
    step: int = 0


@dataclass(frozen=True)
class RingError(Control):
    """A fatal condition, to every stage and the frontend; `message` says what and where."""

    op: ClassVar[str] = "error"
    rank: int
    message: str
    epoch: int = 0


@dataclass(frozen=True)
class NodeHello(Control):
    """Multi-node start-up: a node registers with node 0's rendezvous (launch/rendezvous.py).
    `ring_flags`: the scheduling flags every node must be given alike, by flag name."""

    op: ClassVar[str] = "register"
    rank: int
    host: str
    config_hash: str
    partition: list[int]
    nnodes: int
    port: int
    ring_flags: dict[str, Any]  # JSON-like values only


@dataclass(frozen=True)
class NodeHosts(Control):
    """The rendezvous' answer once every rank has registered: each stage's host, by rank."""

    op: ClassVar[str] = "hosts"
    rank: int
    hosts: list[str]
    epoch: int = 0  # the ring these hosts form: one more each time it re-forms


@dataclass(frozen=True)
class StageStats(Control):
    """What a stage has done since its first step, sent about once a second (ring/report.py)
    round the ring to stage 0 and on to the frontend's /metrics. Times in seconds; the
    scheduler's counts are the same on every stage (it is replicated)."""

    op: ClassVar[str] = "stats"
    rank: int
    steps: int
    wall_s: float  # since the first step
    busy_s: float  # in the stage's forward
    proxy_wait_s: float  # for the previous stage's seam
    output_wait_s: float  # for sampled tokens coming round the ring
    tokens: int  # through the stage's forwards
    batches: int  # forwards run (non-empty micro-batches)
    round_trip_s: float  # stage 0: summed time from a step's seam sent to its tokens back
    round_trips: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int


CTRL_OPS: dict[str, type] = {
    cls.op: cls
    for cls in (
        StageHello,
        RingReady,
        Heartbeat,
        Shutdown,
        RingError,
        NodeHello,
        NodeHosts,
        StageStats,
    )
}


@dataclass(frozen=True)
class Submit:
    """The frontend to stage 0: requests and aborts, numbered in the order they were sent.
    Stage 0 gathers every `Submit` that arrived before a step into that step's `Reqs`."""

    kind: ClassVar[str] = "submit"
    seq: int
    new: list[NewRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    epoch: int = 0  # the ring it was meant for: a re-formed ring drops the older ones


@dataclass(frozen=True)
class StopServing:
    """The frontend to stage 0: fail every request held and shut the ring down."""

    kind: ClassVar[str] = "stop_serving"


@dataclass(frozen=True)
class RequestDelta:
    """What one step did to one request, as stage 0 tells the frontend."""

    rid: str
    token_id: int | None  # the new token; None when the request finished without one
    logprob: float | None
    finish_reason: str  # "" while the request goes on
    error: str = ""  # why, when finish_reason is "error"
    # the new token's step's most likely tokens and their logprobs, when the request asked
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    # with a request's first token: how many of its prompt tokens the prefix cache held
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        if self.finish_reason and self.finish_reason not in FINISH_REASONS:
            raise ProtocolError(f"finish_reason must be one of {', '.join(FINISH_REASONS)}")


@dataclass(frozen=True)
class Deltas:
    """Stage 0 to the frontend: new tokens and finishes, one message per round of the ring's
    slots that has any, sooner for a first token or a finish (ring/loop.py `deltas_due`)."""

    kind: ClassVar[str] = "deltas"
    step: int
    deltas: list[RequestDelta]
    epoch: int = 0


# ---------------------------------------------------------------------------------------------
# Client messages
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in CHAT_ROLES:
            raise ProtocolError(f"chat role must be one of {', '.join(CHAT_ROLES)}")


@dataclass(frozen=True)
class Generate:
    """A client's request. Exactly one of `prompt`, `messages` (chat) or `input_ids` is set."""

    kind: ClassVar[str] = "generate"
    rid: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)  # stop strings, applied by the frontend

    def __post_init__(self) -> None:
        if not self.rid:
            raise ProtocolError("rid must be a non-empty string")
        given = [x for x in (self.prompt, self.messages, self.input_ids) if x is not None]
        if len(given) != 1:
            raise ProtocolError("give exactly one of prompt, messages or input_ids")
        if not given[0]:
            raise ProtocolError("the prompt is empty")
        if self.input_ids is not None and any(t < 0 for t in self.input_ids):
            raise ProtocolError("input_ids must be non-negative token ids")
        if len(self.stop) > 16 or any(not s for s in self.stop):
            raise ProtocolError("stop must be a list of at most 16 non-empty strings")


@dataclass(frozen=True)
class Abort:
    kind: ClassVar[str] = "abort"
    rid: str


@dataclass(frozen=True)
class Ping:
    """A client asks whether a frontend listens; it answers `pong` at once, ring up or not."""

    kind: ClassVar[str] = "ping"
    rid: str


@dataclass(frozen=True)
class Pong:
    kind: ClassVar[str] = "pong"
    rid: str


@dataclass(frozen=True)
class Chunk:
    """An incremental piece of a streamed answer: new text and the token ids it came from."""

    kind: ClassVar[str] = "chunk"
    rid: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    # per token: the most likely tokens at its step and their logprobs (top_logprobs asked)
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclass(frozen=True)
class Done:
    """The one terminal success message of a request, with usage and timings."""

    kind: ClassVar[str] = "done"
    rid: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float  # time to first token
    tpot_s: float  # mean time per output token after the first
    e2e_s: float  # end-to-end latency seen by the frontend
    cached_tokens: int = 0  # prompt tokens the prefix cache held (not computed again)

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ProtocolError(f"finish_reason must be one of {', '.join(FINISH_REASONS)}")


@dataclass(frozen=True)
class Error:
    """The one terminal failure message of a request (or of a message that had no rid)."""

    kind: ClassVar[str] = "error"
    rid: str  # empty when the bad message had no readable rid
    code: str  # e.g. bad_request, ring_down, too_long, aborted
    message: str


RING_KINDS: dict[str, type] = {
    cls.kind: cls for cls in (Reqs, Proxy, Output, Share, Control, Submit, StopServing, Deltas)
}
CLIENT_KINDS: dict[str, type] = {
    cls.kind: cls for cls in (Generate, Abort, Ping, Pong, Chunk, Done, Error)
}
ALL_KINDS: dict[str, type] = {**RING_KINDS, **CLIENT_KINDS}

# Kinds whose (slot, step) a receiver checks for continuity.
SEQUENCED_KINDS = ("reqs", "proxy", "output", "share")


def message_class(kind: object, op: object = None) -> type | None:
    """The dataclass of a message kind (of a control op for kind `ctrl`); None: no such kind."""
    cls = ALL_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is Control:
        return CTRL_OPS.get(op) if isinstance(op, str) else None
    return cls
