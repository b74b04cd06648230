"""DDPOJaggTrainer end to end on a tiny Flux pipeline built from config (offline). What every model family must do
(the rollout reproduces the pipeline, the saved LoRA reloads into it) is tests/test_family_contract.py."""

from __future__ import annotations

import copy
import math
import os
import statistics
import threading

import numpy as np
import pytest
import torch
from datasets import Dataset
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from peft import LoraConfig
from testing_utils import PROMPTS, BackboneCalls, gdpo_by_hand, redness, run_update, trained_steps_of, update_gradient
from transformers import TrainerCallback

import trl_jagg.trainer.generation as generation
from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.core.grpo import group_advantages
from trl_jagg.models import Conditioning, load_adapter
from trl_jagg.models.rollout import sample_trajectories
from trl_jagg.objectives.grpo import GRPOUpdateStage as UpdateStage
from trl_jagg.trainer.backbone import compile_blocks
from trl_jagg.trainer.batch import PendingAdvantages, RolloutBatch, resolved
from trl_jagg.trainer.generation import advantages_per_group
from trl_jagg.trainer.reward_overlap import ChunkAdvantages


def make_config(tmp_path, **overrides) -> GRPOJaggConfig:
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        num_inference_steps=4,
        height=32,
        width=32,
        max_steps=2,
        learning_rate=1e-2,
        epsilon=1e-1,
        noise_level=0.9,
        jagg_group_size=3,
        jagg_frac=1.0,
        max_sequence_length=16,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return GRPOJaggConfig(**kwargs)


def make_trainer(path, tmp_path, *, lora: bool = True, reward=redness, dataset=None, **overrides) -> DDPOJaggTrainer:
    torch.manual_seed(0)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian")
    return DDPOJaggTrainer(
        model=path,
        reward_funcs=reward,
        args=make_config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=peft_config if lora else None,
    )


def trainable_state(trainer) -> dict[str, torch.Tensor]:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("use_jagg", [True, False], ids=["jagg", "exact"])
def test_two_training_steps(tiny_flux_path, tmp_path, lora, use_jagg):
    trainer = make_trainer(tiny_flux_path, tmp_path, lora=lora, use_jagg=use_jagg)
    before = trainable_state(trainer)
    trainer.train()
    after = trainable_state(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before), "no parameter changed"
    if lora:
        assert all("lora" in n for n in before)
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"])
        for key in ("reward_std", "rewards/redness/mean", "ratio", "clip_fraction", "approx_kl", "grad_norm",
                    "learning_rate", "time/rollout_s", "time/update_s", "engine/jagg/backward_calls"):  # fmt: skip
            assert key in entry, key
    # 3 trained steps (all but the last of 4) in one group of W=3: one backward with JAGG, three without.
    assert logs[0]["engine/jagg/backward_calls"] == (1 if use_jagg else 3)


def test_first_ratio_on_fresh_rollout_is_exactly_one(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, max_steps=1)
    trainer.train()
    entry = next(e for e in trainer.state.log_history if "ratio" in e)
    # Exact on purpose: the update scores each step with the same weights on the same per-step batch shape as the
    # rollout, so the log-probs are bit-identical and the ratio is exactly 1 (as TRL checks for tokens).
    assert entry["ratio"] == 1.0
    assert entry["clip_fraction"] == 0.0
    assert entry["approx_kl"] == 0.0


def test_jagg_frac_zero_equals_exact(tiny_flux_path, tmp_path):
    exact = make_trainer(tiny_flux_path, tmp_path / "a", use_jagg=False, max_steps=1)
    exact.train()
    routed = make_trainer(tiny_flux_path, tmp_path / "b", use_jagg=True, jagg_frac=0.0, max_steps=1)
    routed.train()
    a, b = trainable_state(exact), trainable_state(routed)
    # Exact on purpose: with jagg_frac = 0 every group is routed to the exact path, the same calls on the same shapes.
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)


