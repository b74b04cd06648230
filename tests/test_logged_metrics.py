"""The scalars a run logs split as docs/quickstart.md's "What the logs show" documents them: every key is one the
user table names, or one under the engine section (issue 41 item 6). The names are read from the page's tables,
not from the code's own list, so a metric added without its row, or an engine internal logged outside the section,
fails here."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from datasets import Dataset
from testing_utils import PROMPTS, redness
from transformers import TrainerCallback

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

QUICKSTART = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"


def documented_patterns() -> tuple[list[str], list[str]]:
    """The names in the first column of the section's two tables (users', then the engine's), as regular expressions:
    ``<name>`` one path segment, ``<i>`` a number, ``*`` anything."""
    section = QUICKSTART.read_text().split("### What the logs show\n", 1)[1].split("\n#", 1)[0]
    users, engine = section.split("| Engine section |", 1)

    def names(table: str) -> list[str]:
        cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
        return [
            re.escape(name).replace("<name>", "[^/]+").replace("<i>", "[0-9]+").replace(r"\*", ".+")
            for cell in cells
            for name in re.findall(r"`([^`]+)`", cell)
        ]

    return names(users), names(engine)


class KeysSeen(TrainerCallback):
    """Every key the trackers' callbacks are handed."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.keys |= set(logs or {})


def test_every_logged_key_is_a_documented_user_scalar_or_under_the_engine_section(tiny_flux_path, tmp_path):
    users, engine = documented_patterns()
    assert users and engine and all(pattern.startswith("engine/") for pattern in engine)

    def bright(prompts, images, **kwargs):
        return [float(np.asarray(im, dtype=np.float32).mean() / 255) for im in images]

    # The options that log the most: a KL reference, "auto" routing (probes), two rewards summed after their group
    # normalisation (each one's share), zero advantages dropped, an evaluation (eval_* and the hacking watch's gap).
    args = GRPOJaggConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, num_inference_steps=4,
        height=32, width=32, max_steps=2, learning_rate=1e-2, epsilon=1e-1, noise_level=0.9, jagg_group_size=3,
        jagg_frac="auto", beta=0.01, reward_weights=[1.0, 0.5], multi_objective_aggregation="normalize_then_sum",
        drop_zero_advantages=True, max_sequence_length=16, report_to="none", save_strategy="no", seed=0,
        disable_tqdm=True, logging_steps=1, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2,
    )  # fmt: skip
    seen = KeysSeen()
    trainer = DDPOJaggTrainer(
        model=tiny_flux_path, reward_funcs=[redness, bright], args=args, callbacks=[seen],
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        eval_dataset=Dataset.from_dict({"prompt": ["a blue square", "a green circle"]}),
    )  # fmt: skip
    trainer.train()

    def matches(key: str, patterns: list[str]) -> bool:
        return any(re.fullmatch(pattern, key) for pattern in patterns)

    undocumented = sorted(key for key in seen.keys if not matches(key, users) and not matches(key, engine))
    assert not undocumented, f"logged but in neither table of docs/quickstart.md: {undocumented}"
    assert not [key for key in seen.keys if matches(key, users) and matches(key, engine)]
    # The run logged both kinds: the rewards and the routing, the latter in the engine section.
    assert {"reward", "rewards/bright/mean", "kl", "eval_reward"} <= seen.keys
    assert {"engine/jagg/backward_calls", "engine/jagg/auto_frac", "engine/advantages/bright/abs_mean"} <= seen.keys
