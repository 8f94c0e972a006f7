"""OutputProcessor: stop strings, hold-back, output kinds, logprobs, n > 1 fan-in."""

from __future__ import annotations

import math

import pytest

from tokenmill.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.frontend.parallel_sampling import make_child_requests
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


def _request(rid: str, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(**params))


def _feed(proc: OutputProcessor, rid: str, token_ids: list[int], last_finish: FinishReason | None = None):
    """One token per step; the last step may carry the core's finish reason. Returns (outputs per step, aborts)."""
    steps, aborts = [], []
    for i, t in enumerate(token_ids):
        finish = last_finish if i == len(token_ids) - 1 else None
        outs, to_abort = proc.process_outputs(EngineCoreOutputs([EngineCoreOutput(rid, [t], finish_reason=finish)]))
        steps.append(outs)
        aborts += to_abort
        if outs and outs[0].finished:
            break
    return steps, aborts


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_stop_string_across_token_boundary(tokenizer):
    text = "Hello world, how are you today?"
    ids = _ids(tokenizer, text)
    stop = "o w"  # "Hello" | " world": spans two tokens
    assert not any(stop in tokenizer.decode([t]) for t in ids)
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", stop=[stop], max_tokens=50), None)
    steps, aborts = _feed(proc, "r", ids)
    final = steps[-1][0]
    assert final.finished and final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == stop
    assert final.outputs[0].text == "Hell"
    assert aborts == ["r"]
    assert len(final.outputs[0].token_ids) == 2  # stopped as soon as the stop string was complete
    assert not proc.has_unfinished_requests()


def test_stop_string_inside_one_token(tokenizer):
    ids = _ids(tokenizer, "The cat sat")
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", stop=["at"], include_stop_str_in_output=True), None)
    steps, aborts = _feed(proc, "r", ids)
    out = steps[-1][0].outputs[0]
    assert out.text == "The cat"
    assert out.stop_reason == "at" and aborts == ["r"]


def test_earliest_stop_string_wins(tokenizer):
    ids = _ids(tokenizer, "one two three")
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", stop=["three", "two"]), None)
    steps, _ = _feed(proc, "r", ids)
    out = steps[-1][0].outputs[0]
    assert (out.text, out.stop_reason) == ("one ", "two")


@pytest.mark.parametrize("include", [False, True])
def test_partial_stop_never_streamed_in_delta_mode(tokenizer, include):
    text = "abc STOPPING xyz"
    ids = _ids(tokenizer, text)
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", stop=["STOP"], include_stop_str_in_output=include,
                              output_kind=RequestOutputKind.DELTA), None)
    steps, _ = _feed(proc, "r", ids)
    final_text = "abc STOP" if include else "abc "
    streamed = ""
    for outs in steps:
        assert len(outs) == 1
        streamed += outs[0].outputs[0].text
        # Whatever was shown so far must survive the final truncation.
        assert final_text.startswith(streamed), streamed
    assert streamed == final_text
    assert sum(len(o[0].outputs[0].token_ids) for o in steps) == len(steps)  # DELTA: one new token per step


def test_holdback_released_when_stop_is_ruled_out(tokenizer):
    ids = _ids(tokenizer, "I like STOrms a lot")
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", stop=["STOP"], max_tokens=len(ids)), None)
    steps, aborts = _feed(proc, "r", ids, last_finish=FinishReason.LENGTH)
    shown = [s[0].outputs[0].text for s in steps]  # CUMULATIVE
    assert all("I like STOrms a lot".startswith(t) for t in shown)
    assert len(shown[-2]) <= len("I like STOrms a lot") - 1  # held back while running
    assert steps[-1][0].outputs[0].text == "I like STOrms a lot"
    assert steps[-1][0].outputs[0].finish_reason == "length" and aborts == []


def test_eos_finish_adds_no_text_and_keeps_token(tokenizer):
    ids = _ids(tokenizer, "Paris.") + [tokenizer.eos_token_id]
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", output_kind=RequestOutputKind.FINAL_ONLY), "prompt text")
    steps, aborts = _feed(proc, "r", ids, last_finish=FinishReason.STOP)
    assert all(s == [] for s in steps[:-1])  # FINAL_ONLY: nothing until the end
    (final,) = steps[-1]
    out = final.outputs[0]
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == ("Paris.", ids, "stop", None)
    assert final.prompt == "prompt text" and final.prompt_token_ids == [1, 2, 3]
    assert aborts == []