class StopAt(TrainerCallback):
    """Simulates an interruption after ``step`` optimizer steps."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_resume_reproduces_uninterrupted_run(tiny_flux_path, tmp_path, lora):
    straight = make_trainer(tiny_flux_path, tmp_path / "straight", lora=lora, max_steps=4)
    straight.train()
    first = make_trainer(
        tiny_flux_path, tmp_path / "resumed", lora=lora, max_steps=4, save_strategy="steps", save_steps=2
    )
    first.add_callback(StopAt(2))
    first.train()
    assert first.state.global_step == 2
    checkpoint = os.path.join(first.args.output_dir, "checkpoint-2")
    assert os.path.isdir(checkpoint) and not os.path.exists(checkpoint.replace("checkpoint-2", "tmp-checkpoint-2"))
    second = make_trainer(tiny_flux_path, tmp_path / "resumed", lora=lora, max_steps=4, save_strategy="no")
    second.train(resume_from_checkpoint=checkpoint)
    a, b = trainable_state(straight), trainable_state(second)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)


def test_trl_style_rewards_get_keywords_state_and_columns_and_may_return_none(tiny_flux_path, tmp_path):
    calls = []

    def trl_reward(completions, trainer_state, shape, **kwargs):
        calls.append((trainer_state.global_step, list(shape), len(completions)))
        # Applies only to circles: None elsewhere (another reward scores those).
        return [1.0 if s == "circle" else None for s in shape]

    dataset = Dataset.from_dict({"prompt": PROMPTS, "shape": ["circle", "square", "circle", "square"]})
    trainer = make_trainer(tiny_flux_path, tmp_path, reward=[trl_reward, redness], dataset=dataset, max_steps=2)
    trainer.train()
    assert [step for step, _, _ in calls] == [0, 1]  # the live TrainerState
    assert all(len(shapes) == n == 4 for _, shapes, n in calls)
    logged = [e for e in trainer.state.log_history if "rewards/trl_reward/mean" in e]
    assert logged and all(e["rewards/trl_reward/mean"] == 1.0 for e in logged)  # the mean over applicable samples


def test_a_rollout_where_a_reward_applies_nowhere_is_left_out_of_the_logged_mean(tiny_flux_path, tmp_path):
    # Two rollouts per logged step (logging_steps=2): the reward applies to no image of the first one (None for
    # all: its batch mean is NaN) and scores 0.5 on every image of the second. As TRL, the logged mean is 0.5,
    # not NaN; a metric with no value at all is not logged.
    def sometimes(prompts, trainer_state, **kwargs):
        return [None if trainer_state.global_step == 0 else 0.5] * len(prompts)

    def never(prompts, **kwargs):
        return [None] * len(prompts)

    trainer = make_trainer(tiny_flux_path, tmp_path, reward=[sometimes, never, redness], max_steps=2, logging_steps=2)
    trainer.train()
    (entry,) = [e for e in trainer.state.log_history if "reward" in e]
    assert entry["rewards/sometimes/mean"] == 0.5
    assert "rewards/never/mean" not in entry and math.isfinite(entry["reward"])


def test_rewards_log_metrics_and_extra_columns_as_in_trl(tiny_flux_path, tmp_path, monkeypatch):
    import trl_jagg.trainer.ddpo_jagg_trainer as trainer_module

    tables = []
    monkeypatch.setattr(trainer_module, "log_completions", lambda *args: tables.append(args[4]))

    def judged(prompts, trainer_state, log_metric, log_extra, **kwargs):
        log_metric("judge/calls", trainer_state.global_step + 1.0)  # 1 at the first rollout, 2 at the second
        log_extra("verdict", [f"ok {i}" for i in range(len(prompts))])
        return [0.5] * len(prompts)

    trainer = make_trainer(tiny_flux_path, tmp_path, reward=[judged, redness], max_steps=2, log_completions=True)
    trainer.train()
    logged = [e["judge/calls"] for e in trainer.state.log_history if "judge/calls" in e]
    assert logged == [1.0, 2.0]  # one value per rollout, logged as a training metric
    assert [table["verdict"] for table in tables] == [["ok 0", "ok 1", "ok 2", "ok 3"]] * 2  # a completions column
    metrics = trainer.evaluate(Dataset.from_dict({"prompt": ["a red circle", "a blue square"]}))
    assert metrics["eval_judge/calls"] == 3.0  # evaluate() gives rewards the same keywords (global_step 2)


def test_rollout_bar_only_on_a_terminal(tiny_flux_path, tmp_path, monkeypatch):
    # Written to a file (CI, nohup, Slurm), the nested per-rollout bar would leave carriage-return fragments; on a
    # terminal (a real pseudo-terminal here) it shows under the Trainer's own bar.
    import fcntl
    import pty
    import struct
    import termios

    def stderr_of_one_step(stream) -> None:
        monkeypatch.setattr("sys.stderr", stream)
        make_trainer(tiny_flux_path, tmp_path, max_steps=1, disable_tqdm=False).train()
        stream.flush()

    controller, terminal_fd = pty.openpty()
    # A terminal window has a size (a fresh pseudo-terminal 0 x 0, where tqdm draws an empty line).
    fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    received = []
    reader = threading.Thread(target=lambda: received.extend(iter(lambda: _read_or_end(controller), b"")))
    reader.start()  # drained while the step runs: a full terminal buffer would block the writer
    with os.fdopen(terminal_fd, "w") as terminal:
        stderr_of_one_step(terminal)
    reader.join()
    os.close(controller)
    on_terminal = b"".join(received).decode(errors="replace")
    with open(tmp_path / "stderr.log", "w+") as log_file:
        stderr_of_one_step(log_file)
        log_file.seek(0)
        in_file = log_file.read()
    assert "1/1" in on_terminal and "1/1" in in_file  # the Trainer's own bar, in both
    assert "rollout" in on_terminal
    assert "rollout" not in in_file


def _read_or_end(fd: int) -> bytes:
    """A chunk of a pseudo-terminal's output; b"" once its other end is closed (Linux raises EIO then)."""
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


def test_normalize_then_sum_gives_gdpo_advantages_of_the_scores_and_logs_each_share(tiny_flux_path, tmp_path):
    scored = []

    def bright(prompts, images, **kwargs):  # a reward on another scale than redness
        scores = [100 * float(np.asarray(im, dtype=np.float32).mean() / 255) for im in images]
        scored.append(scores)
        return scores

    def red(prompts, images, **kwargs):
        scores = redness(prompts, images)
        scored.append(scores)
        return scores

    trainer = make_trainer(
        tiny_flux_path, tmp_path, reward=[red, bright], reward_weights=[1.0, 0.5],
        multi_objective_aggregation="normalize_then_sum", advantage_std_ddof=0,
    )  # fmt: skip
    rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    expected = gdpo_by_hand(scored, [1.0, 0.5], 2, trainer.args.advantage_eps, 0, trainer.args.adv_clip_max)
    assert rollout.advantages.tolist() == pytest.approx(expected, abs=1e-5)
    share = [
        abs(v - statistics.fmean(g)) / (statistics.pstdev(g) + 1e-4)
        for g in zip(scored[1][::2], scored[1][1::2])
        for v in g
    ]
    assert trainer._metrics["advantages/bright/abs_mean"] == pytest.approx([0.5 * statistics.fmean(share)], rel=1e-4)
    with pytest.raises(ValueError, match="multi_objective_aggregation.*per_prompt_stat_tracking"):
        make_config(tmp_path, multi_objective_aggregation="normalize_then_sum", per_prompt_stat_tracking=True)
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        make_config(tmp_path, multi_objective_aggregation="normalise_then_sum")


