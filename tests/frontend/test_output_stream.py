"""OutputStream with a consumer that does not read: one pending output per request, merged exactly.

CUMULATIVE outputs replace the pending one; DELTA outputs are appended to it
(text, token ids, logprobs), so what a slow reader gets equals what reading
every output would have given. Errors come after the outputs put before them.
"""

from __future__ import annotations

import asyncio

import pytest

from tokenmill.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.frontend.output_stream import OutputStream
from tokenmill.frontend.parallel_sampling import make_child_requests
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

CUMULATIVE, DELTA = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA


class _Llm:
    """The two things an OutputStream calls on its AsyncLLM."""

    def __init__(self) -> None:
        self._queues: dict = {}
        self.aborted: list[str] = []

    def abort_requests(self, ids: list[str]) -> None:
        self.aborted.extend(ids)


def _stream(kinds: dict[str, RequestOutputKind]) -> tuple[OutputStream, _Llm]:
    llm = _Llm()
    stream = OutputStream(llm)  # type: ignore[arg-type]
    for rid, kind in kinds.items():
        stream.add(rid, kind)
        llm._queues[rid] = stream
    return stream, llm


def _out(rid: str, text: str, done: bool = False, index: int = 0) -> RequestOutput:
    ids = [ord(c) for c in text]
    comp = CompletionOutput(index, text, ids, logprobs=[{i: Logprob(-1.0)} for i in ids],
                            finish_reason="length" if done else None)
    return RequestOutput(rid, None, [1], [comp], done)


def test_unread_stream_holds_one_pending_output_per_request():
    stream, llm = _stream({"r": CUMULATIVE, "s": DELTA})
    text = "abcdefghij" * 5
    for k in range(1, len(text) + 1):  # 50 steps, nobody reading
        stream.put(_out("r", text[:k], done=k == len(text)))
        stream.put(_out("s", text[k - 1]))
        assert stream.num_pending() == 2
    outs = asyncio.run(stream.next_ready())
    assert [o.request_id for o in outs] == ["r", "s"]  # the order their first outputs arrived
    assert outs[0].outputs[0].text == text and outs[0].finished
    assert outs[1].outputs[0].text == text and outs[1].outputs[0].token_ids == [ord(c) for c in text]
    assert stream.unfinished == {"s"} and list(llm._queues) == ["s"]  # a finished request leaves AsyncLLM._queues
    assert stream.num_pending() == 0
    stream.close()
    assert llm.aborted == ["s"]


def test_one_at_a_time_reader_gets_the_oldest_request_first():
    stream, _ = _stream({"r": CUMULATIVE, "s": CUMULATIVE})

    async def run() -> list[tuple[str, str]]:
        stream.put(_out("r", "a"))
        stream.put(_out("s", "x"))
        first = await stream.__anext__()
        stream.put(_out("r", "ab"))  # r was read: it queues behind s now
        stream.put(_out("s", "xy"))  # s was not: merged in its place
        return [(o.request_id, o.outputs[0].text) for o in [first, await stream.__anext__(),
                                                            await stream.__anext__()]]

    assert asyncio.run(run()) == [("r", "a"), ("s", "xy"), ("r", "ab")]


def test_merged_delta_outputs_concatenate_exactly():
    stream, _ = _stream({"p": DELTA})
    stream.put(RequestOutput("p", None, [1], [CompletionOutput(0, "Ti", [5, 6], -0.5, [{5: Logprob(-0.25)},
                                                                                      {6: Logprob(-0.25)}])], False))
    # Completion 1 appears only in the second output; completion 0 gets a token that adds no text.
    stream.put(RequestOutput("p", None, [1], [CompletionOutput(0, "", [7], -0.75, [{7: Logprob(-0.25)}]),
                                              CompletionOutput(1, "ế", [8], -0.1, [{8: Logprob(-0.1)}])], False,
                             num_cached_tokens=16))
    stream.put(RequestOutput("p", None, [1], [CompletionOutput(0, "ng 🙂", [9], -1.0, [{9: Logprob(-0.25)}],
                                                               "stop", "!")], False, num_cached_tokens=16))
    assert stream.num_pending() == 1
    (out,) = asyncio.run(stream.next_ready())
    assert out.num_cached_tokens == 16 and not out.finished
    assert out.outputs == [
        CompletionOutput(0, "Ting 🙂", [5, 6, 7, 9], -1.0,
                         [{5: Logprob(-0.25)}, {6: Logprob(-0.25)}, {7: Logprob(-0.25)}, {9: Logprob(-0.25)}],
                         "stop", "!"),
        CompletionOutput(1, "ế", [8], -0.1, [{8: Logprob(-0.1)}]),
    ]


