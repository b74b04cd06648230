"""Helpers shared by several test modules (importable because pytest puts ``tests/`` on ``sys.path``)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import torch
from PIL import Image

# Every preset, in the order of docs/models.md, written out here (not read from trl_jagg.recipes): a preset added
# or dropped fails the tests that list them.
FLOW_FACTORY = (
    "flow-factory-z-image",
    "flow-factory-z-image-turbo",
    "flow-factory-flux2-klein-base",
    "flow-factory-flux2-klein",
    "flow-factory-flux2-dev",
    "flow-factory-wan2.2",
)
DIFFUSION_NFT = ("nft-sd35", "nft-sd35-ocr", "nft-sd35-geneval")
NAMES = [
    "flow-grpo-sd35",
    "flow-grpo-sd35-ocr",
    "flow-grpo-sd35-geneval",
    "flow-grpo-guard-sd35",
    "flow-grpo-flux",
    "flow-grpo-qwenimage",
    "flow-grpo-qwenimage-all-steps",
    "flow-grpo-qwenimage-edit",
    "flow-grpo-kontext",
    "flow-grpo-fast-flux",
    "flow-grpo-wan2.1",
    "dancegrpo-flux",
    "dancegrpo-flux-8gpu",
    "dancegrpo-wan2.1",
    "dancegrpo-qwenimage-edit",
    "mixgrpo-flux",
    "jagg-fast-flux",
    *FLOW_FACTORY,
    *DIFFUSION_NFT,
    "awm-sd35",
    "awm-flux",
    "dgpo-sd35",
]

PROMPTS = ["a red circle", "a green square", "a blue circle", "a red square"]


def engine_and_exact_gradients(model, groups, x_t, t_of, loss_fn):
    """``model``'s gradient through the JAGG engine over ``groups`` (the velocity of trained timestep ``i`` at the
    inputs ``x_t[i]``, ``t_of[i]``) and the exact sum of per-timestep gradients, taken here one by one."""
    from trl_jagg.core.jagg import JaggEngine, StepFunctions

    params = list(model.parameters())
    for p in params:
        p.grad = None
    JaggEngine().run(groups, StepFunctions(lambda i: model(x_t[i], t_of[i]), loss_fn))
    jagg = torch.cat([p.grad.flatten() for p in params])
    exact = sum(
        torch.cat([g.flatten() for g in torch.autograd.grad(loss_fn(i, model(x_t[i], t_of[i])), params)])
        for i in range(len(x_t))
    )
    return jagg, exact


def linear_velocity(params, x, t):
    """A toy velocity linear in (x, t), ``v = W x + t b`` over the flattened latent (the forward-process losses'
    float64 tests)."""
    weight, bias = params
    flat = x.reshape(x.shape[0], -1)
    return (flat @ weight.T + t[:, None] * bias).reshape(x.shape)


def linear_velocity_params(gen, latent_shape, scale=0.3):
    """Random float64 ``(W, b)`` of :func:`linear_velocity` for latents of ``latent_shape`` (without the batch)."""
    dim = math.prod(latent_shape)
    weight = (scale * torch.randn(dim, dim, generator=gen, dtype=torch.float64)).requires_grad_(True)
    bias = (scale * torch.randn(dim, generator=gen, dtype=torch.float64)).requires_grad_(True)
    return weight, bias


def redness(prompts, images, **kwargs):
    """An independent reward: mean red minus mean of the other channels."""
    out = []
    for image in images:
        a = np.asarray(image, dtype=np.float32) / 255.0
        out.append(float(a[..., 0].mean() - a[..., 1:].mean()))
    return out


def solid(rgb: tuple[int, int, int], size: tuple[int, int] = (8, 8)) -> Image.Image:
    return Image.new("RGB", size, rgb)


def noise_image(seed: int = 0, size: int = 64) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def trained_steps_of(trainer, batch):
    """The steps the trainer's next update of ``batch`` trains (its own counters)."""
    from trl_jagg.objectives.grpo import trained_steps

    return trained_steps(trainer.args, batch, micro_step=trainer._step, global_step=trainer.state.global_step)


def step_functions_of(trainer, model, batch):
    """The engine's inputs the trainer's update stage builds for ``batch``."""
    return trainer.update_stage.step_functions(model, batch, trained_steps_of(trainer, batch))


