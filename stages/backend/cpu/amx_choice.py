"""Where a bf16 matrix's calls move to AMX tiles (csrc/matmul_amx.c), chosen by measurement.

A TDPBF16PS does 16 times the work of a vdpbf16ps, but a call on the tiles pays for their
configuration, x padded to whole tiles of 16 rows and, for a weight held as GGUF codes, each
unit's codes decoded to bf16: below some row count the vector kernels (a row's products read
straight from the panels or the codes) win. That count depends on the machine, the threads,
the matrix's kind and shape, so it is measured, as issue 49 asks: the first time a stage meets a
(kind, N, K, threads) on a machine, both paths are timed on a ladder of row counts, alternated,
and the first count from which the tiles win there and at the next rung is kept in a JSON file
beside the kernel build. Every later start on this machine reads it: the choice costs nothing
after the first start, and a matrix's rows take the same path from one start to the next.

`PPRING_AMX_ROWS` (backend/switches.py) sets one row count for every matrix instead (0: never).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from stages.backend.cpu.native import NativeKernels

logger = logging.getLogger(__name__)

# Row counts tried, cheapest first: the search stops at the first rung the tiles win at, and
# at the next (a rung won alone is noise on a shared host until the next agrees).
LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REPEATS = 5  # alternated timings of each path at a rung; their medians are compared
SUFFIX = ".amx_rows.json"  # beside the build it measured: cpu_kernels-<key>.amx_rows.json


def amx_rows_for(module: nn.Module, kernels: NativeKernels, setting: str = "auto") -> int:
    """The row count from which `module` (a bf16 matrix with an `amx_rows` attribute) multiplies
    on AMX tiles; 0: never (no AMX-BF16 here, a K the tiles do not take, or they never won).
    `setting`: "auto" (measured, or read from this machine's file) or a whole number."""
    if not kernels.amx_bf16 or module.in_features % 32:
        return 0
    if setting != "auto":
        return int(setting)
    key = _key(module)
    path = kernels.path.with_suffix(SUFFIX)
    if path not in _TABLES:  # read once a process, not once a matrix
        _TABLES[path] = _read(path)
    table = _TABLES[path]
    if key not in table:
        rows = measure(module)
        # merged into the file as it is now: another stage may have written to it meanwhile
        table.update(_read(path))
        table[key] = rows
        _write(path, table)
        logger.info("AMX tiles for %s: from %s rows (measured)", key, rows or "no")
    return int(table[key])


# each file's choices as this process has read and written them
_TABLES: dict[Path, dict[str, int]] = {}


def measure(module: nn.Module) -> int:
    """The first rung of LADDER from which `module`'s calls are faster on the tiles, there and at
    the next rung (or the last rung alone); 0 if none."""
    kept = module.amx_rows
    won = None
    try:
        for rows in LADDER:
            x = torch.randn(rows, module.in_features).to(torch.bfloat16)
            vector, tiles = [], []
            for _ in range(REPEATS):
                vector.append(_time(module, x, amx_rows=0))
                tiles.append(_time(module, x, amx_rows=1))
            if statistics.median(tiles) < statistics.median(vector):
                if won is not None:
                    return won
                won = rows
            else:
                won = None
        return won or 0
    finally:
        module.amx_rows = kept


def _time(module: nn.Module, x: torch.Tensor, amx_rows: int) -> float:
    module.amx_rows = amx_rows
    start = time.perf_counter()
    module(x)
    return time.perf_counter() - start


def _key(module: nn.Module) -> str:
    """What the choice depends on besides the machine and the build (whose file this is):
    the kind, its grid and passes, the shape and the threads."""
    grid = getattr(module, "grid", None)
    kind = type(module).__name__ + (f"-q{grid.bits}" if grid is not None else "")
    kind += f"-x{module.passes}" if hasattr(module, "passes") else ""
    threads = torch.get_num_threads()
    return f"{kind} {module.out_features}x{module.in_features} threads={threads}"


def _read(path: Path) -> dict[str, int]:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _write(path: Path, table: dict[str, int]) -> None:
    """Atomically (a stage beside this one may read it meanwhile); a folder that cannot be
    written costs only a measurement at the next start."""
    try:
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=".amx_rows-")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(partial, path)
    except OSError as error:
        logger.warning("could not keep the AMX choices in %s: %s", path, error)
