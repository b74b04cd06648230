"""Step time with a slow remote reward, scored after the rollout vs chunk by chunk while it samples and the update
starts (``overlap_rewards``): ``trl-jagg bench reward-overlap``.

A local server on 127.0.0.1 (in its own process) answers the remote-reward protocol after a fixed ``latency`` per
request; the remote reward sends one request per rollout chunk (``batch_size = sample_batch_size``), so after the
rollout it costs ``chunks x latency``. Overlapped, each chunk's request runs while the next chunk samples, and the
last one while the update trains the micro-batches whose groups are already scored: the step has one micro-batch
per chunk (one group of ``num_generations = chunk`` images each, ``gradient_accumulation_steps = chunks``), so the
first ``chunks - 1`` micro-batches' forward and backward (and, with ``beta > 0``, the KL reference; Flow-GRPO's
GenEval and OCR recipes, whose rewards are servers, train with ``beta = 0.04``) hide the last request.

That is possible only when the work beside each request lasts longer than the latency, as it does at real sizes (a
FLUX.1-dev rollout and update take tens of seconds each): the first chunk's request must be answered while the other
chunks sample, the last one's while the update trains the micro-batches before its own. The default Flux pipeline
(built from config, trained on the CPU) is sized for both, and the report says, per ``beta``, whether the sequential
steps' rollout after its first chunk and update before its last micro-batch outlasted the latency.
Each ``beta`` gets one trainer whose steps alternate between the two ways (``overlap_rewards`` set per step,
``S O O S ...`` after a warm-up step, so adjacent steps share the machine's load). Per pair of adjacent steps the
report holds the step times, the reward's share of the sequential step (its wait for rewards) and the issue's
criterion: the step falls by at least that share (``fall / share >= 1``, judged on the median over pairs).
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

JSON_NAME = "reward_overlap_benchmark.json"
PNG_NAME = "reward_overlap_benchmark.png"


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


def _interleaving_callback() -> Any:
    """A Trainer callback that sets ``overlap_rewards`` for each step (the rollout reads it when it starts; step 0,
    the warm-up, is sequential) and records in ``ends`` when steps end."""
    from transformers import TrainerCallback

    class Interleaved(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            args.overlap_rewards = state.global_step > 0 and overlapped_at(state.global_step - 1)
            if not self.ends:
                self.ends.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    return Interleaved()


def step_times(
    url: str, *, chunk: int, chunks: int, pairs: int, num_inference_steps: int, beta: float, resolution: int,
    num_layers: int, num_single_layers: int, seed: int = 0,
) -> list[dict[str, float]]:  # fmt: skip
    """Per timed step (after a warm-up step, ``2 x pairs`` of them, interleaved as :func:`overlapped_at` says): the
    seconds of the step, of its wait for rewards, of the rollout and of the update (its micro-batches together,
    without the wait).
    One trainer runs both ways, so adjacent steps share the machine's load."""
    import torch
    from datasets import Dataset

    from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
    from trl_jagg.rewards import remote
    from trl_jagg.testing.tiny_models import save_tiny_pipeline

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as folder:
        path = save_tiny_pipeline(
            "flux", folder + "/flux", seed=seed,
            transformer={"num_layers": num_layers, "num_single_layers": num_single_layers},
        )  # fmt: skip
        args = GRPOJaggConfig(
            output_dir=folder + "/out", per_device_train_batch_size=chunk, gradient_accumulation_steps=chunks,
            num_generations=chunk, sample_batch_size=chunk, num_inference_steps=num_inference_steps,
            height=resolution, width=resolution, max_steps=2 * pairs + 1, max_sequence_length=16, report_to="none",
            save_strategy="no", disable_tqdm=True, beta=beta, seed=seed,
        )  # fmt: skip
        prompts = [f"a shape number {i}" for i in range(64)]
        trainer = DDPOJaggTrainer(
            path, reward_funcs=[remote(url, batch_size=chunk, name="slow_remote")], args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
        )  # fmt: skip
        times = _interleaving_callback()
        trainer.add_callback(times)
        trainer.train()
        history = trainer.state.log_history
    steps_s = [b - a for a, b in zip(times.ends, times.ends[1:])][1:]
    # One log per step; it averages the step's micro-batches, whose sum is the update's time. An overlapped step
    # waits for the rewards inside its update (the one reward scores chunk by chunk): that wait is taken out.
    logs = [e for e in history if "time/rollout_s" in e][1:]
    return [
        {"step_s": step, "reward_wait_s": log["time/reward_s"], "rollout_s": log["time/rollout_s"],
         "update_s": chunks * log["time/update_s"] - (log["time/reward_s"] if overlapped_at(i) else 0.0)}
        for i, (step, log) in enumerate(zip(steps_s, logs))
    ]  # fmt: skip


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of ``values``, rounded for the report."""
    return {k: round(f(values), 3) for k, f in (("median", statistics.median), ("min", min), ("max", max))}


def compare_pairs(steps: Sequence[dict[str, float]], *, chunks: int, latency: float) -> dict[str, Any]:
    """The report of one ``beta``'s interleaved ``steps``: per pair of adjacent steps the sequential and overlapped
    times and ``fall / share``, their spreads, and whether the update could hide the last request at all."""
    pairs = []
    for k in range(len(steps) // 2):
        first, second = steps[2 * k], steps[2 * k + 1]
        sequential, overlapped = (second, first) if overlapped_at(2 * k) else (first, second)
        fall = sequential["step_s"] - overlapped["step_s"]
        pairs.append({
            "sequential": {key: round(value, 3) for key, value in sequential.items()},
            "overlapped": {key: round(value, 3) for key, value in overlapped.items()},
            "fall_s": round(fall, 3),
            "fall_over_share": round(fall / sequential["reward_wait_s"], 3),
            "overlapped_over_sequential": round(overlapped["step_s"] / sequential["step_s"], 3),
        })  # fmt: skip
    # What can hide the requests, in the sequential steps (which wait for no reward inside the rollout or update):
    # the first chunk's request runs while the other chunks sample, the last one's while the update trains the
    # micro-batches before its own. Both must outlast the latency for no wait to be left.
    room = {
        "rollout_after_first_chunk_s": spread([p["sequential"]["rollout_s"] * (chunks - 1) / chunks for p in pairs]),
        "update_before_last_micro_batch_s": spread(
            [p["sequential"]["update_s"] * (chunks - 1) / chunks for p in pairs]
        ),
    }
    ratios = spread([p["fall_over_share"] for p in pairs])
    return {
        "pairs": pairs,
        "fall_over_share": ratios,
        "overlapped_over_sequential": spread([p["overlapped_over_sequential"] for p in pairs]),
        "reward_wait_s": {
            way: spread([p[way]["reward_wait_s"] for p in pairs]) for way in ("sequential", "overlapped")
        },
        **room,
        "room_outlasts_latency": all(spread_["median"] > latency for spread_ in room.values()),
        # Issue 21's done-when: the step falls by at least the reward's share of the (sequential) step.
        "done_when_met": ratios["median"] >= 1.0,
    }


def plot_reward_overlap(result: dict[str, Any], path: str) -> str:
    """Per ``beta``, the median sequential and overlapped step split into rollout, wait for rewards, update and the
    rest (min-max of the step as error bars); and ``fall / share`` per pair against the criterion's line at 1."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2), dpi=90)
    FigureCanvasAgg(figure)
    steps_ax, ratio_ax = figure.subplots(1, 2)
    parts = (("rollout_s", "rollout", "tab:blue"), ("reward_wait_s", "wait for rewards", "tab:red"),
             ("update_s", "update", "tab:green"))  # fmt: skip
    labels = []
    for i, (beta, report) in enumerate(result["betas"].items()):
        for j, way in enumerate(("sequential", "overlapped")):
            x = 2.6 * i + j
            labels.append((x, f"beta {beta}\n{way}"))
            rows = [p[way] for p in report["pairs"]]
            bottom = 0.0
            for key, name, color in parts:
                height = statistics.median(r[key] for r in rows)
                steps_ax.bar(x, height, bottom=bottom, color=color, label=name if x == 0 else None)
                bottom += height
            step = spread([r["step_s"] for r in rows])
            steps_ax.bar(x, max(step["median"] - bottom, 0.0), bottom=bottom, color="lightgray",
                         label="rest" if x == 0 else None)  # fmt: skip
            steps_ax.errorbar(x, step["median"], yerr=[[step["median"] - step["min"]], [step["max"] - step["median"]]],
                              color="black", capsize=4)  # fmt: skip
        ratio_ax.plot(range(1, len(report["pairs"]) + 1), [p["fall_over_share"] for p in report["pairs"]], "o-",
                      label=f"beta {beta} (median {report['fall_over_share']['median']})")  # fmt: skip
    steps_ax.set_xticks([x for x, _ in labels], [name for _, name in labels], fontsize=8)
    steps_ax.set(ylabel="seconds (median over pairs; bars: step min-max)", title="Step time")
    steps_ax.legend(fontsize=8)
    ratio_ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ratio_ax.set(xlabel="pair of adjacent steps", ylabel="step fall / reward's share",
                 title="Criterion: fall / share >= 1")  # fmt: skip
    ratio_ax.legend(fontsize=8)
    settings = result["settings"]
    figure.suptitle(
        f"Remote reward with {settings['latency']} s latency: {settings['chunks']} chunks of {settings['chunk']} "
        f"images, {settings['num_inference_steps']} steps, {settings['resolution']} px",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path)
    return path


