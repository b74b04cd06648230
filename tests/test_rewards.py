"""Registry, output checks, weight-free rewards (programmatic, JPEG), weighted sums and the remote reward.

Model-backed rewards are tested in test_rewards_models.py (tiny random models) and test_rewards_ocr.py (real OCR).
"""

from __future__ import annotations

import inspect
import io
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from testing_utils import noise_image, solid

import trl_jagg.rewards as rewards
from trl_jagg.rewards import check_rewards, compute_rewards, load_reward_funcs
from trl_jagg.rewards.calling import (
    DEFAULT_REWARD_TIMEOUT,
    RewardInterrupted,
    RewardTimeout,
    abandon_rewards_in_flight,
    reward_deadline,
)
from trl_jagg.rewards.remote import RemoteReward

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------- registry


def test_registry_has_the_documented_names():
    expected = {
        "pickscore",
        "clipscore",
        "hpsv2.1",
        "imagereward",
        "aesthetic",
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "ocr",
        "prompt_color",
        "brightness",
        "high_frequency",
        "horizontal_detail",
    }
    assert expected <= set(rewards.available_rewards())


def test_unknown_name_lists_valid_names_and_suggests_the_closest():
    with pytest.raises(ValueError) as info:
        load_reward_funcs("pickscor")
    message = str(info.value)
    assert "Did you mean 'pickscore'" in message
    assert "hpsv2.1" in message and "prompt_color" in message


def test_load_reward_funcs_mixes_names_and_callables_and_forwards_only_accepted_kwargs():
    def custom(prompts, images, **kwargs):
        return [0.0] * len(images)

    funcs = load_reward_funcs(["prompt_color", custom, "HPSv2", "clipscore"], device="cpu", dtype="bf16", batch_size=3)
    color, same_custom, hps, clip = funcs
    assert same_custom is custom
    assert color.__name__ == "prompt_color"  # built without the device/dtype it does not take
    assert (hps.__name__, hps.device, hps.dtype, hps.batch_size) == ("hpsv2.1", torch.device("cpu"), torch.bfloat16, 3)
    assert clip.__name__ == "clipscore" and clip.dtype == torch.bfloat16
    assert not hps._loaded and not clip._loaded  # nothing is loaded before the first call
    assert [f.__name__ for f in load_reward_funcs("jpeg_compressibility")] == ["jpeg_compressibility"]
    assert load_reward_funcs(custom) == [custom]


def test_url_spec_builds_a_remote_reward():
    (func,) = load_reward_funcs("http://127.0.0.1:9/score/pickscore", device="cpu", timeout=5.0)
    assert isinstance(func, RemoteReward)
    assert func.__name__ == "remote_pickscore" and func.timeout == 5.0


def test_reward_kwargs_configure_each_reward_by_its_name_over_the_shared_kwargs():
    funcs = load_reward_funcs(
        ["HPS", "http://127.0.0.1:9/score/a", "prompt_color"],
        {"hpsv2.1": {"batch_size": 5}, "http://127.0.0.1:9/score/a": {"timeout": 7.0, "name": "mine"}},
        device="cpu", batch_size=3, timeout=5.0,
    )  # fmt: skip
    hps, server, color = funcs
    assert (hps.__name__, hps.batch_size, hps.device) == ("hpsv2.1", 5, torch.device("cpu"))  # its own wins
    assert (server.__name__, server.timeout) == ("mine", 7.0)
    assert color.__name__ == "prompt_color"


@pytest.mark.parametrize(
    ("reward_kwargs", "message"),
    [
        (
            {"pickscore": {"batch_size": 2}},
            r"key 'pickscore', which is not one of reward_funcs \['hpsv2.1', 'custom'\]",
        ),
        (
            {"hpsv2.1": {"batchsize": 2}},
            r"\['batchsize'\], which the 'hpsv2.1' reward does not take\. Did you mean 'batch_size'",
        ),
        ({"hpsv2.1": 2}, "give a mapping from reward names to their keyword arguments"),
        (["hpsv2.1"], "give a mapping"),
    ],
    ids=["not-a-reward", "not-a-keyword", "not-a-mapping", "a-list"],
)
def test_reward_kwargs_that_cannot_apply_are_errors_naming_the_field(reward_kwargs, message):
    def custom(prompts, images, **kwargs):
        return [0.0] * len(images)

    with pytest.raises(ValueError, match=message):
        load_reward_funcs(["hpsv2.1", custom], reward_kwargs)


