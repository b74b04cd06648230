"""Registry, output checks, weight-free rewards (programmatic, JPEG), weighted sums and the remote reward.

Model-backed rewards are tested in test_rewards_models.py (tiny random models) and test_rewards_ocr.py (real OCR).
"""

from __future__ import annotations

import importlib.util
import io
import math
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import trl_jagg.rewards as rewards
from trl_jagg.rewards import check_rewards, compute_rewards, load_reward_funcs
from trl_jagg.rewards.remote import RemoteReward

REPO = Path(__file__).resolve().parents[1]


def solid(rgb: tuple[int, int, int], size: tuple[int, int] = (8, 8)) -> Image.Image:
    return Image.new("RGB", size, rgb)


def noise_image(seed: int = 0, size: int = 64) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


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


# ----------------------------------------------------------------------------------------------- remote


def _load_server_module():
    spec = importlib.util.spec_from_file_location("reward_server", REPO / "examples" / "reward_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server_url():
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

    served = {"prompt_color": rewards.prompt_color(), "flaky": flaky, "nan": nan_reward, "column": column}
    server = _load_server_module().build_server(served, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


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


def test_remote_reward_names_the_url_when_the_server_is_down():
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score/pickscore"
    with pytest.raises(ConnectionError) as info:
        rewards.remote(url, timeout=2, retries=1, backoff=0.01)(["a"], [solid((0, 0, 0))])
    assert url in str(info.value) and "reward_server.py" in str(info.value)


# ----------------------------------------------------------------------------------------------- TRL's convention


def test_rewards_are_called_with_trl_keywords():
    seen = {}

    def trl_style(completions, **kwargs):  # TRL's `def reward(completions, **kwargs)`
        seen.update(kwargs, completions=completions)
        return [float(len(c.getbands())) for c in completions]

    def by_name(*, images, prompts, **kwargs):  # keyword-only: would break on a positional call
        return [float(len(p)) for p in prompts]

    images = [solid((0, 0, 0)), solid((255, 255, 255))]
    state = object()
    total, per_reward = compute_rewards(
        [trl_style, by_name], ["ab", "abc"], images, trainer_state=state, target=["x", "y"]
    )
    assert seen["completions"] == images and seen["images"] == images  # both keywords are the images
    assert seen["prompts"] == ["ab", "abc"] and seen["trainer_state"] is state and seen["target"] == ["x", "y"]
    assert per_reward["trl_style"].tolist() == [3.0, 3.0] and per_reward["by_name"].tolist() == [2.0, 3.0]
    assert total.tolist() == [5.0, 6.0]
    with pytest.raises(ValueError, match=r"\['completions'\].*rename"):
        compute_rewards([trl_style], ["a"], images[:1], completions=["clash"])


def test_none_means_not_applicable_in_the_weighted_sum():
    def only_first(prompts, images, **kwargs):
        return [1.5] + [None] * (len(images) - 1)

    def constant(prompts, images, **kwargs):
        return [2.0] * len(images)

    images = [solid((0, 0, 0))] * 3
    total, per_reward = compute_rewards([only_first, constant], ["a", "b", "c"], images, reward_weights=[2.0, 0.5])
    # Sample 0: 2 * 1.5 + 0.5 * 2; samples 1 and 2: only the constant applies.
    assert total.tolist() == [4.0, 1.0, 1.0]
    assert per_reward["only_first"][0] == 1.5 and per_reward["only_first"][1:].isnan().all()


def test_a_sample_no_reward_applies_to_is_an_error_naming_the_rewards():
    def never(prompts, images, **kwargs):
        return [None] * len(images)

    def sometimes(prompts, images, **kwargs):
        return [1.0, None]

    with pytest.raises(ValueError, match=r"sample 1 \(prompt 'b'\).*\(never, sometimes\) returned None"):
        compute_rewards([never, sometimes], ["a", "b"], [solid((0, 0, 0))] * 2)
    with pytest.raises(ValueError, match="'never'"):  # NaN is still an error, None is not
        check_rewards("never", [None, float("nan")], 2)


# ----------------------------------------------------------------------------------------------- dotted paths


def test_dotted_import_paths_load_your_own_reward(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def darkness(prompts, images, **kwargs):\n    return [0.5] * len(images)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in (str(tmp_path), "")])
    monkeypatch.delitem(__import__("sys").modules, "my_rewards", raising=False)
    func, color = load_reward_funcs(["my_rewards.darkness", "prompt_color"])
    assert func.__module__ == "my_rewards" and func.__name__ == "darkness" and color.__name__ == "prompt_color"
    assert func(["a"], [solid((0, 0, 0))]) == [0.5]
    with pytest.raises(ValueError, match=r"'my_rewards.lightness'.*module.function"):
        load_reward_funcs("my_rewards.lightness")
    with pytest.raises(ValueError, match="did you mean the built-in 'hpsv2.1'"):
        load_reward_funcs("hpsv2.2")
    assert load_reward_funcs("hpsv2.1")[0].__name__ == "hpsv2.1"  # a registered name with a dot is not a path
