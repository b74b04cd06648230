"""Step time with a slow remote reward, scored after the rollout vs chunk by chunk while it samples
(``overlap_rewards``).

A local server on 127.0.0.1 answers the remote-reward protocol after a fixed ``latency`` per request; the remote
reward sends one request per rollout chunk (``batch_size = sample_batch_size``), so after the rollout it costs
``chunks x latency`` and, overlapped, about the last chunk's ``latency`` once the sampling of a chunk takes at least
``latency``. Trains a tiny Flux pipeline built from config on the CPU and prints the median step times.

    python -m trl_jagg.benchmarks.reward_overlap [--latency 0.5] [--steps 4] [--num_inference_steps 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from datasets import Dataset
from transformers import TrainerCallback


def slow_reward_server(latency: float) -> ThreadingHTTPServer:
    """A remote-reward server answering each request after ``latency`` seconds, with scores from the image bytes."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(latency)
            body = json.dumps({"scores": [len(image) % 97 / 97 for image in request["images"]]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


class _StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.ends: list[float] = [time.perf_counter()]

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())


def step_times(overlap: bool, url: str, *, chunk: int, chunks: int, steps: int, num_inference_steps: int) -> list:
    """Seconds of each training step after the first (warm-up) one."""
    import torch

    from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
    from trl_jagg.rewards import remote
    from trl_jagg.testing.tiny_models import save_tiny_pipeline

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        path = save_tiny_pipeline("flux", folder + "/flux", seed=0)
        args = GRPOJaggConfig(
            output_dir=folder + "/out", per_device_train_batch_size=chunk * chunks, num_generations=2,
            sample_batch_size=chunk, num_inference_steps=num_inference_steps, height=32, width=32,
            max_steps=steps + 1, max_sequence_length=16, report_to="none", save_strategy="no", disable_tqdm=True,
            overlap_rewards=overlap, seed=0,
        )  # fmt: skip
        prompts = [f"a shape number {i}" for i in range(64)]
        trainer = DDPOJaggTrainer(
            path, reward_funcs=[remote(url, batch_size=chunk, name="slow_remote")], args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
        )  # fmt: skip
        times = _StepTimes()
        trainer.add_callback(times)
        trainer.train()
        reward_waits = trainer.state.log_history
    steps_s = [b - a for a, b in zip(times.ends, times.ends[1:])][1:]
    rewards_s = [e["time/reward_s"] for e in reward_waits if "time/reward_s" in e][1:]
    rollouts_s = [e["time/rollout_s"] for e in reward_waits if "time/rollout_s" in e][1:]
    return [steps_s, rewards_s, rollouts_s]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.5, help="seconds per reward request")
    parser.add_argument("--chunk", type=int, default=2, help="images per rollout chunk (sample_batch_size)")
    parser.add_argument("--chunks", type=int, default=4, help="chunks per rollout")
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    parser.add_argument("--num_inference_steps", type=int, default=24)
    options = parser.parse_args()
    server = slow_reward_server(options.latency)
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    kwargs = dict(chunk=options.chunk, chunks=options.chunks, steps=options.steps,
                  num_inference_steps=options.num_inference_steps)  # fmt: skip
    results = {overlap: step_times(overlap, url, **kwargs) for overlap in (False, True)}
    server.shutdown()
    for overlap, (steps_s, rewards_s, rollouts_s) in results.items():
        print(
            f"overlap_rewards={overlap!s:5}  step {statistics.median(steps_s):.3f} s  (rollout "
            f"{statistics.median(rollouts_s):.3f} s, waiting for rewards {statistics.median(rewards_s):.3f} s; "
            f"median of {len(steps_s)} steps)"
        )
    sequential, overlapped = (statistics.median(results[flag][0]) for flag in (False, True))
    reward_share = statistics.median(results[False][1])
    print(
        f"step time fell by {sequential - overlapped:.3f} s ({(sequential - overlapped) / sequential:.0%}); the reward "
        f"took {reward_share:.3f} s of the sequential step ({reward_share / sequential:.0%}), of which the last "
        f"chunk's {options.latency:.3f} s cannot overlap"
    )


if __name__ == "__main__":
    main()