def test_trl_config_names(tmp_path):
    # epsilon is TRL's name of the clip range; epsilon_high its upper side.
    config = make_config(tmp_path, epsilon=0.3, epsilon_high=0.5)
    assert (config.epsilon, config.epsilon_high) == (0.3, 0.5)
    assert make_config(tmp_path).epsilon_high is None and make_config(tmp_path).epsilon == 1e-1
    with pytest.raises(ValueError, match="epsilon_high"):
        make_config(tmp_path, epsilon_high=0.0)
    # Boolean scale_rewards, as TRL: True = "group", False = "none" (also as the strings a flag gives).
    assert [make_config(tmp_path, scale_rewards=v).scale_rewards for v in (True, False, "false", "batch")] == [
        "group", "none", "none", "batch"
    ]  # fmt: skip
    # generation_batch_size settable: 8 images = 2 micro-batches of 4 on one process.
    config = make_config(tmp_path, generation_batch_size=8)
    assert (config.steps_per_generation, config.generation_batch_size) == (2, 8)
    assert make_config(tmp_path, gradient_accumulation_steps=3).generation_batch_size == 12
    assert make_config(tmp_path, generation_batch_size=8, steps_per_generation=2).steps_per_generation == 2
    with pytest.raises(ValueError, match="generation_batch_size.*steps_per_generation.*disagree"):
        make_config(tmp_path, generation_batch_size=8, steps_per_generation=3)
    with pytest.raises(ValueError, match="generation_batch_size \\(6\\) is not a positive multiple"):
        make_config(tmp_path, generation_batch_size=6)


def test_epsilon_high_reaches_the_loss_and_generation_batch_size_the_rollout(tiny_flux_path, tmp_path, monkeypatch):
    import inspect
    import sys

    import trl_jagg.core.grpo as grpo

    seen, real = [], grpo.ppo_step_loss
    signature = inspect.signature(real)

    def recording(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)  # by name, wherever the caller puts them
        bound.apply_defaults()
        seen.append((bound.arguments["clip_range"], bound.arguments["clip_range_high"]))
        return real(*args, **kwargs)

    trainer = make_trainer(
        tiny_flux_path, tmp_path, epsilon=0.05, epsilon_high=0.2, generation_batch_size=8, max_steps=1
    )
    # Replaced in every module that imported the loss, wherever the update code calls it from (after the trainer is
    # built: it imports its objective's update code then).
    callers = [m for name, m in list(sys.modules.items()) if name.startswith("trl_jagg.") and m is not grpo]
    callers = [m for m in callers if getattr(m, "ppo_step_loss", None) is real]
    assert callers
    for caller in callers:
        monkeypatch.setattr(caller, "ppo_step_loss", recording)
    trainer.train()
    assert seen and set(seen) == {(0.05, 0.2)}
    # One rollout of 8 images (4 prompts x 2) feeds the 2 micro-batches of one optimizer step.
    assert trainer.args.steps_per_generation == 2
    assert trainer.state.log_history[0]["engine/jagg/backward_calls"] > 0


def test_log_completions_logs_the_rollout_with_its_rewards(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, max_steps=2, log_completions=True, report_to="tensorboard")
    trainer.train()
    folder = tmp_path / "out" / "completions"
    assert sorted(os.listdir(folder)) == ["step-000001.png", "step-000002.png"]
    from PIL import Image

    # One row per prompt group of num_generations = 2 images of 32 px, each with a caption strip of whole 11 px lines
    # (the caption wraps to the tile's width) and a 1 px margin.
    width, height = Image.open(folder / "step-000001.png").size
    strip = height // 2 - 32
    assert width == 2 * 32 and height % 2 == 0 and strip > 1 and (strip - 1) % 11 == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = [root for root, _, files in os.walk(tmp_path) if any(f.startswith("events.out") for f in files)]
    accumulator = EventAccumulator(events)
    accumulator.Reload()
    assert "train/completion_images" in accumulator.Tags()["images"]


# ---------------------------------------------------------------- bad input fails early and clearly
def test_missing_prompt_column(tiny_flux_path, tmp_path):
    with pytest.raises(ValueError, match="no 'prompt' column.*rename_column"):
        make_trainer(tiny_flux_path, tmp_path, dataset=Dataset.from_dict({"text": PROMPTS}))


@pytest.mark.parametrize(
    ("reward", "match"),
    [
        (lambda prompts, images, **kw: [float("nan")] * len(images), "NaN|nan|finite"),
        (lambda prompts, images, **kw: [0.0] * (len(images) - 1), "3|4|count|length"),
    ],
    ids=["nan", "wrong-length"],
)
def test_bad_reward_stops_the_step(tiny_flux_path, tmp_path, reward, match):
    reward.__name__ = "bad_reward"
    trainer = make_trainer(tiny_flux_path, tmp_path, reward=reward, max_steps=1)
    with pytest.raises(ValueError, match="bad_reward"):
        trainer.train()


def test_unsupported_pipeline_class(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    with pytest.raises(ValueError, match="Unsupported pipeline class 'StableDiffusionPipeline'.*FluxPipeline"):
        make_trainer(str(tmp_path), tmp_path)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="num_generations"):
        make_config(tmp_path, num_generations=1)
    with pytest.raises(ValueError, match="per_device_train_batch_size.*num_generations"):
        make_config(tmp_path, per_device_train_batch_size=3, num_generations=2)
    with pytest.raises(ValueError, match="jagg_group_size"):
        make_config(tmp_path, jagg_group_size=0)
    with pytest.raises(ValueError, match="jagg_frac"):
        make_config(tmp_path, jagg_frac=1.5)
    with pytest.raises(ValueError, match="sampler"):
        make_config(tmp_path, sampler="euler")


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_kl_to_reference_starts_at_zero_then_grows(tiny_flux_path, tmp_path, lora):
    trainer = make_trainer(tiny_flux_path, tmp_path, lora=lora, beta=0.5, max_steps=2)
    trainer.train()
    kls = [e["kl"] for e in trainer.state.log_history if "kl" in e]
    # The policy starts as the reference (LoRA B = 0 / an identical frozen copy), so the first KL is 0 up to float
    # rounding: the reference velocities come from one batched no-grad call over the trained steps, which rounds
    # differently from the rollout's per-step calls on some CPUs (9.4e-16 seen on AVX-512; `no_grad_batch_steps=1`
    # gives exactly 0). 1e-10 is far above that rounding and far below the second step's KL (~2e-6 with LoRA).
    assert kls[0] < 1e-10
    assert kls[1] > 1e-8


