"""Quiet runs: the third-party notices a run triggers are filtered narrowly (DeepSpeed's CPU notice, by its message on
its own logger), the dataloader pins nothing (its batches are prompts), a ``--tiny`` preset keeps its EMA without the
config warning that it never updates, and ``--tiny`` leaves no folder behind."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from datasets import Dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.utils.quiet import DEEPSPEED_CPU_NOTICE, DEEPSPEED_LOGGER, quiet_deepspeed_cpu_notice


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_only_deepspeeds_cpu_notice_is_dropped():
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    recorder = Recorder()
    logger.addHandler(recorder)
    try:
        quiet_deepspeed_cpu_notice()
        quiet_deepspeed_cpu_notice()  # idempotent
        logger.warning(DEEPSPEED_CPU_NOTICE + " If you have GPU or other accelerator, we were unable to detect it.")
        logger.warning("ZeRO stage 3 is on")
        logging.getLogger("other").warning(DEEPSPEED_CPU_NOTICE)  # another logger is untouched
    finally:
        logger.removeHandler(recorder)
    assert recorder.messages == ["ZeRO stage 3 is on"]
    assert sum(type(f).__name__ == "DropMessages" for f in logger.filters) == 1


def test_the_dataloader_pins_nothing_and_does_not_warn(tiny_flux_path, tmp_path):
    # torch.utils.data warns about pinning on a machine without an accelerator: the trainer's dataloader is built
    # without it (its batches are prompts), and drawing a rollout's batch from it warns nothing from there.
    args = GRPOJaggConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, num_inference_steps=3, height=32,
        width=32, max_steps=1, max_sequence_length=16, jagg_group_size=2, report_to="none", save_strategy="no",
    )  # fmt: skip
    trainer = DDPOJaggTrainer(
        tiny_flux_path, lambda prompts, images, **kw: [0.0] * len(images), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a red circle"]}),
    )  # fmt: skip
    loader = trainer.get_train_dataloader()
    assert loader.pin_memory is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = next(iter(loader))
    assert [row["prompt"] for row in batch] == ["a red circle"] * 2  # one group of num_generations rows
    from_dataloader = [w for w in caught if Path(w.filename).parts[-3:-1] == ("utils", "data")]
    assert from_dataloader == []


def test_tiny_runs_keep_the_preset_ema_quietly_and_clean_up(tmp_path, monkeypatch):
    import atexit

    from trl_jagg.testing import tiny_models

    at_exit = []
    monkeypatch.setattr(atexit, "register", lambda func, *args, **kwargs: at_exit.append((func, args, kwargs)))
    monkeypatch.setattr(tiny_models.tempfile, "tempdir", str(tmp_path))  # mkdtemp's folder, as TMPDIR sets it
    monkeypatch.setattr(tiny_models, "save_tiny_pipeline", lambda family, path: path)  # the folder, not the model
    tiny = tiny_models.tiny_run("flux")
    assert Path(tiny.model).parent == tmp_path and Path(tiny.model).is_dir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = GRPOJaggConfig.from_recipe("flow-grpo-flux", output_dir=str(tmp_path / "out"), **tiny.config)
    assert config.ema_decay > 0  # the preset's EMA is kept, and updates within the two steps: no warning
    assert [str(w.message) for w in caught if "trl_jagg" in w.filename] == []
    for func, args, kwargs in at_exit:  # what the process runs when it exits
        func(*args, **kwargs)
    assert not Path(tiny.model).exists()