def test_min_tokens_delays_stop_strings(tokenizer):
    ids = _ids(tokenizer, "a b a b a b")
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", stop=["b"], min_tokens=3), None)
    steps, _ = _feed(proc, "r", ids)
    out = steps[-1][0].outputs[0]
    assert out.finished() and len(out.token_ids) == 4  # " b" at token 2 ignored, " b" at token 4 stops


def test_logprobs_shape_and_cumulative(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", logprobs=2), None)
    rows = [([10, 10, 11], [-0.1, -0.1, -2.5], 1), ([12, 13, 12], [-1.0, -0.5, -1.0], 2)]
    for i, (ids, lps, rank) in enumerate(rows):
        eco = EngineCoreOutput("r", [ids[0]], new_logprob_token_ids=[ids], new_logprobs=[lps],
                               new_sampled_token_ranks=[rank],
                               finish_reason=FinishReason.LENGTH if i == 1 else None)
        outs, _ = proc.process_outputs(EngineCoreOutputs([eco]))
    out = outs[0].outputs[0]
    assert [list(d) for d in out.logprobs] == [[10, 11], [12, 13]]  # sampled first; duplicate kept once
    assert out.logprobs[0][11].rank == 2 and out.logprobs[1][12].rank == 2 and out.logprobs[1][13].rank == 1
    assert out.logprobs[1][13].decoded_token == tokenizer.decode([13])
    assert math.isclose(out.cumulative_logprob, -1.1)


def test_no_logprobs_requested_gives_none(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r"), None)
    outs, _ = proc.process_outputs(EngineCoreOutputs([EngineCoreOutput("r", [5], finish_reason=FinishReason.LENGTH)]))
    assert outs[0].outputs[0].logprobs is None and outs[0].outputs[0].cumulative_logprob is None


def test_n_children_ids_seeds_and_fan_in(tokenizer):
    req = _request("p", n=3, seed=7, output_kind=RequestOutputKind.FINAL_ONLY)
    parent, children = make_child_requests(req)
    assert [c.request_id for c in children] == ["0_p", "1_p", "2_p"]
    assert [c.sampling_params.seed for c in children] == [7, 8, 9]
    assert all(c.sampling_params.n == 1 for c in children) and req.sampling_params.n == 3
    proc = OutputProcessor(tokenizer)
    for i, c in enumerate(children):
        proc.add_request(c, "q", parent, i)
    a, b = _ids(tokenizer, " A")[0], _ids(tokenizer, " B")[0]
    # Children finish in the order 2, 0, 1; the parent reports once, at the end.
    outs, _ = proc.process_outputs(EngineCoreOutputs([EngineCoreOutput("2_p", [b], finish_reason=FinishReason.LENGTH),
                                                      EngineCoreOutput("0_p", [a])]))
    assert outs == []
    outs, _ = proc.process_outputs(EngineCoreOutputs([EngineCoreOutput("0_p", [b], finish_reason=FinishReason.LENGTH),
                                                      EngineCoreOutput("1_p", [a], finish_reason=FinishReason.LENGTH)]))
    assert len(outs) == 1 and outs[0].request_id == "p" and outs[0].finished
    assert [(c.index, c.text) for c in outs[0].outputs] == [(0, " A B"), (1, " A"), (2, " B")]
    assert not proc.has_unfinished_requests()


def test_n_without_seed_leaves_children_unseeded():
    _, children = make_child_requests(_request("p", n=2))
    assert [c.sampling_params.seed for c in children] == [None, None]


def test_abort_parent_returns_child_ids(tokenizer):
    parent, children = make_child_requests(_request("p", n=2))
    proc = OutputProcessor(tokenizer)
    for i, c in enumerate(children):
        proc.add_request(c, None, parent, i)
    assert sorted(proc.abort_requests(["p"])) == ["0_p", "1_p"]
    assert not proc.has_unfinished_requests()
    # Late outputs of aborted requests are dropped.
    outs, _ = proc.process_outputs(EngineCoreOutputs([EngineCoreOutput("0_p", [5])]))
    assert outs == []


def test_duplicate_request_id_rejected(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r"), None)
    with pytest.raises(ValueError, match="already running"):
        proc.add_request(_request("r"), None)
