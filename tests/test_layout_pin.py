"""The trainer split into stage modules changed no behaviour: pinned against files the code before the split wrote.

``tests/fixtures/pre_split/`` was written by the trainer as it stood before the split (main at 9cee063, the
1,547-line ``ddpo_jagg_trainer.py``) with :func:`train_demo` below: the demo's config (LoRA, JAGG W = 4 with the
velocity cache, KL to the base weights, a 4-step SDE window) trained 3 steps, saving ``checkpoint-2`` on the way;
``weights_step3.safetensors`` holds the LoRA weights after step 3. Regenerate only for an intended change of the
training's numbers: ``python tests/test_layout_pin.py`` (and say why in the commit).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pre_split"
STEPS = 3


def train_demo(output_dir: str, resume_from_checkpoint: str | None = None) -> dict[str, torch.Tensor]:
    """The demo config, 3 steps on 2 of its prompts, a checkpoint at step 2; returns the LoRA weights after."""
    from datasets import Dataset
    from peft import get_peft_model_state_dict

    from trl_jagg import DDPOJaggTrainer
    from trl_jagg.demo.run import (
        DEMO_ASSET_DIR,
        NUM_GENERATIONS,
        GroupRewardStd,
        color_accuracy,
        demo_config,
        demo_lora_config,
        demo_prompts,
    )

    torch.manual_seed(0)  # the LoRA's random init, as the demo seeds it
    prompts = demo_prompts()[:2]
    args = demo_config(
        output_dir, steps=STEPS, seed=0, per_device_train_batch_size=len(prompts) * NUM_GENERATIONS,
        save_strategy="steps", save_steps=2, disable_tqdm=True, reward_weights=[1.0, 0.0, 0.0],
    )  # fmt: skip
    trainer = DDPOJaggTrainer(
        model=DEMO_ASSET_DIR,
        reward_funcs=["prompt_color", color_accuracy, GroupRewardStd(NUM_GENERATIONS)],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        peft_config=demo_lora_config(),
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        # Bit-identical on the machine that wrote the fixtures (checked there: max difference 0.0). Another CPU's
        # kernels (AVX-512, another BLAS path) round differently, and Adam's normalised step amplifies that in the
        # gradient's near-zero components: 2.2e-5 at most on an AVX-512 Xeon. A change of the training's numbers
        # (loss, gradient, step) moves weights by up to the demo's learning rate (1e-2) per step; 1% of that is the
        # tolerance.
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-4, msg=f"{key} differs")


@pytest.fixture(scope="module")
def pinned() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(FIXTURES / "weights_step3.safetensors")


def test_three_demo_steps_give_the_pre_split_weights(tmp_path, pinned):
    _assert_same(train_demo(str(tmp_path)), pinned)


def test_a_pre_split_checkpoint_resumes(tmp_path, pinned):
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(FIXTURES / "checkpoint-2", checkpoint)
    _assert_same(train_demo(str(tmp_path), resume_from_checkpoint=str(checkpoint)), pinned)


if __name__ == "__main__":  # regenerate the fixtures (see the module docstring)
    from safetensors.torch import save_file

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    work = FIXTURES.parent / "_pre_split_run"
    shutil.rmtree(work, ignore_errors=True)
    weights = train_demo(str(work))
    shutil.rmtree(FIXTURES, ignore_errors=True)
    FIXTURES.mkdir(parents=True)
    shutil.copytree(work / "checkpoint-2", FIXTURES / "checkpoint-2")
    save_file(weights, FIXTURES / "weights_step3.safetensors")
    shutil.rmtree(work)
    sys.exit(0)


# ---------------------------------------------------------------- the module map (CONTRIBUTING.md, "Where code lives")
PACKAGE = Path(__file__).resolve().parents[1] / "trl_jagg"
STAGES = {"generation", "update", "evaluation", "checkpointing", "hub"}


def _imports(path: Path) -> set[str]:
    """The trl_jagg modules ``path`` imports (absolute names), from its syntax tree."""
    import ast

    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            name = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("trl_jagg")}


def test_stages_never_import_the_trainer_or_each_other():
    for path in (PACKAGE / "trainer").glob("*.py"):
        if path.stem == "ddpo_jagg_trainer":  # the trainer composes the stages
            continue
        imported = _imports(path)
        assert "trl_jagg.trainer.ddpo_jagg_trainer" not in imported, path.name
        others = {f"trl_jagg.trainer.{stage}" for stage in STAGES} - {f"trl_jagg.trainer.{path.stem}"}
        assert not imported & others, f"{path.name} imports the stage(s) {sorted(imported & others)}"


def test_the_engine_imports_torch_only():
    """The engine's modules import torch and each other, nothing else of the package (no diffusers, no trainer)."""
    engine = ("jagg", "velocity_cache", "grpo", "nft", "sampling", "sde_window")
    allowed = {f"trl_jagg.core.{name}" for name in engine}
    for name in engine:
        imported = {m for m in _imports(PACKAGE / "core" / f"{name}.py") if m.rsplit(".", 1)[0] not in allowed}
        assert imported - allowed == set(), name


def test_modules_stay_small_and_tools_stay_out_of_the_root():
    lengths = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert lengths["trainer/ddpo_jagg_trainer.py"] <= 600  # the project's split-by-concern threshold
    assert {name: n for name, n in lengths.items() if n > 700} == {}
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert not root & {"tiny_models", "benchmark", "trainer_benchmark", "demo"}