def test_reward_kwargs_refuse_an_import_path():
    with pytest.raises(ValueError, match=r"reward_kwargs\['testing_utils.solid'\]: .* is an import path"):
        load_reward_funcs(["testing_utils.solid"], {"testing_utils.solid": {"x": 1}})


def test_bad_spec_entries_raise():
    with pytest.raises(ValueError):
        load_reward_funcs([])
    with pytest.raises(ValueError):
        load_reward_funcs([3])


# ----------------------------------------------------------------------------------------------- check_rewards


def test_check_rewards_returns_float32_tensor():
    out = check_rewards("r", [1, 2.5, -3.0], 3)
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 2.5, -3.0]
    assert check_rewards("r", torch.tensor([1.0, 2.0], dtype=torch.float64), 2).dtype == torch.float32


@pytest.mark.parametrize(
    ("values", "expected", "fragment"),
    [
        ([1.0, 2.0], 3, "expected a flat list of 3"),
        ([1.0, float("nan"), 2.0], 3, "non-finite values at positions [1]"),
        ([float("inf"), 0.0], 2, "non-finite"),
        ([-math.inf], 1, "non-finite"),
        ([[1.0], [2.0]], 2, "expected a flat list"),
        (["high", 1.0], 2, "not numbers"),
    ],
)
def test_check_rewards_errors_name_the_reward(values, expected, fragment):
    with pytest.raises(ValueError) as info:
        check_rewards("my_reward", values, expected)
    assert "my_reward" in str(info.value) and fragment in str(info.value)


# ----------------------------------------------------------------------------------------------- programmatic


def test_prompt_color_hand_computed_values():
    reward = rewards.prompt_color()
    red = solid((255, 0, 0))
    assert reward(["a red square", "A BLUE circle", "green", "a reddish blob", "a cat"], [red] * 5) == [
        1.0,
        -1.0,
        -1.0,
        0.0,  # "reddish" is not the whole word "red"
        0.0,
    ]
    # One pixel colour (200, 100, 50): target minus the larger of the two others.
    pixel = solid((200, 100, 50))
    scores = reward(["red", "green", "blue"], [pixel] * 3)
    assert scores == pytest.approx([100 / 255, -100 / 255, -150 / 255], abs=1e-12)
    # Yellow is not red: max(others) removes mixed colours.
    assert reward(["red"], [solid((255, 255, 0))]) == [0.0]


def test_prompt_color_averages_over_pixels_and_uses_the_first_colour_named():
    half = np.zeros((4, 4, 3), dtype=np.uint8)
    half[:, :2, 0] = 255  # left half pure red, right half black
    image = Image.fromarray(half)
    assert rewards.prompt_color()(["a red shape", "a red and blue shape"], [image, image]) == [0.5, 0.5]
    # RGBA and greyscale inputs are converted to RGB first.
    assert rewards.prompt_color()(["blue"], [Image.new("RGBA", (2, 2), (0, 0, 255, 10))]) == [1.0]
    assert rewards.prompt_color()(["green"], [Image.new("L", (2, 2), 128)]) == [0.0]


def test_brightness_hand_computed_values():
    scores = rewards.brightness()(["", "", ""], [solid((255, 255, 255)), solid((255, 0, 0)), solid((0, 0, 0))])
    assert scores == pytest.approx([1.0, 0.299, 0.0], abs=1e-12)


def test_high_frequency_hand_computed_values():
    """Each interior pixel minus its 3 x 3 box mean, written out: a one-pixel black / white checkerboard has 5
    pixels of its own value in every 3 x 3 neighbourhood and 4 of the other, so every interior pixel is 4/9 from
    its box mean; a flat image scores 0; a single white pixel in the centre of a 5 x 5 black image is 8/9 from its
    box mean, and each of its 8 interior neighbours 1/9 (9 interior pixels)."""
    checker = ((np.indices((6, 8)).sum(axis=0) % 2) * 255).astype(np.uint8)
    dot = np.zeros((5, 5), dtype=np.uint8)
    dot[2, 2] = 255
    images = [Image.fromarray(np.stack([checker] * 3, axis=-1)), solid((30, 200, 90)), Image.fromarray(dot)]
    scores = rewards.high_frequency()(["", "", ""], images)
    assert scores == pytest.approx([4 / 9, 0.0, (8 / 9 + 8 * 1 / 9) / 9], abs=1e-12)
    # Pure red is luma 0.299: a red / black checkerboard scores 0.299 x 4/9.
    red_checker = np.zeros((6, 8, 3), dtype=np.uint8)
    red_checker[..., 0] = checker
    assert rewards.high_frequency()([""], [Image.fromarray(red_checker)]) == pytest.approx([0.299 * 4 / 9], abs=1e-12)
    with pytest.raises(ValueError, match="3 x 3"):
        rewards.high_frequency()([""], [solid((0, 0, 0)).resize((2, 2))])


