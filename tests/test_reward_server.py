"""The remote reward against ``examples/reward_server.py`` (Starlette on uvicorn) started on 127.0.0.1 in the test:
scores, retries, and the server's limits (body size, header and request deadlines, connections, formats, pixels,
token). The client's own limits against raw servers are in ``tests/test_remote_client.py``. Every loop is bounded;
each test takes well under a few seconds."""

from __future__ import annotations

import base64
import importlib
import importlib.util
import inspect
import io
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from testing_utils import noise_image, solid

import trl_jagg.rewards as rewards
from trl_jagg.rewards.remote import encode_image

REPO = Path(__file__).resolve().parents[1]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def image_bytes(image: Image.Image, format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def server_module():
    spec = importlib.util.spec_from_file_location("reward_server", REPO / "examples" / "reward_server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reward_server"] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules["reward_server"]


def serve(server_module, served, **limits):
    server = server_module.build_server(served, "127.0.0.1", 0, server_module.Limits(**limits)).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def pixel_change(prompts, images, source_images, **kwargs):
    """An edit reward: the mean absolute pixel change from each image's source."""
    return [float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).mean())
            for a, b in zip(images, source_images, strict=True)]  # fmt: skip


@pytest.fixture(scope="module")
def server_url(server_module):
    calls = {"flaky": 0}

    def flaky(prompts, images, **kwargs):  # fails on its first call only
        calls["flaky"] += 1
        if calls["flaky"] == 1:
            raise RuntimeError("warming up")
        return [1.0] * len(images)

    def nan_reward(prompts, images, **kwargs):
        return [float("nan")] * len(images)

    def column(prompts, images, offset=None, **kwargs):
        return [float(o) for o in offset]

    def private(prompts, images, **kwargs):
        raise RuntimeError("secret detail: /home/alice/.cache/model.bin")

    served = {"prompt_color": rewards.prompt_color(), "flaky": flaky, "nan": nan_reward, "column": column,
              "private": private, "change": pixel_change}  # fmt: skip
    server, url = serve(server_module, served, max_pixels=512 * 512, request_timeout=0.5, max_body_bytes=2**20)
    yield url
    server.close()


