"""Wan2.2 A14B (two experts) on its tiny pipeline (boundary_ratio 0.8: timesteps >= 800 go to `transformer`): the
rollout at noise level 0 is WanPipeline's own loop with its expert switch and `guidance_scale_2`; JAGG groups never
straddle the switch on the trainer's path; W = 2 equals exact and the cache equals recomputation in each expert; the
trained experts' LoRA files load with `load_lora_weights` (`load_into_transformer_2=True` for the second) and full
fine-tuning saves both transformers in the pipeline layout; a frozen expert gets no LoRA and no gradient."""

from __future__ import annotations

import os
import re

import pytest
import torch
from datasets import Dataset
from diffusers import DiffusionPipeline, WanPipeline, WanTransformer3DModel
from testing_utils import (
    assert_same_images,
    assert_w2_jagg_equals_exact,
    family_trainer,
    pipeline_run,
    redness,
    run_update,
    trained_steps_of,
    update_gradient,
)

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.models import load_adapter
from trl_jagg.models.rollout import sample_trajectories
from trl_jagg.utils.errors import CheckpointError

# Flow-Factory's two scales (examples/grpo/lora/wan22/t2v.yaml:64-65): CFG 4 on the high-noise expert, 3 below.
CFG = {"guidance_scale": 4.0, "true_cfg_scale": 1.0, "guidance_scale_2": 3.0}
PROMPTS = ["a red circle", "a big blue square on the left"]
experts_names = ("transformer", "transformer_2")


class ExpertCalls:
    """Forward hooks on both experts: the expert of each backbone call, in order, with or without a graph."""

    def __init__(self, pipe):
        self.calls: list[tuple[str, bool]] = []
        self.handles = [
            getattr(pipe, name).register_forward_hook(
                lambda module, args, output, name=name: self.calls.append((name, torch.is_grad_enabled()))
            )
            for name in ("transformer", "transformer_2")
        ]

    def take(self) -> list[tuple[str, bool]]:
        calls, self.calls = self.calls, []
        return calls


def wan22_trainer(path, tmp_path, **overrides):
    return family_trainer("wan", path, tmp_path, CFG, **overrides)  # the Wan2.1 settings: 5 frames, negative "dark"


@pytest.mark.parametrize("guidance", [CFG, {"guidance_scale": 1.0, "true_cfg_scale": 1.0}], ids=["cfg", "no_cfg"])
def test_rollout_at_noise_level_0_is_the_pipeline_loop_with_its_expert_switch(tiny_wan22_path, guidance):
    pipe = DiffusionPipeline.from_pretrained(tiny_wan22_path)
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio == 0.8
    adapter = load_adapter(pipe)
    adapter.num_frames, adapter.guidance_scale_2 = 5, guidance.get("guidance_scale_2")
    negative = "dark" if guidance["guidance_scale"] > 1 else None
    calls = ExpertCalls(pipe)
    expected_latents, expected_videos = pipeline_run(pipe, "wan", PROMPTS, negative, guidance)
    # The pipeline's own switch at t >= 800 of [1000, 857.7, 602.2, 8.9]; with CFG it calls each expert twice a step.
    per_step = 2 if negative else 1
    assert [name for name, _ in calls.take()] == ["transformer"] * 2 * per_step + ["transformer_2"] * 2 * per_step

    cond = adapter.condition(PROMPTS, height=32, width=32, negative_prompt=negative, max_sequence_length=16)
    noise = adapter.prepare_latents(len(PROMPTS), 32, 32, torch.Generator().manual_seed(0))
    sigmas, timesteps = adapter.schedule(4, 32, 32)
    trajectory = sample_trajectories(
        adapter, cond, noise, sigmas, timesteps, sampler="sde", noise_level=0.0,
        guidance_scale=guidance["guidance_scale"], true_cfg_scale=1.0,
    )  # fmt: skip
    assert [name for name, _ in calls.take()] == ["transformer"] * 2 + ["transformer_2"] * 2  # CFG in one call
    torch.testing.assert_close(trajectory.latents[:, -1], expected_latents, atol=1e-5, rtol=0)
    assert_same_images(adapter.decode(trajectory.latents[:, -1], 32, 32), expected_videos)


