"""OutputProcessor.update + make_outputs over several steps (a front end catching up) vs one step at a time.

The same steps applied in a row and reported once must carry exactly what the
step-by-step outputs carry together: the text, token ids, logprobs, finish and
stop reasons (CUMULATIVE: the last snapshot; DELTA: the concatenation).
"""

from __future__ import annotations

import pytest

from tokenmill.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.frontend.parallel_sampling import make_child_requests
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


def _steps(ids_a: list[int], ids_b: list[int], rid_a: str = "a", rid_b: str = "b") -> list[EngineCoreOutputs]:
    """Two requests, one token per step each; `a` ends with LENGTH at its last token, `b` runs on."""
    steps = []
    for i in range(max(len(ids_a), len(ids_b))):
        outs = []
        if i < len(ids_a):
            lp = [[ids_a[i], 7], [-0.5 - i, -1.5]]
            outs.append(EngineCoreOutput(rid_a, [ids_a[i]], new_logprob_token_ids=[lp[0]], new_logprobs=[lp[1]],
                                         new_sampled_token_ranks=[1],
                                         finish_reason=FinishReason.LENGTH if i == len(ids_a) - 1 else None))
        if i < len(ids_b):
            outs.append(EngineCoreOutput(rid_b, [ids_b[i]]))
        steps.append(EngineCoreOutputs(outs, timestamp=100.0 + i))
    return steps


def _proc(tokenizer, kind: RequestOutputKind, **params) -> OutputProcessor:
    proc = OutputProcessor(tokenizer)
    for rid in ("a", "b"):
        sp = SamplingParams(output_kind=kind, logprobs=1 if rid == "a" else None, max_tokens=64, **params)
        proc.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling_params=sp), None)
    return proc


def _one_by_one(proc: OutputProcessor, steps: list[EngineCoreOutputs]):
    per_step, aborts = [], []
    for step in steps:
        outs, to_abort = proc.process_outputs(step)
        per_step.append(outs)
        aborts += to_abort
    return per_step, aborts


def _coalesced(proc: OutputProcessor, steps: list[EngineCoreOutputs], group: int):
    """Apply `group` steps at a time, then report once."""
    per_group, aborts = [], []
    for start in range(0, len(steps), group):
        touched: dict = {}
        for step in steps[start:start + group]:
            aborts += proc.update(step, touched)
        per_group.append(proc.make_outputs(touched))
    return per_group, aborts


def _text_ids_lps(per_step, rid: str, kind: RequestOutputKind):
    """(text, token ids, logprob keys, finish, stop) of request `rid` over a run's outputs."""
    outs = [o.outputs[0] for step in per_step for o in step if o.request_id == rid]
    if kind == RequestOutputKind.CUMULATIVE:
        last = outs[-1]
        return last.text, last.token_ids, [list(d) for d in last.logprobs or []], last.finish_reason, last.stop_reason
    text = "".join(o.text for o in outs)
    ids = [t for o in outs for t in o.token_ids]
    lps = [list(d) for o in outs for d in (o.logprobs or [])]
    return text, ids, lps, outs[-1].finish_reason, outs[-1].stop_reason


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
@pytest.mark.parametrize("group", [2, 3, 100])
def test_coalesced_steps_carry_the_same_text_tokens_and_logprobs(tokenizer, kind, group):
    # "ế" is two tokens (a held-back partial character), "🙂" more: coalescing must not split or drop bytes.
    ids_a = tokenizer.encode(" Tiếng Việt 🙂 ok", add_special_tokens=False)
    ids_b = tokenizer.encode(" the quick brown fox jumps", add_special_tokens=False)
    steps = _steps(ids_a, ids_b)
    ref, ref_aborts = _one_by_one(_proc(tokenizer, kind), steps)
    got, aborts = _coalesced(_proc(tokenizer, kind), steps, group)
    for rid in ("a", "b"):
        assert _text_ids_lps(got, rid, kind) == _text_ids_lps(ref, rid, kind)
    assert _text_ids_lps(got, "a", kind)[0] == " Tiếng Việt 🙂 ok"
    assert len(_text_ids_lps(got, "a", kind)[1]) == len(ids_a)
    assert aborts == ref_aborts == []
    # One output per request per group, in first-touch order.
    assert all(len({o.request_id for o in outs}) == len(outs) for outs in got)
    assert len(got) == -(-len(steps) // group)


def test_stop_string_in_a_coalesced_group_ignores_the_later_steps_tokens(tokenizer):
    ids_a = tokenizer.encode(" one two three four five six", add_special_tokens=False)
    steps = _steps(ids_a, [], rid_a="a")
    proc = OutputProcessor(tokenizer)
    sp = SamplingParams(output_kind=RequestOutputKind.CUMULATIVE, stop=[" three"], logprobs=1, max_tokens=64)
    proc.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=[1], sampling_params=sp), None)
    (outs,), aborts = _coalesced(proc, steps, len(steps))
    out = outs[0].outputs[0]
    assert out.text == " one two" and out.finish_reason == "stop" and out.stop_reason == " three"
    assert len(out.token_ids) == 3 and len(out.logprobs) == 3  # the core ran ahead; later tokens are dropped
    assert aborts == ["a"] and not proc.has_unfinished_requests()


def test_n_children_coalesced_cumulative_report_the_latest_snapshot(tokenizer):
    a, b = tokenizer.encode(" A", add_special_tokens=False)[0], tokenizer.encode(" B", add_special_tokens=False)[0]
    req = EngineCoreRequest(request_id="p", prompt_token_ids=[1],
                            sampling_params=SamplingParams(n=2, output_kind=RequestOutputKind.CUMULATIVE))
    parent, children = make_child_requests(req)
    proc = OutputProcessor(tokenizer)
    for i, c in enumerate(children):
        proc.add_request(c, None, parent, i)
    steps = [EngineCoreOutputs([EngineCoreOutput("0_p", [a]), EngineCoreOutput("1_p", [b])]),
             EngineCoreOutputs([EngineCoreOutput("0_p", [b], finish_reason=FinishReason.LENGTH),
                                EngineCoreOutput("1_p", [a], finish_reason=FinishReason.LENGTH)])]
    (outs,), _ = _coalesced(proc, steps, 2)
    assert len(outs) == 1 and outs[0].request_id == "p" and outs[0].finished
    assert [(c.index, c.text, c.finish_reason) for c in outs[0].outputs] == [(0, " A B", "length"),
                                                                            (1, " B A", "length")]
    assert not proc.has_unfinished_requests()
