"""Credentials never leave memory: one training run passes a secret through every channel the library documents (a
remote reward's ``token`` in ``reward_kwargs``, ``TRL_JAGG_REWARD_TOKEN``, a judge's ``api_key_env`` variable,
``hub_token``) and secrets nested in ``reward_kwargs`` (headers, passwords), against reward and judge stubs on
127.0.0.1 that check each key arrives; then no file under ``output_dir`` (what a Hub push uploads: checkpoints,
``training_args.bin``, the model card, TensorBoard's ``runs/``), no W&B file (offline) and no log line holds any
secret's bytes. The redaction policy's own cases are checked on values written here."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from datasets import Dataset
from peft import LoraConfig
from testing_utils import PROMPTS

from trl_jagg import GRPOJaggConfig, GRPOJaggTrainer
from trl_jagg.rewards import REWARD_REGISTRY
from trl_jagg.utils.redaction import REDACTED, names_secret, redacted, redacted_argv, redacted_fields

SECRETS = {
    "token": "tok-REWARD-7f3a9c",  # reward_kwargs={url: {"token": ...}}, the documented way
    "env_token": "tok-ENV-51d2e8",  # TRL_JAGG_REWARD_TOKEN
    "judge": "sk-JUDGE-a83b0d",  # the variable api_key_env names
    "hub": "hf_HUB-e91c4a",  # GRPOJaggConfig.hub_token
    "header": "Bearer HEADER-0c7d11",  # nested in reward_kwargs under a header's name
    "password": "PASS-9b2e66",  # two levels down
    "api_key": "KEY-44aa01",  # a list of mappings
}


class Stubs(ThreadingHTTPServer):
    """A reward server (``POST /score/<name>``) and a chat-completions judge (``POST /v1/chat/completions``), each
    recording the Authorization header of every request by path."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.authorization: dict[str, set[str]] = {}
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        server: Stubs = self.server
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.authorization.setdefault(self.path, set()).add(self.headers.get("Authorization", ""))
        if self.path.startswith("/score/"):  # a score from the image bytes: the group advantages are not all 0
            body = {"scores": [int(hashlib.md5(i.encode()).hexdigest()[:4], 16) / 65535 for i in request["images"]]}
        else:
            body = {"choices": [{"message": {"role": "assistant", "content": "Yes"}}]}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def options_reward(**options: object):
    """A reward taking any keyword (as a user's own factory may): the nested secrets ride in ``reward_kwargs``."""

    def reward(prompts, images, **kwargs):
        return [0.0] * len(images)

    reward.options = options
    return reward


def test_names_that_hold_secrets():
    for name in ("token", "hub_token", "api_key", "apiKey", "X-API-Key", "Authorization", "client_secret",
                 "PASSWORD", "db_password", "Proxy-Authorization", "credentials", "Cookie"):  # fmt: skip
        assert names_secret(name), name
    # A variable's name, a vocabulary index and token counts are not secrets (the value is not a key).
    for name in ("api_key_env", "reward_token_id", "max_tokens", "include_num_input_tokens_seen", "url", "model"):
        assert not names_secret(name), name


def test_redaction_at_any_depth_and_in_urls():
    value = {
        "http://u:pw1@host/score": {"url": "https://user:pw2@host/v1?q=1", "token": "t", "n": 3},
        "list": [{"Authorization": "Bearer b"}, ("ftp://x:pw3@h/", None)],
        "headers": {"X-API-Key": {"nested": "k"}},
        "api_key_env": "MY_KEY",
        "token": None,
    }
    assert redacted(value) == {
        f"http://{REDACTED}@host/score": {"url": f"https://{REDACTED}@host/v1?q=1", "token": REDACTED, "n": 3},
        "list": [{"Authorization": REDACTED}, (f"ftp://{REDACTED}@h/", None)],
        "headers": {"X-API-Key": REDACTED},
        "api_key_env": "MY_KEY",
        "token": None,
    }
    assert value["headers"]["X-API-Key"] == {"nested": "k"}  # the original is untouched
    args = GRPOJaggConfig(output_dir="unused", hub_token="h", reward_kwargs=value, report_to="none")
    clean = redacted_fields(args)
    assert clean.hub_token is None and clean.reward_kwargs == redacted(value) and args.hub_token == "h"


