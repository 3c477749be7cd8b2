"""No pickle anywhere in the project: a peer that can reach a port must not be able to run code.

Scans every shipped package's source (protocol/ above all) for the modules and builtins that
turn bytes into code: pickle (and its relatives), marshal, eval, exec. bench/ is exempt: it
imports pickle only to measure it as the baseline.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "ring", "stages", "launch")
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
BANNED_CALLS = {"eval", "exec", "__import__"}
# torch.load unpickles unless weights_only=True; the project reads safetensors instead.
BANNED_ATTRS = {("torch", "load"), ("zmq", "recv_pyobj"), ("zmq", "send_pyobj")}


def violations(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in BANNED_MODULES:
                found.append(node.module)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in BANNED_CALLS:
                found.append(f"{node.func.id}()")
        elif isinstance(node, ast.Attribute):
            if node.attr in ("recv_pyobj", "send_pyobj"):
                found.append(node.attr)
            if isinstance(node.value, ast.Name) and (node.value.id, node.attr) in BANNED_ATTRS:
                found.append(f"{node.value.id}.{node.attr}")
    return found


def source_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_package_uses_no_pickle_marshal_or_eval(package):
    files = source_files(package)
    if package == "protocol":
        assert files, "protocol/ must exist"
    bad = {str(p.relative_to(ROOT)): v for p in files if (v := violations(p.read_text()))}
    assert not bad, f"code-executing deserialisation found: {bad}"


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "from pickle import loads",
        "import marshal as m",
        "x = eval('1')",
        "exec('x = 1')",
        "import torch\ntorch.load('f')",
        "sock.recv_pyobj()",
    ],
)
def test_the_scanner_catches(snippet):
    assert violations(snippet)
