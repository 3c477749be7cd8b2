"""The ring's configuration: one frozen dataclass, the same on every stage but for `rank`.

Each process gets `dataclasses.replace(cfg, rank=r)`. What a stage discovers at run time (the
agreed KV capacity, the model's context length) is passed to the scheduler separately and never
written back here.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULE_POLICIES = ("fcfs", "lpm")


@dataclass(frozen=True)
class RingConfig:
    pp_size: int = 1
    rank: int = 0
    pp_async_batch_depth: int = 0
    max_running_requests: int = 64
    pp_max_micro_batch_size: int | None = None  # None: max_running_requests / slots, rounded up
    chunked_prefill_size: int = 512  # prefill tokens per micro-batch, over all requests in it
    # The lm_head split by vocabulary between stage 0 and the last stage (--split-lm-head): the
    # last sends its share of the logits to stage 0 (`share`), which samples and sends the
    # output round the ring. Decode's lm_head then weighs on two stages, not on the last alone.
    split_lm_head: bool = False
    # --disable-radix-cache (SGLang's name): no prefix cache, every prompt computed whole.
    disable_radix_cache: bool = False
    # --schedule-policy (SGLang's name): the order admission takes waiting requests in, "fcfs"
    # (arrival) or "lpm" (longest cached prefix first; ring/scheduler.py _admission_order).
    schedule_policy: str = "fcfs"
    # Liveness. While idle, stage 0 sends a heartbeat around the ring every interval; a stage
    # that hears nothing for `ring_timeout_s` declares the ring down.
    heartbeat_interval_s: float = 1.0
    ring_timeout_s: float = 30.0
    # The ring's incarnation: 0 at start, one more each time the launcher re-forms it after a
    # stage died. Every ring message carries it; one from an older ring is dropped and logged.
    epoch: int = 0
    # --trace-steps: a folder each stage writes one JSON line per step into (ring/trace.py).
    trace_steps_dir: str | None = None
    # Fault injection for tests: (what, rank, step). "diverge": that rank drops the last
    # request of its decision at that step; "drop": that rank does not send its proxy;
    # "forget": from that step on, the first time it has a request waiting, that rank's prefix
    # cache forgets its idle blocks (its cache then differs from the other stages').
    debug_fault: tuple[str, int, int] | None = None

    def __post_init__(self) -> None:
        if self.pp_size < 1:
            raise ValueError(f"--pp-size must be at least 1, got {self.pp_size}")
        if not 0 <= self.rank < self.pp_size:
            raise ValueError(f"rank {self.rank} is outside --pp-size {self.pp_size}")
        if not 0 <= self.pp_async_batch_depth <= 8:
            raise ValueError("--pp-async-batch-depth must be between 0 and 8")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be at least 1")
        if self.pp_max_micro_batch_size is not None and self.pp_max_micro_batch_size < 1:
            raise ValueError("--pp-max-micro-batch-size must be at least 1")
        if self.epoch < 0:
            raise ValueError("--ring-epoch must be at least 0")
        if self.chunked_prefill_size < 1:
            raise ValueError("--chunked-prefill-size must be at least 1")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"--schedule-policy must be one of {', '.join(SCHEDULE_POLICIES)}")
        if self.split_lm_head and self.pp_size < 2:
            raise ValueError("a one-stage ring has no lm_head to split")

    @property
    def output_origin(self) -> int:
        """The rank whose stage samples: stage 0 with the lm_head split, else the last."""
        return 0 if self.split_lm_head else self.pp_size - 1

    @property
    def pp_loop_size(self) -> int:
        """Micro-batch slots in flight: one per stage, plus the async depth (SGLang's rule)."""
        return self.pp_size + self.pp_async_batch_depth

    @property
    def micro_batch_cap(self) -> int:
        """Requests one micro-batch may hold: the running cap split over the slots, rounded up
        so that all of it fits. SGLang splits over the stages, which with an async depth leaves
        slots empty (32 requests, 3 slots: 16, 16 and none)."""
        if self.pp_max_micro_batch_size is not None:
            return self.pp_max_micro_batch_size
        return -(-self.max_running_requests // self.pp_loop_size)

    @property
    def is_first_stage(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank == self.pp_size - 1