def _n2_processor(tokenizer, kind: RequestOutputKind) -> OutputProcessor:
    req = EngineCoreRequest(request_id="p", prompt_token_ids=[1, 2],
                            sampling_params=SamplingParams(n=2, output_kind=kind, logprobs=1, max_tokens=64))
    parent, children = make_child_requests(req)
    proc = OutputProcessor(tokenizer)
    for i, child in enumerate(children):
        proc.add_request(child, None, parent, i)
    return proc


def _steps(ids: list[int]) -> list[EngineCoreOutputs]:
    """Child 0 and child 1 sample `ids` (child 1 one step later); each ends with LENGTH on its last token."""
    steps = []
    for i in range(len(ids) + 1):
        outs = []
        for child, k in (("0_p", i), ("1_p", i - 1)):
            if 0 <= k < len(ids):
                done = FinishReason.LENGTH if k == len(ids) - 1 else None
                outs.append(EngineCoreOutput(child, [ids[k]], new_logprob_token_ids=[[ids[k], 7]],
                                             new_logprobs=[[-0.5 - k, -2.0]], new_sampled_token_ranks=[1],
                                             finish_reason=done))
        steps.append(EngineCoreOutputs(outs, timestamp=100.0 + i))
    return steps


def test_unread_delta_stream_equals_the_read_cumulative_outputs(tokenizer):
    # "ế" and "🙂" span several tokens (text held back, then released): the merge must not drop or split bytes.
    ids = tokenizer.encode(" Tiếng Việt 🙂 ok", add_special_tokens=False)
    stream, _ = _stream({"p": DELTA})
    delta = _n2_processor(tokenizer, DELTA)
    cumulative = _n2_processor(tokenizer, CUMULATIVE)
    last = None
    for step in _steps(ids):  # one flush per step, nobody reading
        for out in delta.process_outputs(step)[0]:
            stream.put(out)
        last = cumulative.process_outputs(step)[0][-1]
        assert stream.num_pending() == 1
    (merged,) = asyncio.run(stream.next_ready())
    assert merged.finished and last.finished and not stream.unfinished

    def fields(c: CompletionOutput) -> tuple:
        return c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason

    assert [fields(c) for c in merged.outputs] == [fields(c) for c in last.outputs]
    assert merged.outputs[0].text == " Tiếng Việt 🙂 ok" and len(merged.outputs[1].token_ids) == len(ids)


@pytest.mark.parametrize("reader", ["next_ready", "anext"])
def test_error_after_outputs_is_raised_after_them(reader):
    stream, llm = _stream({"r": CUMULATIVE, "s": CUMULATIVE})
    for item in (_out("r", "a"), _out("s", "x"), _out("r", "ab", done=True)):
        stream.put(item)
    stream.put_error(ValueError("bad"))
    stream.put(_out("s", "xy"))  # after the error: not merged into the output queued before it

    async def read() -> list[RequestOutput]:
        if reader == "next_ready":
            return await stream.next_ready()
        return [await stream.__anext__()]

    async def run() -> None:
        got = [o for _ in range(1 if reader == "next_ready" else 2) for o in await read()]
        assert [(o.request_id, o.outputs[0].text) for o in got] == [("r", "ab"), ("s", "x")]
        assert stream.unfinished == {"s"} and "r" not in llm._queues
        with pytest.raises(ValueError, match="bad"):
            await read()
        assert [(o.request_id, o.outputs[0].text) for o in await read()] == [("s", "xy")]

    asyncio.run(run())
    stream.close()
    assert llm.aborted == ["s"]


def test_reader_waiting_on_an_empty_stream_wakes_on_put():
    stream, _ = _stream({"r": CUMULATIVE})

    async def run() -> list[RequestOutput]:
        reader = asyncio.ensure_future(stream.next_ready())
        await asyncio.sleep(0)
        assert not reader.done()
        stream.put(_out("r", "a", done=True))
        outs = await reader
        with pytest.raises(StopAsyncIteration):
            await stream.next_ready()
        return outs

    assert [o.outputs[0].text for o in asyncio.run(run())] == ["a"]
