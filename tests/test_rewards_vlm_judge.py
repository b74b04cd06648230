"""The VLM-judge reward against a stub chat-completions server on 127.0.0.1 (no network): the request schema, the
three judges' scores (computed here from the stub's replies), errors for replies without a score, bounded
concurrency, retries, the deadline and the API key from the environment."""

from __future__ import annotations

import base64
import io
import itertools
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

import trl_jagg.rewards as rewards
from trl_jagg.rewards.vlm_judge import JudgeReplyError


class ChatStub(ThreadingHTTPServer):
    """Answers ``POST /v1/chat/completions`` with ``self.reply(request) -> (status, body[, headers])``, recording
    every request (and when it came) and the most requests it held at once."""

    daemon_threads = True

    def __init__(self, reply):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.reply = reply
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.times: list[float] = []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        server: ChatStub = self.server
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.requests.append(request)
            server.headers.append(dict(self.headers))
            server.times.append(time.monotonic())
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
            status, body, *headers = (
                server.reply(request) if self.path == "/v1/chat/completions" else (404, {"error": "path"})
            )
        finally:
            with server.lock:
                server.in_flight -= 1
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in (headers[0] if headers else {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the deadline test's client has given up already
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    servers = []

    def start(reply):
        server = ChatStub(reply)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def completion(text: str, top_logprobs: list[tuple[str, float]] | None = None) -> tuple[int, dict]:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    if top_logprobs is not None:
        entries = [{"token": token, "logprob": logprob, "bytes": None} for token, logprob in top_logprobs]
        choice["logprobs"] = {"content": [{"token": text, "logprob": top_logprobs[0][1], "top_logprobs": entries}]}
    return 200, {"id": "x", "object": "chat.completion", "model": "judge", "choices": [choice]}


def sent_images(request: dict) -> list[Image.Image]:
    """The images of a request, decoded from their data URLs."""
    images = []
    for part in request["messages"][0]["content"]:
        if part["type"] == "image_url":
            header, data = part["image_url"]["url"].split(",", 1)
            assert header == "data:image/png;base64"
            images.append(Image.open(io.BytesIO(base64.b64decode(data))))
    return images


def sent_text(request: dict) -> str:
    return next(part["text"] for part in request["messages"][0]["content"] if part["type"] == "text")


def gray(level: int) -> Image.Image:
    return Image.new("RGB", (8, 8), (level, level, level))


def test_point_judge_request_and_mean_of_dimensions(stub, monkeypatch):
    def reply(request):  # scores derived from the image, so a mixed-up order shows
        level = sent_images(request)[0].getpixel((0, 0))[0]
        return completion(f"Alignment Score (1-5): {level / 100}\nCoherence Score (1-5): 2\nStyle Score (1-5): 4.5")

    server = stub(reply)
    monkeypatch.setenv("TRL_JAGG_JUDGE_API_KEY", "sk-test")
    judge = rewards.vlm_judge(url=server.url, model="UnifiedReward")
    images = [gray(100), gray(250), gray(300 // 2)]
    scores = judge(prompts=["a cat", "a dog", "a cow"], images=images)
    assert scores == pytest.approx([(1.0 + 2 + 4.5) / 3, (2.5 + 2 + 4.5) / 3, (1.5 + 2 + 4.5) / 3])
    request = next(r for r in server.requests if sent_text(r).endswith("[a dog]"))
    assert request["model"] == "UnifiedReward" and request["temperature"] == 0.0 and "logprobs" not in request
    assert sent_text(request).startswith("You are presented with a generated image and its associated text caption.")
    assert list(sent_images(request)[0].getdata()) == list(gray(250).getdata())  # PNG: the exact pixels
    assert all(headers["Authorization"] == "Bearer sk-test" for headers in server.headers)
    only_alignment = rewards.vlm_judge(url=server.url, dimensions=["Alignment"], name="ur_alignment")
    assert only_alignment(prompts=["a cat"], images=[gray(100)]) == pytest.approx([1.0])
    assert only_alignment.__name__ == "ur_alignment"


def test_yes_no_judge_from_logprobs(stub):
    top = [("Yes", math.log(0.6)), ("No", math.log(0.2)), (" yes", math.log(0.1)), ("Maybe", math.log(0.05))]
    server = stub(lambda request: completion("Yes", top))
    judge = rewards.vlm_judge(url=server.url + "/chat/completions", judge="qwen-vl-yes-no", model="qwen")
    assert judge(prompts=["a red ball"], images=[gray(10)]) == pytest.approx([(0.6 + 0.1) / (0.6 + 0.1 + 0.2)])
    request = server.requests[0]
    assert request["logprobs"] is True and request["top_logprobs"] == 20 and request["max_tokens"] == 1
    assert sent_text(request) == 'Does this figure show "a red ball"? Please answer Yes or No.'
    assert judge.__name__ == "qwen_vl_yes_no"


@pytest.mark.parametrize(("text", "expected"), [("Yes.", 1.0), (" no", 0.0), ("YES, it does", 1.0)])
def test_yes_no_judge_falls_back_to_the_answer_without_logprobs(stub, text, expected):
    server = stub(lambda request: completion(text))
    judge = rewards.vlm_judge(url=server.url, judge="qwen-vl-yes-no")
    assert judge(prompts=["p"], images=[gray(0)]) == [expected]


@pytest.mark.parametrize(
    ("judge", "text"),
    [
        ("unifiedreward", "Alignment Score (1-5): 3\nStyle Score (1-5): 4"),  # Coherence missing
        ("unifiedreward", "I cannot rate this image."),
        ("qwen-vl-yes-no", "Perhaps"),
        ("unifiedreward-think-pairwise", "<think>...</think>"),
        ("unifiedreward-think-pairwise", "<answer>Both are equal</answer>"),
    ],
)
def test_reply_without_a_score_is_an_error_naming_the_judge(stub, judge, text):
    server = stub(lambda request: completion(text))
    reward = rewards.vlm_judge(url=server.url, judge=judge, retries=0)
    with pytest.raises(JudgeReplyError, match=f"VLM judge '{reward.__name__}' \\({judge}"):
        reward(prompts=["p", "p"], images=[gray(0), gray(9)])


def test_reply_that_is_not_a_chat_completion(stub):
    server = stub(lambda request: (200, {"scores": [1.0]}))
    with pytest.raises(RuntimeError, match="not a chat completion"):
        rewards.vlm_judge(url=server.url)(prompts=["p"], images=[gray(0)])


def test_pairwise_judge_win_rates_within_each_prompt(stub):
    def reply(request):  # the brighter image wins
        first, second = (image.getpixel((0, 0))[0] for image in sent_images(request))
        return completion(f"<think>...</think>\n<answer>Image {1 if first > second else 2} is better</answer>")

    server = stub(reply)
    judge = rewards.vlm_judge(url=server.url, judge="unifiedreward-think-pairwise")
    prompts = ["a", "b", "a", "a", "b", "c"]
    levels = [50, 10, 200, 120, 30, 90]
    scores = judge(prompts=prompts, images=[gray(level) for level in levels])
    expected = []
    for i, (prompt, level) in enumerate(zip(prompts, levels)):
        others = [levels[j] for j in range(len(prompts)) if j != i and prompts[j] == prompt]
        expected.append(sum(level > other for other in others) / len(others) if others else None)
    assert scores == pytest.approx(expected)  # a: 1/2, 1, 0; b: 0, 1; c alone: None
    assert len(server.requests) == 3 + 1  # C(3, 2) + C(2, 2) pairs
    pairs = {tuple(image.getpixel((0, 0))[0] for image in sent_images(r)) for r in server.requests}
    assert pairs == {(50, 200), (50, 120), (200, 120), (10, 30)}  # each pair once, in sample order
    asked = sorted(prompt for r in server.requests for prompt in "ab" if f"「{prompt}」" in sent_text(r))
    assert asked == ["a", "a", "a", "b"]  # each pair asked with its own prompt (requests arrive in any order)


def test_concurrency_is_bounded(stub):
    def reply(request):
        time.sleep(0.15)
        return completion("Alignment Score (1-5): 1\nCoherence Score (1-5): 1\nStyle Score (1-5): 1")

    server = stub(reply)
    judge = rewards.vlm_judge(url=server.url, max_concurrency=3)
    assert judge(prompts=["p"] * 9, images=[gray(i) for i in range(9)]) == [1.0] * 9
    assert server.max_in_flight == 3
    # Two calls at once (overlapped rollout chunks) share the bound.
    server.max_in_flight = 0
    calls = [threading.Thread(target=judge, kwargs=dict(prompts=["p"] * 4, images=[gray(0)] * 4)) for _ in range(2)]
    for call in calls:
        call.start()
    for call in calls:
        call.join()
    assert server.max_in_flight == 3


def test_server_errors_are_retried(stub):
    calls = itertools.count()

    def reply(request):
        if next(calls) == 0:
            return 503, {"error": "loading"}
        return completion("Yes")

    server = stub(reply)
    judge = rewards.vlm_judge(url=server.url, judge="qwen-vl-yes-no", retries=1, backoff=0.0)
    assert judge(prompts=["p"], images=[gray(0)]) == [1.0]
    assert len(server.requests) == 2


@pytest.mark.parametrize("status", [429, 503])
def test_rate_limits_are_retried_after_the_wait_the_server_asks_for(stub, status):
    calls = itertools.count()

    def reply(request):
        if next(calls) == 0:
            return status, {"error": "slow down"}, {"Retry-After": "1"}
        return completion("Yes")

    server = stub(reply)
    # A backoff of 0 would resend at once: the second request waits the server's 1 s instead.
    judge = rewards.vlm_judge(url=server.url, judge="qwen-vl-yes-no", retries=1, backoff=0.0, timeout=5.0)
    assert judge(prompts=["p"], images=[gray(0)]) == [1.0]
    assert len(server.requests) == 2 and server.times[1] - server.times[0] >= 1.0


def test_retry_after_is_bounded_by_the_deadline(stub):
    calls = itertools.count()

    def reply(request):  # asks for an hour once, then answers
        if next(calls) == 0:
            return 429, {"error": "quota"}, {"Retry-After": "3600"}
        return completion("Yes")

    server = stub(reply)
    judge = rewards.vlm_judge(url=server.url, judge="qwen-vl-yes-no", retries=1, backoff=0.0, timeout=0.3)
    start = time.monotonic()
    assert judge(prompts=["p"], images=[gray(0)]) == [1.0]
    assert 0.3 <= time.monotonic() - start < 3.0  # waited one attempt's deadline, not the hour


def test_retry_after_dates_and_unreadable_values():
    from email.utils import formatdate

    from trl_jagg.rewards.remote import retry_after_seconds

    assert retry_after_seconds("7") == 7.0 and retry_after_seconds(None) is None
    assert retry_after_seconds("soon") is None  # the client's backoff applies
    assert 25.0 < retry_after_seconds(formatdate(time.time() + 30, usegmt=True)) <= 30.0
    assert retry_after_seconds(formatdate(time.time() - 30, usegmt=True)) == 0.0  # a date already past


def test_each_request_has_a_deadline(stub):
    server = stub(lambda request: (time.sleep(1.0), completion("Yes"))[1])
    judge = rewards.vlm_judge(url=server.url, judge="qwen-vl-yes-no", timeout=0.2, retries=0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout=0.2"):
        judge(prompts=["p"], images=[gray(0)])
    assert time.monotonic() - start < 0.9


def test_selected_by_name_with_url_and_model_from_the_environment(stub, monkeypatch):
    server = stub(lambda request: completion("no"))
    monkeypatch.setenv("TRL_JAGG_JUDGE_URL", server.url)
    monkeypatch.setenv("TRL_JAGG_JUDGE_MODEL", "my-judge")
    monkeypatch.delenv("TRL_JAGG_JUDGE_API_KEY", raising=False)
    monkeypatch.setenv("TRL_JAGG_REWARD_TOKEN", "reward-server-secret")  # never sent to a judge
    (judge,) = rewards.load_reward_funcs(["vlm-judge"], judge="qwen-vl-yes-no", device="cpu")
    total, per_reward = rewards.compute_rewards([judge], ["p"], [gray(0)])
    assert total.tolist() == [0.0] and list(per_reward) == ["qwen_vl_yes_no"]
    assert server.requests[0]["model"] == "my-judge" and "Authorization" not in server.headers[0]


def test_the_cli_and_the_trainer_build_the_judge_from_reward_kwargs(stub, tiny_flux_path, tmp_path, monkeypatch):
    from trl_jagg.scripts import train

    server = stub(lambda request: completion("yes"))
    monkeypatch.delenv("TRL_JAGG_JUDGE_URL", raising=False)
    monkeypatch.delenv("TRL_JAGG_JUDGE_MODEL", raising=False)
    kwargs = {"vlm-judge": {"url": server.url, "model": "my-judge", "judge": "qwen-vl-yes-no"}}
    flags = ["--model_name_or_path", tiny_flux_path, "--prompts", "a", "b", "--output_dir", str(tmp_path)]
    flags += ["--reward_funcs", "vlm-judge", "--reward_kwargs", json.dumps(kwargs), "--report_to", "none"]
    flags += ["--per_device_train_batch_size", "2", "--num_generations", "2", "--max_sequence_length", "16"]
    script_args, args = train.parse_train_args(flags)
    trainer = train.build_trainer(script_args, args)
    (judge,) = trainer.reward_funcs
    assert judge(prompts=["p"], images=[gray(0)]) == [1.0]
    assert server.requests[0]["model"] == "my-judge" and "top_logprobs" in server.requests[0]


def test_bad_arguments_name_the_fix(monkeypatch):
    monkeypatch.delenv("TRL_JAGG_JUDGE_URL", raising=False)
    with pytest.raises(ValueError, match="TRL_JAGG_JUDGE_URL.*vllm serve CodeGoat24/UnifiedReward-2.0"):
        rewards.vlm_judge()
    with pytest.raises(ValueError, match="Unknown judge"):
        rewards.vlm_judge(url="http://127.0.0.1:1/v1", judge="gpt")
    with pytest.raises(ValueError, match="dimensions"):
        rewards.vlm_judge(url="http://127.0.0.1:1/v1", dimensions=["Beauty"])


POINT = "Alignment Score (1-5): {}\nCoherence Score (1-5): {}\nStyle Score (1-5): {}"


@pytest.mark.parametrize(
    ("judge", "reply", "problem"),
    [
        ("unifiedreward", completion(POINT.format(999, 3, 3)), "outside the template's range 1-5: Alignment 999"),
        ("unifiedreward", completion(POINT.format("1e9", 3, 3)), "Alignment 1e"),  # not read as 1
        ("unifiedreward", completion(POINT.format(0, 3, 3)), "range 1-5: Alignment 0"),
        ("unifiedreward", completion(POINT.format(3, -2, 3)), "Coherence -2"),
        ("unifiedreward", completion(POINT.format(3, 3, 3) + "\nStyle Score (1-5): 5"), "more than one score"),
        (
            "unifiedreward-think-pairwise",
            completion("<answer>Image 1 is better</answer>\n<answer>Image 2 is better</answer>"), "both images",
        ),
        ("unifiedreward-think-pairwise", completion("<answer>Image 1 is better, Image 2 is better</answer>"), "both"),
        ("qwen-vl-yes-no", completion("Yes", [("Yes", 1000.0), ("No", -1.0)]), "'Yes' is 1000.0, not a number <= 0"),
        ("qwen-vl-yes-no", completion("Yes", [("Yes", float("nan"))]), "is nan"),
        ("qwen-vl-yes-no", completion("Yes", [("Yes", "-0.1")]), "'Yes' is '-0.1'"),
        (
            "qwen-vl-yes-no",
            (200, {"choices": [{"message": {"content": "Yes"}, "logprobs": {"content": [{"top_logprobs": [{"tok": "Yes"}]}]}}]}),
            "not {'token': str, 'logprob': number}",
        ),
    ],
)  # fmt: skip
def test_replies_the_judge_cannot_mean_are_errors(stub, judge, reply, problem):
    """Scores out of the declared range, a dimension given twice, both pairwise answers and unreadable
    log-probabilities: each was scored before (the last value, image 1, an overflow or NaN)."""
    server = stub(lambda request: reply)
    reward = rewards.vlm_judge(url=server.url, judge=judge, model="served-judge", retries=0)
    with pytest.raises(JudgeReplyError) as caught:
        reward(prompts=["p", "p"], images=[gray(0), gray(9)])
    message = str(caught.value)
    assert problem in message, message
    assert f"VLM judge '{reward.__name__}' ({judge}, model 'served-judge'" in message and "Reply: " in message


def test_judge_reply_errors_go_through_reward_retries(stub, caplog):
    replies = iter([completion(POINT.format(999, 3, 3)), completion(POINT.format(5, 3, 1))])
    server = stub(lambda request: next(replies))
    judge = rewards.vlm_judge(url=server.url, retries=0, max_concurrency=1)
    total, _ = rewards.compute_rewards([judge], ["p"], [gray(0)], retries=1)
    assert total.tolist() == pytest.approx([(5 + 3 + 1) / 3]) and len(server.requests) == 2
    assert any("JudgeReplyError" in record.getMessage() for record in caplog.records)
    server.reply = lambda request: completion(POINT.format(999, 3, 3))
    with pytest.raises(JudgeReplyError):  # out of retries: the step stops
        rewards.compute_rewards([judge], ["p"], [gray(0)], retries=1)


def test_keys_in_urls_or_in_api_key_env_are_refused_without_showing_them(monkeypatch, caplog):
    secret = "sk-live-0123456789abcdef"
    for call, fix in (
        (lambda: rewards.vlm_judge(url=f"http://user:{secret}@127.0.0.1:1/v1"), "TRL_JAGG_JUDGE_API_KEY"),
        (lambda: rewards.vlm_judge(url="http://127.0.0.1:1/v1", api_key_env=secret), "api_key_env='MY_JUDGE_KEY'"),
        (lambda: rewards.vlm_judge(url="http://127.0.0.1:1/v1", api_key_env="abcDEF0123456789"), "NAME"),
        (lambda: rewards.remote(f"https://{secret}@127.0.0.1:1/score"), "TRL_JAGG_REWARD_TOKEN"),
    ):
        with pytest.raises(ValueError) as caught:
            call()
        assert fix in str(caught.value) and secret not in str(caught.value)
    monkeypatch.delenv("MY_JUDGE_KEY", raising=False)
    with caplog.at_level("WARNING"):
        rewards.vlm_judge(url="http://127.0.0.1:1/v1", api_key_env="MY_JUDGE_KEY")
    assert "MY_JUDGE_KEY' is not set" in caplog.text