def test_sample_images_are_logged(tiny_flux_path, tmp_path):
    trainer = make_trainer(
        tiny_flux_path, tmp_path, max_steps=2, image_log_steps=1, eval_prompts=["a red circle", "a blue square"],
        report_to="tensorboard",
    )  # fmt: skip
    trainer.train()
    samples = tmp_path / "out" / "samples"
    assert sorted(os.listdir(samples)) == ["latest", "step-000001.png", "step-000002.png"]  # latest: the widget
    events = [f for _, _, files in os.walk(tmp_path) for f in files if f.startswith("events.out.tfevents")]
    assert events


def test_calibrate_jagg_reports_group_cosines(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, num_inference_steps=5, jagg_group_size=2)
    exact_limit = trainer.calibrate_jagg(threshold=0.99)
    # W = 2 is exact: every group's cosine is 1, so every group qualifies.
    assert len(exact_limit["group_cosine"]) == 2
    assert all(abs(c - 1) < 1e-5 for c in exact_limit["group_cosine"])
    assert exact_limit["jagg_frac"] == 1.0
    trainer.args.jagg_group_size = 4
    approx = trainer.calibrate_jagg(threshold=0.0)
    assert len(approx["group_cosine"]) == 1 and -1 <= approx["group_cosine"][0] <= 1
    assert 0 <= approx["jagg_frac"] <= 1


# ---------------------------------------------------------------- velocity cache, batched calls, routing
@pytest.mark.parametrize("beta", [0.0, 0.2])
def test_velocity_cache_gives_the_uncached_gradient_with_two_forwards_and_one_backward(tiny_flux_path, tmp_path, beta):
    # 5 steps, 4 trained: one JAGG group of W = 4 with two intermediate steps.
    trainer = make_trainer(tiny_flux_path, tmp_path, num_inference_steps=5, jagg_group_size=4, beta=beta)
    rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    assert rollout.velocities.shape == (*rollout.latents[:, 1:].shape,)
    calls = BackboneCalls(trainer)
    uncached = update_gradient(trainer, rollout, jagg_cache_velocities=False)
    # Batched: one no-grad call for both intermediates, one for the KL reference of the 4 trained steps.
    assert calls.take() == (2, 1 + (1 if beta else 0), 1)
    # The KL reference's means were kept by the first update of this micro-batch: no no-grad call is left.
    cached = update_gradient(trainer, rollout)
    assert calls.take() == (2, 0, 1)
    assert trainer._metrics["jagg/cached_velocities"][-1] == 2
    # Within float rounding, not bit-equal: batch shapes differ, and AVX-512 kernels round per shape (see
    # testing_utils.assert_velocity_cache_equals_recomputation); a wrong velocity moves the gradient by its own order.
    torch.testing.assert_close(cached, uncached, rtol=0, atol=1e-5 * uncached.abs().max().item())
    # One call per step (no batching) gives the same gradient within float rounding.
    trainer.update_stage.reference_cache.pop(rollout, None)
    unbatched = update_gradient(trainer, rollout, jagg_cache_velocities=False, no_grad_batch_steps=1)
    assert calls.take() == (2, 2 + (4 if beta else 0), 1)
    torch.testing.assert_close(unbatched, uncached, rtol=0, atol=1e-5 * uncached.abs().max().item())
    # Sequential endpoints: same gradient, two backward calls, still no extra forward with the cache.
    sequential = update_gradient(trainer, rollout, jagg_endpoint_backward="sequential")
    assert calls.take() == (2, 0, 2)
    torch.testing.assert_close(sequential, cached, rtol=0, atol=1e-5 * cached.abs().max().item())
    calls.handle.remove()


def test_batched_reference_means_match_one_call_per_step(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, num_inference_steps=5, beta=0.2)
    rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    trained = trained_steps_of(trainer, rollout)
    model = trainer.accelerator.unwrap_model(trainer.model)
    batched = trainer.update_stage.reference_means(model, rollout, trained)
    for steps in (1, 3):
        trainer.args.no_grad_batch_steps = steps
        chunked = trainer.update_stage.reference_means(model, rollout, trained)
        for k in trained:
            torch.testing.assert_close(chunked[k], batched[k], rtol=0, atol=1e-6)


def compiled_blocks(transformer: torch.nn.Module) -> list[str]:
    return [type(m).__name__ for m in transformer.modules() if m._compiled_call_impl is not None]