def run_update(trainer, model, batch):
    """One micro-batch update through the trainer's update stage, with the trainer's counters."""
    return trainer.update_stage.run(
        model, batch, micro_step=trainer._step, global_step=trainer.state.global_step,
        accumulation_steps=trainer.current_gradient_accumulation_steps,
    )  # fmt: skip


def update_gradient(trainer, rollout, **overrides) -> torch.Tensor:
    """The flat gradient of one update of `rollout` with config `overrides` (restored afterwards)."""
    model = trainer.model
    saved = {k: getattr(trainer.args, k) for k in overrides}
    for k, v in overrides.items():
        setattr(trainer.args, k, v)
    try:
        model.zero_grad(set_to_none=True)
        model.train()
        run_update(trainer, model, rollout)
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    finally:
        for k, v in saved.items():
            setattr(trainer.args, k, v)


def gdpo_by_hand(columns, weights, group_size, eps, ddof, clip):
    """GDPO (TRL's normalize_then_sum) written out with Python floats: per reward and group, (r - mean) / (std +
    eps) over the scored (not None) values, 0 for None and for an all-equal group; the weighted sum; then the
    batch's (s - mean) / (std + eps), clipped."""
    std = statistics.stdev if ddof == 1 else statistics.pstdev
    n = len(columns[0])
    total = [0.0] * n
    for column, weight in zip(columns, weights):
        for start in range(0, n, group_size):
            group = [v for v in column[start : start + group_size] if v is not None]
            for i in range(start, start + group_size):
                value = column[i]
                if value is None or len(set(group)) == 1:
                    continue
                spread = std(group) if len(group) > ddof else 0.0
                total[i] += weight * (value - statistics.fmean(group)) / (spread + eps)
    mean, spread = statistics.fmean(total), std(total)
    return [max(-clip, min(clip, (t - mean) / (spread + eps))) for t in total]


class BackboneCalls:
    """Forward hooks on the backbone (forwards with / without graph) and a counting ``accelerator.backward``."""

    def __init__(self, trainer):
        self.graph = self.no_grad = self.backward = 0
        self.handle = trainer.accelerator.unwrap_model(trainer.model).register_forward_hook(self._hook)
        backward = trainer.accelerator.backward

        def counting_backward(loss, **kwargs):
            self.backward += 1
            backward(loss, **kwargs)

        trainer.accelerator.backward = counting_backward

    def _hook(self, module, args, output) -> None:
        if torch.is_grad_enabled():
            self.graph += 1
        else:
            self.no_grad += 1

    def take(self) -> tuple[int, int, int]:
        counts = (self.graph, self.no_grad, self.backward)
        self.graph = self.no_grad = self.backward = 0
        return counts


