"""Structured output: spec checks, request fields, the bitmask, and the engine-core manager's loop.

The manager tests drive a real xgrammar matcher over SmolLM2's tokenizer with
random "logits": whatever the logits, masked sampling must produce text
that matches the grammar and finishes on EOS.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from optional_deps import require

xgr = require("xgrammar")
jsonschema = require("jsonschema")

from tokenmill.core.request import Request
from tokenmill.core.sched_output import CachedRequestData, SchedulerOutput
from tokenmill.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from tokenmill.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from tokenmill.structured_output.backend import GrammarBackend
from tokenmill.structured_output.bitmask import apply_grammar_bitmask, grammar_rows, unpack_bitmask
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.structured_output.request import structured_outputs_from_fields
from tokenmill.structured_output.spec import get_spec, validate_structured_outputs

VOCAB = 49152
EOS = 2


# ---------------------------------------------------------------- spec and request fields


@pytest.mark.parametrize("bad", [
    StructuredOutputsParams(json={"type": "objekt"}),
    StructuredOutputsParams(json="{not json"),
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": 5}}}),
    StructuredOutputsParams(regex="a(b"),
    StructuredOutputsParams(grammar="root ::= (\"a\""),
    StructuredOutputsParams(choice=[]),
    StructuredOutputsParams(choice=["a"], regex="b"),
    StructuredOutputsParams(),
])
def test_invalid_specs_are_value_errors(bad):
    with pytest.raises(ValueError):
        validate_structured_outputs(bad)


def test_spec_kinds_and_key_keeps_property_order():
    spec = get_spec(StructuredOutputsParams(json={"properties": {"z": {}, "a": {}}, "type": "object"}))
    assert spec.kind == "json" and list(json.loads(spec.value)["properties"]) == ["z", "a"]
    assert get_spec(StructuredOutputsParams(choice=["x", "y"])).choices() == ["x", "y"]
    assert get_spec(None) is None
    assert validate_structured_outputs(StructuredOutputsParams(grammar='root ::= "a" | "b"')).kind == "grammar"
    assert validate_structured_outputs(StructuredOutputsParams(grammar='start: "a" | "b"')).kind == "grammar"


def test_sampling_params_structured_outputs_field():
    so = StructuredOutputsParams(regex="[0-9]+")
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    old = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "b"]))  # vLLM's older name
    assert old.structured_outputs == StructuredOutputsParams(choice=["a", "b"]) and old.guided_decoding is None
    assert SamplingParams(structured_outputs={"json_object": True}).structured_outputs == \
        StructuredOutputsParams(json_object=True)
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=so, guided_decoding=so)
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"json_schema": {}})
    with pytest.raises(ValueError, match="typed field"):
        SamplingParams(extra_args={"structured_outputs": {"regex": "a"}})


def test_structured_outputs_cross_the_process_boundary():
    from tokenmill.engine.messages import decode_request, encode_request

    so = StructuredOutputsParams(json={"type": "object"}, reasoning_end_token_ids=[7, 8])
    req = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=so))
    assert decode_request(encode_request(req)).sampling_params.structured_outputs == so


def test_response_format_conversion():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert structured_outputs_from_fields(rf) == StructuredOutputsParams(json=schema)
    assert structured_outputs_from_fields({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    assert structured_outputs_from_fields({"type": "text"}) is None
    assert structured_outputs_from_fields(None, None, {"guided_regex": "[0-9]+"}) == \
        StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(ValueError, match="one way only"):
        structured_outputs_from_fields({"type": "json_object"}, {"regex": "a"})
    with pytest.raises(ValueError, match="response_format.type"):
        structured_outputs_from_fields({"type": "xml"})
    with pytest.raises(ValueError, match="JSON schema"):
        structured_outputs_from_fields({"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": 3}}})


# ---------------------------------------------------------------- bitmask


def test_mask_apply_matches_xgrammar_kernel_and_torch_fallback():
    rng = np.random.default_rng(0)
    v = 100
    bitmask = torch.from_numpy(rng.integers(-(2**31), 2**31 - 1, size=(5, 4), dtype=np.int64).astype(np.int32))
    logits = torch.randn(5, v)
    rows = [4, 0, 2]
    fast, slow = logits.clone(), logits.clone()
    apply_grammar_bitmask(fast, bitmask, torch.tensor(rows), rows)  # xgrammar's kernel
    apply_grammar_bitmask(slow, bitmask, torch.tensor(rows))  # pure torch
    assert torch.equal(fast, slow)
    # Reference from the bits themselves: token t of row r is allowed iff bit t % 32 of word t // 32 is set.
    words = bitmask.numpy().astype(np.int64) & 0xFFFFFFFF
    for r in range(5):
        for t in range(v):
            allowed = r not in rows or (words[r, t // 32] >> (t % 32)) & 1
            assert (slow[r, t] == logits[r, t]) if allowed else slow[r, t] == float("-inf")
    # word 5 = 0b101: tokens 0 and 2 allowed, 1 not.
    assert unpack_bitmask(torch.tensor([[5]], dtype=torch.int32), 3).tolist() == [[True, False, True]]


def test_grammar_rows_align_with_sampling_rows():
    so = SchedulerOutput([], CachedRequestData(), {"a": 1, "b": 5, "c": 1}, 7)
    so.structured_output_request_ids = {"c": 0, "b": 1}
    so.grammar_bitmask = np.array([[1], [2]], np.int32)
    bitmask, rows, rows_list = grammar_rows(so, ["a", "c"], torch.device("cpu"))  # "b": partial prefill, no sample
    assert rows_list == [1] and rows.tolist() == [1] and bitmask.tolist() == [[-1], [1]]
    assert grammar_rows(so, ["a"], torch.device("cpu")) is None


# ---------------------------------------------------------------- the manager loop


@pytest.fixture(scope="module")
def backend(smollm2_gguf):
    from tokenmill.model_loader.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_gguf)
    return tok, GrammarBackend(tok, VOCAB, [EOS])


class _Scheduler:
    def __init__(self) -> None:
        self.finished: list[str] = []

    def finish_requests(self, ids, status) -> None:
        self.finished += ids


def _manager(backend) -> StructuredOutputManager:
    cfg = SimpleNamespace(model_config=None, scheduler_config=SimpleNamespace(max_num_seqs=8))
    return StructuredOutputManager(cfg, backend_factory=lambda: backend)


def _request(req_id: str, so: dict, max_tokens: int = 120) -> Request:
    params = SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**so))
    return Request(EngineCoreRequest(req_id, [1, 2, 3], params), max_tokens)


def _run(backend, specs: dict[str, dict], seed: int = 0, max_steps: int = 150) -> dict[str, list[int]]:
    """Drive the manager like EngineCore.step does, sampling from random logits masked by its bitmask."""
    _, be = backend
    mgr = _manager(be)
    for rid, so in specs.items():
        req = _request(rid, so)
        mgr.submit(req, mgr.spec_of(req))
    admitted: list[str] = []
    while mgr.has_pending():
        ready, failed = mgr.pop_ready(wait=True)
        assert failed == []
        admitted += [r.request_id for r in ready]
    assert sorted(admitted) == sorted(specs)
    gen = torch.Generator().manual_seed(seed)
    tokens: dict[str, list[int]] = {r: [] for r in specs}
    live = list(specs)
    sched = _Scheduler()
    for _ in range(max_steps):
        if not live:
            break
        so = SchedulerOutput([], CachedRequestData(), {r: 1 for r in live}, len(live))
        mgr.fill_bitmask(so)
        logits = torch.randn(len(live), VOCAB, generator=gen) * 3
        apply_grammar_bitmask(logits, *grammar_rows(so, live, torch.device("cpu")))
        picked = logits.argmax(-1).tolist()
        outs = []
        for rid, tok in zip(live, picked):
            tokens[rid].append(tok)
            # The scheduler finishes a request on EOS (a stop token).
            outs.append(EngineCoreOutput(rid, [tok], finish_reason=FinishReason.STOP if tok == EOS else None))
        mgr.accept_outputs(EngineCoreOutputs(outs), sched)
        live = [r for r, o in zip(live, outs) if o.finish_reason is None]
    assert not live, "a constrained request did not finish"
    return tokens


def test_masked_random_sampling_always_matches(backend):
    tok, _ = backend
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 50},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 2}},
        "required": ["name", "n", "tags"]}
    specs = {"json": {"json": schema}, "regex": {"regex": r"[a-c]{2}-\d{2}"},
             "choice": {"choice": ["alpha", "beta", "gamma delta"]},
             "ebnf": {"grammar": 'root ::= "(" [0-9]+ ")"'}}
    for seed in range(2):
        tokens = _run(backend, specs, seed)
        texts = {r: tok.decode([t for t in ids if t != EOS]) for r, ids in tokens.items()}
        assert all(ids[-1] == EOS for ids in tokens.values())
        jsonschema.validate(json.loads(texts["json"]), schema)
        assert re.fullmatch(r"[a-c]{2}-\d{2}", texts["regex"])
        assert texts["choice"] in ("alpha", "beta", "gamma delta")
        assert re.fullmatch(r"\(\d+\)", texts["ebnf"])


def test_terminated_grammar_finishes_without_eos_in_stop_ids(backend):
    _, be = backend
    mgr = _manager(be)
    req = _request("r", {"choice": ["ab"]})
    mgr.submit(req, mgr.spec_of(req))
    while mgr.has_pending():
        mgr.pop_ready(wait=True)
    sched = _Scheduler()
    m = mgr.matchers["r"]
    assert m.accept_string("ab")
    out = EngineCoreOutput("r", [EOS])
    mgr.accept_outputs(EngineCoreOutputs([out]), sched)
    assert sched.finished == ["r"] and out.finish_reason is not None and "r" not in mgr.matchers


def test_rejected_token_stops_the_request_and_abort_forgets(backend):
    tok, be = backend
    mgr = _manager(be)
    for rid in ("a", "b"):
        req = _request(rid, {"regex": "[0-9]+"})
        mgr.submit(req, mgr.spec_of(req))
    mgr.abort(["b"])
    while mgr.has_pending():
        mgr.pop_ready(wait=True)
    assert set(mgr.matchers) == {"a"}
    sched = _Scheduler()
    letter = tok.encode("x", add_special_tokens=False)[0]
    out = EngineCoreOutput("a", [letter])
    mgr.accept_outputs(EngineCoreOutputs([out]), sched)
    assert sched.finished == ["a"] and out.finish_reason is not None


def test_grammar_waits_for_the_end_of_reasoning(backend):
    tok, be = backend
    mgr = _manager(be)
    end_ids = tok.encode("</think>", add_special_tokens=False)
    params = SamplingParams(max_tokens=50, structured_outputs=StructuredOutputsParams(
        regex="[0-9]+", reasoning_end_token_ids=end_ids))
    req = Request(EngineCoreRequest("t", [1, 2], params), 50)
    mgr.submit(req, mgr.spec_of(req))
    while mgr.has_pending():
        mgr.pop_ready(wait=True)
    sched = _Scheduler()
    thinking = tok.encode("Let me think, x", add_special_tokens=False)
    for t in thinking + end_ids:
        so = SchedulerOutput([], CachedRequestData(), {"t": 1}, 1)
        mgr.fill_bitmask(so)
        assert so.grammar_bitmask is None  # free text while thinking (letters would break the regex)
        mgr.accept_outputs(EngineCoreOutputs([EngineCoreOutput("t", [t])]), sched)
    assert sched.finished == [] and "t" not in mgr.thinking
    so = SchedulerOutput([], CachedRequestData(), {"t": 1}, 1)
    mgr.fill_bitmask(so)
    allowed = unpack_bitmask(torch.from_numpy(so.grammar_bitmask), VOCAB)[0]
    assert allowed[tok.encode("7", add_special_tokens=False)[0]]
    assert not allowed[tok.encode("x", add_special_tokens=False)[0]]