def test_horizontal_detail_hand_computed_values():
    """Mean |vertical step| minus mean |horizontal step| of the luma, written out: one-pixel rows alternating black
    and white step by 1 between every vertical pair and 0 between horizontal ones (+1); the same as columns is -1; a
    one-pixel checkerboard steps by 1 both ways (0); a flat image 0; a 3 x 3 image with one white top row steps 1
    in 3 of the 6 vertical pairs and in none of the 6 horizontal ones (+0.5)."""
    rows = ((np.indices((6, 8))[0] % 2) * 255).astype(np.uint8)
    columns = ((np.indices((6, 8))[1] % 2) * 255).astype(np.uint8)
    checker = ((np.indices((6, 8)).sum(axis=0) % 2) * 255).astype(np.uint8)
    top = np.zeros((3, 3), dtype=np.uint8)
    top[0] = 255
    images = [Image.fromarray(np.stack([a] * 3, axis=-1)) for a in (rows, columns, checker, top)]
    scores = rewards.horizontal_detail()([""] * 5, [*images, solid((30, 200, 90))])
    assert scores == pytest.approx([1.0, -1.0, 0.0, 0.5, 0.0], abs=1e-12)
    with pytest.raises(ValueError, match="2 x 2"):
        rewards.horizontal_detail()([""], [solid((0, 0, 0)).resize((1, 3))])


def test_rewards_refuse_mismatched_prompts_and_images():
    with pytest.raises(ValueError, match="2 prompts for 1 images"):
        rewards.prompt_color()(["a", "b"], [solid((0, 0, 0))])


# ----------------------------------------------------------------------------------------------- JPEG


def test_jpeg_rewards_are_the_jpeg_size_in_kilobytes():
    flat, noisy = solid((30, 60, 90), (64, 64)), noise_image()
    buffer = io.BytesIO()
    noisy.save(buffer, "JPEG", quality=95)  # DDPO: quality 95, size / 1000
    incompressibility = rewards.jpeg_incompressibility()(["", ""], [flat, noisy])
    compressibility = rewards.jpeg_compressibility()(["", ""], [flat, noisy])
    assert incompressibility[1] == len(buffer.getvalue()) / 1000
    assert 3.0 < incompressibility[1] < 15.0  # random pixels barely compress (12.3 kB raw, 4:2:0 chroma)
    assert 0.3 < incompressibility[0] < 1.5  # a flat 64x64 JPEG is headers plus a few bytes
    assert compressibility == [-x for x in incompressibility]


# ----------------------------------------------------------------------------------------------- weighted sums


def test_compute_rewards_weighted_sum_and_per_reward_scores():
    red, white = solid((255, 0, 0)), solid((255, 255, 255))
    funcs = load_reward_funcs(["prompt_color", "brightness"])
    total, per_reward = compute_rewards(funcs, ["red", "blue"], [red, white], reward_weights=[1.0, 0.5])
    # prompt_color: red on "red" = 1, white on "blue" = 1 - 1 = 0; brightness: 0.299 and 1.
    assert per_reward["prompt_color"].tolist() == [1.0, 0.0]
    assert per_reward["brightness"].tolist() == pytest.approx([0.299, 1.0])
    assert total.tolist() == pytest.approx([1.0 + 0.5 * 0.299, 0.5])
    total, per_reward = compute_rewards([funcs[1], funcs[1]], ["a", "b"], [red, white])
    assert list(per_reward) == ["brightness", "brightness_2"]
    assert total.tolist() == pytest.approx([2 * 0.299, 2.0])