def raw_request(url: str, data: bytes, timeout: float = 5.0) -> tuple[int, dict]:
    """Send ``data`` as is on a fresh connection and return the status and the JSON answer."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        answer = b""
        for _ in range(1000):  # bounded: the server closes after one answer
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"{}")


JSON_POST = b"POST /score/prompt_color HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
"""The headers of a JSON request to ``prompt_color``, to complete (h11 refuses an HTTP/1.1 request without ``Host``
with HTTP 400, as RFC 9112 asks)."""


def post(url: str, path: str, payload, headers: str = "Content-Type: application/json\r\n") -> tuple[int, dict]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode()
    return raw_request(url, head + body)


# ------------------------------------------------------------------------------------------------ scoring
def test_remote_reward_matches_the_local_reward(server_url):
    prompts = ["red", "green", "blue", "none"]
    images = [solid((200, 100, 50)), noise_image(1, 16), solid((0, 0, 255)), solid((9, 9, 9))]
    local = rewards.prompt_color()(prompts, images)
    reward = rewards.remote(f"{server_url}/score/prompt_color", timeout=10)
    assert reward.__name__ == "remote_prompt_color"
    assert reward(prompts, images) == pytest.approx(local, abs=1e-12)  # PNG is lossless
    assert rewards.remote(f"{server_url}/score/prompt_color", batch_size=3)(prompts, images) == pytest.approx(local)


def test_remote_reward_sends_dataset_columns_split_by_batch(server_url):
    reward = rewards.remote(f"{server_url}/score/column", batch_size=2)
    images = [solid((0, 0, 0))] * 3
    assert reward(["a", "b", "c"], images, offset=[1, 2, 3], tensor_column=torch.zeros(3)) == [1.0, 2.0, 3.0]


def test_remote_reward_sends_source_images_split_by_batch(server_url):
    """An editing model's source images travel as lossless PNGs beside the images, split with the batch, and reach
    the served reward as `source_images`; a request whose source list does not match its prompts is a 400."""
    images = [noise_image(seed, 16) for seed in range(3)]
    sources = [noise_image(seed + 10, 16) for seed in range(3)]
    local = pixel_change(["a"] * 3, images, sources)
    reward = rewards.remote(f"{server_url}/score/change", batch_size=2)
    assert reward(["a"] * 3, images, source_images=sources) == pytest.approx(local, abs=1e-12)
    with pytest.raises(ValueError, match="2 source images for 3 images"):
        reward(["a"] * 3, images, source_images=sources[:2])
    status, answer = post(server_url, "/score/change", {"prompts": ["a"], "images": [], "source_images": []})
    assert status == 400 and "'images' must be a list as long as 'prompts'" in answer["error"]
    payload = {"prompts": ["a"], "images": [encode_image(images[0])], "source_images": []}
    status, answer = post(server_url, "/score/change", payload)
    assert status == 400 and "'source_images' must be a list as long as 'prompts'" in answer["error"]


def test_remote_reward_retries_server_errors(server_url):
    reward = rewards.remote(f"{server_url}/score/flaky", retries=2, backoff=0.01)
    assert reward(["a", "b"], [solid((0, 0, 0))] * 2) == [1.0, 1.0]


def test_remote_reward_reports_failing_rewards_and_bad_paths(server_url):
    with pytest.raises(RuntimeError, match="non-finite"):
        rewards.remote(f"{server_url}/score/nan", retries=1, backoff=0.01)(["a"], [solid((0, 0, 0))])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="HTTP 404") as info:
        rewards.remote(f"{server_url}/score/nope", retries=3, backoff=1.0)(["a"], [solid((0, 0, 0))])
    assert time.monotonic() - start < 1.0  # a client error is not retried
    assert "prompt_color" in str(info.value)  # the server lists what it serves


def test_reward_timeout_bounds_a_remote_reward_whose_server_never_answers(server_module):
    """The example server's scoring hangs (until the test ends); the client's own per-attempt timeout (60 s) is far
    off, and reward_timeout stops the wait."""
    from trl_jagg.rewards.calling import RewardTimeout

    release, started = threading.Event(), threading.Event()

    def stuck(prompts, images, **kwargs):
        started.set()
        release.wait(60)
        return [0.0] * len(images)

    server, base = serve(server_module, {"stuck": stuck})
    try:
        remote = rewards.remote(f"{base}/score/stuck", timeout=60, retries=0, name="stuck_server")
        with pytest.raises(RewardTimeout, match=r"Reward 'stuck_server' did not return within reward_timeout=1 s"):
            rewards.compute_rewards([remote], ["a"], [solid((0, 0, 0))], timeout=1)
        assert started.is_set()  # the request reached the server, which was still scoring
    finally:
        release.set()
        server.close()


# ------------------------------------------------------------------------------------------------ server limits
def test_failing_reward_details_stay_in_the_server_log(server_url):
    status, answer = post(
        server_url, "/score/private", {"prompts": ["a"], "images": [b64(image_bytes(solid((0, 0, 0)), "PNG"))]}
    )
    assert status == 500
    assert "secret" not in answer["error"] and "alice" not in answer["error"]


def test_oversized_body_is_refused_before_it_is_read(server_url):
    start = time.monotonic()
    # Headers only: the server must answer without waiting for (or reading) the announced 10 GB.
    status, answer = raw_request(
        server_url,
        JSON_POST + b"Content-Length: 10000000000\r\n\r\n",
    )
    assert status == 413 and "body exceeds 1048576 bytes" in answer["error"]
    assert time.monotonic() - start < 0.4  # before the 0.5 s request deadline
    assert raw_request(server_url, JSON_POST + b"\r\n")[0] == 411


def test_a_chunked_body_is_refused_at_the_bound_whatever_its_content_length(server_module):
    """h11 reads a chunked body past its ``Content-Length``: the server stops at ``max_body_bytes`` (HTTP 413)."""
    server, url = serve(server_module, {"prompt_color": rewards.prompt_color()}, max_body_bytes=1000)
    try:
        chunk = b"[" + b" " * 1998 + b"]"
        head = JSON_POST + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
        status, answer = raw_request(url, head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk))
        assert status == 413 and "body exceeds 1000 bytes" in answer["error"]
    finally:
        server.close()


def trickle(url: str, head: bytes, limit_s: float = 3.0) -> tuple[float, bytes]:
    """Send ``head`` then one byte every 50 ms (at most ``limit_s``) until the server answers or closes."""
    port = int(url.rsplit(":", 1)[1])
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as sock:
        sock.sendall(head)
        sock.settimeout(0.05)
        for _ in range(int(limit_s / 0.05)):
            try:
                data = sock.recv(65536)
                return time.monotonic() - start, data  # an answer, or b"" when the server closed
            except TimeoutError:
                pass
            try:
                sock.sendall(b"x")
            except OSError:
                return time.monotonic() - start, b""
    return time.monotonic() - start, b"still open"


def test_slow_client_is_cut_off_at_the_request_deadline(server_url):
    # Trickling the headers: the connection is closed once the 0.5 s deadline passes, though every byte arrives
    # well within any per-read timeout.
    elapsed, data = trickle(server_url, b"POST /score/prompt_color HTTP/1.1\r\nX-Slow: ")
    assert 0.4 < elapsed < 1.5 and data != b"still open"
    # Trickling the body: HTTP 408.
    head = JSON_POST + b"Content-Length: 100000\r\n\r\n"
    elapsed, data = trickle(server_url, head)
    assert 0.4 < elapsed < 1.5 and data.startswith(b"HTTP/1.1 408")  # answered by the app, through h11


BODY_HEAD = JSON_POST + b"Content-Length: 1000\r\n\r\n"


def test_connections_are_bounded(server_module):
    server, url = serve(server_module, {"prompt_color": rewards.prompt_color()}, max_connections=2,
                        request_timeout=2.0)  # fmt: skip
    port = server.server_address[1]
    try:
        before = threading.active_count()
        # Six requests past their headers, their bodies slow to come: two take the two slots.
        slow = [socket.create_connection(("127.0.0.1", port), timeout=2) for _ in range(6)]
        for sock in slow:
            sock.sendall(BODY_HEAD)
        time.sleep(0.3)
        assert threading.active_count() <= before + 2  # two request threads, not six
        # The four others were answered 503 at once (retried by the client) and closed; the two served wait.
        answers = []
        for sock in slow:
            sock.settimeout(0.2)
            try:
                answers.append(sock.recv(1024)[:12])
            except TimeoutError:
                answers.append(b"waiting")
        assert sorted(answers) == [b"HTTP/1.1 503"] * 4 + [b"waiting"] * 2  # h11 speaks HTTP/1.1
        for sock in slow:
            sock.close()
        time.sleep(0.2)  # the two handlers see the close and free their slots
        assert rewards.remote(f"{url}/score/prompt_color", timeout=2, retries=0)(["red"], [solid((255, 0, 0))])
    finally:
        server.close()


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width x height`` pixels (a decompression bomb needs nothing more)."""
    data = bytearray(image_bytes(solid((0, 0, 0), (1, 1)), "PNG"))
    ihdr = bytes(data[12:16]) + struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(ihdr))
    return bytes(data)


