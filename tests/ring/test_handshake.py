"""The start-up handshake refuses a stage that serves another model (ring/control.py)."""

from __future__ import annotations

import time

import pytest

from ring.config import RingConfig
from ring.loop import ModelInfo
from tests.ring.conftest import sim_ring


@pytest.mark.timeout(60)
def test_a_stage_that_loaded_another_model_stops_the_whole_ring_at_start_up():
    ring = sim_ring(RingConfig(pp_size=3, ring_timeout_s=10))
    ring.model_for = lambda c: ModelInfo(4096, config_hash="other" if c.rank == 2 else "mine")
    with ring:
        codes = ring.join(timeout_s=20)
        deadline = time.monotonic() + 10
        while ring.driver.ring_error() is None and time.monotonic() < deadline:
            ring.driver.poll(0.05)
        error = ring.driver.ring_error()
    assert codes == {0: 1, 1: 1, 2: 1}  # no stage serves, none hangs
    assert error is not None and error.rank == 2
    assert "[pp2] config_hash differs from stage 0's" in error.message
    assert "every stage must serve the same model" in error.message
