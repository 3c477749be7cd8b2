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


def _imported_modules(path) -> set[str]:
    """Every module a file imports, TYPE_CHECKING blocks and function bodies included."""
    import ast

    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def test_models_and_backends_never_import_each_other() -> None:
    # DESIGN.md §13: a model file never knows which backend runs it; a backend never imports a
    # model. Both meet in stages/interface.py and stages/layer_spec.py.
    from pathlib import Path

    stages = Path(__file__).resolve().parents[2] / "stages"
    for half, other in (("models", "stages.backend"), ("backend", "stages.models")):
        files = sorted((stages / half).rglob("*.py"))
        assert files, half
        for path in files:
            crossing = sorted(
                m for m in _imported_modules(path) if m == other or m.startswith(other + ".")
            )
            assert not crossing, f"{path.relative_to(stages.parent)} imports {crossing}"


def test_the_model_registry_imports_without_torch() -> None:
    # stages/config.py reads the registry at start-up, in the launcher too.
    code = (
        "import sys; import stages.models, stages.layer_spec; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