@pytest.mark.parametrize(
    ("image", "status", "message"),
    [
        (png_claiming(8000, 8000), 413, "images[0] has 8000 x 8000 pixels, more than the 262144 allowed"),
        (image_bytes(solid((0, 0, 0), (600, 600)), "PNG"), 413, "has 600 x 600 pixels"),
        (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n", 415, "is not a PNG, JPEG, WEBP image"),
        (image_bytes(solid((0, 0, 0)), "GIF"), 415, "is not a PNG, JPEG, WEBP image"),
        (image_bytes(solid((0, 0, 0)), "BMP"), 415, "is not a PNG, JPEG, WEBP image"),
        (image_bytes(noise_image(), "PNG")[:200], 400, "could not be decoded"),
    ],
    ids=["bomb", "too-many-pixels", "eps", "gif", "bmp", "truncated-png"],
)
def test_images_are_limited_in_format_and_pixels(server_url, image, status, message):
    start = time.monotonic()
    got, answer = post(server_url, "/score/prompt_color", {"prompts": ["a"], "images": [b64(image)]})
    assert (got, time.monotonic() - start < 1.0) == (status, True)
    assert message in answer["error"]


def test_accepted_formats(server_url):
    images = [b64(image_bytes(solid((255, 0, 0)), fmt)) for fmt in ("PNG", "JPEG", "WEBP")]
    status, answer = post(server_url, "/score/prompt_color", {"prompts": ["red"] * 3, "images": images})
    assert status == 200 and len(answer["scores"]) == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not JSON"),
        ({"prompts": ["a"]}, "'prompts' and 'images'"),
        ({"prompts": "a", "images": []}, "'prompts' must be a list of strings"),
        ({"prompts": [1], "images": ["x"]}, "'prompts' must be a list of strings"),
        ({"prompts": ["a", "b"], "images": ["x"]}, "'images' must be a list as long as 'prompts'"),
        ({"prompts": ["a"], "images": ["x"], "metadata": [1]}, "'metadata' must be an object"),
        ({"prompts": ["a"], "images": ["@@not base64@@"]}, "images[0] is not valid base64"),
        ({"prompts": ["a"], "images": [3]}, "images[0] is a int, not a base64 string"),
    ],
    ids=["not-json", "no-images", "prompts-str", "prompt-int", "length", "metadata", "base64", "image-int"],
)
def test_bad_fields_are_client_errors_without_exception_text(server_url, body, message):
    status, answer = post(server_url, "/score/prompt_color", body)
    assert status == 400 and message in answer["error"]
    for leaked in ("Traceback", "Expecting", "Error:", "binascii", "line 1"):
        assert leaked not in answer["error"]