def assert_two_lora_jagg_steps(trainer) -> None:
    """Train ``trainer`` (LoRA, 4 steps of which 3 are trained in one JAGG group of W = 3, 2 optimizer steps) and
    check that the LoRA weights moved, every logged loss and gradient norm is finite, and each step took one joint
    backward."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert before and all("lora" in n for n in before)
    trainer.train()
    after = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(before[n], after[n]) for n in before), "no parameter changed"
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["grad_norm"]) and entry["grad_norm"] > 0
        # 3 trained steps (all but the last of 4) in one JAGG group of W = 3: one joint backward.
        assert entry["engine/jagg/backward_calls"] == 1 and entry["engine/jagg/groups_jagg"] == 1


def assert_w2_jagg_equals_exact(trainer) -> None:
    """Theorem 1's exact limit on ``trainer``'s adapter (4 trained steps): for W = 2 the joint backward through the
    two endpoints gives the sum of the per-step gradients, up to float rounding."""
    from trl_jagg.core.jagg import JaggEngine, StepFunctions, plan_groups

    model = trainer.accelerator.unwrap_model(trainer.model)
    batch = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    fns = step_functions_of(trainer, model, batch)
    times = [float(batch.sigmas[k]) for k in fns.trained]
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(plan) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        JaggEngine().run(plan, StepFunctions(fns.velocity_fn, fns.loss_fn))
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]

    joint_plan = plan_groups(times, 2, 1.0)
    assert len(fns.trained) == 4 and [g.method for g in joint_plan] == ["jagg", "jagg"]
    exact, jagg = gradient(plan_groups(times, 2, 0.0)), gradient(joint_plan)
    assert max(e.abs().max().item() for e in exact) > 1e-4  # a real gradient, not zeros on both sides
    for e, j in zip(exact, jagg):
        torch.testing.assert_close(j, e, atol=1e-6, rtol=0)


def assert_velocity_cache_equals_recomputation(trainer, calls_per_velocity: int) -> None:
    """One JAGG group of W = 4 (``trainer``: 5 steps, 4 trained): the cached rollout velocities replace the no-grad
    forward of the two intermediate steps; the gradient is the one recomputing them, and both make two graph
    forwards (the endpoints) and one backward. ``calls_per_velocity``: backbone calls per guided velocity."""
    rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    assert rollout.velocities.shape == rollout.latents[:, 1:].shape
    calls = BackboneCalls(trainer)
    recomputed = update_gradient(trainer, rollout, jagg_cache_velocities=False)
    per = calls_per_velocity
    assert calls.take() == (2 * per, per, 1)  # one batched no-grad velocity for both intermediates
    cached = update_gradient(trainer, rollout)
    assert calls.take() == (2 * per, 0, 1)
    assert trainer._metrics["jagg/cached_velocities"][-1] == 2
    assert recomputed.abs().max() > 0
    # Not bit-equal: the recomputation runs both intermediates in one batched call, another batch shape than the
    # rollout's, and AVX-512 kernels round per shape (up to 2.1e-6 of the largest entry seen there). A wrong cached
    # velocity changes the gradient at the order of the gradient itself.
    torch.testing.assert_close(cached, recomputed, rtol=0, atol=1e-5 * recomputed.abs().max().item())
    calls.handle.remove()


def check_sharded_nft_run(work_dir, *, resume_atol: float = 0.0) -> None:
    """What ``distributed_scripts/nft_sharded.py`` left in ``work_dir`` (a pathlib folder): each process kept its
    shard of DiffusionNFT's old policy, checkpoints hold it whole, and the resumed run ends bit-identical.

    The old policy is checked against its definition from the saved files: ``checkpoint-(t+1)`` holds the policy
    that followed the weights after step ``t``, ``old_(t+1) = d_t old_t + (1 - d_t) w_t`` (``checkpoint-1``: the
    initial weights), with ``w_t`` written by the worker from torch's or DeepSpeed's own gather and ``d_t`` the decay
    schedule pinned against DiffusionNFT's in test_nft.py. ``resume_atol``: how far the resumed weights may be (0:
    bit-identical)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    from trl_jagg.core.nft import old_policy_decay
    from trl_jagg.trainer.old_policy import OLD_POLICY_FILE

    reports = [json.loads((work_dir / f"nft{r}.json").read_text()) for r in range(2)]
    for report in reports:  # each process holds a part of the weights the backend split
        assert report["old_policy_parts"] != report["whole_shapes"] and report["followed"] == 2

    def old(run: str, t: int) -> dict[str, torch.Tensor]:
        return load_file(str(work_dir / run / f"checkpoint-{t}" / OLD_POLICY_FILE))

    weights = [load_file(str(work_dir / f"w{t}.safetensors")) for t in range(3)]
    whole_shapes = {str(i): list(shape) for i, shape in enumerate(reports[0]["whole_shapes"])}
    assert {k: list(v.shape) for k, v in old("whole", 1).items()} == whole_shapes
    assert all(torch.equal(old("whole", 1)[k], weights[0][k].float()) for k in weights[0])
    for t in (1, 2):
        decay = old_policy_decay(t, 1)
        for k, w in weights[t].items():
            expected = decay * old("whole", t)[k] + (1 - decay) * w.float()
            torch.testing.assert_close(old("whole", t + 1)[k], expected, rtol=1e-6, atol=1e-7)
    with safe_open(str(work_dir / "whole" / "checkpoint-3" / OLD_POLICY_FILE), framework="pt") as reader:
        assert reader.metadata()["step"] == "2"
    # Bit-identical (resume_atol 0) on purpose: the resumed run repeats the same calls on the same shapes with the
    # restored RNG.
    for name in (OLD_POLICY_FILE, "pytorch_lora_weights.safetensors"):
        straight, resumed = (load_file(str(work_dir / run / "checkpoint-3" / name)) for run in ("whole", "resumed"))
        assert straight.keys() == resumed.keys()
        for k in straight:
            torch.testing.assert_close(resumed[k], straight[k], rtol=0, atol=resume_atol, msg=f"{name} {k}")