def test_compiled_blocks_give_the_eager_velocity_and_gradient(tiny_flux_path, tiny_sd3_path):
    """Regional compilation (aot_eager: the graphs captured, no code generated, so seconds on a CPU): every repeated
    block compiled, the velocity and the parameter gradients those of the eager backbone within float rounding."""
    adapter = load_adapter(FluxPipeline.from_pretrained(tiny_flux_path))
    eager = adapter.transformer.requires_grad_(True)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, backend="aot_eager")
    blocks = [type(m).__name__ for m in eager.transformer_blocks] + [
        type(m).__name__ for m in eager.single_transformer_blocks
    ]
    assert compiled_blocks(compiled) == blocks and compiled_blocks(eager) == []
    cond = adapter.condition(PROMPTS[:2], height=32, width=32, max_sequence_length=16)
    generator = torch.Generator().manual_seed(0)
    latents = adapter.prepare_latents(2, 32, 32, generator)
    weight = torch.randn(latents.shape, generator=generator)
    timestep = adapter.schedule(4, 32, 32)[1][1].expand(2)
    results = []
    for transformer in (eager, compiled):
        velocity = adapter.predict_velocity(transformer, latents, timestep, cond, guidance_scale=3.5, true_cfg_scale=1)
        grads = torch.autograd.grad((velocity * weight).sum(), list(transformer.parameters()), allow_unused=True)
        results.append((velocity, grads))
    (v_eager, g_eager), (v_compiled, g_compiled) = results
    torch.testing.assert_close(v_compiled, v_eager, atol=1e-5, rtol=1e-5)
    for got, want in zip(g_compiled, g_eager):
        if want is not None:
            torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item() + 1e-8, rtol=1e-4)
    # SD3 declares no `_repeated_blocks`: its transformer blocks (`_no_split_modules`) are compiled.
    sd3 = load_adapter(StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)).transformer
    compile_blocks(sd3, backend="aot_eager")
    assert compiled_blocks(sd3) == ["JointTransformerBlock"] * len(sd3.transformer_blocks)


def test_compile_option_compiles_the_backbone_and_the_reference_blocks(tiny_flux_path, tmp_path):
    trainer = make_trainer(
        tiny_flux_path, tmp_path, lora=False, beta=0.1, compile_repeated_blocks=True, compile_backend="aot_eager"
    )
    assert compiled_blocks(trainer.adapter.transformer) and compiled_blocks(trainer.ref_transformer)
    assert compiled_blocks(trainer.adapter.transformer) == compiled_blocks(trainer.ref_transformer)


@pytest.mark.parametrize("lora", [False, True], ids=["frozen-copy", "adapters-disabled"])
def test_reference_means_are_computed_once_per_micro_batch_and_reused(tiny_flux_path, tmp_path, lora):
    """Two micro-batches of one rollout, two PPO iterations each: the KL reference runs once per micro-batch (2
    calls, not 4), and what the later updates use is bit-identical to a fresh computation (same batching)."""
    trainer = make_trainer(
        tiny_flux_path, tmp_path, lora=lora, beta=0.2, num_iterations=2, steps_per_generation=2,
        per_device_train_batch_size=2, max_steps=4,
    )  # fmt: skip
    stage = trainer.update_stage
    calls = []
    reference_means = stage.reference_means
    stage.reference_means = lambda *a, **k: calls.append(a[2]) or reference_means(*a, **k)
    trainer.train()
    trained = list(range(trainer.args.num_inference_steps - 1))  # all but the last
    assert calls == [trained, trained]
    stage.reference_means = reference_means
    model = trainer.accelerator.unwrap_model(trainer.model)
    for chunk in trainer._buffered_inputs:
        kept = stage.reference_cache.pop(chunk)
        fresh = stage.reference_means(model, chunk, trained)
        assert all(torch.equal(kept[k], fresh[k]) for k in trained)  # the reference is frozen: exactly the same


def test_selected_samples_index_the_per_sample_fields_and_keep_the_shared_ones():
    batch = RolloutBatch(
        latents=torch.arange(12.0).view(4, 3), advantages=torch.arange(4.0), cond=Conditioning({"x": torch.arange(4)}),
        sigmas=torch.tensor([1.0, 0.5, 0.0]), sigma_values=[1.0, 0.5, 0.0], timesteps=torch.tensor([1000.0, 500.0]),
        stochastic_steps=[0], log_probs=torch.arange(8.0).view(4, 2), velocities=torch.arange(8.0).view(4, 2, 1),
        velocity_keys=["k0", "k1"], velocity_step=3,
    )  # fmt: skip
    rows = torch.tensor([3, 1])
    selected = batch.select(rows)
    for name in ("latents", "advantages", "log_probs", "velocities"):
        assert torch.equal(getattr(selected, name), getattr(batch, name)[rows]), name
    assert torch.equal(selected.cond.per_sample["x"], torch.tensor([3, 1]))
    for name in ("sigmas", "timesteps"):
        assert getattr(selected, name) is getattr(batch, name), name
    assert (selected.sigma_values, selected.stochastic_steps) == ([1.0, 0.5, 0.0], [0])
    assert (selected.velocity_keys, selected.velocity_step, selected.size) == (["k0", "k1"], 3, 2)
    halves = batch.split(2)
    assert [h.advantages.tolist() for h in halves] == [[0.0, 1.0], [2.0, 3.0]]


@pytest.mark.parametrize(
    "overrides",
    [{"steps_per_generation": 2, "per_device_train_batch_size": 2}, {"num_iterations": 2}],
    ids=["two-micro-batches-per-rollout", "two-iterations"],
)
def test_recompute_mode_does_not_use_the_cache_after_an_optimizer_step(tiny_flux_path, tmp_path, overrides):
    # One rollout feeds two optimizer steps: the second update's parameters differ from the rollout's. The default
    # mode (`checked`) may correct the cached velocity then; test_velocity_cache.py covers it.
    trainer = make_trainer(tiny_flux_path, tmp_path, max_steps=2, jagg_cache_mode="recompute", **overrides)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "engine/jagg/cached_velocities" in e]
    # One group of W = 3 (3 trained steps): one intermediate velocity, cached only before the first step.
    assert [e["engine/jagg/cached_velocities"] for e in logs] == [1, 0]
    assert [e["engine/jagg/no_grad_forwards"] for e in logs] == [0, 1]