def test_jagg_groups_never_straddle_the_expert_switch_on_the_trainer_path(tiny_wan22_path, tmp_path):
    """7 steps (high-noise: the first 3), 6 trained, W = 2: without the break the groups would be steps 0-1, 2-3
    (both experts) and 4-5. The trainer plans 0-1 (JAGG), 2 (exact), 3-4 (JAGG), 5 (exact): the backbone calls between
    two backward calls (one group each) all hit one expert."""
    trainer = wan22_trainer(tiny_wan22_path, tmp_path, num_inference_steps=7, jagg_group_size=2)
    batch = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    trained = trained_steps_of(trainer, batch)
    assert trained == [0, 1, 2, 3, 4, 5]
    groups = trainer.update_stage.plan(batch, trained, use_jagg=True)
    assert [(g.steps, g.method) for g in groups] == [
        ((0, 1), "jagg"),
        ((2,), "exact"),
        ((3, 4), "jagg"),
        ((5,), "exact"),
    ]
    calls = ExpertCalls(trainer.adapter.pipeline)
    backward = trainer.accelerator.backward

    def marked_backward(loss, **kwargs):
        calls.calls.append(("backward", True))
        backward(loss, **kwargs)

    trainer.accelerator.backward = marked_backward
    trainer.model.train()
    run_update(trainer, trainer.model, batch)
    per_group, current = [], []
    for name, grad in calls.take():
        if name == "backward":
            per_group, current = [*per_group, current], []
        elif grad:
            current.append(name)
    high, low = "transformer", "transformer_2"
    assert per_group == [[high, high], [high], [low, low], [low]]


def test_w2_jagg_gradient_equals_exact_across_both_experts(tiny_wan22_path, tmp_path):
    """5 steps, 4 trained (2 per expert): for W = 2 the joint backward of each expert's pair equals the sum of its
    per-step gradients; the gradient reaches both experts' LoRA weights."""
    trainer = wan22_trainer(tiny_wan22_path, tmp_path, num_inference_steps=5)
    assert_w2_jagg_equals_exact(trainer)
    names = {n.split(".")[0] for n, p in trainer.model.named_parameters() if p.grad is not None and p.grad.any()}
    assert names == {"transformer", "transformer_2"}


def test_velocity_cache_equals_recomputation_in_each_expert(tiny_wan22_path, tmp_path):
    """7 steps, 6 trained, W = 3: one group per expert, each with one intermediate step. The rollout's velocities
    replace both intermediates' no-grad forwards (one per expert) and give the recomputed gradient."""
    trainer = wan22_trainer(tiny_wan22_path, tmp_path, num_inference_steps=7, jagg_group_size=3)
    rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    calls = ExpertCalls(trainer.adapter.pipeline)
    recomputed = update_gradient(trainer, rollout, jagg_cache_velocities=False)
    no_grad = sorted(name for name, grad in calls.take() if not grad)
    assert no_grad == ["transformer", "transformer_2"]  # the intermediates 1 and 4, split by expert
    cached = update_gradient(trainer, rollout)
    assert [grad for _, grad in calls.take()] == [True] * 4  # the endpoints only
    assert trainer._metrics["jagg/cached_velocities"][-1] == 2
    assert recomputed.abs().max() > 0
    # Within float rounding (batch shapes differ: see testing_utils.assert_velocity_cache_equals_recomputation).
    torch.testing.assert_close(cached, recomputed, rtol=0, atol=1e-5 * recomputed.abs().max().item())


def pipeline_sample(pipe) -> tuple[torch.Tensor, list]:
    return pipeline_run(pipe, "wan", ["a red circle"], "dark", CFG)


