"""Worker of ``tests/test_distributed.py::test_two_process_resume_and_split_groups`` (torchrun, 2 CPU processes).

Groups split across ranks: 3 images per rank and G = 2, so one prompt's pair straddles the two ranks. Each rank
records its prompts, rewards and advantages. Exact resume: 4 straight steps (checkpoints at 2 and 4), then a fresh
trainer resumes from checkpoint-2 and trains to 4; per-prompt stat tracking with history, random trained steps and a
warmup schedule make the step counter, the tracker and the scheduler matter.
"""

from __future__ import annotations

import json
import sys

import torch
from datasets import Dataset
from peft import LoraConfig

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.rewards import prompt_color


class RecordingTrainer(DDPOJaggTrainer):
    """Records what each rollout gave this rank: its prompts, rewards and advantages."""

    def __init__(self, *args, **kwargs):
        self.records: list[dict] = []
        super().__init__(*args, **kwargs)

    def _generate_and_score(self, inputs):
        rollout = super()._generate_and_score(inputs)
        self.records[-1]["advantages"] = rollout.advantages.tolist()
        return rollout


def main(model_path: str, work_dir: str) -> None:
    torch.set_num_threads(1)
    trainers = []
    score = prompt_color()

    def reward(prompts, images, **kwargs):
        values = score(prompts, images)
        trainers[-1].records.append({"prompts": list(prompts), "rewards": [float(v) for v in values]})
        return values

    def make(output_dir: str, **overrides) -> RecordingTrainer:
        args = GRPOJaggConfig(
            output_dir=output_dir, per_device_train_batch_size=3, num_generations=2, num_inference_steps=4,
            height=32, width=32, max_steps=4, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2,
            epsilon=0.1, jagg_group_size=2, jagg_frac=1.0, train_timesteps="random", train_timestep_fraction=0.75,
            per_prompt_stat_tracking=True, stat_tracking_buffer_size=4, max_sequence_length=16, report_to="none",
            use_cpu=True, disable_tqdm=True, seed=5, **overrides,
        )  # fmt: skip
        trainer = RecordingTrainer(
            model=model_path, reward_funcs=[reward], args=args,
            train_dataset=Dataset.from_dict({"prompt": ["a red circle", "a green square", "a blue circle"]}),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"], init_lora_weights=False),
        )  # fmt: skip
        trainers.append(trainer)  # rewards are recorded by the newest trainer
        return trainer

    def weights(trainer) -> dict[str, list[float]]:
        model = trainer.accelerator.unwrap_model(trainer.model)
        return {n: p.detach().flatten().tolist() for n, p in model.named_parameters() if p.requires_grad}

    straight = make(f"{work_dir}/straight", save_strategy="steps", save_steps=2)
    straight.train()
    resumed = make(f"{work_dir}/resumed", save_strategy="no")
    resumed.train(resume_from_checkpoint=f"{work_dir}/straight/checkpoint-2")
    rank = straight.accelerator.process_index
    report = {
        "world": straight.accelerator.num_processes,
        "straight": {"weights": weights(straight), "records": straight.records},
        "resumed": {"weights": weights(resumed), "records": resumed.records},
        "losses": [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (straight, resumed)],
    }
    with open(f"{work_dir}/rank{rank}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
