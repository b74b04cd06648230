"""``examples/flow_grpo_sidecar.py`` serves Flow-GRPO's reward-server scorers over the JSON remote-reward protocol,
tested with stand-in ``reward_server/gen_eval.py`` and ``deqa.py`` files of the sidecar's layout and signatures (no
mmdet, no pickle): the metadata each image reaches the scorer with, and the scores the remote reward reads."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from PIL import Image

import trl_jagg.rewards as rewards

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flow_grpo_sidecar.py"

# The sidecar's signatures (reward-server/reward_server/gen_eval.py, deqa.py): load_geneval() returns
# compute_geneval(images, metadatas, only_strict) -> (scores, rewards, strict_rewards, group_rewards,
# group_strict_rewards); load_deqascore() returns compute_deqascore(images) -> [score / 5, ...].
GEN_EVAL = """
CALLS = []

def load_geneval():
    def compute_geneval(images, metadatas, only_strict=False):
        CALLS.append((metadatas, only_strict, [image.getpixel((0, 0)) for image in images]))
        scores = [len(m["include"]) + 0.5 * ("exclude" in m) + image.getpixel((0, 0))[0] / 255
                  for image, m in zip(images, metadatas)]
        return scores, [0.0] * len(images), [1.0] * len(images), {}, {}
    return compute_geneval
"""
DEQA = """
def load_deqascore():
    return lambda images: [image.getpixel((0, 0))[1] / 255 for image in images]
"""


@pytest.fixture
def sidecar(tmp_path):
    (tmp_path / "reward_server").mkdir()
    (tmp_path / "reward_server" / "gen_eval.py").write_text(GEN_EVAL)
    (tmp_path / "reward_server" / "deqa.py").write_text(DEQA)
    spec = importlib.util.spec_from_file_location("flow_grpo_sidecar", EXAMPLE)
    adapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(adapter)
    served = adapter.sidecar_rewards(["geneval", "deqa"], tmp_path)
    server = adapter.build_server(served, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.close()
    for name in ("flow_grpo_gen_eval", "flow_grpo_deqa"):
        sys.modules.pop(name, None)


def test_geneval_and_deqa_through_the_json_adapter(sidecar):
    images = [Image.new("RGB", (16, 16), (51, 102, 0)), Image.new("RGB", (16, 16), (255, 0, 0))]
    prompts = ["a photo of a bench", "a photo of two cats"]
    include = [[{"class": "bench", "count": 1}], [{"class": "cat", "count": 2}, {"class": "dog", "count": 0}]]
    geneval = rewards.remote(f"{sidecar}/geneval")
    scores = geneval(
        prompts, images, tag=["single_object", "counting"], include=include, exclude=[None, [{"class": "x"}]]
    )
    assert scores == pytest.approx([1 + 51 / 255, 2 + 0.5 + 1.0])
    metadatas, only_strict, pixels = sys.modules["flow_grpo_gen_eval"].CALLS[-1]
    assert only_strict is True  # Flow-GRPO trains on the strict pass's scores
    assert metadatas[0] == {"tag": "single_object", "include": include[0], "prompt": prompts[0]}
    assert metadatas[1]["exclude"] == [{"class": "x"}] and pixels == [(51, 102, 0), (255, 0, 0)]
    assert rewards.remote(f"{sidecar}/deqa")(prompts, images) == pytest.approx([102 / 255, 0.0])


def test_geneval_without_its_metadata_fails_the_request(sidecar):
    with pytest.raises(RuntimeError, match="HTTP 500|failed to score"):
        rewards.remote(f"{sidecar}/geneval", retries=0)(["a bench"], [Image.new("RGB", (8, 8))])