def test_velocity_cache_is_not_used_at_another_batch_shape(tiny_flux_path, tmp_path):
    # The rollout runs its 4 samples as one backbone batch; 3 steps trained in one JAGG group of W = 3, whose one
    # intermediate velocity is cached. A smaller batch may round differently (other kernels), so a micro-batch of 2
    # of those samples recomputes it, though the parameters are the rollout's.
    trainer = make_trainer(tiny_flux_path, tmp_path)
    rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.train()
    calls = BackboneCalls(trainer)
    run_update(trainer, model, rollout)
    assert calls.take() == (2, 0, 1)  # the rollout's shape: two endpoints, no intermediate forward, one backward
    run_update(trainer, model, rollout.select(slice(0, 2)))
    assert calls.take() == (2, 1, 1)  # another shape: the intermediate velocity is recomputed
    assert trainer._metrics["jagg/cached_velocities"][-2:] == [1, 0]
    calls.handle.remove()


def test_velocity_cache_is_not_used_with_active_dropout(tiny_flux_path, tmp_path):
    torch.manual_seed(0)
    trainer = DDPOJaggTrainer(
        model=tiny_flux_path, reward_funcs=redness, args=make_config(tmp_path, max_steps=1),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["to_q", "to_k", "to_v"]),
    )  # fmt: skip
    trainer.train()
    entry = next(e for e in trainer.state.log_history if "engine/jagg/cached_velocities" in e)
    assert entry["engine/jagg/cached_velocities"] == 0 and entry["engine/jagg/no_grad_forwards"] == 1


def test_auto_routing_probes_and_logs(tiny_flux_path, tmp_path):
    # 8 trained steps, W = 2: four groups; W = 2 is exact, so every cosine is 1 and all four are routed.
    trainer = make_trainer(
        tiny_flux_path, tmp_path, num_inference_steps=9, jagg_group_size=2, jagg_frac="auto", jagg_probe_steps=2,
        jagg_cos_threshold=0.999, max_steps=3,
    )  # fmt: skip
    trainer.train()
    logs = [e for e in trainer.state.log_history if "reward" in e]
    probed = [e["step"] for e in logs if "engine/jagg/auto_frac" in e]
    assert probed == [1, 3]  # optimizer steps 0 and 2 (logged after the step)
    for entry in logs:
        assert entry["engine/jagg/groups_jagg"] == 4
        if "engine/jagg/auto_frac" in entry:
            assert entry["engine/jagg/auto_frac"] == 1.0
            assert all(entry[f"engine/jagg/probe_cosine/group_{i}"] == pytest.approx(1.0, abs=1e-4) for i in range(4))


def test_conditional_cfg_gradient_without_cfg_warns(tiny_flux_path, tmp_path):
    with pytest.warns(
        UserWarning, match="cfg_gradient='conditional' does nothing: FluxPipeline runs no unconditional"
    ):
        make_trainer(tiny_flux_path, tmp_path, cfg_gradient="conditional")  # true_cfg_scale=1: no CFG


def test_auto_routing_defers_the_probe_of_a_zero_gradient_batch(tiny_flux_path, tmp_path):
    calls = []

    def constant_then_redness(prompts, images, **kwargs):  # step 1: every group constant, all advantages 0
        calls.append(1)
        return [0.5] * len(images) if len(calls) == 1 else redness(prompts, images)

    trainer = make_trainer(tiny_flux_path, tmp_path, reward=constant_then_redness, jagg_frac="auto",
                           jagg_cos_threshold=1.0, max_steps=2)  # fmt: skip
    trainer.train()
    first, second = [e for e in trainer.state.log_history if "reward" in e]
    # A probe of step 1 would read cosine 1.0 (0 / 0) and route every group to JAGG for jagg_probe_steps steps.
    assert first["engine/jagg/probe_deferred"] == 1.0 and "engine/jagg/auto_frac" not in first
    assert first["engine/jagg/groups_jagg"] == 0  # exact until the first probe
    assert second["engine/jagg/auto_frac"] == 0.0 and second["engine/jagg/probe_cosine/group_0"] < 1.0


def test_auto_routing_with_an_unreachable_threshold_is_exact(tiny_flux_path, tmp_path):
    exact = make_trainer(tiny_flux_path, tmp_path / "a", use_jagg=False, max_steps=1)
    exact.train()
    auto = make_trainer(tiny_flux_path, tmp_path / "b", jagg_frac="auto", jagg_cos_threshold=1.0, max_steps=1)
    auto.train()
    entry = next(e for e in auto.state.log_history if "engine/jagg/auto_frac" in e)
    assert entry["engine/jagg/auto_frac"] == 0.0 and entry["engine/jagg/probe_cosine/group_0"] < 1.0
    a, b = trainable_state(exact), trainable_state(auto)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)


def test_jagg_config_errors_name_the_field(tmp_path):
    assert make_config(tmp_path, jagg_frac="0.5").jagg_frac == 0.5  # the CLI hands numbers over as text
    for name, value in (("jagg_frac", "half"), ("jagg_probe_steps", 0), ("jagg_cos_threshold", 2.0),
                        ("jagg_endpoint_backward", "parallel"), ("no_grad_batch_steps", 0)):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            make_config(tmp_path, **{name: value})


# ---------------------------------------------------------------- rewards overlapping the rollout (overlap_rewards)
# Per-sample rewards score each rollout chunk while the next chunk samples: each chunk is scored before the following
# chunk has finished sampling (synchronised, not timed), once, in order, and the rollout's scores and advantages are
# exactly those of the sequential run. The time saved is measured in docs/rewards.md.
OVERLAP_CHUNKS = 4  # generation_batch_size 8 = 4 prompts x G 2, sampled 2 images at a time