def test_compute_rewards_stops_on_bad_values_and_bad_weights():
    def broken(prompts, images, **kwargs):
        return [float("nan")] * len(images)

    with pytest.raises(ValueError, match="'broken'"):
        compute_rewards([broken], ["a"], [solid((0, 0, 0))])
    with pytest.raises(ValueError, match="2 reward weights for 1"):
        compute_rewards([broken], ["a"], [solid((0, 0, 0))], reward_weights=[1.0, 2.0])


def test_compute_rewards_passes_dataset_columns():
    def uses_column(prompts, images, target=None, **kwargs):
        return [float(t) for t in target]

    total, _ = compute_rewards(
        [uses_column, rewards.prompt_color()], ["a", "b"], [solid((0, 0, 0))] * 2, target=[3, 4]
    )
    assert total.tolist() == [3.0, 4.0]


def test_a_reward_without_kwargs_is_refused_when_loaded_with_its_name():
    def strict(prompts, images):
        return [0.0] * len(images)

    class Scorer:
        def __call__(self, prompts, images, trainer_state=None):
            return [0.0] * len(images)

    for func, name in ((strict, "strict"), (Scorer(), "Scorer")):
        with pytest.raises(ValueError, match=rf"Reward '{name}' has no \*\*kwargs \(its parameters: prompts, images"):
            load_reward_funcs(["prompt_color", func])
    with pytest.raises(ValueError, match=r"Reward 'join' has no \*\*kwargs"):  # a dotted import path too
        load_reward_funcs("os.path.join")


def test_async_rewards_run_concurrently_with_each_other_and_with_the_sync_ones():
    import asyncio
    import functools
    import threading

    both_async_started = asyncio.Barrier(2)
    async_ran = threading.Event()
    calls = {"flaky": 0}

    async def first(prompts, images, **kwargs):
        await asyncio.wait_for(both_async_started.wait(), 5)  # times out if the two ran one after the other
        async_ran.set()
        return [1.0] * len(images)

    async def second(prompts, images, scale, **kwargs):
        calls["flaky"] += 1
        if calls["flaky"] == 1:
            await asyncio.wait_for(both_async_started.wait(), 5)
            raise ConnectionError("first attempt fails")
        return [scale * i for i in range(len(images))]

    class AsyncJudge:
        __name__ = "first"  # the same name as `first`: made unique in the rewards' order

        async def __call__(self, prompts, images, **kwargs):
            return [None, 3.0, None]

    def sync(prompts, images, **kwargs):
        assert async_ran.wait(5), "the async rewards did not run while this synchronous reward did"
        return [0.5] * len(images)

    assert rewards.base.is_async_reward(functools.partial(second, scale=2.0))
    assert rewards.base.is_async_reward(AsyncJudge()) and not rewards.base.is_async_reward(sync)
    funcs = [sync, first, functools.partial(second, scale=2.0), AsyncJudge()]
    images = [solid("red")] * 3
    total, per_reward = compute_rewards(funcs, ["a", "b", "c"], images, [1.0, 2.0, 1.0, 10.0], retries=1)
    assert list(per_reward) == ["sync", "first", "second", "first_2"]
    assert per_reward["second"].tolist() == [0.0, 2.0, 4.0] and calls["flaky"] == 2
    assert per_reward["first_2"].isnan().tolist() == [True, False, True]
    assert total.tolist() == pytest.approx([0.5 + 2.0 + 0.0, 0.5 + 2.0 + 2.0 + 30.0, 0.5 + 2.0 + 4.0])


def test_async_reward_errors_name_the_reward():
    async def broken(prompts, images, **kwargs):
        return [float("nan")] * len(images)

    with pytest.raises(ValueError, match="'broken'"):
        compute_rewards([broken], ["a"], [solid("red")])


# ---------------------------------------------------------------- deadlines (reward_timeout)
HANG_S = 60.0
"""How long the hanging rewards below block at most: without a deadline a test fails after this, never hangs."""


@pytest.fixture
def release():
    """An event the hanging rewards wait on, set when the test ends so that no abandoned call outlives it."""
    import threading

    event = threading.Event()
    yield event
    event.set()