def test_shared_token(server_module):
    server, url = serve(server_module, {"prompt_color": rewards.prompt_color()}, token="s3cret")
    try:
        image = [b64(image_bytes(solid((255, 0, 0)), "PNG"))]
        assert post(url, "/score/prompt_color", {"prompts": ["red"], "images": image})[0] == 401
        assert post(url, "/score/prompt_color", {"prompts": ["red"], "images": image},
                    "Content-Type: application/json\r\nAuthorization: Bearer wrong\r\n")[0] == 401  # fmt: skip
        assert rewards.remote(f"{url}/score/prompt_color", token="s3cret")(["red"], [solid((255, 0, 0))])
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="HTTP 401"):
            rewards.remote(f"{url}/score/prompt_color", token="", retries=3, backoff=1.0)(["red"], [solid((0, 0, 0))])
        assert time.monotonic() - start < 1.0  # not retried
    finally:
        server.close()


def test_binds_to_loopback_by_default(server_module):
    assert inspect.signature(server_module.build_server).parameters["host"].default == "127.0.0.1"
    source = (REPO / "examples" / "reward_server.py").read_text()
    assert 'parser.add_argument("--host", default="127.0.0.1"' in source


def test_connections_sending_headers_are_bounded_the_oldest_closed(server_module):
    """Past ``max_pending`` connections sending headers, the oldest is closed at once; the others wait for their
    header deadline (HTTP 408)."""
    server, url = serve(server_module, {"prompt_color": rewards.prompt_color()}, max_pending=2, header_timeout=1.0)
    try:
        port = server.server_address[1]
        trickling = []
        for _ in range(3):
            trickling.append(socket.create_connection(("127.0.0.1", port), timeout=3))
            trickling[-1].sendall(b"POST /score/prompt_color HTTP/1.1\r\nX-Slow: ")
            time.sleep(0.1)  # in order: the first one is the oldest
        answers = [sock.recv(1024) for sock in trickling]
        assert answers[0] == b"" and all(a.startswith(b"HTTP/1.0 408") for a in answers[1:])
    finally:
        for sock in trickling:
            sock.close()
        server.close()


