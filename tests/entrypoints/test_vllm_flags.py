"""The vLLM flag table (tokenmill/config/vllm_flags.py), walked row by row.

Every row's example parses with `tokenmill serve`; an implemented flag changes
the resolved engine config or the built server (compared with the same
command line without the flag); an ignored flag logs its one line and the
server goes on starting; a not-built flag stops start-up with its sentence.
The table, the parser and docs/flags.md must list the same flags.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine, asgi_call

from tokenmill.config import EngineArgs
from tokenmill.entrypoints.cli import main, make_parser
from tokenmill.entrypoints.openai.api_server import build_openai_app
from tokenmill.entrypoints.openai.http_options import http_options_from_args
from tokenmill.model_loader.source import bundled_gguf_path
from tokenmill.config.vllm_flags import FLAGS, check_compat_flags, markdown_table

REPO = Path(__file__).resolve().parents[2]
ENGINE_DESTS = {f.name for f in dataclasses.fields(EngineArgs)}
# Implemented flags whose effect lives in a running process, with the test that observes it there.
OBSERVED_ELSEWHERE = {
    "--shutdown-timeout": "tests/e2e/test_vllm_openai_entrypoint.py",
    "--metrics-vllm-names": "tests/e2e/test_production.py",
    "--enable-auto-tool-choice": "tests/tool_parsers/test_chat_server.py",
    "--tool-call-parser": "tests/e2e/test_agents.py",
    "--async-scheduling": "tests/engine/test_async_scheduling.py",
    "--reasoning-parser": "tests/tool_parsers/test_chat_server.py",
    "--disable-hybrid-kv-cache-manager": "tests/models/test_gpt_oss.py",  # one-group models resolve the same
}


def _argv(example: tuple[str, ...]) -> list[str]:
    gguf = bundled_gguf_path()
    return [a.replace("{model}", gguf).replace("{tokenizer}", os.path.dirname(gguf)) for a in example]


def _without(argv: list[str], flag: str) -> list[str]:
    """`argv` minus `flag` (or its --no- form) and the values after it."""
    out, skip = [], False
    for a in argv:
        if a in (flag, "--no-" + flag[2:]):
            skip = True
            continue
        if skip and not a.startswith("--"):
            continue
        skip = False
        out.append(a)
    return out


def _parse(argv: list[str]) -> Any:
    args = make_parser().parse_args(["serve", *argv])
    args.model = args.model if args.model is not None else args.model_tag
    return args


def _engine_view(argv: list[str]) -> Any:
    """The resolved EngineConfig as comparable dicts, or the ValueError's text."""
    try:
        config = EngineArgs.from_cli_args(_parse(argv)).create_engine_config("server")
    except ValueError as e:
        return f"ValueError: {e}"
    return {sub.name: {f.name: getattr(getattr(config, sub.name), f.name)
                       for f in dataclasses.fields(getattr(config, sub.name)) if f.name != "hf_config"}
            for sub in dataclasses.fields(config)}


class _ModelConfig:
    max_logprobs, chat_template, model, served_model_name = 5, None, "m", "m"


def _server_view(argv: list[str]) -> Any:
    """What the built OpenAI app and its uvicorn settings look like for these flags."""
    args = _parse(argv)
    opts = http_options_from_args(args)
    engine = FakeEngine()
    engine.model_config = _ModelConfig()
    app = build_openai_app(engine, ["m"], args, opts)
    middleware = [(m.cls.__name__, sorted((k, repr(v)) for k, v in m.kwargs.items())) for m in app.user_middleware]
    return {"options": opts, "uvicorn": opts.uvicorn_kwargs(), "middleware": middleware, "docs": app.docs_url,
            "template_policy": app.state.template_policy}


IMPLEMENTED = [f for f in FLAGS if f.status == "implemented"]
IGNORED = [f for f in FLAGS if f.status == "ignored"]
NOT_BUILT = [f for f in FLAGS if f.status == "not-built"]


@pytest.mark.parametrize("info", FLAGS, ids=lambda f: f.flag)
def test_every_example_parses(info):
    default = getattr(_parse([]), info.dest)
    assert getattr(_parse(_argv(info.example)), info.dest) != default, info.flag