def test_a_hung_sync_reward_stops_at_its_deadline_and_is_not_retried(release):
    calls = []

    def hang(prompts, images, **kwargs):
        calls.append(torch.is_grad_enabled())
        release.wait(HANG_S)
        return [0.0] * len(images)

    def quick(prompts, images, **kwargs):
        return [1.0] * len(images)

    with (
        torch.no_grad(),
        pytest.raises(RewardTimeout, match=r"Reward 'hang' did not return within reward_timeout=0.5 s"),
    ):
        compute_rewards([quick, hang], ["a"], [solid("red")], retries=2, timeout=0.5)
    # Not retried (a retry would wait as long again); run in the caller's grad mode, though in another thread.
    assert calls == [False]


def test_a_reward_raising_its_own_timeout_error_is_retried_as_any_error():
    calls = []

    def server(prompts, images, **kwargs):  # a client's own deadline, within reward_timeout
        calls.append(1)
        if len(calls) == 1:
            raise TimeoutError("the server did not answer")
        return [2.0] * len(images)

    total, _ = compute_rewards([server], ["a"], [solid("red")], retries=1, timeout=30)
    assert total.tolist() == [2.0] and len(calls) == 2


def test_an_async_reward_that_never_finishes_is_cancelled_at_its_deadline():
    import asyncio
    import threading

    cancelled = threading.Event()

    async def never(prompts, images, **kwargs):
        try:
            await asyncio.sleep(HANG_S)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return [0.0] * len(images)

    async def quick(prompts, images, **kwargs):
        return [1.0] * len(images)

    with pytest.raises(RewardTimeout, match=r"Reward 'never' did not return within reward_timeout=0.5 s"):
        compute_rewards([quick, never], ["a"], [solid("red")], timeout=0.5)
    assert cancelled.wait(10)  # the coroutine was cancelled, not left running


def test_every_reward_has_a_default_deadline_and_none_turns_it_off():
    """The config's default and compute_rewards' agree, and apply to local callables as to the remote reward; a
    synchronous reward under a deadline runs in a thread of its own (so that the caller can stop waiting), without
    one in the caller's thread."""
    import threading

    from trl_jagg import GRPOJaggConfig

    default = GRPOJaggConfig(output_dir="unused").reward_timeout
    assert default == DEFAULT_REWARD_TIMEOUT == inspect.signature(compute_rewards).parameters["timeout"].default
    assert 600 < default < 1800  # past the remote reward's own attempts, within the process group's timeout

    def local(prompts, images, **kwargs):
        return [0.0] * len(images)

    remote = rewards.remote("http://127.0.0.1:9/score/x")
    assert reward_deadline(local, default) == reward_deadline(remote, default) == default
    assert reward_deadline(local, None) is reward_deadline(remote, None) is None
    threads = []

    def where(prompts, images, **kwargs):
        threads.append(threading.current_thread())
        return [0.0] * len(images)

    compute_rewards([where], ["a"], [solid("red")])
    compute_rewards([where], ["a"], [solid("red")], timeout=None)
    assert threads[0] is not threading.main_thread() and threads[1] is threading.main_thread()


def _signal_soon(seconds: float = 0.3) -> None:
    """What the trainer's SIGTERM handler does to the rewards in flight, from a timer thread."""
    import signal
    import threading

    threading.Timer(seconds, abandon_rewards_in_flight, args=(signal.SIGTERM,)).start()


def test_a_stop_signal_abandons_a_sync_reward_in_flight_and_is_not_retried(release):
    calls = []

    def hang(prompts, images, **kwargs):
        calls.append(1)
        release.wait(HANG_S)
        return [0.0] * len(images)

    _signal_soon()
    with pytest.raises(RewardInterrupted, match=r"Reward 'hang' was abandoned: SIGTERM arrived while it was scoring"):
        compute_rewards([hang], ["a"], [solid("red")], retries=2, timeout=HANG_S)
    assert calls == [1]  # not retried: the abandoned call may still run
    # A later call is not abandoned by the signal that came before it.
    assert compute_rewards([lambda prompts, images, **kw: [1.0]], ["a"], [solid("red")])[0].tolist() == [1.0]


def test_a_stop_signal_cancels_an_async_reward_in_flight():
    import asyncio
    import threading

    cancelled = threading.Event()

    async def never(prompts, images, **kwargs):
        try:
            await asyncio.sleep(HANG_S)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return [0.0] * len(images)

    _signal_soon()
    with pytest.raises(RewardInterrupted, match="Reward 'never' was abandoned: SIGTERM"):
        compute_rewards([never], ["a"], [solid("red")], retries=1, timeout=HANG_S)
    assert cancelled.wait(10)