class PerSampleReward:
    """A per-sample reward (as a remote server's) that records each call's prompts and signals it."""

    per_sample = True
    __name__ = "remote_like"

    def __init__(
        self, fail_first_call: bool = False, last_waits_for: threading.Event | None = None, events: list | None = None
    ):
        self.calls: list[list[str]] = []
        self.called = [threading.Event() for _ in range(OVERLAP_CHUNKS + 1)]
        self.fail_first_call = fail_first_call
        self.last_waits_for, self.last_timed_out = last_waits_for, None
        self.events = events if events is not None else []

    def __call__(self, prompts, images, **kwargs):
        self.calls.append(list(prompts))
        self.called[len(self.calls) - 1].set()
        if self.fail_first_call and len(self.calls) == 1:
            raise ConnectionError("the server dropped the first chunk")
        if self.last_waits_for is not None and len(self.calls) == OVERLAP_CHUNKS:  # the last chunk's answer
            self.events.append("last chunk requested")
            self.last_timed_out = not self.last_waits_for.wait(5)
            self.events.append("last chunk answered")
        return [10 * r for r in redness(prompts, images)]


def overlap_rollout(path, tmp_path, monkeypatch, reward, *, overlap: bool, **overrides):
    """One scored rollout of 4 chunks; the sampling of chunk k > 0 waits (at most 5 s) until chunk k - 1 is being
    scored, which only an overlapping rollout can satisfy. Returns the rollout and which waits timed out."""
    timed_out, real = [], sample_trajectories
    sampled = iter(range(OVERLAP_CHUNKS))

    def sample_chunk(*args, **kwargs):
        k = next(sampled)
        trajectory = real(*args, **kwargs)
        if k > 0 and overlap:
            timed_out.append(not reward.called[k - 1].wait(5))
        return trajectory

    monkeypatch.setattr(generation, "sample_trajectories", sample_chunk)
    trainer = make_trainer(
        path, tmp_path, reward=[reward, redness], generation_batch_size=8, sample_batch_size=2,
        overlap_rewards=overlap, **overrides,
    )  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer._generate_and_score(batch), [x["prompt"] for x in batch], timed_out, trainer


def test_chunks_are_scored_while_the_next_chunk_samples_with_the_sequential_results(
    tiny_flux_path, tmp_path, monkeypatch
):
    overlapped = PerSampleReward()
    result, prompts, timed_out, trainer = overlap_rollout(
        tiny_flux_path, tmp_path / "a", monkeypatch, overlapped, overlap=True
    )
    assert timed_out == [False] * (OVERLAP_CHUNKS - 1)  # each chunk k - 1 was being scored before chunk k finished
    assert overlapped.calls == [prompts[i : i + 2] for i in range(0, 8, 2)]  # once per chunk, in order
    sequential = PerSampleReward()
    expected, _, _, _ = overlap_rollout(tiny_flux_path, tmp_path / "b", monkeypatch, sequential, overlap=False)
    assert sequential.calls == [prompts]  # one call on the whole rollout
    # Bit-equal is the property: the same scores in the same order give the same advantages.
    assert torch.equal(result.advantages, expected.advantages)
    assert torch.equal(result.latents, expected.latents)


def test_the_last_chunk_is_scored_while_the_update_computes_the_kl_reference(tiny_flux_path, tmp_path, monkeypatch):
    # Every reward scores chunk by chunk: the update resolves the advantages at its first loss, so the last chunk's
    # answer may come after the KL reference's forwards. Here it comes only then (synchronised, not timed), which
    # a rollout that waited for it would never see; the update is the sequential run's, bit for bit.
    reference_done, real = threading.Event(), UpdateStage.reference_means

    def reference_means(self, *args, **kwargs):
        means = real(self, *args, **kwargs)
        reference_done.set()
        return means

    monkeypatch.setattr(UpdateStage, "reference_means", reference_means)
    results = {}
    for overlap in (True, False):
        reference_done.clear()
        reward = PerSampleReward(last_waits_for=reference_done if overlap else None)
        trainer = make_trainer(
            tiny_flux_path, tmp_path / str(overlap), reward=reward, generation_batch_size=8, sample_batch_size=2,
            overlap_rewards=overlap, beta=0.04,
        )  # fmt: skip
        batch = next(iter(trainer.get_train_dataloader()))
        rollout = trainer._generate_and_score(batch)
        assert isinstance(rollout.advantages, PendingAdvantages) == overlap
        assert not reference_done.is_set()
        result = run_update(trainer, trainer.model, rollout)
        assert reward.last_timed_out is (False if overlap else None)
        grads = [p.grad.clone() for p in trainer.model.parameters() if p.requires_grad]
        results[overlap] = (rollout.advantages, result.step_losses, grads)
    (pending, losses, grads), (advantages, expected_losses, expected_grads) = results[True], results[False]
    # Bit-equal is the property: the same scores and the same computations, only in another order.
    assert torch.equal(pending.resolve(), advantages)
    assert losses == expected_losses
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))