def test_both_experts_lora_reload_with_load_lora_weights(tiny_wan22_path, tmp_path):
    """Each expert's LoRA is a diffusers file in its component folder; `load_lora_weights` loads the first into
    `transformer` and, with `load_into_transformer_2=True`, the second into `transformer_2`: the pipeline then
    samples what the trainer samples."""
    trainer = wan22_trainer(tiny_wan22_path, tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model()
    out = trainer.args.output_dir
    ours = trainer.sample_images(["a red circle"], seed=0)
    pipe = DiffusionPipeline.from_pretrained(tiny_wan22_path)
    pipe.load_lora_weights(os.path.join(out, "transformer"))
    # The model card's form (tests below): the folder as `subfolder=`, which a Hub repository takes too.
    pipe.load_lora_weights(out, subfolder="transformer_2", load_into_transformer_2=True)
    lora_latents, theirs = pipeline_sample(pipe)
    assert_same_images(ours, theirs)
    high_only = DiffusionPipeline.from_pretrained(tiny_wan22_path)
    high_only.load_lora_weights(os.path.join(out, "transformer"))
    base_latents, _ = pipeline_sample(DiffusionPipeline.from_pretrained(tiny_wan22_path))
    # Each expert's LoRA changes the samples: the base, the high-noise LoRA alone and both differ.
    assert not torch.allclose(pipeline_sample(high_only)[0], lora_latents)
    assert not torch.allclose(base_latents, pipeline_sample(high_only)[0])


@pytest.mark.parametrize(("train_experts", "trained", "frozen"), [
    ("high_noise", "transformer", "transformer_2"), ("low_noise", "transformer_2", "transformer")])  # fmt: skip
def test_one_trained_expert_the_other_gets_no_lora_and_no_gradient(
    tiny_wan22_path, tmp_path, train_experts, trained, frozen
):
    """The frozen expert has no LoRA layer, no gradient and its weights unchanged after two steps; its steps are
    not trained; only the trained expert's folder is written."""
    trainer = wan22_trainer(tiny_wan22_path, tmp_path, train_experts=train_experts, num_inference_steps=5)
    frozen_module = getattr(trainer.adapter.pipeline, frozen)
    before = {n: p.detach().clone() for n, p in frozen_module.named_parameters()}
    assert not any("lora" in n for n in before)
    batch = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    # Steps [1000, 900] are the high-noise expert's, [751, 503] the low-noise one's (the last is never trained).
    expected = [0, 1] if trained == "transformer" else [2, 3]
    assert trainer.update_stage.steps_to_train(batch, micro_step=0, global_step=0) == expected
    # A random draw is made among the trained expert's steps: never empty, so every micro-batch takes a backward
    # (under DDP the synced one must). One of the 4 candidates drawn over all steps would miss it half the time.
    trainer.args.train_timesteps, trainer.args.train_timestep_fraction = "random_but_last", 0.25
    draws = [trainer.update_stage.steps_to_train(batch, micro_step=m, global_step=0) for m in range(16)]
    assert all(len(steps) == 1 and steps[0] in expected for steps in draws)
    assert {steps[0] for steps in draws} == set(expected)
    trainer.args.train_timesteps = "all_but_last"
    trainer.train()
    assert all(p.grad is None for p in frozen_module.parameters())
    assert all(torch.equal(p, before[n]) for n, p in frozen_module.named_parameters())
    assert all(n.startswith(f"{trained}.") for n, p in trainer.model.named_parameters() if p.requires_grad)
    trainer.save_model()
    assert trained in os.listdir(trainer.args.output_dir)
    assert not os.path.exists(os.path.join(trainer.args.output_dir, frozen))


def test_full_fine_tuning_saves_both_transformers_in_the_pipeline_layout(tiny_wan22_path, tmp_path):
    """Without LoRA both experts train and are saved as `from_pretrained(..., subfolder=...)` reads them; the
    pipeline with both reloaded samples what the trainer samples."""
    torch.manual_seed(0)
    config = GRPOJaggConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, num_inference_steps=4,
        height=32, width=32, num_frames=5, max_steps=1, learning_rate=1e-3, noise_level=0.9, jagg_group_size=2,
        max_sequence_length=16, negative_prompt="dark", report_to="none", save_strategy="no", disable_tqdm=True, **CFG,
    )  # fmt: skip
    trainer = DDPOJaggTrainer(
        model=tiny_wan22_path, reward_funcs=redness, args=config, train_dataset=Dataset.from_dict({"prompt": PROMPTS})
    )
    assert {n.split(".")[0] for n, p in trainer.model.named_parameters() if p.requires_grad} == set(experts_names)
    trainer.train()
    trainer.save_model()
    out = trainer.args.output_dir
    experts = {n: WanTransformer3DModel.from_pretrained(out, subfolder=n) for n in experts_names}
    for name, module in experts.items():
        trained = getattr(trainer.adapter.pipeline, name).state_dict()
        assert all(torch.equal(value, trained[key]) for key, value in module.state_dict().items()), name
    pipe = WanPipeline.from_pretrained(tiny_wan22_path, **experts)  # DiffusionPipeline's drops these keywords
    assert_same_images(trainer.sample_images(["a red circle"], seed=0), pipeline_sample(pipe)[1])


