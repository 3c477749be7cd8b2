"""A stage's statistics for the frontend's /metrics, sent at a low, fixed rate.

After a step, at most once per `REPORT_INTERVAL_S` (and once more when the scheduler has just
gone idle, so /metrics shows the idle state), a stage sends its cumulative `StageStats` on its
control path (ring/control.py `report`): round the ring to stage 0, which hands them to the
frontend. A report is one small message a second per stage, sent without waiting, so nothing a
scrape does can hold a step up.
"""

from __future__ import annotations

import time

from protocol.messages import StageStats
from ring.config import RingConfig
from ring.control import RingControl
from ring.roles import LoopStats
from ring.scheduler import Scheduler

REPORT_INTERVAL_S = 1.0


class StatsReporter:
    def __init__(self, cfg: RingConfig, control: RingControl, stats: LoopStats) -> None:
        self.cfg, self.control, self.stats = cfg, control, stats
        self.started = time.monotonic()
        self.last_sent = self.started
        self.idle_reported = False

    def after_step(self, scheduler: Scheduler) -> None:
        now = time.monotonic()
        idle = scheduler.is_idle()
        if idle and self.idle_reported:
            return
        if now - self.last_sent >= REPORT_INTERVAL_S or idle:
            self.control.report(self.snapshot(scheduler, now))
            self.last_sent, self.idle_reported = now, idle

    def snapshot(self, scheduler: Scheduler, now: float) -> StageStats:
        st, pool = self.stats, scheduler.pool
        return StageStats(
            rank=self.cfg.rank,
            steps=st.steps,
            wall_s=now - self.started,
            busy_s=st.busy_s,
            proxy_wait_s=st.proxy_wait_s,
            output_wait_s=st.stalls_s,
            tokens=st.tokens,
            batches=st.batches,
            round_trip_s=st.round_trip_s,
            round_trips=st.round_trips,
            num_running=sum(len(slot) for slot in scheduler.slots),
            num_waiting=len(scheduler.waiting),
            kv_blocks_used=pool.num_blocks - pool.num_available,  # held by requests
            kv_blocks_total=pool.num_blocks,
        )