def test_no_secret_reaches_a_file_a_tracker_or_a_log(
    tiny_flux_path, tmp_path, monkeypatch, caplog, capfd, offline_wandb
):
    wandb = offline_wandb
    monkeypatch.setenv("TRL_JAGG_REWARD_TOKEN", SECRETS["env_token"])
    monkeypatch.setenv("TEST_JUDGE_KEY", SECRETS["judge"])
    monkeypatch.setitem(REWARD_REGISTRY, "test-options", options_reward)  # registered for this test only
    server = Stubs()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    with_token, from_env = f"{server.url}/score/a", f"{server.url}/score/b"
    reward_kwargs = {
        with_token: {"token": SECRETS["token"], "timeout": 30},
        "vlm-judge": {"url": f"{server.url}/v1", "judge": "qwen-vl-yes-no", "api_key_env": "TEST_JUDGE_KEY"},
        "test-options": {
            "headers": {"Authorization": SECRETS["header"]},
            "database": {"login": {"user": "me", "password": SECRETS["password"]}},
            "services": [{"name": "a", "api_key": SECRETS["api_key"]}],
        },
    }
    out = tmp_path / "out"
    args = GRPOJaggConfig(
        output_dir=str(out), per_device_train_batch_size=4, num_generations=2, num_inference_steps=3, height=32,
        width=32, max_steps=2, jagg_group_size=2, max_sequence_length=16, seed=0, save_strategy="steps", save_steps=1,
        disable_tqdm=True, logging_steps=1, report_to=["tensorboard", "wandb"], project="trl-jagg-secrets",
        run_name="secrets", hub_token=SECRETS["hub"], reward_kwargs=reward_kwargs,
    )  # fmt: skip
    caplog.set_level(logging.DEBUG)
    try:
        trainer = GRPOJaggTrainer(
            model=tiny_flux_path, reward_funcs=[with_token, from_env, "vlm-judge", "test-options"], args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"]),
        )  # fmt: skip
        trainer.train()
        trainer.save_model()  # the top-level folder a Hub push uploads
        wandb.finish()  # flushes the run's log
        shown = [repr(args), str(args), *map(repr, trainer.reward_funcs)]
    finally:
        server.shutdown()
        server.server_close()

    # Every channel was used: each key reached its server (so its absence below is not a key never passed).
    assert server.authorization["/score/a"] == {f"Bearer {SECRETS['token']}"}
    assert server.authorization["/score/b"] == {f"Bearer {SECRETS['env_token']}"}
    assert server.authorization["/v1/chat/completions"] == {f"Bearer {SECRETS['judge']}"}
    assert trainer.reward_funcs[3].options["headers"]["Authorization"] == SECRETS["header"]

    files = [p for p in glob.glob(str(out / "**" / "*"), recursive=True) if os.path.isfile(p)]
    tracker_files = {  # once each: wandb/latest-run links to the run's folder
        os.path.realpath(p)
        for p in glob.glob(str(tmp_path / "wandb" / "**" / "*"), recursive=True)
        if os.path.isfile(p)
    }
    names = {os.path.relpath(p, out) for p in files}
    # The run wrote what a leak would be in: the args in the top folder and each checkpoint, the TensorBoard events
    # (its "args" text and hparams), W&B's config and run log.
    assert {"training_args.bin", "checkpoint-1/training_args.bin", "checkpoint-2/training_args.bin"} <= names
    events = [open(p, "rb").read() for p in files if "events.out.tfevents" in p]
    (run_log,) = [open(p, "rb").read() for p in tracker_files if p.endswith(".wandb")]
    for recorded in (b"".join(events), run_log):  # both hold the config, redacted
        assert b"reward_kwargs" in recorded and REDACTED.encode() in recorded
    saved = torch.load(out / "training_args.bin", weights_only=False)
    assert saved.hub_token is None and saved.reward_kwargs[with_token]["token"] == REDACTED
    assert saved.reward_kwargs[with_token]["timeout"] == 30  # the rest of the config is kept
    logs = caplog.text + "".join(capfd.readouterr())
    for secret in SECRETS.values():
        raw = secret.encode()
        leaks = [p for p in [*files, *tracker_files] if raw in open(p, "rb").read()]
        assert not leaks, (secret, leaks)
        assert secret not in logs and not any(secret in text for text in shown), secret


