"""Installing tokenmill: the torch choice of scripts/install_torch.sh, missing extras, a CUDA torch without a GPU, docs.

The script is run in --dry-run mode with a fake `nvidia-smi` first on PATH,
so the pip command it would run is checked without installing anything.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install_torch.sh"
CU126 = "--index-url https://download.pytorch.org/whl/cu126"


def _dry_run(tmp_path: Path, nvidia_smi: str | None) -> str:
    """The command the script prints with `nvidia_smi` as the fake tool's shell body (None: no nvidia-smi)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\n" + nvidia_smi + "\n")
        fake.chmod(0o755)
    # Only the fake and the basic tools the script uses (sh, tr, grep, sort, head) are on PATH.
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    done = subprocess.run(["sh", str(SCRIPT), "PY", "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("caps", ["7.0", "7.5", "8.0\\n7.0"])
def test_compute_capability_7_gets_the_cuda_12_6_build(tmp_path, caps):
    # The query the script must make is checked too: any other arguments print nothing.
    fake = ('[ "$*" = "--query-gpu=compute_cap --format=csv,noheader" ] || exit 3\n'
            f'printf "{caps}\\n"')
    assert _dry_run(tmp_path, fake) == f"PY -m pip install torch {CU126}"


def test_newer_gpu_gets_pips_default_torch(tmp_path):
    assert _dry_run(tmp_path, 'printf "9.0\\n9.0\\n"') == "PY -m pip install torch"


@pytest.mark.parametrize("nvidia_smi", [None, "echo 'NVIDIA-SMI has failed' >&2; exit 9"])
def test_no_gpu_gets_the_cpu_build(tmp_path, nvidia_smi):
    assert _dry_run(tmp_path, nvidia_smi) == "PY -m pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu"


def test_makefile_installs_torch_through_the_script():
    makefile = (REPO / "Makefile").read_text()
    assert "sh scripts/install_torch.sh $(PY)" in makefile


@pytest.mark.skipif(os.environ.get("TOKENMILL_TEST_NETWORK") != "1",
                    reason="not runnable here: needs download.pytorch.org (set TOKENMILL_TEST_NETWORK=1 to run)")
def test_cuda_12_6_index_serves_torch_wheels(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pip", "download", "torch", "--no-deps", "--dest", str(tmp_path),
                           *CU126.split()], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr
    assert any(p.name.startswith("torch-") and "cu126" in p.name for p in tmp_path.iterdir())


def _run_without(module: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`tokenmill ARGV` in a subprocess where importing `module` fails as if it were not installed."""
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from tokenmill.entrypoints.cli import main\n"
            f"sys.exit(main({argv!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_serve_without_the_serve_extra_names_the_install_line():
    done = _run_without("fastapi", ["serve", "--port", "8000"])
    assert done.returncode == 1, done.stderr
    assert "tokenmill serve needs the 'serve' extra (fastapi is not installed)" in done.stderr
    assert "pip install -e '.[serve]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_bench_serve_without_the_bench_extra_names_the_install_line():
    done = _run_without("aiohttp", ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"])
    assert done.returncode == 1, done.stderr
    assert "tokenmill bench needs the 'bench' extra (aiohttp is not installed)" in done.stderr
    assert "pip install -e '.[bench]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_cuda_torch_without_a_gpu_warns(monkeypatch, caplog):
    import torch

    from tokenmill.platforms import warn_if_cuda_torch_without_gpu

    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="tokenmill.platforms"):
        assert warn_if_cuda_torch_without_gpu() is True
    assert "CUDA 12.6 build, but no NVIDIA GPU is visible" in caplog.text
    assert "https://download.pytorch.org/whl/cpu" in caplog.text
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build: nothing to say
    caplog.clear()
    assert warn_if_cuda_torch_without_gpu() is False and caplog.records == []


def test_docs_do_not_imply_a_pypi_release():
    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for path in texts:
        text = path.read_text()
        assert not re.search(r"pip install (-U )?['\"]?tokenmill\b", text), path
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in (REPO / "README.md").read_text()


def test_readme_supported_models_table_lists_every_registered_architecture():
    from tokenmill.models.registry import get_supported_archs

    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("### Supported models"):]
    for arch in get_supported_archs():
        assert f"`{arch}`" in table, arch
