"""Every stage's statistics reach the frontend side of the ring (ring/report.py)."""

from __future__ import annotations

import json
import random
import time

import pytest

from protocol.messages import StageStats
from ring.config import RingConfig
from tests.ring.conftest import SimSpec, random_requests, sim_ring


def latest_reports(driver) -> dict[int, StageStats]:
    reports = {}
    for msg in driver.ctrl:
        if isinstance(msg, StageStats):
            reports[msg.rank] = msg  # they arrive in order per stage
    return reports


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pp_size", [1, 3])
def test_every_stage_reports_its_work_and_the_last_report_is_idle(pp_size):
    cfg = RingConfig(pp_size=pp_size, max_running_requests=16, chunked_prefill_size=64)
    requests = random_requests(random.Random(pp_size), 40, max_prompt=100, max_new=20)
    # Every stage runs every token of every request once: the prompt, then each sampled token
    # but the last.
    tokens = sum(len(prompt) + s.max_new_tokens - 1 for _, prompt, s in requests)
    with sim_ring(cfg, SimSpec(t0_s=0.002)) as ring:
        ring.driver.submit_many(requests)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=60)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            reports = latest_reports(ring.driver)
            if len(reports) == pp_size and all(r.tokens == tokens for r in reports.values()):
                break
            ring.driver.poll(0.05)
    assert sorted(reports) == list(range(pp_size))
    for report in reports.values():
        assert report.tokens == tokens, report
        assert 0 < report.busy_s <= report.wall_s and report.steps >= report.batches > 0
        assert report.num_running == report.num_waiting == report.kv_blocks_used == 0
        assert report.kv_blocks_total == 4096
    if pp_size > 1:
        first = reports[0]
        assert first.round_trips > 0 and first.round_trip_s > 0
        assert reports[1].proxy_wait_s > 0


@pytest.mark.timeout(120)
def test_trace_steps_writes_one_line_per_step_on_every_stage(tmp_path):
    folder = tmp_path / "trace"
    cfg = RingConfig(
        pp_size=2,
        pp_async_batch_depth=1,
        max_running_requests=8,
        chunked_prefill_size=64,
        trace_steps_dir=str(folder),
    )
    requests = random_requests(random.Random(7), 12, max_prompt=100, max_new=10)
    tokens = sum(len(prompt) + s.max_new_tokens - 1 for _, prompt, s in requests)
    decodes = sum(s.max_new_tokens - 1 for _, _, s in requests)  # every sampled token but the last
    with sim_ring(cfg, SimSpec(t0_s=0.002)) as ring:
        ring.driver.submit_many(requests)
        ring.driver.wait_finished([r[0] for r in requests], timeout_s=60)
    files = sorted(folder.glob("*.jsonl"))
    assert [f.name.split("-")[:2] for f in files] == [["stage0", "epoch0"], ["stage1", "epoch0"]]
    for path in files:
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert [x["step"] for x in lines] == list(range(len(lines)))  # every step, in order
        assert all(x["slot"] == x["step"] % cfg.pp_loop_size for x in lines)
        for x in lines:
            assert x["start"] <= x["decided"] <= x["launched"] <= x["computed"] <= x["end"], x
            assert x["decodes"] <= x["requests"] <= x["tokens"] or x["requests"] == 0
        assert sum(x["tokens"] for x in lines) == tokens  # what the stage ran, all of it
        assert sum(x["decodes"] for x in lines) == decodes