def test_a_missing_server_stack_is_one_line_naming_the_extra(monkeypatch, capsys):
    """Without starlette or uvicorn, the server module's import error and the example's exit name the extra."""
    import runpy

    for missing in ("starlette", "uvicorn"):
        for name in [missing, *(name for name in sys.modules if name.startswith(f"{missing}."))]:
            monkeypatch.setitem(sys.modules, name, None)  # makes `import <name>` fail
        for name in ("trl_jagg.rewards.server", "trl_jagg.rewards.server_app"):
            monkeypatch.delitem(sys.modules, name, raising=False)
        with pytest.raises(
            ModuleNotFoundError, match=rf"{missing} is not installed: pip install \"trl-jagg\[server\]\""
        ):
            importlib.import_module("trl_jagg.rewards.server")
        with pytest.raises(SystemExit) as info:
            runpy.run_path(str(REPO / "examples" / "reward_server.py"), run_name="__main__")
        assert "\n" not in str(info.value) and 'pip install "trl-jagg[server]"' in str(info.value)
        monkeypatch.undo()


def test_a_remote_reward_called_inside_an_async_reward_names_the_fix(server_url):
    remote = rewards.remote(f"{server_url}/score/prompt_color")

    async def blocking(prompts, images, **kwargs):
        return remote(prompts, images)

    async def awaiting(prompts, images, **kwargs):
        return await remote.acall(prompts, images)

    with pytest.raises(RuntimeError, match=r"await reward\.acall"):
        rewards.compute_rewards([blocking], ["red"], [solid((255, 0, 0))])
    total, _ = rewards.compute_rewards([awaiting], ["red"], [solid((255, 0, 0))])
    assert total.tolist() == pytest.approx(rewards.prompt_color()(["red"], [solid((255, 0, 0))]))


# ------------------------------------------------------------------------------------------------ round two
def test_decompression_bomb_and_deep_json_and_content_type_and_reserved_metadata_are_4xx(server_url):
    # PIL refuses 100000 x 100000 at open (its own bomb limit): a 413, not a dropped connection.
    status, answer = post(
        server_url, "/score/prompt_color", {"prompts": ["a"], "images": [b64(png_claiming(100000, 100000))]}
    )
    assert status == 413 and "decompression bomb" in answer["error"]
    status, answer = post(server_url, "/score/prompt_color", b"[" * 200_000 + b"]" * 200_000)
    assert status == 400 and "nested too deeply" in answer["error"]
    image = b64(image_bytes(solid((255, 0, 0)), "PNG"))
    body = {"prompts": ["red"], "images": [image]}
    status, answer = post(server_url, "/score/prompt_color", body, headers="Content-Type: text/plain\r\n")
    assert status == 415 and "application/json" in answer["error"]
    status, answer = post(server_url, "/score/prompt_color", {**body, "metadata": {"prompts": ["x"]}})
    assert status == 400 and "'metadata' keys ['prompts'] are reward keywords" in answer["error"]


@pytest.mark.parametrize("content_type", ["text/plain", "multipart/form-data; boundary=x", None])
def test_a_body_of_another_content_type_is_refused_from_its_headers_before_any_body_byte(server_url, content_type):
    """Headers announcing 60 MB of another type, then no body at all: the answer is 415 from the headers alone (a
    server reading the body first would wait for it and answer 408 at its 0.5 s request deadline, or hold it)."""
    announced = f"Content-Type: {content_type}\r\n" if content_type else ""
    head = f"POST /score/prompt_color HTTP/1.1\r\nHost: x\r\n{announced}Content-Length: {60 * 2**20}\r\n\r\n"
    status, answer = raw_request(server_url, head.encode())
    assert status == 415 and "application/json" in answer["error"]


