"""The peer conventions the recipes select, through the trainer on a tiny Flux (offline): Flow-GRPO's KL scale per
step, DanceGRPO's timestep quantisation, one initial noise per group, zero-advantage samples dropped and counted,
the EMA of the trained weights (closed form, saved beside the weights, resumed), and the held-out evaluation."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from datasets import Dataset
from diffusers import FluxPipeline
from peft import LoraConfig
from PIL import Image
from safetensors.torch import load_file
from testing_utils import PROMPTS, redness, step_functions_of
from transformers import TrainerCallback

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.trainer import evaluation
from trl_jagg.utils.errors import CheckpointError
from trl_jagg.utils.prompts import prompt_dataset


def make_trainer(path, tmp_path, *, reward=redness, eval_dataset=None, **overrides) -> DDPOJaggTrainer:
    torch.manual_seed(0)
    config = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, num_inference_steps=4,
        height=32, width=32, max_steps=2, learning_rate=1e-2, epsilon=1e-1, noise_level=0.9, jagg_group_size=3,
        jagg_frac=1.0, max_sequence_length=16, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    return DDPOJaggTrainer(
        model=path,
        reward_funcs=reward,
        args=GRPOJaggConfig(**(config | overrides)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        eval_dataset=eval_dataset,
        peft_config=LoraConfig(
            r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"
        ),
    )


def first_rollout(trainer: DDPOJaggTrainer) -> dict:
    return trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))


def trainable(trainer: DDPOJaggTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer._trainable_parameters()]


# ---------------------------------------------------------------- KL scale
def test_flow_grpo_kl_is_the_exact_step_kl_times_dt_at_every_step(tiny_flux_path, tmp_path):
    """kl_std='flow_grpo' divides by g^2 where the exact step KL divides by g^2 |dt|: per step, KL_flow = KL * |dt|
    (the per-step formula against g itself is in tests/test_sampling.py)."""
    trainer = make_trainer(tiny_flux_path, tmp_path, beta=0.1, num_inference_steps=5)
    with torch.no_grad():  # move the policy away from the reference (LoRA B starts at 0)
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    batch = first_rollout(trainer)
    kls = {}
    for kl_std in ("step", "flow_grpo"):
        trainer.args.kl_std = kl_std
        fns = step_functions_of(trainer, trainer.model, batch)
        trained = fns.trained
        with torch.no_grad():
            for i in range(len(trained)):
                fns.loss_fn(i, fns.velocity_fn(i))
        kls[kl_std] = [float(kl) for kl in fns.stats["kl"].values()]
    sigmas = batch.sigmas.double()
    dt = [(sigmas[k] - sigmas[k + 1]).item() for k in trained]
    assert min(kls["step"]) > 0
    np.testing.assert_allclose(kls["flow_grpo"], np.array(kls["step"]) * np.array(dt), rtol=1e-4)
    # No single rescaling of beta maps one onto the other: the factor changes from step to step.
    assert max(dt) / min(dt) > 1.2


# ---------------------------------------------------------------- timestep quantisation
def test_quantized_timesteps_feed_int_sigma_times_1000_over_1000(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, quantize_timesteps=True)
    seen = []
    hook = trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"][0].item()), with_kwargs=True
    )
    batch = first_rollout(trainer)
    hook.remove()
    sigmas = batch.sigmas
    # DanceGRPO: timestep_value = int(sigma * 1000) with a float32 sigma; the model gets timestep_value / 1000.
    expected = [int(sigmas[k] * 1000) / 1000 for k in range(len(sigmas) - 1)]
    assert seen == pytest.approx(expected, abs=1e-6)
    own, _ = trainer.adapter.schedule(4, 32, 32)
    assert torch.equal(sigmas, own)  # the sampler keeps the exact sigmas
    assert any(abs(s * 1000 - int(s * 1000)) > 1e-3 for s in sigmas[:-1].tolist())  # the quantisation did bite


# ---------------------------------------------------------------- same initial noise per group
def test_same_group_noise_shares_the_initial_latent_within_each_group_only(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, same_group_noise=True)
    noise = first_rollout(trainer).latents[:, 0]
    assert torch.equal(noise[0], noise[1]) and torch.equal(noise[2], noise[3])
    assert not torch.allclose(noise[0], noise[2])
    other = first_rollout(make_trainer(tiny_flux_path, tmp_path / "b")).latents[:, 0]
    assert not torch.allclose(other[0], other[1])  # off by default: independent noise per image


# ---------------------------------------------------------------- zero-advantage samples
def test_zero_advantage_samples_are_dropped_and_counted(tiny_flux_path, tmp_path):
    def mostly_constant(prompts, images, **kwargs):
        # Only "a blue circle" groups have a reward spread; every other group has zero std.
        return [r if p == "a blue circle" else 1.0 for p, r in zip(prompts, redness(prompts, images))]

    mostly_constant.__name__ = "mostly_constant"
    trainer = make_trainer(tiny_flux_path, tmp_path, reward=mostly_constant, drop_zero_advantages=True, max_steps=3)
    advantages, graph_batches = [], []
    generate = trainer._generate_and_score

    def spy(inputs):
        rollout = generate(inputs)
        advantages.append(rollout.advantages.clone())
        return rollout

    trainer._generate_and_score = spy
    hook = trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: (
            graph_batches.append(kwargs["hidden_states"].shape[0]) if torch.is_grad_enabled() else None
        ),
        with_kwargs=True,
    )
    trainer.train()
    hook.remove()
    kept = [int((a != 0).sum()) for a in advantages]
    assert sum(kept) > 0 and sum(4 - k for k in kept) > 0  # the run saw both kinds of samples
    # Every graph forward of the update ran on the kept samples only; a rollout with none kept ran no backward.
    expected = [k for k in kept for _ in range(2) if k > 0]  # a JAGG group of W = 3: two endpoint forwards
    assert graph_batches == expected
    logged = [
        e["engine/zero_advantage/dropped_frac"]
        for e in trainer.state.log_history
        if "engine/zero_advantage/dropped_frac" in e
    ]
    assert logged == pytest.approx([1 - k / 4 for k in kept])


# ---------------------------------------------------------------- EMA
class Record(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.weights = trainer, {0: trainable(trainer)}

    def on_step_end(self, args, state, control, **kwargs):
        self.weights[state.global_step] = trainable(self.trainer)


def closed_form_ema(weights: dict[int, list[torch.Tensor]], steps, decay, interval, warmup) -> list[torch.Tensor]:
    """EMA_0 = the initial weights; after optimizer step t with t % interval == 0:
    EMA = d EMA + (1 - d) W_t, d = min(decay, (1 + t) / (10 + t)) with warm-up (Flow-GRPO's EMAModuleWrapper), else
    d = decay (DanceGRPO)."""
    ema = [w.double() for w in weights[0]]
    for t in range(1, steps + 1):
        if t % interval == 0:
            d = min(decay, (1 + t) / (10 + t)) if warmup else decay
            ema = [d * e + (1 - d) * w.double() for e, w in zip(ema, weights[t])]
    return ema


@pytest.mark.parametrize(
    ("warmup", "interval", "offload"), [(True, 2, False), (False, 1, True)], ids=["flow-grpo", "dancegrpo-offload"]
)
def test_ema_equals_the_closed_form_of_the_recorded_weights(tiny_flux_path, tmp_path, warmup, interval, offload):
    trainer = make_trainer(
        tiny_flux_path, tmp_path, max_steps=5, ema_decay=0.8, ema_update_interval=interval, ema_warmup=warmup,
        ema_offload=offload,
    )  # fmt: skip
    record = Record(trainer)
    trainer.add_callback(record)
    trainer.train()
    expected = closed_form_ema(record.weights, 5, 0.8, interval, warmup)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in trainer.ema.shadow_params)
    for got, want, last in zip(trainer.ema.shadow_params, expected, record.weights[5]):
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
        assert not torch.allclose(got, last)  # an average, not the last weights
    # Saved beside the trained weights, in the same diffusers LoRA format.
    trainer.save_model()
    out = trainer.args.output_dir
    saved = load_file(os.path.join(out, "ema", "pytorch_lora_weights.safetensors"))
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    for name, want in zip(names, expected):
        key = "transformer." + name.replace(".default", "")
        torch.testing.assert_close(saved[key].double(), want, atol=1e-6, rtol=1e-5)
    pipe = FluxPipeline.from_pretrained(tiny_flux_path)
    pipe.load_lora_weights(os.path.join(out, "ema"))  # loads as any LoRA


def flow_grpo_ema(weights: dict[int, list[torch.Tensor]], steps, accumulation, decay, interval) -> list[torch.Tensor]:
    """Flow-GRPO's EMA, written from its loop (zhtmike/flow_grpo@9745241): scripts/train_sd3.py calls
    ``ema.step(params, global_step)`` after every micro-batch (L960), ``global_step`` counting the optimizer steps
    taken, one every ``accumulation`` micro-batches (L360, L947-952); flow_grpo/ema.py:33-49 updates when
    ``(t + 1) % interval == 0`` with decay ``min(decay, (1 + t) / (10 + t))``, from the initial weights (L17)."""
    ema = [w.double() for w in weights[0]]
    for micro_batch in range(steps * accumulation):
        t = (micro_batch + 1) // accumulation  # optimizer steps taken after this micro-batch's backward
        if (t + 1) % interval == 0:
            d = min(decay, (1 + t) / (10 + t))
            ema = [e + (1 - d) * (w.double() - e) for e, w in zip(ema, weights[t])]
    return ema


@pytest.mark.parametrize("accumulation", [2, 3])
def test_flow_grpo_ema_schedule_equals_the_peer_sequence(tiny_flux_path, tmp_path, accumulation):
    trainer = make_trainer(
        tiny_flux_path, tmp_path, max_steps=5, per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
        ema_decay=0.9, ema_update_interval=2, ema_warmup=True, ema_schedule="flow_grpo",
    )  # fmt: skip
    record = Record(trainer)
    trainer.add_callback(record)
    trainer.train()
    expected = flow_grpo_ema(record.weights, 5, accumulation, 0.9, 2)
    once = closed_form_ema(record.weights, 5, 0.9, 2, True)  # the `step` schedule: one update at t % 2 == 0
    for got, want, other in zip(trainer.ema.shadow_params, expected, once):
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
        assert not torch.allclose(want, other, atol=1e-6, rtol=1e-5)  # the schedules differ on these weights


def test_ema_resumes_from_a_checkpoint(tiny_flux_path, tmp_path):
    ema = dict(ema_decay=0.7, ema_update_interval=1, ema_warmup=True, max_steps=4)
    straight = make_trainer(tiny_flux_path, tmp_path / "straight", **ema)
    straight.train()

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    first = make_trainer(tiny_flux_path, tmp_path / "resumed", save_strategy="steps", save_steps=2, **ema)
    first.add_callback(StopAt())
    first.train()
    checkpoint = os.path.join(first.args.output_dir, "checkpoint-2")
    assert os.path.isfile(os.path.join(checkpoint, "ema", "pytorch_lora_weights.safetensors"))
    second = make_trainer(tiny_flux_path, tmp_path / "resumed", **ema)
    second.train(resume_from_checkpoint=checkpoint)
    for a, b in zip(straight.ema.shadow_params, second.ema.shadow_params):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    with pytest.raises(CheckpointError, match="no ema/ folder"):
        make_trainer(tiny_flux_path, tmp_path / "other", **ema).train(
            resume_from_checkpoint=_checkpoint_without_ema(tiny_flux_path, tmp_path)
        )


def _checkpoint_without_ema(path, tmp_path) -> str:
    trainer = make_trainer(path, tmp_path / "plain", max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    return os.path.join(trainer.args.output_dir, "checkpoint-1")


# ---------------------------------------------------------------- held-out evaluation
def test_evaluation_on_the_eval_dataset_every_eval_steps(tiny_flux_path, tmp_path, monkeypatch):
    eval_prompts = ["a red square", "a blue circle", "a green circle"]
    # The eval set is checked row by row once, at __init__, not again at every evaluation.
    checks = []

    def counted_check(*args, **kwargs):
        checks.append(args)
        return prompt_dataset(*args, **kwargs)

    monkeypatch.setattr(evaluation, "prompt_dataset", counted_check)
    trainer = make_trainer(
        tiny_flux_path, tmp_path, eval_dataset=Dataset.from_dict({"prompt": eval_prompts}), eval_strategy="steps",
        eval_steps=1, per_device_eval_batch_size=2, eval_num_inference_steps=3, eval_seed=5,
    )  # fmt: skip
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_reward" in e]
    assert [e["step"] for e in evals] == [1, 2]
    assert all("eval_rewards/redness/mean" in e and "loss" not in e for e in evals)
    assert os.path.isfile(os.path.join(trainer.args.output_dir, "eval_samples", "step-000002.png"))
    # The same rewards from the diffusers pipeline with the trained LoRA: ODE sampling, 3 steps, a seed per batch.
    trainer.save_model()
    pipe = FluxPipeline.from_pretrained(tiny_flux_path)
    pipe.load_lora_weights(trainer.args.output_dir)
    rewards = []
    for begin in (0, 2):
        batch = eval_prompts[begin : begin + 2]
        images = pipe(
            batch, height=32, width=32, num_inference_steps=3, guidance_scale=3.5, max_sequence_length=16,
            generator=torch.Generator().manual_seed(5 + begin),
        ).images  # fmt: skip
        rewards.extend(redness(batch, images))
    metrics = trainer.evaluate()
    assert metrics["eval_reward"] == pytest.approx(np.mean(rewards), abs=2e-3)
    assert metrics["eval_samples"] == 3
    assert checks == []
    with pytest.raises(ValueError, match="no 'prompt' column"):
        make_trainer(tiny_flux_path, tmp_path, eval_dataset=Dataset.from_dict({"text": eval_prompts}))


def test_best_checkpoint_by_eval_reward_is_kept_and_loaded_at_the_end(tiny_flux_path, tmp_path):
    # A reward peaking at the second optimizer step (a function of the live trainer state, 10x any redness
    # difference), so the best checkpoint is not the last one; redness keeps the training gradients non-zero.
    def peak_at_step_2(prompts, trainer_state, **kwargs):
        return [-10.0 * (trainer_state.global_step - 2) ** 2] * len(prompts)

    trainer = make_trainer(
        tiny_flux_path, tmp_path, reward=[redness, peak_at_step_2],
        eval_dataset=Dataset.from_dict({"prompt": ["a red circle", "a blue square"]}),
        max_steps=3, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, save_total_limit=1,
        load_best_model_at_end=True, metric_for_best_model="eval_reward", greater_is_better=True,
    )  # fmt: skip
    last_step = {}

    class KeepLastWeights(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            last_step.update({i: p.detach().clone() for i, p in enumerate(trainable(trainer))})

    trainer.add_callback(KeepLastWeights())
    trainer.train()
    evals = {e["step"]: e["eval_reward"] for e in trainer.state.log_history if "eval_reward" in e}
    assert max(evals, key=evals.get) == 2
    best = os.path.join(trainer.args.output_dir, "checkpoint-2")
    assert trainer.state.best_model_checkpoint == best
    # Rotation never deleted the best checkpoint; at the end Trainer keeps only it (save_total_limit=1).
    assert [f for f in os.listdir(trainer.args.output_dir) if f.startswith("checkpoint-")] == ["checkpoint-2"]
    # The weights in memory at the end are the best checkpoint's (a file round trip: bit-identical), not step 3's.
    trainer.save_model(str(tmp_path / "final"))
    final = load_file(str(tmp_path / "final" / "pytorch_lora_weights.safetensors"))
    saved = load_file(os.path.join(best, "pytorch_lora_weights.safetensors"))
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in saved)
    assert any(not torch.equal(a, b) for a, b in zip(trainable(trainer), last_step.values()))


def test_shuffle_dataset_false_keeps_the_dataset_order(tiny_flux_path, tmp_path):
    def order(**overrides) -> list[int]:
        return list(make_trainer(tiny_flux_path, tmp_path, **overrides)._rollout_sampler())

    # generation_batch_size 4 = 2 prompts x G = 2 per rollout: each index twice in a row.
    assert order(shuffle_dataset=False) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sorted(order()) == sorted(order(shuffle_dataset=False)) != order()  # TRL's default: shuffled


def test_num_completions_to_print_limits_the_logged_rollout_images(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, max_steps=1, log_completions=True, num_completions_to_print=2)
    trainer.train()
    grid = Image.open(os.path.join(trainer.args.output_dir, "completions", "step-000001.png"))
    # One row of G = 2 images of 32 px with a caption strip of whole 11 px lines (and a 1 px margin), instead of the
    # rollout's 2 rows.
    width, height = grid.size
    assert width == 2 * 32 and height > 32 + 1 and (height - 32 - 1) % 11 == 0


def test_predict_is_refused_with_what_to_use_instead(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path)
    with pytest.raises(
        NotImplementedError, match=r"predict\(\) is not supported.*evaluate\(eval_dataset\).*sample_images"
    ):
        trainer.predict(Dataset.from_dict({"prompt": ["a red circle"]}))


def test_the_trainer_derives_from_the_base_trls_own_trainers_use():
    """TRL's trainers at the locked version derive from its private ``_BaseTrainer`` (model cards, tags); the trainer
    follows them. If TRL moves its own trainers off it, this fails and the trainer's base should move too."""
    from trl import DPOTrainer, GRPOTrainer, SFTTrainer
    from trl.trainer.base_trainer import _BaseTrainer

    assert all(issubclass(trainer, _BaseTrainer) for trainer in (GRPOTrainer, DPOTrainer, SFTTrainer))
    assert issubclass(DDPOJaggTrainer, _BaseTrainer)


def test_image_grid_tiles_rows_with_caption_strips_and_fills_the_last_row():
    from trl_jagg.trainer.image_logging import image_grid

    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    grid = image_grid([red, blue, red, blue, red], captions=["", "", "", "", ""], columns=3)
    assert grid.size == (3 * 8, 2 * (8 + 12))  # 3 columns, 2 rows of image + 12-pixel caption strip
    assert grid.getpixel((0, 0)) == (255, 0, 0) and grid.getpixel((8, 0)) == (0, 0, 255)
    assert grid.getpixel((0, 20)) == (0, 0, 255) and grid.getpixel((8, 20)) == (255, 0, 0)  # row 2: 4th, 5th
    assert grid.getpixel((4, 10)) == (255, 255, 255)  # empty caption strip
    assert grid.getpixel((20, 24)) == (255, 255, 255)  # the last row's missing 6th tile


def test_the_config_is_data_two_trainers_from_one_config(tiny_flux_path, tmp_path):
    """Issue 42: a notebook re-run builds a second trainer from the same config. The trainer settles the
    checkpointing switches for transformers.Trainer on its own copy, so the config reads back as given and the
    second trainer checkpoints its backbone as the first did."""
    config = GRPOJaggConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, num_inference_steps=4,
        height=32, width=32, max_steps=1, max_sequence_length=16, report_to="none", save_strategy="no",
        disable_tqdm=True, activation_checkpointing=True, activation_checkpointing_kwargs={"every_n_layers": 2},
    )  # fmt: skip
    before = config.to_dict()
    trainers = [
        DDPOJaggTrainer(
            model=tiny_flux_path,
            reward_funcs=redness,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )  # fmt: skip
        for _ in range(2)
    ]
    assert config.to_dict() == before
    for trainer in trainers:
        assert trainer.accelerator.unwrap_model(trainer.model).gradient_checkpointing