def run_reward_overlap_benchmark(
    output_dir: str = "runs/bench", latency: float = 0.5, chunk: int = 2, chunks: int = 4, pairs: int = 16,
    num_inference_steps: int = 48, resolution: int = 64, num_layers: int = 2, num_single_layers: int = 4,
    betas: Sequence[float] = (0.0, 0.04), num_threads: int = 1, seed: int = 0, plot: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Time interleaved sequential and overlapped steps for each ``beta``; print and return the report, and write it
    to ``output_dir`` as ``reward_overlap_benchmark.json`` (and ``.png`` unless ``plot=False``).

    Args:
        output_dir: where the JSON and PNG go.
        latency: seconds the server waits before answering each request.
        chunk: images per rollout chunk (``sample_batch_size``), one group and one request each.
        chunks: chunks per rollout, each also one micro-batch of the update.
        pairs: pairs of adjacent steps per ``beta``, one each way, after a warm-up step.
        num_inference_steps: sampling steps (all but the last trained).
        resolution: image height and width.
        num_layers, num_single_layers: the Flux transformer's double- and single-stream blocks.
        betas: KL coefficients, each with its own trainer (``beta = 0``: no KL reference to overlap).
        num_threads: torch intra-op threads (the other core runs the server and the requests).
        seed: seed of the weights and the rollouts.
        plot: write the PNG.
    """
    from trl_jagg.benchmarks.engine import torch_threads

    settings = dict(latency=latency, chunk=chunk, chunks=chunks, pairs=pairs, num_inference_steps=num_inference_steps,
                    resolution=resolution, num_layers=num_layers, num_single_layers=num_single_layers,
                    betas=list(betas), num_threads=num_threads, seed=seed)  # fmt: skip
    result: dict[str, Any] = {"settings": settings, "betas": {}}
    server, url = slow_reward_server(latency)
    try:
        with torch_threads(num_threads):
            for beta in betas:
                steps = step_times(
                    url, chunk=chunk, chunks=chunks, pairs=pairs, num_inference_steps=num_inference_steps, beta=beta,
                    resolution=resolution, num_layers=num_layers, num_single_layers=num_single_layers, seed=seed,
                )  # fmt: skip
                report = compare_pairs(steps, chunks=chunks, latency=latency)
                result["betas"][str(beta)] = report
                ratio = report["fall_over_share"]
                print(
                    f"beta {beta}: step fall / reward share median {ratio['median']} (min {ratio['min']}, max "
                    f"{ratio['max']}) over {len(report['pairs'])} pairs; overlapped / sequential step "
                    f"{report['overlapped_over_sequential']['median']}; wait left "
                    f"{report['reward_wait_s']['overlapped']['median']} s of "
                    f"{report['reward_wait_s']['sequential']['median']} s; done-when (median >= 1) "
                    f"{'met' if report['done_when_met'] else 'NOT met'}"
                )
                if not report["room_outlasts_latency"]:
                    print(
                        f"  the rollout after its first chunk took {report['rollout_after_first_chunk_s']['median']} "
                        f"s and the update before its last micro-batch "
                        f"{report['update_before_last_micro_batch_s']['median']} s: both must outlast the {latency} s "
                        "latency to hide every request; raise --num_inference_steps or the model size "
                        "(--num_layers, --num_single_layers, --resolution)."
                    )
    finally:
        server.terminate()
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / JSON_NAME).write_text(json.dumps(result, indent=2))
    print(f"wrote {folder / JSON_NAME}")
    if plot:
        print(f"wrote {plot_reward_overlap(result, str(folder / PNG_NAME))}")
    return result
