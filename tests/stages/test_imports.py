from __future__ import annotations

import subprocess
import sys


def test_scheduler_facing_modules_import_without_torch() -> None:
    # ring/'s scheduler imports stages.batch; the launcher reads configs and partitions.
    code = (
        "import sys; import stages.batch, stages.partition, stages.config, stages.errors; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