def test_command_line_secrets_are_redacted_once_parsed():
    """W&B records ``sys.argv``: ``trl-jagg train`` replaces it with this once its arguments are parsed."""
    argv = ["train", "--hub_token", "hf_x", "--api_key=k", "--reward_kwargs", '{"http://h/s": {"token": "t"}}',
            "--reward_funcs", "http://u:p@h/s", "--learning_rate", "1e-4", "--config", "{not json"]  # fmt: skip
    assert redacted_argv(argv) == [
        "train", "--hub_token", REDACTED, f"--api_key={REDACTED}", "--reward_kwargs",
        json.dumps({"http://h/s": {"token": REDACTED}}), "--reward_funcs", f"http://{REDACTED}@h/s",
        "--learning_rate", "1e-4", "--config", REDACTED,
    ]  # fmt: skip


def test_secrets_are_redacted_by_their_shape_as_well_as_by_name():
    """Issue 42: a key in a URL's query string, after ``Bearer`` or an ``Authorization:`` header's scheme, with a
    common token prefix, or under a user's own ``bearer`` / ``pat`` / ``access`` key; ordinary words stay."""
    from trl_jagg.utils.redaction import redact_text

    value = {
        "http://h/score": {
            "headers": ["Authorization: Bearer B1-secret", "Accept: json"],
            "url": "http://h/s?api_key=Q1",
        },
        "mine": {"bearer": "B2", "pat": "P1", "access": "A1", "note": "Authorization: Basic dXNlcjpwYXNz"},
        "prefixed": ["sk-abcdef123456", "hf_abcdefgh1234", "ghp_abcdefgh1234", "AKIAABCDEFGHIJKLMNOP"],
        "plain": "a basic red square, max_tokens 16, token ids",
    }
    assert redacted(value) == {
        "http://h/score": {
            "headers": [f"Authorization: Bearer {REDACTED}", "Accept: json"],
            "url": f"http://h/s?api_key={REDACTED}",
        },
        "mine": {"bearer": REDACTED, "pat": REDACTED, "access": REDACTED, "note": f"Authorization: Basic {REDACTED}"},
        "prefixed": [REDACTED] * 4,
        "plain": "a basic red square, max_tokens 16, token ids",
    }
    assert redact_text("https://u:pw@h/v1?token=T1&q=cat#f") == f"https://{REDACTED}@h/v1?token={REDACTED}&q=cat#f"
    # Both argv forms of a JSON value, and a URL flag's query.
    assert redacted_argv(['--reward_kwargs={"h": {"token": "t"}}', "--reward_funcs=http://h/s?secret=S1"]) == [
        "--reward_kwargs=" + json.dumps({"h": {"token": REDACTED}}), f"--reward_funcs=http://h/s?secret={REDACTED}",
    ]  # fmt: skip


def test_a_reward_url_with_a_key_in_its_query_keeps_it_out_of_repr_errors_and_saved_args(tmp_path):
    """The key reaches the server (the URL is used as given) but not ``repr()``, the connection error, the config's
    JSON (what trackers get) or ``training_args.bin``'s redacted copy."""
    import pytest
    from PIL import Image

    from trl_jagg.rewards.remote import RemoteReward

    url = "http://127.0.0.1:9/score?api_key=QUERYKEY-5e1"  # port 9 (discard): refused at once
    reward = RemoteReward(url, timeout=5, retries=0)
    assert reward.url == url and "QUERYKEY" not in repr(reward)
    with pytest.raises(ConnectionError) as error:
        reward(["a red square"], [Image.new("RGB", (8, 8))])
    assert "QUERYKEY" not in str(error.value) and "127.0.0.1:9" in str(error.value)
    args = GRPOJaggConfig(output_dir=str(tmp_path), reward_kwargs={url: {"timeout": 5}}, report_to="none")
    assert "QUERYKEY" not in args.to_json_string() and "QUERYKEY" not in repr(redacted_fields(args))