def test_expert_settings_are_checked_early(tiny_wan_path, tmp_path):
    with pytest.raises(
        ValueError, match=r"train_experts.*is 'middle'.*Use one of \('both', 'high_noise', 'low_noise'\)"
    ):
        GRPOJaggConfig(output_dir=str(tmp_path), train_experts="middle")
    with pytest.raises(ValueError, match="guidance_scale_2.*is 0.5"):
        GRPOJaggConfig(output_dir=str(tmp_path), guidance_scale_2=0.5)
    with pytest.raises(ValueError, match="WanPipeline has one transformer: they choose between the experts"):
        family_trainer("wan", tiny_wan_path, tmp_path, {"guidance_scale": 4.5}, train_experts="high_noise")


def test_both_experts_on_several_processes_train_under_ddp_only(tiny_wan22_path, tmp_path, monkeypatch):
    """On 2 processes (as TrainingArguments reports them; the checks need no process group) both experts train under
    DDP with `find_unused_parameters` on, whatever the config said; one expert keeps the config's value; a sharding
    backend is refused before anything is prepared. The gradients themselves are pinned on 2 real processes by
    `tests/test_distributed.py::test_trainer_gradients_on_two_processes` (kind `wan22-both`)."""
    from trl_jagg.trainer.inputs import checked_model_inputs

    adapter, dataset = load_adapter(tiny_wan22_path), Dataset.from_dict({"prompt": PROMPTS})

    def checked(launch_env: dict[str, str] | None = None, **settings) -> GRPOJaggConfig:
        args = GRPOJaggConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **settings)
        assert args.ddp_find_unused_parameters is False  # the config's default: one network, every weight used
        with monkeypatch.context() as patch:
            for name, value in (launch_env or {}).items():  # as `accelerate launch` with an FSDP / DeepSpeed config
                patch.setenv(name, value)
            patch.setattr(GRPOJaggConfig, "world_size", property(lambda self: 2))
            checked_model_inputs(adapter, args, dataset, None)
        return args

    assert checked().ddp_find_unused_parameters is True
    assert checked(train_experts="high_noise").ddp_find_unused_parameters is False
    refused = r'train_experts="both" on 2 processes trains under DDP only, but this run uses {}.*multi_gpu.yaml'
    with pytest.raises(ValueError, match=refused.format("fully_shard_backbone=True")):
        checked(fully_shard_backbone=True)
    for variable, backend in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        with pytest.raises(ValueError, match=refused.format(backend)):
            checked({variable: "true"})


def test_train_experts_values_are_the_config_checks_ones():
    from trl_jagg.config.sampling import TRAIN_EXPERTS as CHECKED
    from trl_jagg.models.wan_experts import TRAIN_EXPERTS

    assert tuple(TRAIN_EXPERTS) == CHECKED