# ---------------------------------------------------------------- videos (lists of frames)


def test_image_rewards_score_videos_per_frame_and_take_the_mean():
    """An image reward scores every frame of a video (its prompt and dataset columns repeated per frame) and a video
    gets its frames' mean, frames scored None left out; a reward declaring `takes_videos` receives the clips."""
    videos = [[solid((200, 0, 0)), solid((0, 0, 0))], [solid((100, 100, 100))] * 3]
    seen = {}

    def red(prompts, images, ids, log_extra, **kwargs):
        seen["red"] = (list(prompts), list(ids), len(images))
        log_extra("redness", [float(np.asarray(im)[..., 0].mean()) for im in images])
        return [float(np.asarray(im, np.float32)[..., 0].mean()) / 255 for im in images]

    def dark_only(prompts, images, **kwargs):  # None for the frames it does not apply to
        return [1.0 if np.asarray(im).max() == 0 else None for im in images]

    def clip_length(prompts, images, **kwargs):
        seen["clip"] = [len(video) for video in images]
        return [float(len(video)) for video in images]

    clip_length.takes_videos = True
    logged = {}
    total, per_reward = compute_rewards(
        [red, dark_only, clip_length], ["a", "b"], videos, ids=[7, 8],
        log_extra=lambda column, values: logged.setdefault(column, []).extend(values),
    )  # fmt: skip
    assert seen["red"] == (["a", "a", "b", "b", "b"], [7, 7, 8, 8, 8], 5)
    assert seen["clip"] == [2, 3]
    # By hand: red (200/255 + 0) / 2 and 100/255; dark only on the first video's black frame; the clip lengths.
    torch.testing.assert_close(per_reward["red"], torch.tensor([100 / 255, 100 / 255]))
    assert per_reward["dark_only"][0] == 1.0 and per_reward["dark_only"][1].isnan()
    torch.testing.assert_close(per_reward["clip_length"], torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(total, torch.tensor([100 / 255 + 1 + 2, 100 / 255 + 3]))
    assert logged == {"redness": [200.0, 100.0]}  # one value per video: its first frame's


def test_async_image_rewards_score_videos_per_frame():
    async def brightness(prompts, images, **kwargs):
        return [float(np.asarray(im, np.float32).mean()) for im in images]

    _, per_reward = compute_rewards([brightness], ["a"], [[solid((30, 30, 30)), solid((90, 90, 90))]])
    torch.testing.assert_close(per_reward["brightness"], torch.tensor([60.0]))


def test_per_frame_scores_are_checked_against_the_frame_count():
    def one_per_video(prompts, images, **kwargs):  # a video reward that forgot to declare `takes_videos`
        return [1.0]

    with pytest.raises(ValueError, match="'one_per_video' returned .* expected a flat list of 3"):
        compute_rewards([one_per_video], ["a"], [[solid((1, 1, 1))] * 3])


# ---------------------------------------------------------------- a reward server's unreadable answers
@pytest.fixture
def answering():
    """A server on 127.0.0.1 answering every POST with HTTP 200 and the bytes ``set_answer`` gave it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answer = {"body": b""}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer["body"])))
            self.end_headers()
            self.wfile.write(answer["body"])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score/x?api_key=s3cret"

    def set_answer(body: bytes) -> str:
        answer["body"] = body
        return url

    yield set_answer
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b'{"scores": [1' + b"0" * 400 + b"]}", "integers too large for a float at positions [0]"),
        (b'{"scores": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "JSON nested too deep to read"),
        (b'{"scores": [1' + b"0" * 5000 + b"]}", "an answer that is not JSON"),  # past int's digit limit
    ],
    ids=["400-digit-integer", "nested-100000-deep", "5000-digit-integer"],
)
def test_an_unreadable_server_answer_is_a_named_error_naming_the_server(answering, body, problem):
    url = answering(body)
    with pytest.raises(RuntimeError, match=re.escape(problem)) as info:
        rewards.remote(url, retries=0)(["a"], [solid("red")])
    assert "127.0.0.1" in str(info.value) and "s3cret" not in str(info.value)  # the server, its key redacted
