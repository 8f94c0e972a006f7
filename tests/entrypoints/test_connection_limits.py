"""Slow clients, the connection cap and unexpected errors, over real sockets (uvicorn in a thread, fake engine).

Each test waits on socket events (a read that returns when the server answers
or closes), never on sleeps; the socket timeouts are only a safety net.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http import client as http_client

import pytest
from fake_engine import FakeEngine

SAFETY_S = 60  # a socket read never waits longer than this
REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"


class LiveServer:
    """`build_app(FakeEngine())` served by uvicorn with tokenmill's bounded protocol, on 127.0.0.1."""

    def __init__(self, header_timeout_s: float, limit: int | None, body_timeout_s: float | None = None) -> None:
        import uvicorn

        from tokenmill.entrypoints.openai.api_server import build_app
        from tokenmill.entrypoints.openai.limits import bounded_protocol

        app = build_app(FakeEngine(), ["fake-model"], request_body_timeout_s=body_timeout_s)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=30,
                                http=bounded_protocol(header_timeout_s, limit))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + SAFETY_S
        while not self.server.started:  # start-up, not a timed assertion
            assert self.thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=SAFETY_S)
        return s

    def request(self, conn: http_client.HTTPConnection | None = None, prompt: str = "hi") -> tuple[int, dict]:
        conn = conn or http_client.HTTPConnection("127.0.0.1", self.port, timeout=SAFETY_S)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(SAFETY_S)


@pytest.fixture
def live():
    servers: list[LiveServer] = []

    def start(**kwargs) -> LiveServer:
        servers.append(LiveServer(**kwargs))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_an_unexpected_error_is_a_500_body_and_the_connection_keeps_serving(live):
    srv = live(header_timeout_s=30, limit=None)
    conn = http_client.HTTPConnection("127.0.0.1", srv.port, timeout=SAFETY_S)
    status, body = srv.request(conn, prompt="boom")  # the fake engine raises RuntimeError
    assert status == 500 and "RuntimeError" in body["error"]["message"]
    sock = conn.sock
    status, body = srv.request(conn)
    assert status == 200 and conn.sock is sock  # the same kept-alive connection


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"])
def test_a_slow_header_is_closed_after_the_timeout_while_others_are_served(live, sent):
    srv = live(header_timeout_s=1.0, limit=None)
    slow = srv.connect()
    slow.sendall(sent)
    assert srv.request()[0] == 200  # served while the slow socket is open
    started = time.monotonic()
    answer = _read_until_closed(slow)  # returns when the server closes the socket
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 408
    assert time.monotonic() - started < SAFETY_S


def test_a_half_sent_second_request_on_a_kept_alive_connection_is_closed(live):
    srv = live(header_timeout_s=1.0, limit=None)
    sock = srv.connect()
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    sock.sendall(REQUEST % (len(body), body))
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200 ")
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")
    assert _read_until_closed(sock).endswith(b"")  # closed: the read returned
    assert srv.request()[0] == 200


def test_a_slow_body_gets_408_and_the_connection_closes(live):
    srv = live(header_timeout_s=30, limit=None, body_timeout_s=1.0)
    sock = srv.connect()
    sock.sendall(REQUEST % (100, b'{"prompt": "'))  # 12 of the 100 announced bytes
    answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"--request-body-timeout" in answer
    assert srv.request()[0] == 200


def test_past_the_connection_cap_a_request_gets_a_json_503(live):
    srv = live(header_timeout_s=30, limit=3)
    idle = [srv.connect(), srv.connect()]
    assert srv.request()[0] == 200  # 2 idle + this one: at the cap, served
    idle.append(srv.connect())
    status, body = srv.request()  # 3 idle + this one: past it
    assert status == 503
    assert "--limit-concurrency" in body["error"]["message"] and body["error"]["code"] == 503
    for s in idle:
        s.close()


def test_bad_limits_are_refused():
    from tokenmill.entrypoints.openai.limits import bounded_protocol

    with pytest.raises(ValueError, match="request-header-timeout"):
        bounded_protocol(0, 10)
    with pytest.raises(ValueError, match="limit-concurrency"):
        bounded_protocol(5, 0)
