"""The remote reward's client (:mod:`trl_jagg.rewards.remote`) against raw servers on 127.0.0.1 that answer as a
test needs (trickling, rate limiting, oversized or malformed answers, hanging up, never answering): its deadline,
answer bound, retries, settings and score checks. Every loop is bounded; each test takes well under a few seconds."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest
from testing_utils import solid

import trl_jagg.rewards as rewards


def test_remote_reward_names_the_url_when_the_server_is_down():
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score/pickscore"
    with pytest.raises(ConnectionError) as info:
        rewards.remote(url, timeout=2, retries=1, backoff=0.01)(["a"], [solid((0, 0, 0))])
    assert url in str(info.value) and "reward_server.py" in str(info.value)


def read_request(conn: socket.socket) -> None:
    """Read one request whole, its headers then its ``Content-Length`` body (a client may send them apart)."""
    data = b""
    for _ in range(1000):  # bounded: the requests in these tests are small
        head, found, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        if found and len(body) >= int(length.group(1) if length else 0):
            return
        chunk = conn.recv(1 << 20)
        if not chunk:
            return
        data += chunk


def one_shot_server(*behaviours):
    """A raw server on 127.0.0.1 answering one connection per behaviour, in turn, with ``behave(sock)``; returns
    its URL and thread."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def run():
        with listener:
            listener.settimeout(5)
            for behave in behaviours:
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(5)
                    read_request(conn)
                    try:
                        behave(conn)
                    except OSError:
                        pass  # the client gave up and closed

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{port}/score/x", thread


@pytest.mark.parametrize("phase", ["status-line", "body"])
def test_client_timeout_is_a_deadline_against_a_trickling_server(phase):
    def behave(conn):
        head = b"HTTP/1.0 200 OK\r\nContent-Length: 200\r\n\r\n" if phase == "body" else b""
        conn.sendall(head)
        for byte in (b"HTTP/1.0 200 OK\r\n" if phase == "status-line" else b" " * 200)[:60]:  # bounded: 60 bytes
            conn.sendall(bytes([byte]))
            time.sleep(0.05)

    url, thread = one_shot_server(behave)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not answer within timeout=0.5 s"):
        rewards.remote(url, timeout=0.5, retries=0)(["a"], [solid((0, 0, 0))])
    assert time.monotonic() - start < 1.0  # a per-read timeout would wait ~3 s (a byte every 50 ms)
    thread.join(5)


def test_rate_limited_requests_are_retried_after_the_wait_the_server_asks_for():
    answered = []

    def rate_limited(conn):
        answered.append(time.monotonic())
        body = b'{"error": "rate limited"}'
        conn.sendall(
            f"HTTP/1.0 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        conn.sendall(body)

    def scores(conn):
        answered.append(time.monotonic())
        body = json.dumps({"scores": [0.25]}).encode()
        conn.sendall(f"HTTP/1.0 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

    url, thread = one_shot_server(rate_limited, scores)
    # The backoff alone would resend at once: the second attempt waits the 1 s the server asked for.
    assert rewards.remote(url, timeout=5, retries=1, backoff=0.0)(["a"], [solid((0, 0, 0))]) == [0.25]
    assert answered[1] - answered[0] >= 1.0
    thread.join(5)


def test_retries_count_every_attempt_once():
    """``retries=2`` is three attempts in all, each one request on its own connection: the client's one retry loop
    counts every attempt."""
    accepted = []

    def hang_up(conn):  # no answer at all: a transport error for the client
        accepted.append(conn)

    url, thread = one_shot_server(hang_up, hang_up, hang_up)
    with pytest.raises(ConnectionError, match=r"after 3 attempt\(s\)"):
        rewards.remote(url, timeout=2, retries=2, backoff=0.0)(["a"], [solid((0, 0, 0))])
    thread.join(5)
    assert len(accepted) == 3


def test_client_bounds_the_answer_size():
    def behave(conn):
        body = json.dumps({"scores": [0.0] * 200_000}).encode()
        conn.sendall(f"HTTP/1.0 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

    url, thread = one_shot_server(behave)
    with pytest.raises(RuntimeError, match="more than max_response_bytes=4096 bytes"):
        rewards.remote(url, timeout=2, retries=0, max_response_bytes=4096)(["a"], [solid((0, 0, 0))])
    thread.join(5)


def test_a_longer_answer_is_refused_without_reading_the_rest():
    """The server announces a gigabyte, sends 64 KB and holds the connection: the client refuses the answer at its
    bound, without waiting for the rest (which would end at its 30 s deadline as a timeout)."""
    closed = threading.Event()

    def behave(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n" + b" " * 65536)
        conn.settimeout(10)
        if conn.recv(1) == b"":  # the client closes the connection it gave up on
            closed.set()

    url, thread = one_shot_server(behave)
    with pytest.raises(RuntimeError, match="more than max_response_bytes=4096 bytes"):
        rewards.remote(url, timeout=30, retries=0, max_response_bytes=4096)(["a"], [solid((0, 0, 0))])
    assert closed.wait(10)
    thread.join(5)


def test_reward_timeout_cancels_the_request_in_flight():
    """``reward_timeout`` cancels the remote reward's coroutine on the shared event loop: its connection is closed at
    the deadline (a synchronous call abandoned in a thread would hold it until its own 60 s timeout)."""
    from trl_jagg.rewards.calling import RewardTimeout, is_async_reward

    closed = threading.Event()

    def behave(conn):  # never answers; sees the client close the connection
        conn.settimeout(30)
        if conn.recv(1) == b"":
            closed.set()

    url, thread = one_shot_server(behave)
    remote = rewards.remote(url, timeout=60, retries=0)
    assert is_async_reward(remote)
    with pytest.raises(RewardTimeout):
        rewards.compute_rewards([remote], ["a"], [solid((0, 0, 0))], timeout=0.5)
    assert closed.wait(10)
    thread.join(5)


@pytest.mark.parametrize("scores", [["0.5"], [True]], ids=["string", "boolean"])
def test_client_refuses_scores_that_are_not_numbers(scores):
    def behave(conn):
        body = json.dumps({"scores": scores}).encode()
        conn.sendall(f"HTTP/1.0 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

    url, thread = one_shot_server(behave)
    with pytest.raises(RuntimeError, match=r"scores that are not numbers at positions \[0\]"):
        rewards.remote(url, timeout=2, retries=0)(["a"], [solid((0, 0, 0))])
    thread.join(5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(backoff=-1.0), "backoff"),
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=-1), "batch_size"),
        (dict(timeout=float("inf")), "timeout"),
        (dict(timeout=0), "timeout"),
        (dict(retries=1.5), "retries"),
    ],
)
def test_client_settings_are_checked_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=rf"remote\('http://127.0.0.1:9/score/x'\): {field} is "):
        rewards.remote("http://127.0.0.1:9/score/x", **kwargs)
