"""`--trace-steps DIR`: each stage writes one JSON line per step, for finding where a step's time
goes (what the stage logs' busy and waiting fractions sum up over a run).

A line: {"step", "slot", "start", "decided", "launched", "computed", "end", "requests",
"decodes", "tokens"}. Times are milliseconds since the ring was ready on this stage (each
stage's own clock): `start` the step began, `decided` its batch was known (the reqs waited
for, the scheduler run; with an async depth the decision often came during the previous
forward), `launched` the forward started (after the proxy from the stage before arrived),
`computed` the forward (and, on the sampling stage, the sampling) ended, `end` the step's
messages were out. `requests`, `decodes`, `tokens`: the batch's requests, how many of them
decode one token, and its tokens. The file is DIR/stage<rank>-epoch<epoch>-<pid>.jsonl.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ring.scheduler import Batch


class StepTracer:
    def __init__(self, directory: str | Path, rank: int, epoch: int) -> None:
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"stage{rank}-epoch{epoch}-{os.getpid()}.jsonl"
        self.file = open(self.path, "w", buffering=1 << 16)  # noqa: SIM115 (closed by close())
        self.t0 = time.monotonic()

    def record(
        self,
        batch: Batch,
        start: float,
        decided: float,
        launched: float,
        computed: float,
        end: float,
    ) -> None:
        """One step; the times are time.monotonic() values."""
        decodes = sum(
            1
            for e in batch.entries
            if e.chunk.num_tokens == 1 and e.chunk.start_pos >= len(e.req.prompt_ids)
        )
        line = {
            "step": batch.step,
            "slot": batch.slot,
            **{
                name: round(1000 * (t - self.t0), 2)
                for name, t in (
                    ("start", start),
                    ("decided", decided),
                    ("launched", launched),
                    ("computed", computed),
                    ("end", end),
                )
            },
            "requests": len(batch.entries),
            "decodes": decodes,
            "tokens": batch.num_tokens,
        }
        self.file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.file.close()
