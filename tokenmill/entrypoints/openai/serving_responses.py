"""POST /v1/responses (and GET /v1/responses/{id}): OpenAI's Responses API over the chat handler.

A request is translated to a chat request (protocol_responses.py) and run
by `OpenAIServingChat` (chat template or harmony, tool and reasoning
parsers); its message fields become output items:

    reasoning_content -> {"type": "reasoning", "content": [{"type": "reasoning_text", ...}]}
    content           -> {"type": "message", "content": [{"type": "output_text", ...}]}
    tool_calls        -> one {"type": "function_call", "call_id", "name", "arguments"} each

Streaming sends OpenAI's event sequence, every event with a
`sequence_number` counting from 0:

    response.created, response.in_progress,
    per item: response.output_item.added, [response.content_part.added],
              response.reasoning_text.delta* | response.output_text.delta* |
              response.function_call_arguments.delta*,
              response.reasoning_text.done | response.output_text.done | response.function_call_arguments.done,
              [response.content_part.done], response.output_item.done,
    response.completed (or response.incomplete when max_output_tokens cut the output)

`store` (default true) keeps the response and its conversation in memory,
the last `max_stored` of them (LRU), so `previous_response_id` can continue
it and GET /v1/responses/{id} can return it.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest, to_chat_body
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat, parser_input
from tokenmill.entrypoints.openai.serving_engine import (
    Submission,
    finish_reason_text,
    ready_outputs,
    sse,
    stream_error_body,
)

DEFAULT_MAX_STORED = 1024


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    messages: list[dict[str, Any]]  # the conversation after it (chat messages, without instructions)


class ResponseStore:
    """The last `max_stored` stored responses, least recently used evicted first."""

    def __init__(self, max_stored: int = DEFAULT_MAX_STORED) -> None:
        self.max_stored = max_stored
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_stored:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def __len__(self) -> int:
        return len(self._items)


def output_items(fields: dict[str, Any]) -> list[dict[str, Any]]:
    """Output items of a finished chat message's fields (reasoning, message, function calls, in that order)."""
    items: list[dict[str, Any]] = []
    if fields.get("reasoning_content"):
        items.append(_reasoning_item(fields["reasoning_content"], "completed"))
    if fields.get("content"):
        items.append(_message_item(fields["content"], "completed"))
    for call in fields.get("tool_calls") or []:
        fn = call["function"]
        items.append(_call_item(call["id"], fn["name"], fn["arguments"], "completed"))
    return items


def _reasoning_item(text: str | None, status: str, item_id: str | None = None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id or _new_id("rs"), "summary": [], "content": content, "status": status}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(text: str | None, status: str, item_id: str | None = None) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
    return {"type": "message", "id": item_id or _new_id("msg"), "role": "assistant", "status": status,
            "content": content}