def test_resume_keeps_both_experts_weights_and_optimizer_state(tiny_wan22_path, tmp_path):
    """1 step, a checkpoint, a fresh trainer, 1 more step == 2 straight steps, for both experts' LoRA weights (the
    second Adam step needs the first's moments: a lost optimizer state would move the weights otherwise)."""
    from test_trainer import StopAt, trainable_state

    straight = wan22_trainer(tiny_wan22_path, tmp_path / "straight")
    straight.train()
    first = wan22_trainer(tiny_wan22_path, tmp_path / "resumed", save_strategy="steps", save_steps=1)
    first.add_callback(StopAt(1))
    first.train()
    checkpoint = os.path.join(first.args.output_dir, "checkpoint-1")
    assert {"transformer", "transformer_2"} <= set(os.listdir(checkpoint))
    second = wan22_trainer(tiny_wan22_path, tmp_path / "resumed")
    second.train(resume_from_checkpoint=checkpoint)
    a, b = trainable_state(straight), trainable_state(second)
    assert {name.split(".")[0] for name in a} == {"transformer", "transformer_2"}
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    # Resumed with one expert, the checkpoint's other expert would be dropped: the message says what differs.
    one = wan22_trainer(tiny_wan22_path, tmp_path / "one", train_experts="high_noise")
    with pytest.raises(CheckpointError, match=re.escape(
        "holds the weights of the expert(s) ['transformer', 'transformer_2'] (a run with train_experts='both'); this "
        "run trains ['transformer'] (train_experts='high_noise')")):  # fmt: skip
        one.train(resume_from_checkpoint=checkpoint)


def test_training_an_expert_that_denoises_no_trained_step_is_refused_at_init(tiny_wan22_path, tmp_path):
    """Steps 0 and 1 of 5 (timesteps 1000 and 900) are the high-noise expert's: training only the low-noise one on
    them would save an untrained LoRA after updates of zero gradient."""
    window = {"train_timesteps": "sde_window", "sde_window_size": 2, "sde_window_max_start": 0}
    with pytest.raises(ValueError, match=r"train_experts='low_noise' trains \['transformer_2'\], but the steps "
                       r"train_timesteps='sde_window' can train, 0 \(t=1000\), 1 \(t=900\) of num_inference_steps=5, "
                       "are all denoised by the other expert"):  # fmt: skip
        wan22_trainer(tiny_wan22_path, tmp_path, train_experts="low_noise", num_inference_steps=5, **window)
    # One window position further (steps 0-2, t=751 included), the low-noise expert has a step to train.
    wan22_trainer(tiny_wan22_path, tmp_path, train_experts="low_noise", num_inference_steps=5,
                  **window | {"sde_window_max_start": 1})  # fmt: skip


def test_model_card_snippet_loads_each_expert():
    """The card's snippet for a two-expert run loads each trained expert from its folder, as the tests above do."""
    from trl_jagg.trainer.model_card import usage_snippet

    settings = dict(base="Wan-AI/Wan2.2-T2V-A14B-Diffusers", repo="me/run", pipeline_class="WanPipeline",
                    transformer_class="WanTransformer3DModel", dtype="bfloat16", scheduler_class=None,
                    call_kwargs={}, experts=["transformer", "transformer_2"])  # fmt: skip
    lora = usage_snippet(is_lora=True, **settings)
    weight = 'weight_name="pytorch_lora_weights.safetensors"'
    assert f'pipe.load_lora_weights("me/run", subfolder="transformer", {weight})' in lora
    assert (
        f'pipe.load_lora_weights("me/run", subfolder="transformer_2", {weight}, load_into_transformer_2=True)' in lora
    )
    ema = usage_snippet(is_lora=True, ema=True, **settings)  # each expert's EMA weights: ema/<expert>/
    assert f'pipe.load_lora_weights("me/run", subfolder="ema/transformer_2", {weight}, load_into_transformer_2' in ema
    full = usage_snippet(is_lora=False, **settings)
    assert 'transformer_2 = WanTransformer3DModel.from_pretrained("me/run", subfolder="transformer_2"' in full
    assert "transformer=transformer, transformer_2=transformer_2" in full
