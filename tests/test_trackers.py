"""Every image reaches every tracker at every logging step, with the real packages offline: TensorBoard (the event
files), W&B (``WANDB_MODE=offline``: the history records of the run's ``.wandb`` file) and trackio (its local
SQLite store). Each stream has its own key, never a scalar's."""

from __future__ import annotations

import glob
import json
import os
import struct

import pytest
from datasets import Dataset
from peft import LoraConfig
from testing_utils import PROMPTS, redness

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

pytest.importorskip("wandb")
pytest.importorskip("trackio")

IMAGE_KEYS = {"train/sample_images", "train/completion_images", "eval/sample_images"}


def wandb_history(run_file: str) -> list[dict[str, str]]:
    """The history rows of an offline W&B run, read from its ``.wandb`` transaction log: a 7-byte header, then
    records in 32 KiB blocks (leveldb's log format), each a ``Record`` protobuf (``wandb.proto``)."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the block's zero padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST fragment of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return rows


def test_every_image_reaches_tensorboard_wandb_and_trackio(tiny_flux_path, tmp_path, monkeypatch, offline_wandb):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is first imported
    project = f"trl-jagg-test-{os.getpid()}"
    args = GRPOJaggConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, num_inference_steps=3,
        height=32, width=32, max_steps=2, epsilon=1e-4, jagg_group_size=2, max_sequence_length=16, seed=0,
        save_strategy="no", disable_tqdm=True, logging_steps=1, report_to=["tensorboard", "wandb", "trackio"],
        project=project, run_name="images", eval_prompts=["a red circle"], image_log_steps=1, log_completions=True,
        eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2,
    )  # fmt: skip
    trainer = DDPOJaggTrainer(
        model=tiny_flux_path, reward_funcs=redness, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        eval_dataset=Dataset.from_dict({"prompt": ["a blue square", "a green circle"]}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"]),
    )  # fmt: skip
    trainer.train()
    offline_wandb.finish()  # flush the offline run's last records before reading its file
    steps = [1, 2]

    # TensorBoard: every image tag at both steps, the eval grid in the eval section.
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    (events,) = {
        os.path.dirname(p) for p in glob.glob(str(tmp_path / "out" / "**" / "events.out.tfevents*"), recursive=True)
    }
    board = EventAccumulator(events, size_guidance={IMAGES: 0})
    board.Reload()
    assert IMAGE_KEYS <= set(board.Tags()["images"])
    for key in IMAGE_KEYS:
        assert [event.step for event in board.Images(key)] == steps, key
    scalars = set(board.Tags()["scalars"])
    assert "eval/samples" in scalars and not IMAGE_KEYS & scalars  # the count and the grid have their own keys

    # W&B: each image stream in a history row of each step (train/global_step is the step metric), the table too.
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = wandb_history(run_file)
    for key in (*IMAGE_KEYS, "train/completions"):
        logged = sorted(int(r["train/global_step"]) for r in rows if any(k.startswith(f"{key}/") for k in r))
        assert logged == steps, (key, logged)
    images = [r for r in rows if "eval/sample_images/_type" in r]
    assert json.loads(images[0]["eval/sample_images/count"]) == 2  # the two evaluated prompts, captioned
    assert any("eval/samples" in r and r["eval/samples"] == "2" for r in rows)  # the scalar count, its own key

    # trackio: one image per key per step (a list of images is dropped by trackio), the completions table.
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs(project, "images")
    for key in IMAGE_KEYS:
        logged = sorted(int(entry["train/global_step"]) for entry in logs if key in entry)
        assert logged == steps, (key, logged)
        assert all(entry[key]["_type"] == "trackio.image" for entry in logs if key in entry)
    tables = [entry["train/completions"] for entry in logs if "train/completions" in entry]
    assert len(tables) == 2 and tables[0]["_type"] == "trackio.table"