def _call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def items_to_message(items: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The assistant chat message that output `items` make (for the stored conversation)."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for it in items:
        if it["type"] == "reasoning":
            msg["reasoning_content"] = "".join(c["text"] for c in it["content"])
        elif it["type"] == "message":
            msg["content"] += "".join(c["text"] for c in it["content"])
        elif it["type"] == "function_call":
            fn = {"name": it["name"], "arguments": it["arguments"]}
            msg.setdefault("tool_calls", []).append({"id": it["call_id"], "type": "function", "function": fn})
    return msg if len(msg) > 2 or msg["content"] else None


class OpenAIServingResponses:
    """Handler for /v1/responses.

    Args:
        chat: the server's chat handler (template / harmony, parsers, engine).
        max_stored: responses kept for previous_response_id (LRU bound).
    """

    def __init__(self, chat: OpenAIServingChat, max_stored: int = DEFAULT_MAX_STORED) -> None:
        self.chat = chat
        self.store = ResponseStore(max_stored)

    def start(self, req: ResponsesRequest, raw_request: Any = None) -> tuple[dict[str, Any], ChatCompletionRequest,
                                                                          Submission, list[dict[str, Any]]]:
        """Validate, translate, queue; returns (response skeleton, chat request, submission, conversation).

        Raises:
            ValueError: a bad field, or an unknown previous_response_id (400).
            ModelNotFoundError: an unknown model (404).
        """
        history: list[dict[str, Any]] = []
        if req.previous_response_id:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise ValueError(f"previous_response_id {req.previous_response_id!r} is unknown: this server keeps "
                                 f"the last {self.store.max_stored} responses created with store=true, in memory.")
            history = prev.messages
        response_id = req.request_id or _new_id("resp")
        try:
            chat_req = ChatCompletionRequest.model_validate(to_chat_body(req, history, response_id))
        except ValidationError as exc:  # a field out of the chat request's range (seed, top_k, ...): the client's
            errs = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"Invalid request: {errs}.") from None
        _, model, sub = self.chat.start(chat_req, raw_request)
        skeleton = {
            "id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "in_progress", "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {}, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id":
                req.previous_response_id, "reasoning": req.reasoning, "store": req.store is not False,
            "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
            "truncation": "disabled", "usage": None, "user": req.user,
        }
        conversation = chat_req.message_dicts()
        if req.instructions:
            conversation = conversation[1:]  # instructions do not carry over to the next response (OpenAI)
        return skeleton, chat_req, sub, conversation

    def _finish(self, req: ResponsesRequest, skeleton: dict[str, Any], sub: Submission,
                items: list[dict[str, Any]], finish: str | None, reasoning_text: str,
                conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """The completed response object (also stored when `store`)."""
        resp = dict(skeleton)
        resp["output"] = items
        resp["status"] = "completed"
        if finish == "length":
            resp["status"], resp["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        elif finish == "abort":
            resp["status"] = "cancelled"
        p, c = sub.num_prompt_tokens(), sub.num_completion_tokens()
        resp["usage"] = {"input_tokens": p, "input_tokens_details": {"cached_tokens": sub.num_cached_tokens()},
                         "output_tokens": c, "output_tokens_details": {
                             "reasoning_tokens": self._num_tokens(reasoning_text)}, "total_tokens": p + c}
        if req.store is not False:
            msg = items_to_message(items)
            self.store.put(resp["id"], StoredResponse(resp, conversation + ([msg] if msg else [])))
        return resp

    def _num_tokens(self, text: str) -> int:
        """Tokens of the reasoning text (re-encoded: outputs do not say which token was which part)."""
        tok = getattr(self.chat.engine, "tokenizer", None)
        if not text or tok is None:
            return 0
        return len(tok.encode(text, add_special_tokens=False))

    async def full_response(self, req: ResponsesRequest, skeleton: dict[str, Any], chat_req: ChatCompletionRequest,
                            sub: Submission, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """Wait for the output and build the response object."""
        try:
            async for out in sub.stream:
                sub.record(out)
        finally:
            sub.stream.close()
        comp = sub.ordered_choices()[0].last
        assert comp is not None, "a finished request always has an output"
        parser = chat_req._output_parser
        fields, _ = parser.message(parser_input(parser, comp), finish_reason_text(comp.finish_reason))
        items = output_items(fields)
        return self._finish(req, skeleton, sub, items, finish_reason_text(comp.finish_reason),
                            fields.get("reasoning_content") or "", conversation)

    async def stream_response(self, req: ResponsesRequest, skeleton: dict[str, Any],
                              chat_req: ChatCompletionRequest, sub: Submission,
                              conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        """The Responses SSE event sequence (see the module docstring)."""
        events = _EventWriter(skeleton)
        try:
            yield events.emit("response.created", response=dict(skeleton))
            yield events.emit("response.in_progress", response=dict(skeleton))
            parser = chat_req._output_parser
            streamer = parser.streamer()
            finish = None
            # All outputs queued at once (a client that fell behind) make one update
            # from their joined new text (`Submission.record_ready`).
            async for outs in ready_outputs(sub.stream):
                for choice, comp in sub.record_ready(outs):
                    if choice.finished:
                        continue
                    finish = finish_reason_text(comp.finish_reason)
                    choice.finished = finish is not None
                    for delta in streamer.update(parser_input(parser, comp), final=finish is not None):
                        for chunk in events.delta(delta):
                            yield chunk
            for chunk in events.close_item():
                yield chunk
            resp = self._finish(req, skeleton, sub, events.items, finish, events.reasoning_text, conversation)
            kind = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
            yield events.emit(kind, response=resp)
        except Exception as exc:  # noqa: BLE001 - after headers: report in-band
            err = stream_error_body(exc)["error"]
            yield events.emit("error", code=str(err.get("code")), message=err["message"], param=err.get("param"))
        finally:
            sub.stream.close()


class _EventWriter:
    """Turns chat deltas into Responses events; keeps the output items and the open one."""

    def __init__(self, skeleton: dict[str, Any]) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # closed items, in output order
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""  # text / arguments of the open item so far
        self.reasoning_text = ""

    def emit(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\n{sse(body)}"

    @property
    def index(self) -> int:
        return len(self.items)

    def _open(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[str]:
        self.open, self.text = item, ""
        out = [self.emit("response.output_item.added", output_index=self.index, item=item)]
        if part is not None:
            out.append(self.emit("response.content_part.added", item_id=item["id"], output_index=self.index,
                                 content_index=0, part=part))
        return out

    def close_item(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        out, idx, iid = [], self.index, item["id"]
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            out.append(self.emit("response.reasoning_text.done", item_id=iid, output_index=idx, content_index=0,
                                 text=self.text))
            out.append(self.emit("response.content_part.done", item_id=iid, output_index=idx, content_index=0,
                                 part=part))
            item = _reasoning_item(self.text, "completed", iid)
            self.reasoning_text += self.text
        elif item["type"] == "message":
            part = _output_text(self.text)
            out.append(self.emit("response.output_text.done", item_id=iid, output_index=idx, content_index=0,
                                 text=self.text, logprobs=[]))
            out.append(self.emit("response.content_part.done", item_id=iid, output_index=idx, content_index=0,
                                 part=part))
            item = _message_item(self.text, "completed", iid)
        else:
            out.append(self.emit("response.function_call_arguments.done", item_id=iid, output_index=idx,
                                 name=item["name"], arguments=self.text))
            item = _call_item(item["call_id"], item["name"], self.text, "completed", iid)
        out.append(self.emit("response.output_item.done", output_index=idx, item=item))
        self.items.append(item)
        self.open = None
        return out

    def _text_delta(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            out += self.close_item()
            if kind == "reasoning":
                out += self._open(_reasoning_item(None, "in_progress"), {"type": "reasoning_text", "text": ""})
            else:
                out += self._open(_message_item(None, "in_progress"), _output_text(""))
        self.text += text
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.emit(event, item_id=self.open["id"], output_index=self.index, content_index=0, delta=text,
                             **extra))
        return out

    def delta(self, d: dict[str, Any]) -> list[str]:
        """Events for one chat delta dict (reasoning_content / content / one tool_calls entry)."""
        out: list[str] = []
        if d.get("reasoning_content"):
            out += self._text_delta("reasoning", d["reasoning_content"])
        if d.get("content"):
            out += self._text_delta("message", d["content"])
        for call in d.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):  # a new call's header
                out += self.close_item()
                out += self._open(_call_item(call["id"], fn.get("name", ""), "", "in_progress"), None)
            args = fn.get("arguments") or ""
            if args and self.open is not None and self.open["type"] == "function_call":
                self.text += args
                out.append(self.emit("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=self.index, delta=args))
        return out