def test_the_first_micro_batches_train_while_the_last_chunk_is_scored(tiny_flux_path, tmp_path, monkeypatch):
    # beta 0 and group advantages: each of the 4 micro-batches is one group, sampled as one chunk, so micro-batch 0
    # needs only chunk 0's rewards. The last chunk's answer comes only after micro-batch 0's update (forward and
    # backward) has returned (synchronised, not timed), which an update that waited for every reward at its first
    # loss would never see; the 4 updates are the sequential run's, bit for bit.
    events, first_update_done, real = [], threading.Event(), UpdateStage.run

    def run(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        events.append("micro-batch updated")
        first_update_done.set()
        return result

    monkeypatch.setattr(UpdateStage, "run", run)
    results = {}
    for overlap in (True, False):
        events.clear()
        first_update_done.clear()
        reward = PerSampleReward(last_waits_for=first_update_done if overlap else None, events=events)
        trainer = make_trainer(
            tiny_flux_path, tmp_path / str(overlap), reward=reward, per_device_train_batch_size=2,
            gradient_accumulation_steps=OVERLAP_CHUNKS, generation_batch_size=8, sample_batch_size=2,
            overlap_rewards=overlap, beta=0.0,
        )  # fmt: skip
        rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
        losses = [run_update(trainer, trainer.model, micro).step_losses for micro in rollout.split(4)]
        if overlap:
            assert reward.last_timed_out is False
            assert events.index("last chunk requested") < events.index("micro-batch updated")
            assert events.index("micro-batch updated") < events.index("last chunk answered")
        grads = [p.grad.clone() for p in trainer.model.parameters() if p.requires_grad]
        metrics = {k: trainer._metrics[k] for k in ("reward", "reward_std", "advantages/abs_mean")}
        results[overlap] = (resolved(rollout.advantages), losses, grads, metrics)
    (advantages, losses, grads, metrics), expected = results[True], results[False]
    # Bit-equal is the property: the same scores and the same computations, only in another order.
    assert torch.equal(advantages, expected[0])
    assert losses == expected[1]
    assert all(torch.equal(g, e) for g, e in zip(grads, expected[2]))
    assert metrics == expected[3]


def chunks_needed_by_hand(num_processes: int, num_rows: int, chunk: int, group: int) -> list[int]:
    """For each local row (the same rows on every process), how many chunks (of every process) hold a row of its
    groups: written out over processes and rows."""
    needed = []
    for row in range(num_rows):
        last = 0
        for process in range(num_processes):
            g = (process * num_rows + row) // group
            for member in range(g * group, (g + 1) * group):
                last = max(last, (member % num_rows) // chunk)
        needed.append(last + 1)
    return needed


@pytest.mark.parametrize(("processes", "rows", "chunk", "group"), [(1, 8, 2, 2), (1, 8, 2, 4), (2, 6, 2, 4),
                                                                   (2, 4, 2, 8), (3, 4, 3, 2)])  # fmt: skip
def test_chunk_advantages_score_only_the_chunks_a_selection_needs_in_order(processes, rows, chunk, group):
    # Groups span processes where `group` does not divide `rows`; each process scores chunks in the same order, as
    # many as the same selection needs, and the values are those of the whole batch's group advantages.
    torch.manual_seed(0)
    rewards = torch.randn(processes * rows)
    per_process = rewards.view(processes, rows)
    needed = chunks_needed_by_hand(processes, rows, chunk, group)
    for process in range(processes):
        scored, finished = [], []

        def score_chunk(c, scored=scored):
            scored.append(c)
            values = per_process[:, c * chunk : (c + 1) * chunk].flatten()  # gathered: process-major
            return values, values[:, None]

        advantages = ChunkAdvantages(
            num_rows=rows, chunk_size=chunk, num_processes=processes, process_index=process, num_generations=group,
            score_chunk=score_chunk, advantages=lambda r: group_advantages(r, group),
            finish=lambda *done, into=finished: into.append(done),
        )  # fmt: skip
        pending = PendingAdvantages(advantages, torch.arange(rows))
        expected = group_advantages(rewards, group)[process * rows : (process + 1) * rows]
        for begin in range(0, rows, 2):
            values = resolved(pending[begin : begin + 2])
            assert scored == list(range(max(needed[begin : begin + 2])))  # not one chunk more, in order
            assert torch.equal(values, expected[begin : begin + 2])  # bit-equal: the property (see ChunkAdvantages)
        assert len(finished) == 1 and torch.equal(finished[0][0], rewards)


@pytest.mark.parametrize(
    "setting",
    [{"scale_rewards": "batch"}, {"per_prompt_stat_tracking": True}, {"drop_zero_advantages": True},
     {"multi_objective_aggregation": "normalize_then_sum"}, {"steps_per_generation": 2}],
)  # fmt: skip
def test_advantages_that_are_not_per_group_wait_for_the_whole_rollout(tmp_path, setting):
    assert advantages_per_group(make_config(tmp_path, per_device_train_batch_size=2))
    assert not advantages_per_group(make_config(tmp_path, per_device_train_batch_size=2, **setting))


def test_a_failed_chunk_is_scored_again_on_the_whole_batch_under_reward_retries(tiny_flux_path, tmp_path, monkeypatch):
    flaky = PerSampleReward(fail_first_call=True)
    result, prompts, _, _ = overlap_rollout(
        tiny_flux_path, tmp_path / "a", monkeypatch, flaky, overlap=True, reward_retries=1
    )
    assert flaky.calls[-1] == prompts and len(flaky.calls) == OVERLAP_CHUNKS + 1
    reliable = PerSampleReward()
    expected, _, _, _ = overlap_rollout(tiny_flux_path, tmp_path / "b", monkeypatch, reliable, overlap=False)
    assert torch.equal(result.advantages, expected.advantages)


def test_a_chunk_still_scoring_at_its_deadline_is_abandoned_and_an_async_one_cancelled():
    """The chunk's own deadline (reward_timeout, from its start), without the one of the whole batch's scoring: the
    stand-in is called here with no deadline of its own."""
    import asyncio

    from trl_jagg.rewards.calling import RewardTimeout
    from trl_jagg.trainer.reward_overlap import ChunkScorer

    cancelled = threading.Event()

    async def judge(prompts, images, **kwargs):
        try:
            await asyncio.sleep(60)  # bounded: without a deadline the test fails after it, never hangs
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return [0.0] * len(images)

    judge.per_sample = True
    scorer = ChunkScorer([judge], enabled=True, trainer_state=None, timeout=0.5)
    scorer.submit(["a"], ["image"], {})
    (stand_in,) = scorer.reward_funcs()
    with pytest.raises(RewardTimeout, match=r"Reward 'judge' did not return within reward_timeout=0.5 s"):
        stand_in(prompts=["a"], images=["image"])
    assert cancelled.wait(10)