def test_null_scores_travel_as_not_applicable(server_module):
    def partial(prompts, images, **kwargs):
        return [None if p == "skip" else 1.0 for p in prompts]

    server, url = serve(server_module, {"partial": partial})
    try:
        assert rewards.remote(f"{url}/score/partial")(["a", "skip"], [solid((0, 0, 0))] * 2) == [1.0, None]
    finally:
        server.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max_connections", "0"], "--max_connections is 0"),
        (["--request_timeout", "0"], "--request_timeout is 0.0"),
        (["--max_body_mb", "-1"], "--max_body_mb is -1"),
        (["--max_pixels", "100", "--max_request_pixels", "50"], r"--max_pixels \(100\) is larger than --max_request"),
    ],
)
def test_server_refuses_limits_that_refuse_every_request_at_start(server_module, capsys, flags, message):
    with pytest.raises(SystemExit) as info:
        server_module.main(["--rewards", "prompt_color", *flags])
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_decoded_pixels_are_bounded_per_request_and_over_all_requests(server_module):
    release = threading.Event()

    def slow(prompts, images, **kwargs):
        release.wait(5)
        return [0.0] * len(images)

    side = 64
    server, url = serve(server_module, {"slow": slow, "fast": rewards.prompt_color()}, max_pixels=side * side,
                        max_request_pixels=2 * side * side, max_decoded_pixels=2 * side * side,
                        request_timeout=1.0)  # fmt: skip
    image = b64(image_bytes(solid((255, 0, 0), (side, side)), "PNG"))
    try:
        status, answer = post(url, "/score/fast", {"prompts": ["red"] * 3, "images": [image] * 3})
        assert status == 413 and "12288 pixels, more than the 8192 allowed per request" in answer["error"]
        # A request holding the whole budget (its reward still scoring) makes the next one wait, then 503 at its
        # deadline; once it is answered the budget is back.
        holder = threading.Thread(
            target=post, args=(url, "/score/slow", {"prompts": ["a"] * 2, "images": [image] * 2})
        )
        holder.start()
        time.sleep(0.2)
        start = time.monotonic()
        status, answer = post(url, "/score/fast", {"prompts": ["red"], "images": [image]})
        assert status == 503 and "busy decoding" in answer["error"] and 0.5 < time.monotonic() - start < 1.5
        release.set()
        holder.join(5)
        assert post(url, "/score/fast", {"prompts": ["red"], "images": [image]})[0] == 200
    finally:
        release.set()
        server.close()


@pytest.fixture(scope="module")
def server_process():
    """``examples/reward_server.py`` in its own process on 127.0.0.1 (a free port), with a token and 2 slots."""
    process = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "reward_server.py"), "--rewards", "prompt_color", "--port", "0",
         "--token", "s3cret", "--max_connections", "2", "--header_timeout", "1", "--request_timeout", "5"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        url = None
        for _ in range(200):  # bounded: the start-up logs a few lines
            line = process.stderr.readline()
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/score", line)
            if found or not line:
                url = found and found.group(1)
                break
        assert url, "the server did not start"
        yield url, process
    finally:
        process.kill()
        process.wait(10)


def test_connections_slow_to_send_headers_or_without_token_take_no_slot(server_process):
    url, _ = server_process
    port = int(url.rsplit(":", 1)[1])
    # Eight connections trickling headers and eight without the token, against 2 request slots.
    trickling = [socket.create_connection(("127.0.0.1", port), timeout=2) for _ in range(8)]
    for sock in trickling:
        sock.sendall(b"POST /score/prompt_color HTTP/1.1\r\nX-Slow: ")
    wrong = [post(url, "/score/prompt_color", b"{}", "Content-Type: application/json\r\n")[0] for _ in range(8)]
    assert wrong == [401] * 8
    try:
        start = time.monotonic()
        reward = rewards.remote(f"{url}/score/prompt_color", token="s3cret", timeout=2, retries=0)
        assert reward(["red"], [solid((255, 0, 0))]) == pytest.approx(
            rewards.prompt_color()(["red"], [solid((255, 0, 0))])
        )
        assert time.monotonic() - start < 0.5  # served at once, not after the trickling connections' deadline
        # The trickling connections are answered 408 at the 1 s header deadline.
        for sock in trickling:
            sock.settimeout(3)
            assert sock.recv(1024).startswith(b"HTTP/1.0 408")
    finally:
        for sock in trickling:
            sock.close()