# ---------------------------------------------------------------- model families (trl_jagg/models/families.py)
def tiny_path(request, record) -> str:
    """The saved tiny pipeline of family ``record`` (its conftest fixture ``tiny_<name>_path``)."""
    return request.getfixturevalue(f"tiny_{record.name}_path")


def frames_of(family: str) -> dict:
    """The `num_frames` keyword of a video family (for the pipeline and the config), none for image families."""
    from trl_jagg.models.families import family as record_of

    frames = record_of(family).tiny_config.get("num_frames")
    return {"num_frames": frames} if frames is not None else {}


def prompt_length(family: str) -> int:
    """The tests' `max_sequence_length` for this family: 16 tokens unless its record asks for more."""
    from trl_jagg.models.families import family as record_of

    return record_of(family).tiny_config.get("max_sequence_length", 16)


def pipeline_run(pipe, family: str, prompts: list[str], negative: str | None, guidance: dict):
    """The pipeline's own sampling (4 steps at 32 x 32 px, noise seeded 0): final latents (captured after the last
    step) and PIL images, or for a video family one list of frames per sample. Each guidance setting and the negative
    prompt go to the pipeline where its ``__call__`` takes them (FLUX.2 has no negative prompt; SD3 no
    ``true_cfg_scale``)."""
    import inspect

    from trl_jagg.models.families import family as record_of

    captured = {}

    def keep_latents(pipeline, step, timestep, tensors):
        captured["latents"] = tensors["latents"]
        return {}

    takes = inspect.signature(pipe.__call__).parameters
    kwargs = {key: value for key, value in guidance.items() if key in takes}
    if "negative_prompt" in takes:
        kwargs["negative_prompt"] = [negative] * len(prompts) if negative else None
    video = record_of(family).task == "text-to-video"
    if video:  # WanPipeline returns float arrays by default
        kwargs |= frames_of(family) | {"output_type": "pil"}
    output = pipe(
        prompt=list(prompts),  # ZImagePipeline rewrites the list it is given into chat-templated prompts
        height=32, width=32, num_inference_steps=4, max_sequence_length=prompt_length(family),
        generator=torch.Generator().manual_seed(0), callback_on_step_end=keep_latents, **kwargs,
    )  # fmt: skip
    return captured["latents"], output.frames if video else output.images


def assert_same_images(ours, theirs) -> None:
    """Images, or videos (lists of frames) frame by frame, equal up to uint8 rounding."""
    if isinstance(ours[0], list):
        assert [len(video) for video in ours] == [len(video) for video in theirs]
        ours, theirs = [f for video in ours for f in video], [f for video in theirs for f in video]
    for a, b in zip(ours, theirs, strict=True):
        diff = np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16))
        assert diff.max() <= 1  # uint8 rounding only


def family_trainer(family: str, path: str, tmp_path, guidance: dict, dataset=None, **overrides):
    """A LoRA trainer (to_q/to_k/to_v, rank 4) of family ``family``'s tiny pipeline at ``path`` on :data:`PROMPTS`
    (or ``dataset``): 2 optimizer steps of 4 samples, 4 steps of which 3 are trained in one JAGG group of W = 3, at the
    family's frame count and prompt length, with its negative prompt unless ``guidance`` names one."""
    from datasets import Dataset
    from peft import LoraConfig

    from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
    from trl_jagg.models.families import family as record_of

    torch.manual_seed(0)
    config = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, num_inference_steps=4,
        height=32, width=32, max_steps=2, learning_rate=1e-2, epsilon=1e-1, noise_level=0.9, jagg_group_size=3,
        jagg_frac=1.0, max_sequence_length=prompt_length(family), report_to="none", save_strategy="no",
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    config |= frames_of(family) | guidance | overrides
    negative = record_of(family).negative_prompt
    if "negative_prompt" not in config and negative is not None:
        config["negative_prompt"] = negative
    return DDPOJaggTrainer(
        model=path,
        reward_funcs=redness,
        args=GRPOJaggConfig(**config),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}) if dataset is None else dataset,
        peft_config=LoraConfig(
            r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"
        ),
    )
