"""The Dockerfiles, the Compose files and docker/check_torch_arch.py; the real image build is opt-in.

The static checks run everywhere. `deploy/test_images.sh` (build, run, chat,
SIGTERM, compose, GPU image) takes minutes and needs root and Docker: it runs
only with TOKENMILL_TEST_DOCKER=1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {"cpu": REPO / "docker" / "Dockerfile.cpu", "gpu": REPO / "docker" / "Dockerfile"}
COMPOSE = REPO / "deploy" / "compose"


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_dockerfile_has_what_production_needs(kind):
    ins = _instructions(DOCKERFILES[kind])
    first_from = next(i for i, (w, _) in enumerate(ins) if w == "FROM")
    assert ("ARG", "BASE_IMAGE=" + ("python:3.12-slim" if kind == "cpu" else "nvidia/cuda:12.6.3-runtime-ubuntu22.04")) \
        in ins[:first_from]
    assert ins[first_from] == ("FROM", "${BASE_IMAGE}")
    entrypoint = json.loads(dict(ins)["ENTRYPOINT"])
    assert entrypoint == ["tokenmill", "serve"]  # vLLM's shape; the address comes from TOKENMILL_HOST below
    assert dict(ins)["USER"] == "tokenmill"
    assert json.loads(dict(ins)["VOLUME"]) == ["/data"]
    env = dict(ins)["ENV"]
    assert "HF_HOME=/data/huggingface" in env and "TOKENMILL_CACHE_DIR=/data/tokenmill" in env
    assert "TOKENMILL_HOST=0.0.0.0" in env  # every interface, also under a replaced entrypoint
    health = dict(ins)["HEALTHCHECK"]
    assert "/health" in health and re.search(r"--start-period=\d{3,}s", health)
    if kind == "gpu":
        assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126") in ins
        assert ("RUN", "python3 /tmp/check_torch_arch.py && rm /tmp/check_torch_arch.py") in ins


def test_dockerignore_lets_in_what_the_dockerfiles_copy():
    allowed = {line[1:] for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    for path in DOCKERFILES.values():
        for word, rest in _instructions(path):
            if word == "COPY":
                for src in rest.split()[:-1]:
                    assert src.rstrip("/") in allowed, f"{path.name} copies {src}, which .dockerignore leaves out"


def _run_arch_check(tmp_path: Path, flags: str | None, require: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "torch"
    fake.mkdir(exist_ok=True)
    getter = "" if flags is None else f"    _cuda_getArchFlags = staticmethod(lambda: {flags!r})\n"
    (fake / "__init__.py").write_text(f"__version__ = '9.9+fake'\nclass version:\n    cuda = '12.6'\nclass _C:\n"
                                      f"{getter or '    pass'}\n")
    return subprocess.run([sys.executable, str(REPO / "docker" / "check_torch_arch.py")], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tmp_path), "REQUIRE_SM70": require})


def test_the_gpu_build_fails_without_sm70(tmp_path):
    ok = _run_arch_check(tmp_path, "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90", "1")
    assert ok.returncode == 0 and "sm_70" in ok.stdout
    no_volta = _run_arch_check(tmp_path, "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120", "1")
    assert no_volta.returncode == 1 and "has no sm_70 kernels" in no_volta.stderr
    cpu_only = _run_arch_check(tmp_path, None, "1")
    assert cpu_only.returncode == 1 and "arch list []" in cpu_only.stderr
    assert _run_arch_check(tmp_path, "sm_80", "0").returncode == 0


def test_compose_files_wire_the_services_together():
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"tokenmill", "prometheus", "grafana"}
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["job_name"] == "tokenmill" and job["static_configs"][0]["targets"] == ["tokenmill:8000"]
    # Grafana mounts the dashboard folder and the provisioning that points at it.
    mounts = dict(v.rsplit(":", 2)[:2] for v in services["grafana"]["volumes"])
    assert "../grafana" in mounts and (COMPOSE / "../grafana/tokenmill-dashboard.json").exists()
    provider = yaml.safe_load((COMPOSE / "grafana/provisioning/dashboards/tokenmill.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == mounts["../grafana"]
    gpu = yaml.safe_load((COMPOSE / "compose.gpu.yaml").read_text())["services"]["tokenmill"]
    assert gpu["ipc"] == "host" and gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


def test_docker_compose_config_validates():
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install docker-compose)")
    for files in (["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"]):
        args = [a for f in files for a in ("-f", str(COMPOSE / f))]
        result = subprocess.run([tool, *args, "config", "-q"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_images_build_run_and_stop():
    if os.environ.get("TOKENMILL_TEST_DOCKER") != "1":
        pytest.skip("builds and runs container images for minutes: set TOKENMILL_TEST_DOCKER=1 (root, Docker)")
    result = subprocess.run(["bash", str(REPO / "deploy" / "test_images.sh")], capture_output=True, text=True,
                            timeout=3600, env={**os.environ, "PYTHON": sys.executable})
    print(result.stdout[-6000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "test_images.sh: OK" in result.stdout
