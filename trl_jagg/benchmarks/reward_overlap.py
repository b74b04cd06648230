"""Step time with a slow remote reward, scored after the rollout vs chunk by chunk while it samples and the update
starts (``overlap_rewards``).

A local server on 127.0.0.1 (in its own process) answers the remote-reward protocol after a fixed ``latency`` per
request; the remote reward sends one request per rollout chunk (``batch_size = sample_batch_size``), so after the
rollout it costs ``chunks x latency``. Overlapped, each chunk's request runs while the next chunk samples, and the
last one while the update trains the micro-batches whose groups are already scored: the step has one micro-batch
per chunk (one group of ``num_generations = chunk`` images each, ``gradient_accumulation_steps = chunks``), so the
first ``chunks - 1`` micro-batches' forward and backward (and, with ``beta > 0``, the KL reference of the last;
Flow-GRPO's GenEval and OCR recipes, whose rewards are servers, train with ``beta = 0.04``) hide the last request.
Trains a tiny Flux pipeline built from config on the CPU, its steps alternating between the two ways (one trainer,
``overlap_rewards`` set per step, so adjacent steps share the machine's load), and prints (and writes with
``--json``) per pair of adjacent steps the step times, the reward's share of the sequential step, and the issue's
criterion: the step falls by at least that share (``fall / share >= 1``, judged on the median over pairs).

    python -m trl_jagg.benchmarks.reward_overlap [--latency 0.5] [--pairs 6] [--beta 0.04] [--json f]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from datasets import Dataset
from transformers import TrainerCallback


class _SlowHandler(BaseHTTPRequestHandler):
    """Answers each remote-reward request after ``latency`` seconds, with scores from the image bytes."""

    latency = 0.5

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.latency)
        body = json.dumps({"scores": [len(image) % 97 / 97 for image in request["images"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def _serve(latency: float, ports: Any) -> None:
    _SlowHandler.latency = latency
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowHandler)
    ports.put(server.server_address[1])
    server.serve_forever(poll_interval=0.05)


def slow_reward_server(latency: float) -> tuple[multiprocessing.Process, str]:
    """A remote-reward server answering each request after ``latency`` seconds, in its own process as a real server
    (its request handling does not share the trainer's interpreter); returns the process and the URL."""
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    process = context.Process(target=_serve, args=(latency, ports), daemon=True)
    process.start()
    return process, f"http://127.0.0.1:{ports.get(timeout=120)}/score"


def overlapped_at(step: int) -> bool:
    """Whether timed step ``step`` (0-based) overlaps: S O O S S O O S ..., so each pair of adjacent steps has one
    of each, and neither always comes first."""
    return (step % 4) in (1, 2)


class _Interleaved(TrainerCallback):
    """Sets ``overlap_rewards`` for each step (the rollout reads it when it starts) and records when steps end."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        args.overlap_rewards = state.global_step > 0 and overlapped_at(state.global_step - 1)  # step 0: warm-up
        if not self.ends:
            self.ends.append(time.perf_counter())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())


def step_times(url: str, *, chunk: int, chunks: int, pairs: int, num_inference_steps: int, beta: float) -> list:
    """Per timed step (after a warm-up step, ``2 x pairs`` of them, interleaved as :func:`overlapped_at` says):
    seconds of the step, of the wait for rewards and of the rollout. One trainer runs both ways, so adjacent steps
    share the machine's load."""
    import torch

    from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
    from trl_jagg.rewards import remote
    from trl_jagg.testing.tiny_models import save_tiny_pipeline

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        path = save_tiny_pipeline("flux", folder + "/flux", seed=0)
        args = GRPOJaggConfig(
            output_dir=folder + "/out", per_device_train_batch_size=chunk, gradient_accumulation_steps=chunks,
            num_generations=chunk, sample_batch_size=chunk, num_inference_steps=num_inference_steps, height=32,
            width=32, max_steps=2 * pairs + 1, max_sequence_length=16, report_to="none", save_strategy="no",
            disable_tqdm=True, beta=beta, seed=0,
        )  # fmt: skip
        prompts = [f"a shape number {i}" for i in range(64)]
        trainer = DDPOJaggTrainer(
            path, reward_funcs=[remote(url, batch_size=chunk, name="slow_remote")], args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
        )  # fmt: skip
        times = _Interleaved()
        trainer.add_callback(times)
        trainer.train()
        history = trainer.state.log_history
    steps_s = [b - a for a, b in zip(times.ends, times.ends[1:])][1:]
    rewards_s = [e["time/reward_s"] for e in history if "time/reward_s" in e][1:]
    rollouts_s = [e["time/rollout_s"] for e in history if "time/rollout_s" in e][1:]
    return list(zip(steps_s, rewards_s, rollouts_s))


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of ``values``, rounded for the report."""
    return {k: round(f(values), 3) for k, f in (("median", statistics.median), ("min", min), ("max", max))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.5, help="seconds per reward request")
    parser.add_argument("--chunk", type=int, default=2, help="images per rollout chunk (sample_batch_size)")
    parser.add_argument("--chunks", type=int, default=4, help="chunks per rollout")
    parser.add_argument("--pairs", type=int, default=6, help="pairs of adjacent steps, one each way")
    parser.add_argument("--num_inference_steps", type=int, default=24)
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (0: no KL reference to overlap)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    options = parser.parse_args()
    server, url = slow_reward_server(options.latency)
    steps = step_times(url, chunk=options.chunk, chunks=options.chunks, pairs=options.pairs, beta=options.beta,
                       num_inference_steps=options.num_inference_steps)  # fmt: skip
    rounds = []
    for k in range(options.pairs):
        first, second = steps[2 * k], steps[2 * k + 1]
        (sequential, reward_s, rollout_s), (overlapped, left_s, _) = (
            (second, first) if overlapped_at(2 * k) else (first, second)
        )
        rounds.append({
            "sequential_step_s": round(sequential, 3), "overlapped_step_s": round(overlapped, 3),
            "reward_share_s": round(reward_s, 3), "overlapped_reward_wait_s": round(left_s, 3),
            "sequential_rollout_s": round(rollout_s, 3), "fall_s": round(sequential - overlapped, 3),
            "fall_over_share": round((sequential - overlapped) / reward_s, 3),
            "overlapped_over_sequential": round(overlapped / sequential, 3),
        })  # fmt: skip
        print(f"pair {k + 1}: {json.dumps(rounds[-1])}")
    server.terminate()
    ratios = spread([x["fall_over_share"] for x in rounds])
    result = {
        "settings": vars(options),
        "pairs": rounds,
        "fall_over_share": ratios,
        "overlapped_over_sequential": spread([x["overlapped_over_sequential"] for x in rounds]),
        # Issue 21's done-when: the step falls by at least the reward's share of the (sequential) step.
        "done_when_met": ratios["median"] >= 1.0,
    }
    print(
        f"step fall / reward share: median {ratios['median']}, min {ratios['min']}, max {ratios['max']} over "
        f"{len(rounds)} pairs of adjacent steps; overlapped / sequential step: {result['overlapped_over_sequential']}; "
        f"done-when (median >= 1) {'met' if result['done_when_met'] else 'NOT met'}"
    )
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
