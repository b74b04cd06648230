"""The DiffusionNFT presets' batch against DiffusionNFT's own counters (issue 37): images per optimizer step, and the
old-policy decay and EMA at a given number of images, with DiffusionNFT's numbers and formulas written out here from
NVlabs/DiffusionNFT@24af555 (config/nft.py, scripts/train_nft_sd3.py), never read from trl_jagg."""

from __future__ import annotations

import pytest

from trl_jagg import GRPOJaggConfig
from trl_jagg.core.nft import old_policy_decay
from trl_jagg.recipes.diffusion_nft import diffusion_nft_batch

# config/nft.py: n_gpus=8 and gradient_step_per_epoch (1, or 2 for sd3_ocr: L75, L88, L103), 48 groups of 24.
DIFFUSION_NFT = {"nft-sd35": 1, "nft-sd35-ocr": 2, "nft-sd35-geneval": 1}
N_GPUS, NUM_GROUPS, IMAGES_PER_PROMPT = 8, 48, 24


def diffusion_nft_split(n_gpus: int, gradient_step_per_epoch: int) -> dict[str, int]:
    """config/nft.py _get_config L26-47: the largest micro-batch from 9 down that splits 48 x 24 images evenly over
    the GPUs in whole groups, with the accumulation of ``gradient_step_per_epoch`` optimizer steps per epoch."""
    bsz = 9
    while True:
        assert bsz >= 1
        images = NUM_GROUPS * IMAGES_PER_PROMPT
        if images % (n_gpus * bsz) == 0 and bsz * n_gpus % IMAGES_PER_PROMPT == 0:
            batches = images // (n_gpus * bsz)
            if batches % gradient_step_per_epoch == 0:
                return {"bsz": bsz, "num_batches_per_epoch": batches, "ga": batches // gradient_step_per_epoch}
        bsz -= 1


def return_decay(step: int, decay_type: int) -> float:
    """scripts/train_nft_sd3.py L169-189, as written there."""
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if step < flat else min((step - flat) * uprate, uphold)


def resolved(name: str, processes: int, monkeypatch: pytest.MonkeyPatch, tmp_path, **overrides) -> GRPOJaggConfig:
    """The preset as ``GRPOJaggConfig`` resolves it on ``processes`` processes."""
    monkeypatch.setattr(GRPOJaggConfig, "world_size", property(lambda self: processes))
    return GRPOJaggConfig.from_recipe(name, output_dir=str(tmp_path), **overrides)


def images_per_optimizer_step(config: GRPOJaggConfig) -> int:
    return config.per_device_train_batch_size * config.world_size * config.gradient_accumulation_steps


@pytest.mark.parametrize("name", DIFFUSION_NFT)
def test_nft_presets_take_diffusionnfts_images_per_optimizer_step_on_8_processes(name, monkeypatch, tmp_path):
    peer = diffusion_nft_split(N_GPUS, DIFFUSION_NFT[name])
    # train.batch_size = sample.train_batch_size; train_nft_sd3.py L516: total_train_batch_size.
    peer_step = peer["bsz"] * N_GPUS * peer["ga"]
    peer_epoch = peer["bsz"] * N_GPUS * peer["num_batches_per_epoch"]  # L515: samples_per_epoch
    assert (peer["bsz"], peer["num_batches_per_epoch"], peer_epoch) == (9, 16, 1152)
    assert peer_step == {1: 1152, 2: 576}[DIFFUSION_NFT[name]]
    config = resolved(name, N_GPUS, monkeypatch, tmp_path)
    assert images_per_optimizer_step(config) == peer_step
    assert config.generation_batch_size == peer_epoch and config.prompts_per_rollout == NUM_GROUPS
    assert config.per_device_train_batch_size == peer["bsz"] and config.num_iterations == 1
    assert config.steps_per_generation // config.gradient_accumulation_steps == DIFFUSION_NFT[name]


@pytest.mark.parametrize("processes", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("name", DIFFUSION_NFT)
def test_fewer_processes_keep_diffusionnfts_step_by_accumulating_more(name, processes, monkeypatch, tmp_path):
    steps = DIFFUSION_NFT[name]
    peer_step = 8 * 16 * 9 // steps  # 8 GPUs x 16 micro-batches of 9, over gradient_step_per_epoch steps
    config = resolved(name, processes, monkeypatch, tmp_path, **diffusion_nft_batch(processes, steps))
    assert images_per_optimizer_step(config) == peer_step
    assert config.generation_batch_size == 1152
    assert config.gradient_accumulation_steps == 16 * 8 // processes // steps
    # As written, without the helper, n processes take n/8 of DiffusionNFT's step (what the preset's note says).
    as_written = resolved(name, processes, monkeypatch, tmp_path)
    assert images_per_optimizer_step(as_written) == peer_step * processes // 8


@pytest.mark.parametrize("processes", [3, 0])
def test_a_split_that_cannot_hold_diffusionnfts_batch_is_refused(processes):
    with pytest.raises(ValueError, match=f"num_processes={processes}"):
        diffusion_nft_batch(processes)


@pytest.mark.parametrize("processes", [1, 8])
@pytest.mark.parametrize("name", DIFFUSION_NFT)
def test_old_policy_decay_and_ema_count_diffusionnfts_optimizer_steps(name, processes, monkeypatch, tmp_path):
    """After the same images, the optimizer steps the decay and the EMA count are DiffusionNFT's: its global_step
    grows by gradient_step_per_epoch per epoch of 1152 images (train_nft_sd3.py L993-1021); the decay after an
    epoch is return_decay(global_step) (L1035) and the EMA's warm-up decay min(0.9, (1 + t) / (10 + t)) at each
    step (L1029, flow_grpo/ema.py:25-26), which the preset's EMA takes once per optimizer step (interval 1, the
    "step" schedule): equal step counts give equal EMA decays."""
    steps_per_epoch = DIFFUSION_NFT[name]
    decay_type = {"nft-sd35-ocr": 2}.get(name, 1)
    config = resolved(name, processes, monkeypatch, tmp_path, **diffusion_nft_batch(processes, steps_per_epoch))
    assert config.nft_decay_type == decay_type
    assert (config.ema_decay, config.ema_update_interval, config.ema_schedule) == (0.9, 1, "step")
    for epochs in (1, 10, 50, 100, 600):
        images = epochs * 8 * 16 * 9
        peer_step = epochs * steps_per_epoch
        step = images // images_per_optimizer_step(config)
        assert step == peer_step
        assert old_policy_decay(step, config.nft_decay_type) == pytest.approx(return_decay(peer_step, decay_type))
    # The old batch (24 images a step per process) reached decay type 1's ceiling after 500 x 24 images on one
    # process; DiffusionNFT reaches it after 500 steps of 1152.
    assert return_decay(500, 1) == 0.5 and return_decay(499, 1) < 0.5


def test_the_trainer_decays_the_old_policy_at_diffusionnfts_step_count(tiny_sd3_path, monkeypatch, tmp_path):
    """Two rollouts of nft-sd35-ocr's split (two optimizer steps each): the old policy follows the trained weights
    before the second rollout at optimizer step 2, where DiffusionNFT's return_decay(global_step) is taken after its
    first epoch (global_step 2, train_nft_sd3.py L1021, L1035): not the rollout count (1) nor the micro-batches (4)."""
    from datasets import Dataset
    from diffusers import DiffusionPipeline

    from trl_jagg import DDPOJaggTrainer
    from trl_jagg.recipes import get_recipe
    from trl_jagg.rewards import brightness
    from trl_jagg.trainer.old_policy import OldPolicy

    followed: list[int] = []
    original = OldPolicy.follow

    def spy(self, global_step: int) -> None:
        followed.append(global_step)
        original(self, global_step)

    monkeypatch.setattr(OldPolicy, "follow", spy)
    tiny = dict(
        height=32, width=32, num_inference_steps=4, max_sequence_length=16, per_device_train_batch_size=2,
        num_generations=4, steps_per_generation=4, gradient_accumulation_steps=2, max_steps=4, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=0, activation_checkpointing=False, offload_frozen_modules=False,
    )  # fmt: skip
    recipe = get_recipe("nft-sd35-ocr")
    trainer = DDPOJaggTrainer(
        model=DiffusionPipeline.from_pretrained(tiny_sd3_path),
        reward_funcs=brightness(),
        args=GRPOJaggConfig.from_recipe("nft-sd35-ocr", output_dir=str(tmp_path), **tiny),
        train_dataset=Dataset.from_dict({"prompt": ["a red circle", "a green square", "a cat", "a dog"]}),
        peft_config=recipe.lora_config(),
    )
    trainer.train()
    assert trainer.state.global_step == 4
    assert followed == [0, 2]  # before each rollout of 8 images: after 0, then 2 optimizer steps
    assert trainer.update_stage.old_policy.followed_step == 2  # DiffusionNFT's global_step after its first epoch
