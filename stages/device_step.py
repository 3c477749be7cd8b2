"""A step queued on a CUDA device, as the ring's loop sees it (`StepHandle`, `Sample`).

`StageRunner.launch` on a GPU returns as soon as the step's kernels (or its graph replay) and
the copies of its outputs to pinned host memory are queued; an event marks their end. The loop
prepares the next step meanwhile (SGLang's overlap scheduling), and only `wait()` blocks, on
the event, not on the whole device. Sampled greedy tokens travel the same way and are the last
stage's only per-step wait.

A stage on the host can take the same path (`StageRunner(overlap=True)`) with `HostEvent`s,
which are done as soon as recorded: the step has run by then. The tests run real rings that way,
so the queued path is exercised on every CI run, not only on a GPU.
"""

from __future__ import annotations

import time

import torch

from stages.batch import SampleResult
from stages.contract import StageOutput, StepHandle

# First guess of a step's device time, before one has been measured.
FIRST_ESTIMATE_S = 0.005
CLOCK_WEIGHT = 0.2  # of the newest measurement in the moving average


class StepClock:
    """How long the device took for recent steps (a moving average), so the loop knows when a
    queued step should be done (`StepHandle.ready_at`)."""

    def __init__(self) -> None:
        self.estimate_s = FIRST_ESTIMATE_S

    def record(self, seconds: float) -> None:
        self.estimate_s += CLOCK_WEIGHT * (seconds - self.estimate_s)


class HostEvent:
    """A CUDA event's stand-in for a step that ran on the host: complete once recorded."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.monotonic()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.at - self.at) * 1000  # ms, as torch.cuda.Event's


Event = torch.cuda.Event | HostEvent


def new_event(device: torch.device, timing: bool = False) -> Event:
    """An event on the device's stream (CUDA), or a host stand-in."""
    if device.type == "cuda":
        return torch.cuda.Event(enable_timing=timing)
    return HostEvent()


class DeviceSample:
    """Greedy token ids [N] on their way into pinned host memory (the copy is queued); `event`
    is recorded here, after the copy."""

    def __init__(self, host_tokens: torch.Tensor, event: Event) -> None:
        self.host_tokens = host_tokens
        self.event = event
        self.event.record()

    def is_ready(self) -> bool:
        return self.event.query()

    def wait(self) -> SampleResult:
        self.event.synchronize()
        return SampleResult(token_ids=self.host_tokens.tolist())


class DeviceStep(StepHandle):
    """A queued step: `output` (a seam in pinned host buffers, a share, or a sample) is valid
    once the `end` event has completed. `start` and `end` are timing events around the step,
    so each wait measures the device's own time for it, however late the host asks."""

    overlaps = True

    def __init__(
        self,
        output: StageOutput,
        start: Event,
        end: Event,
        seam: bool,
        launched_at: float,
        clock: StepClock,
    ) -> None:
        self.output = output
        self.start, self.end = start, end
        # The seam's host tensors exist now, so the proxy header can be encoded while the
        # device fills them; ZeroMQ reads them after `wait`.
        self.early_output = output if seam else None  # type: ignore[assignment]
        self.clock = clock
        self.ready_at = launched_at + clock.estimate_s

    def wait(self) -> StageOutput:
        self.end.synchronize()
        self.ended_at = time.monotonic()
        self.clock.record(self.start.elapsed_time(self.end) / 1000)  # ms -> s
        return self.output
