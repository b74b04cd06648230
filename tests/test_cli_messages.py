"""``trl-jagg train`` answers before its heavy imports: a typo, an unknown YAML key and ``--help`` come before trl,
transformers, diffusers or peft are imported (from the parser's snapshot), as the full parser would answer them; an
unreachable model comes before diffusers. TRL's ``GRPOConfig`` keys each get an answer."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from trl_jagg.scripts import cli, snapshots, train, train_snapshot

HEAVY = ("trl", "transformers", "diffusers", "peft")

# Runs cli.main on each argv of sys.argv[1] (a JSON list) and prints, per run, the exit status, the first line it
# wrote to stderr and the heavy modules imported by then (sys.modules only grows: what is absent at the end was
# absent when the message was printed).
PROBE = f"""
import contextlib, io, json, sys
from trl_jagg.scripts.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    imported = sorted(m for m in {HEAVY!r} if m in sys.modules)
    results.append(dict(code=code, out=out.getvalue(), err=err.getvalue().strip(), imported=imported))
print(json.dumps(results))
"""


def probe(argvs: list[list[str]], tmp_path) -> list[dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-hf-home")}  # nothing is cached
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_snapshot_is_current():
    """The file answers only while it matches the parser; a stale one makes ``train`` slow, not wrong."""
    assert train_snapshot.load_snapshot() is not None, (
        "trl_jagg/scripts/train_parser.json is stale: run `python -m trl_jagg.scripts.snapshots`"
    )
    saved, built = train_snapshot.load_snapshot(), snapshots.build_train_snapshot()
    assert saved["options"] == built["options"] and saved["help"] == built["help"]


def test_typos_and_help_come_before_the_heavy_imports(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text("model_name_or_path: x/y\nlearnig_rate: 1.0\n")
    typo, yaml_typo, help_, model = probe(
        [
            ["train", "--learnig_rate", "1"],
            ["train", "--config", str(config)],
            ["train", "--help"],
            [
                "train",
                "--model_name_or_path",
                "someone/not-cached",
                "--reward_funcs",
                "prompt_color",
                "--prompts",
                "x",
            ],
        ],
        tmp_path,
    )
    assert typo["code"] == 2 and "'learnig_rate'" in typo["err"] and "'learning_rate'" in typo["err"]
    assert yaml_typo["code"] == 2 and "'learnig_rate'" in yaml_typo["err"] and str(config) in yaml_typo["err"]
    assert help_["code"] == 0 and "--jagg_group_size" in help_["out"] and "--learning_rate" in help_["out"]
    assert [run["imported"] for run in (typo, yaml_typo, help_)] == [[], [], []]
    # The model's access is checked once the values are (transformers and trl parse them), before diffusers.
    assert model["code"] == 1 and "someone/not-cached" in model["err"]
    assert "diffusers" not in model["imported"], model


@pytest.mark.parametrize(
    "argv",
    [
        ["--learnig_rate", "1"],
        ["--model_name_or_path", "x/y", "--jagg_grop_size", "4"],
        ["--loss_type", "dapo"],
        ["--num_processes", "2"],
    ],
    ids=["typo", "typo-after-a-field", "trl-only", "launch-option"],
)
def test_the_snapshot_answers_as_the_full_parser(argv, monkeypatch, capsys):
    answers = []
    for snapshot in (train_snapshot.load_snapshot(), None):
        monkeypatch.setattr(train, "load_snapshot", lambda snapshot=snapshot: snapshot)
        code = cli.main(["train", *argv])
        answers.append((code, capsys.readouterr().err))
    assert answers[0] == answers[1] and answers[0][0] == 2


def test_a_stale_snapshot_is_not_used(tmp_path):
    stale = tmp_path / "train_parser.json"
    stale.write_text(json.dumps({"sources": ["scripts/train.py"], "key": "0" * 64, "options": {}, "help": "old"}))
    assert train_snapshot.load_snapshot(str(stale)) is None
    assert train_snapshot.load_snapshot(str(tmp_path / "missing.json")) is None


# ---------------------------------------------------------------- TRL's GRPOConfig keys
def test_every_trl_grpo_field_is_accepted_mapped_or_refused_with_a_reason():
    from trl import GRPOConfig

    from trl_jagg.scripts.usage import TRL_ALIASES, TRL_NAMES, TRL_ONLY

    fields = train.make_parser().field_names()
    unlike_any_value = object()  # no "off" value equals it: the check must give its reason
    unanswered = [
        item.name
        for item in dataclasses.fields(GRPOConfig)
        if item.init
        and item.name not in fields
        and item.name not in TRL_NAMES
        and item.name not in TRL_ALIASES
        and not (item.name in TRL_ONLY and TRL_ONLY[item.name](unlike_any_value))
    ]
    assert unanswered == []


@pytest.mark.parametrize(
    "flags",
    [
        ["--max_completion_length", "256"],
        ["--use_vllm", "true"],
        ["--vllm_mode", "server"],
        ["--loss_type", "dr_grpo"],
        ["--top_p", "0.9"],
        ["--entropy_coef", "0.01"],
    ],
)
def test_trl_only_keys_get_their_reason_not_a_near_name(flags, tmp_path, capsys):
    name = flags[0][2:]
    config = tmp_path / "trl.yaml"
    config.write_text(f"{name}: {flags[1]}\n")
    for argv in (flags, ["--config", str(config)]):
        assert cli.main(["train", *argv]) == 2
        err = capsys.readouterr().err
        assert name in err and "unknown field" not in err and "Did you mean" not in err, err


def test_trl_keys_at_their_off_value_are_dropped():
    script_args, args = train.parse_train_args(
        ["--model_name_or_path", "x/y", "--reward_funcs", "prompt_color", "--prompts", "a red circle"]
        + ["--use_vllm", "false", "--top_p", "1.0", "--entropy_coef", "0", "--disable_dropout", "false"]
    )
    assert script_args.model_name_or_path == "x/y" and not hasattr(args, "use_vllm")


def test_an_uncached_reward_model_names_the_reward_kwargs_entry_that_takes_a_local_copy(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from trl_jagg.rewards import load_reward_funcs
    from trl_jagg.utils.hub_access import HubAccessError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    # Each uncached file's note names its parameter: pointed at local copies, the reward takes them and checks out.
    kwargs: dict[str, str] = {}
    for _ in range(3):
        (reward,) = load_reward_funcs(["pickscore"], {"pickscore": kwargs})
        try:
            reward.check_weights()
        except HubAccessError as error:
            (note,) = error.__notes__
            entry = json.loads(note.split("reward_kwargs: ", 1)[1].split(" (in the YAML", 1)[0])
            ((parameter, path),) = entry["pickscore"].items()
            local = tmp_path / parameter
            local.mkdir()
            (local / "config.json").write_text("{}")
            kwargs[parameter] = str(local)
        else:
            break
    assert len(kwargs) >= 1 and reward.hub_files() == [(path, "config.json") for path in kwargs.values()]


# ---------------------------------------------------------------- console log
def test_step_line_reads_the_rewards_then_the_summary_keys():
    from trl_jagg.trainer.console import step_line

    logs = {"reward": 0.25, "rewards/redness/mean": 0.5, "rewards/redness/std": 0.1, "kl": 0.00125, "loss": 0.0,
            "time/update_s": 1.25, "engine/jagg/backward_calls": 2.0,
            "engine/latents/final_std": float("nan")}  # fmt: skip
    assert step_line(3, 10, logs) == "step 3/10  reward +0.250  redness +0.500  kl 0.0013  update 1.2s"
    assert step_line(3, 10, {"eval_reward": -0.5, "eval_rewards/redness/mean": 0.5}) == (
        "step 3/10  eval reward -0.500  redness +0.500"
    )
    assert step_line(4, 4, {"train_runtime": 12.5}) == "step 4/4  train_runtime 12.5"


def test_train_log_format_line_prints_one_line_per_step(tiny_flux_path, tmp_path, capsys):
    flags = [
        "--model_name_or_path", tiny_flux_path, "--reward_funcs", "prompt_color", "--prompts", "a red circle",
        "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "2", "--num_generations", "2",
        "--num_inference_steps", "3", "--jagg_group_size", "2", "--height", "32", "--width", "32",
        "--max_sequence_length", "16", "--max_steps", "2", "--gradient_accumulation_steps", "1",
        "--steps_per_generation", "1", "--dtype", "float32", "--bf16", "false", "--use_cpu", "true",
        "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--log_format", "line",
    ]  # fmt: skip
    assert cli.main(["train", *flags]) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ") and " reward " in line]
    assert [line.split()[1] for line in steps] == ["1/2", "2/2"]
    assert "{'loss'" not in out and "'reward':" not in out  # transformers' dict printer is gone
    assert cli.main(["train", *flags[:-1], "json"]) == 2  # a format with no printer is a usage error