def _hub_download_kwargs(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The keyword arguments resolving `--model org/name` + argv hands the Hugging Face hub download."""
    import huggingface_hub

    seen: dict[str, Any] = {}

    def fake_download(repo_id: str, **kwargs: Any) -> str:
        seen.update(kwargs, repo_id=repo_id)
        raise OSError("offline test")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert _engine_view(["--model", "org/name", *argv]).startswith("ValueError: Could not download")
    return seen


@pytest.mark.parametrize("info", IMPLEMENTED, ids=lambda f: f.flag)
def test_implemented_flag_changes_what_runs(info, monkeypatch, tmp_path):
    argv = _argv(info.example)
    if info.flag == "--generation-config":  # the bundled GGUF has no generation_config.json: give a folder
        folder = Path(tmp_path)
        (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.25}))
        argv = ["--generation-config", str(folder)]
    if info.flag in ("--download-dir", "--revision"):  # only a hub download reads them
        with_flag = _hub_download_kwargs(argv, monkeypatch)
        assert with_flag != _hub_download_kwargs([], monkeypatch)
        assert argv[1] in with_flag.values()
        return
    if info.flag in OBSERVED_ELSEWHERE:
        path = REPO / OBSERVED_ELSEWHERE[info.flag]
        text = path.read_text()
        assert info.flag in text or f"{info.dest}=" in text, f"{path} no longer exercises {info.flag}"
        return
    if info.dest in ENGINE_DESTS and info.dest not in ("disable_log_stats",):
        with_flag, without = _engine_view(argv), _engine_view(_without(argv, info.flag))
        assert with_flag != without, f"{info.flag} did not change the resolved engine config"
        if isinstance(with_flag, str):  # a refusal is the behaviour: it must name the flag
            assert info.flag in with_flag, with_flag
    else:
        with_flag, without = _server_view(argv), _server_view(_without(argv, info.flag))
        assert with_flag != without, f"{info.flag} did not change the server"


@pytest.mark.parametrize("info", IGNORED, ids=lambda f: f.flag)
def test_ignored_flag_logs_its_line_and_start_up_goes_on(info, monkeypatch, caplog, capsys):
    from tokenmill.frontend.async_llm import AsyncLLM
    from tokenmill.frontend.core_client import EngineStartupError

    async def reached_engine(cls, engine_args, usage="server"):
        raise EngineStartupError("engine start reached")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(reached_engine))
    with caplog.at_level(logging.WARNING, logger="tokenmill.config.vllm_flags"):
        assert main(["serve", *_argv(info.example)]) == 1
    assert "engine start reached" in capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenmill.config.vllm_flags"]
    assert lines == [f"{info.flag} is ignored: {info.note}"]


@pytest.mark.parametrize("info", NOT_BUILT, ids=lambda f: f.flag)
def test_not_built_flag_fails_start_up_with_its_sentence(info, monkeypatch, capsys):
    from tokenmill.frontend.async_llm import AsyncLLM

    async def must_not_start(cls, engine_args, usage="server"):
        raise AssertionError("the engine must not start")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(must_not_start))
    assert main(["serve", *_argv(info.example)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"Error: {info.flag}") and info.note in err
    assert "usage:" not in err


def test_not_built_flags_off_values_pass_silently(caplog):
    with caplog.at_level(logging.WARNING):
        consumed = check_compat_flags({"cpu_offload_gb": "0", "data_parallel_size": "1", "task": "generate",
                                       "enable_lora": False, "quantization": None})
    assert sorted(consumed) == ["cpu_offload_gb", "data_parallel_size", "enable_lora", "task"]
    assert caplog.records == []


def test_offline_llm_takes_vllm_keywords(caplog):
    from tokenmill.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="LoRA adapters are not supported yet"):
        LLM(enable_lora=True)
    with pytest.raises(ValueError, match="Unknown LLM argument"):
        LLM(no_such_argument=1)


def test_table_parser_and_docs_list_the_same_flags():
    parser = make_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001 - argparse has no public walk
    long_options = {s for a in serve._actions for s in a.option_strings if s.startswith("--")}  # noqa: SLF001
    long_options -= {"--help"} | {s for s in long_options if s.startswith("--no-")}
    assert long_options == {f.flag for f in FLAGS}
    assert len({f.flag for f in FLAGS}) == len(FLAGS)
    docs = (REPO / "docs" / "flags.md").read_text()
    assert markdown_table() in docs, "docs/flags.md is stale: regenerate it with python -m tokenmill.config.vllm_flags"


def test_served_model_names_all_accepted_first_reported():
    import asyncio

    from tokenmill.entrypoints.openai.api_server import build_app

    engine = FakeEngine()
    app = build_app(engine, ["a", "b"], max_logprobs=5)
    status, raw = asyncio.run(asgi_call(app, "GET", "/v1/models"))
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == ["a", "b"]
    for name in ("a", "b"):
        status, raw = asyncio.run(asgi_call(app, "POST", "/v1/completions",
                                            {"model": name, "prompt": "hi", "max_tokens": 2}))
        assert status == 200 and json.loads(raw)["model"] == "a"
    status, raw = asyncio.run(asgi_call(app, "POST", "/v1/completions", {"model": "c", "prompt": "hi"}))
    assert status == 404 and "a, b" in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize("name", ["VLLM_USE_MODELSCOPE", "TOKENMILL_USE_MODELSCOPE"])
def test_modelscope_env_switch_vllm_name_too(name, monkeypatch, tmp_path):
    import tokenmill.model_loader.source as source

    calls = []

    def fake_modelscope(repo_id, revision, download_dir):
        calls.append(repo_id)
        raise ValueError("offline test")

    monkeypatch.setattr(source, "_download_modelscope", fake_modelscope)
    monkeypatch.delenv("TOKENMILL_USE_MODELSCOPE", raising=False)
    monkeypatch.delenv("VLLM_USE_MODELSCOPE", raising=False)
    monkeypatch.setenv(name, "1")
    with pytest.raises(ValueError, match="offline test"):
        source.resolve_model_source("org/model")
    assert calls == ["org/model"]
