"""`tokenmill` command line: version, help text, and start-up errors turned into exit codes."""

from __future__ import annotations

import pytest

from tokenmill.entrypoints.cli import main, make_parser


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("tokenmill ")


def test_serve_defaults_are_local_and_help_names_device_defaults(capsys):
    args = make_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model_tag) == ("127.0.0.1", 8000, None)
    args = make_parser().parse_args(["serve", "some/model", "--served-model-name", "m", "--max-num-seqs", "4"])
    assert (args.model_tag, args.served_model_name, args.max_num_seqs) == ("some/model", ["m"], 4)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "CPU 256 offline / 128 server" in text  # --max-num-seqs per-device defaults
    assert "127.0.0.1" in text


def test_tokenmill_host_sets_the_default_address(monkeypatch):
    # The container images set TOKENMILL_HOST=0.0.0.0 so that `docker run -p` and a replaced entrypoint
    # (python3 -m tokenmill.entrypoints.openai.api_server) listen on every interface; --host still wins.
    from tokenmill.entrypoints.openai.http_options import http_options_from_args

    monkeypatch.setenv("TOKENMILL_HOST", "0.0.0.0")
    assert http_options_from_args(make_parser().parse_args(["serve"])).host == "0.0.0.0"
    assert http_options_from_args(make_parser().parse_args(["serve", "--host", "127.0.0.2"])).host == "127.0.0.2"
    monkeypatch.delenv("TOKENMILL_HOST")
    assert http_options_from_args(make_parser().parse_args(["serve"])).host == "127.0.0.1"


def test_bad_engine_argument_exits_1_with_the_sentence(capsys):
    code = main(["serve", "--max-num-seqs", "0"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and "--max-num-seqs" in err


@pytest.mark.parametrize("flag, value, words", [
    ("--kv-cache-memory-bytes", "12x", "Cannot read '12x' as a size in bytes; use e.g. 4G"),
    ("--max-model-len", "-5", "'-5' is negative; a token count is 0 or more"),
    ("--max-prefill-tokens-with-decodes", "0.5", "'0.5' is not a whole number of tokens"),
    ("--max-model-len", "2048.9", "'2048.9' is not a whole number of tokens"),
    ("--max-num-batched-tokens", "lots", "cannot read 'lots' as a token count")])
def test_unreadable_sizes_exit_2_with_the_sentence(flag, value, words, capsys):
    """argparse keeps only an ArgumentTypeError's message: the sentence, not the type function's name."""
    with pytest.raises(SystemExit) as exc:
        make_parser().parse_args(["serve", flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}: {words}" in capsys.readouterr().err


def test_token_counts_with_a_suffix_may_have_decimals():
    args = make_parser().parse_args(["serve", "--max-num-batched-tokens", "1.5k", "--max-model-len", "32K"])
    assert (args.max_num_batched_tokens, args.max_model_len) == (1500, 32768)


def test_conflicting_model_arguments_exit_2(capsys):
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "two different models" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "serve" in capsys.readouterr().out


def test_engine_startup_error_is_printed_and_exits_1(monkeypatch, capsys):
    from tokenmill.frontend.async_llm import AsyncLLM
    from tokenmill.frontend.core_client import EngineStartupError

    async def failing(cls, engine_args, usage="server"):
        assert usage == "server" and engine_args.model == "m.gguf"
        raise EngineStartupError("max_model_len 8192 needs 512 KV blocks but only 20 fit; use at most 320.")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(failing))
    assert main(["serve", "m.gguf"]) == 1
    assert "use at most 320" in capsys.readouterr().err


def test_subcommands_with_their_own_parsers_get_the_rest_of_argv(capsys):
    import json

    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert isinstance(info, dict) and info
    assert main(["bench", "--help"]) == 0
    assert "throughput" in capsys.readouterr().out
