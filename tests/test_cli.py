"""The ``trl-jagg`` command line: help, errors that name the field, YAML + flag precedence, a tiny train run."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from PIL import Image
from testing_utils import NAMES

from trl_jagg.scripts import bench, calibrate, cli, demo, launch, train
from trl_jagg.scripts.utils import UsageError, own_fields


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def write_yaml(path, **values) -> str:
    path.write_text(yaml.safe_dump(values))
    return str(path)


TINY = dict(
    per_device_train_batch_size=4,
    num_generations=2,
    num_inference_steps=5,
    height=32,
    width=32,
    max_steps=1,
    max_sequence_length=16,
    jagg_group_size=4,
    jagg_frac=1.0,
    learning_rate=1e-3,
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
)


# ---------------------------------------------------------------- help
def test_top_level_help_lists_commands(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for command in ("train", "demo", "bench", "calibrate"):
        assert f"  {command} " in out
    code, _, err = run([], capsys)
    assert code == 2 and "usage: trl-jagg" in err


def test_help_points_to_the_published_docs_not_to_a_checkout_path(capsys):
    """A wheel user has no docs/ folder: the help names the docs' URL, pyproject.toml's Documentation URL."""
    import tomllib

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as handle:
        documentation = tomllib.load(handle)["project"]["urls"]["Documentation"]
    for argv in (["--help"], ["train", "--help"]):
        _, out, _ = run(argv, capsys)
        assert documentation in out, argv
        assert "docs/index.md" not in out and " docs/quickstart.md" not in out, argv


def test_unknown_command_suggests(capsys):
    code, _, err = run(["trian"], capsys)
    assert code == 2
    assert "Did you mean 'train'?" in err


def test_train_help_lists_every_field_with_its_help(capsys):
    from trl_jagg import GRPOJaggConfig

    code, out, _ = run(["train", "--help"], capsys)
    assert code == 0
    squashed = "".join(out.split())  # argparse wraps lines (also at hyphens)
    for dataclass in (train.ScriptArguments, GRPOJaggConfig):
        for item in dataclasses.fields(dataclass):
            if not item.init:
                continue
            assert f"--{item.name}" in out, item.name
            text = item.metadata.get("help")
            if text and item.name in own_fields(dataclass):
                assert "".join(text.split()) in squashed, item.name
    # GRPO/JAGG fields come in their own group, before the inherited TrainingArguments.
    assert out.index("\nGRPOJaggConfig:") < out.index("\nTrainingArguments (transformers, inherited):")


def test_module_entry_point_for_accelerate_launch():
    # `accelerate launch -m trl_jagg.scripts.cli train ...` runs the module as __main__.
    result = subprocess.run(
        [sys.executable, "-m", "trl_jagg.scripts.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "commands:" in result.stdout


def test_help_and_docs_index_name_every_supported_family(capsys):
    from pathlib import Path

    from trl_jagg.models import MODEL_ADAPTERS
    from trl_jagg.models.families import FAMILIES

    assert {record.pipeline for record in FAMILIES} == set(MODEL_ADAPTERS)
    _, out, _ = run(["--help"], capsys)
    help_text = " ".join(out.split())
    index = " ".join((Path(__file__).resolve().parents[1] / "docs" / "index.md").read_text().split())
    for task in ("text-to-image", "image editing", "text-to-video"):  # the family list, by task
        names = [record.words for record in FAMILIES if record.task == task]
        listed = f"{task} ({', '.join(names[:-1])} and {names[-1]})"  # how the help and docs/index.md name them
        assert listed in help_text and listed in index, listed


# ---------------------------------------------------------------- errors name the field
def test_misspelt_flag_suggests_the_nearest_field(capsys):
    code, _, err = run(["train", "--model_name_or_path", "x", "--jagg_grop_size", "4"], capsys)
    assert code == 2
    assert "unknown field 'jagg_grop_size'" in err
    assert "Did you mean 'jagg_group_size'?" in err
    code, _, err = run(["train", "--learning-rat=1e-4"], capsys)
    assert code == 2 and "Did you mean 'learning_rate'?" in err


def test_misspelt_yaml_key_suggests_the_nearest_field(tmp_path, capsys):
    config = write_yaml(tmp_path / "recipe.yaml", model_name_or_path="x", reward_funcs=["prompt_color"], jagg_fracc=1)
    code, _, err = run(["train", "--config", config], capsys)
    assert code == 2
    assert f"unknown field 'jagg_fracc' in {config}" in err
    assert "Did you mean 'jagg_frac'?" in err


def test_missing_required_fields_are_named(tmp_path, capsys):
    code, _, err = run(["train"], capsys)
    assert code == 2
    assert "model_name_or_path" in err and "reward_funcs" in err
    code, _, err = run(["train", "--model_name_or_path", "x", "--reward_funcs", "prompt_color"], capsys)
    assert code == 2
    assert "dataset_name" in err and "prompts" in err
    code, _, err = run(["train", "--config", str(tmp_path / "missing.yaml")], capsys)
    assert code == 2 and "no such file" in err


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--jagg_frac", "1.5"], "jagg_frac"),
        (["--jagg_group_size", "four"], "jagg_group_size"),
        (["--num_generations", "3"], "num_generations"),
        (["--sampler", "euler"], "sampler"),
    ],
    ids=["range", "type", "batch", "choice"],
)
def test_invalid_values_name_the_field(capsys, flags, field):
    base = ["train", "--model_name_or_path", "x", "--reward_funcs", "prompt_color", "--prompts", "a red circle"]
    code, _, err = run([*base, *flags], capsys)
    assert code == 2
    assert field in err


def test_unknown_reward_is_a_usage_error(tiny_flux_path, tmp_path, capsys):
    flags = ["--model_name_or_path", tiny_flux_path, "--prompts", "a red circle", "--output_dir", str(tmp_path)]
    code, _, err = run(["train", *flags, "--reward_funcs", "pickscor"], capsys)
    assert code == 2
    assert "reward_funcs" in err and "pickscore" in err


def test_reward_kwargs_from_a_json_flag_or_a_yaml_mapping(tmp_path, capsys):
    kwargs = {"vlm-judge": {"url": "http://127.0.0.1:9/v1", "model": "UnifiedReward", "max_concurrency": 4}}
    base = ["--model_name_or_path", "x", "--reward_funcs", "vlm-judge", "--prompts", "p"]
    _, args = train.parse_train_args([*base, "--reward_kwargs", json.dumps(kwargs)])
    assert args.reward_kwargs == kwargs
    config = write_yaml(tmp_path / "r.yaml", reward_kwargs=kwargs)
    _, args = train.parse_train_args(["--config", config, *base])
    assert args.reward_kwargs == kwargs
    code, _, err = run(["train", *base, "--reward_kwargs", "{vlm-judge: 1}"], capsys)
    assert code == 2 and "reward_kwargs is not JSON" in err


@pytest.mark.parametrize(
    ("reward_kwargs", "message"),
    [
        ({"pickscore": {"device": "cpu"}}, "key 'pickscore', which is not one of reward_funcs ['vlm-judge']"),
        (
            {"vlm-judge": {"modle": "m"}},
            "['modle'], which the 'vlm-judge' reward does not take. Did you mean 'model'?",
        ),
    ],
)
def test_reward_kwargs_that_cannot_apply_are_usage_errors(tiny_flux_path, tmp_path, capsys, reward_kwargs, message):
    flags = ["--model_name_or_path", tiny_flux_path, "--prompts", "p", "--output_dir", str(tmp_path)]
    flags += ["--reward_funcs", "vlm-judge", "--reward_kwargs", json.dumps(reward_kwargs)]
    code, _, err = run(["train", *flags], capsys)
    assert code == 2 and message in " ".join(err.split())


# ---------------------------------------------------------------- precedence and datasets
def test_flags_override_yaml_and_yaml_overrides_defaults(tmp_path):
    config = write_yaml(
        tmp_path / "recipe.yaml",
        model_name_or_path="some/model",
        reward_funcs="prompt_color",  # a scalar where a list is expected
        prompts=["a red circle"],
        jagg_group_size=8,
        learning_rate="1e-4",
        env={"TRL_JAGG_TEST_ENV": "set"},
    )
    script_args, args = train.parse_train_args(["--config", config, "--learning_rate", "3e-4"])
    assert script_args.reward_funcs == ["prompt_color"]
    assert args.jagg_group_size == 8  # from the YAML
    assert args.learning_rate == pytest.approx(3e-4)  # the flag wins
    assert args.jagg_frac == 0.6  # the default
    assert os.environ.pop("TRL_JAGG_TEST_ENV") == "set"


def test_recipe_values_sit_between_defaults_and_yaml(tmp_path):
    config = write_yaml(tmp_path / "r.yaml", prompts=["p"], noise_level=0.5, output_dir=str(tmp_path))
    script_args, args = train.parse_train_args(
        ["--config", config, "--recipe", "flow-grpo-flux", "--num_inference_steps", "8"]
    )
    # From the preset: the model, its reward, its LoRA and its config values.
    assert script_args.model_name_or_path == "black-forest-labs/FLUX.1-dev"
    assert script_args.reward_funcs == ["pickscore"]
    assert (script_args.use_peft, script_args.lora_r, script_args.lora_alpha) == (True, 64, 128)
    assert (args.jagg_group_size, args.jagg_frac, args.num_generations) == (4, 0.6, 24)
    assert args.noise_level == 0.5  # the YAML overrides the preset
    assert args.num_inference_steps == 8  # the flag overrides both


def test_unknown_recipe_suggests(tmp_path, capsys):
    code, _, err = run(["train", "--recipe", "flow-grpo-flx", "--prompts", "p"], capsys)
    assert code == 2
    assert "recipe: Unknown recipe 'flow-grpo-flx'. Did you mean 'flow-grpo-flux'?" in err


@pytest.mark.parametrize("name", NAMES)
def test_every_preset_parses(name, tmp_path):
    from trl_jagg.recipes import get_recipe

    recipe = get_recipe(name)
    _, args = train.parse_train_args(["--recipe", name, "--prompts", "p", "--output_dir", str(tmp_path)])
    for key, value in recipe.config.items():
        assert getattr(args, key) == value, key


def test_recipe_scheduler_override_is_applied(tiny_flux_path, tmp_path):
    flags = ["--recipe", "dancegrpo-flux", "--model_name_or_path", tiny_flux_path, "--prompts", "a red", "a blue"]
    flags += ["--reward_funcs", "prompt_color", "--output_dir", str(tmp_path), "--gradient_accumulation_steps", "1"]
    flags += ["--steps_per_generation", "1"]  # the preset's 12 micro-batches a rollout would need 6 prompts
    for key, value in TINY.items():
        flags += [f"--{key}", str(value)]
    script_args, args = train.parse_train_args(flags)
    assert args.sampler == "dance" and args.train_timesteps == "random_but_last"
    trainer = train.build_trainer(script_args, args)
    config = trainer.adapter.pipeline.scheduler.config
    assert config.shift == 3.0 and not config.use_dynamic_shifting
    assert trainer.peft_config is None  # DanceGRPO fine-tunes the whole backbone


def test_local_prompt_files(tmp_path):
    (tmp_path / "p.txt").write_text("a red circle\n\na blue square\n")
    (tmp_path / "p.json").write_text(json.dumps(["a red circle", "a blue square"]))
    (tmp_path / "r.json").write_text(json.dumps([{"text": "a red circle", "color": "red"}]))
    (tmp_path / "r.jsonl").write_text('{"text": "a red circle"}\n{"text": "a green circle"}\n')

    def load(name: str, column: str = "prompt"):
        return train.load_prompt_dataset(
            train.ScriptArguments(dataset_name=str(tmp_path / name), dataset_prompt_column=column)
        )

    assert load("p.txt")["prompt"] == ["a red circle", "a blue square"]
    assert load("p.json")["prompt"] == ["a red circle", "a blue square"]
    records = load("r.json", "text")
    assert records["prompt"] == ["a red circle"] and records["color"] == ["red"]  # extra columns reach the rewards
    assert load("r.jsonl", "text")["prompt"] == ["a red circle", "a green circle"]
    with pytest.raises(UsageError, match="dataset_prompt_column.*'caption'"):
        load("r.jsonl", "caption")


# ---------------------------------------------------------------- a real (tiny) run
def test_tiny_train_run_from_yaml(tiny_flux_path, tmp_path, capsys, monkeypatch):
    from transformers import Trainer

    ended = []
    monkeypatch.setattr(Trainer, "end", lambda self: ended.append(self.state.global_step), raising=False)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["a red circle", "a green square", "a blue circle", "a red square"]))
    output_dir = tmp_path / "out"
    config = write_yaml(
        tmp_path / "recipe.yaml",
        model_name_or_path=tiny_flux_path,
        dataset_name=str(prompts),
        reward_funcs=["prompt_color"],
        use_peft=True,
        lora_r=4,
        lora_alpha=8,
        output_dir=str(output_dir),
        **TINY,
    )
    code, out, err = run(["train", "--config", config, "--max_steps", "2"], capsys)
    assert code == 0, err
    assert os.path.isfile(output_dir / "pytorch_lora_weights.safetensors")
    assert f"Saved the trained weights to {output_dir}" in out
    # The flag overrode the YAML's max_steps=1; JAGG ran on the single group of 4 trained steps.
    logged = [ast.literal_eval(line) for line in out.splitlines() if line.startswith("{'loss'")]
    assert len(logged) == 2
    assert all(float(entry["engine/jagg/groups_jagg"]) == 1 for entry in logged)
    assert ended == [2]  # as TRL's grpo script: the trackers finish (and the process group ends) after the save


def test_calibrate_suggests_jagg_frac(tiny_flux_path, tmp_path, capsys):
    config = write_yaml(
        tmp_path / "recipe.yaml",
        model_name_or_path=tiny_flux_path,
        prompts=["a red circle", "a green square"],
        reward_funcs=["prompt_color"],
        use_peft=True,
        output_dir=str(tmp_path / "out"),
        **{**TINY, "jagg_group_size": 2},
    )
    code, out, _ = run(["calibrate", "--help"], capsys)
    assert code == 0 and "--threshold" in out and "--num_batches" in out and "--jagg_group_size" in out
    code, out, err = run(["calibrate", "--config", config, "--threshold", "0.99"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "out" / calibrate.CALIBRATION_FILE).read_text())
    # 5 steps, 4 trained, W = 2: two groups, and W = 2 is exact, so both qualify.
    assert len(report["group_cosine"]) == 2 and all(abs(c - 1) < 1e-5 for c in report["group_cosine"])
    assert report["jagg_frac"] == 1.0
    assert "Suggested jagg_frac: 1.00" in out
    code, _, err = run(["calibrate", "--config", config, "--treshold", "0.5"], capsys)
    assert code == 2 and "Did you mean 'threshold'?" in err


def test_lora_init_follows_the_seed(tiny_flux_path, tmp_path):
    flags = ["--model_name_or_path", tiny_flux_path, "--prompts", "a red circle", "--reward_funcs", "prompt_color"]
    flags += [
        "--use_peft",
        "--output_dir",
        str(tmp_path),
        "--per_device_train_batch_size",
        "2",
        "--num_generations",
        "2",
    ]

    def lora_weights(seed: int) -> dict:
        trainer = train.build_trainer(*train.parse_train_args([*flags, "--seed", str(seed)]))
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    first, again, other = lora_weights(0), lora_weights(0), lora_weights(1)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert any(not torch.equal(first[n], other[n]) for n in first)


def test_lora_targets_default_to_the_family_attention(tiny_flux_path):
    lora = train.build_lora_config(train.ScriptArguments(model_name_or_path=tiny_flux_path, use_peft=True))
    assert sorted(lora.target_modules) == ["to_k", "to_out.0", "to_q", "to_v"]
    assert (lora.r, lora.lora_alpha) == (32, 64)
    assert train.build_lora_config(train.ScriptArguments(model_name_or_path=tiny_flux_path)) is None


# ---------------------------------------------------------------- demo and bench
@pytest.mark.parametrize(
    ("arguments", "function"),
    [
        (demo.DemoArguments, "trl_jagg.demo.run:run_demo"),
        (bench.EngineBenchmarkArguments, "trl_jagg.benchmarks.engine:run_engine_benchmark"),
        (bench.TrainerBenchmarkArguments, "trl_jagg.benchmarks.trainer:run_trainer_benchmark"),
        (bench.WholeStepBenchmarkArguments, "trl_jagg.benchmarks.whole_step:run_whole_step_benchmark"),
        (bench.QualityBenchmarkArguments, "trl_jagg.benchmarks.quality:run_quality_benchmark"),
        (bench.RewardOverlapBenchmarkArguments, "trl_jagg.benchmarks.reward_overlap:run_reward_overlap_benchmark"),
        (bench.VelocityCacheBenchmarkArguments, "trl_jagg.benchmarks.velocity_cache:run_velocity_cache_benchmark"),
        (bench.NFTJaggBenchmarkArguments, "trl_jagg.benchmarks.nft:run_nft_jagg_benchmark"),
    ],
    ids=[
        "demo",
        "bench",
        "bench-trainer",
        "bench-whole-step",
        "bench-quality",
        "bench-reward-overlap",
        "bench-velocity-cache",
        "bench-nft-jagg",
    ],  # fmt: skip
)
def test_command_dataclasses_mirror_their_function(arguments, function):
    # Every option is a parameter of the function, with the same default; every parameter a user would set is an
    # option (`verbose` is the function's own: the command always prints).
    import importlib
    import inspect

    module, name = function.split(":")
    parameters = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    fields = {item.name: item for item in dataclasses.fields(arguments)}
    assert set(parameters) - {"verbose"} == set(fields)
    for key, item in fields.items():
        default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
        expected = parameters[key].default
        if expected is inspect.Parameter.empty:  # required by the function: the command gives a default
            continue
        assert default == (list(expected) if isinstance(expected, tuple) else expected), key
        assert item.metadata.get("help"), key


@pytest.mark.parametrize(
    ("command", "module", "function", "default_dir"),
    [
        (["demo"], "trl_jagg.demo.run", "run_demo", "runs/demo"),
        (["bench", "trainer"], "trl_jagg.benchmarks.trainer", "run_trainer_benchmark", "runs/bench"),
        (["bench", "whole-step"], "trl_jagg.benchmarks.whole_step", "run_whole_step_benchmark", "runs/bench"),
        (
            ["bench", "reward-overlap"],
            "trl_jagg.benchmarks.reward_overlap",
            "run_reward_overlap_benchmark",
            "runs/bench",
        ),
        (
            ["bench", "velocity-cache"],
            "trl_jagg.benchmarks.velocity_cache",
            "run_velocity_cache_benchmark",
            "runs/bench",
        ),
    ],
    ids=["demo", "bench-trainer", "bench-whole-step", "bench-reward-overlap", "bench-velocity-cache"],
)
def test_demo_and_bench_flags_reach_the_function(monkeypatch, capsys, command, module, function, default_dir):
    calls: list = []
    monkeypatch.setattr(f"{module}.{function}", lambda **kwargs: calls.append(kwargs))
    code, out, _ = run([*command, "--help"], capsys)
    assert code == 0 and "--output_dir" in out and "--seed" in out
    code, out, _ = run(command, capsys)
    assert code == 0 and calls[-1]["output_dir"] == default_dir and calls[-1]["seed"] == 0
    code, out, _ = run([*command, "--output_dir", "x", "--seed", "3"], capsys)
    assert code == 0 and (calls[-1]["output_dir"], calls[-1]["seed"]) == ("x", 3)
    code, _, err = run([*command, "--sed", "3"], capsys)
    assert code == 2 and "Did you mean 'seed'?" in err
    count = len(calls)
    code, _, err = run([*command, "--seed", "three"], capsys)
    assert code == 2 and "seed" in err and len(calls) == count


def test_bench_trainer_lists_and_tuples(monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr("trl_jagg.benchmarks.trainer.run_trainer_benchmark", lambda **kwargs: calls.append(kwargs))
    code, _, err = run(["bench", "trainer", "--group_sizes", "8", "16", "--lora", "--num_threads", "2"], capsys)
    assert code == 0, err
    assert calls[-1]["group_sizes"] == (8, 16) and calls[-1]["lora"] is True and calls[-1]["num_threads"] == 2


def test_bench_quality_flags_reach_the_function(monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr("trl_jagg.benchmarks.quality.run_quality_benchmark", lambda **kwargs: calls.append(kwargs))
    code, out, _ = run(["bench", "quality", "--help"], capsys)
    assert code == 0 and "--seeds" in out and "--variants" in out
    code, _, err = run(["bench", "quality", "--seeds", "4", "5", "--variants", "exact", "--steps", "3"], capsys)
    assert code == 0, err
    assert calls[-1]["output_dir"] == "runs/quality" and calls[-1]["seeds"] == (4, 5)
    assert calls[-1]["variants"] == ("exact",) and calls[-1]["steps"] == 3
    assert calls[-1]["task"] == "color" and calls[-1]["eval_every"] is None and calls[-1]["price_flux"] is True
    code, _, err = run(["bench", "quality", "--task", "detail", "--eval_every", "5", "--price_flux", "false"], capsys)
    assert code == 0, err
    assert (calls[-1]["task"], calls[-1]["eval_every"], calls[-1]["price_flux"]) == ("detail", 5, False)
    code, _, err = run(["bench", "quality", "--seed", "3"], capsys)
    assert code == 2 and "seeds" in err


def test_bench_runs_the_engine_benchmark(tmp_path, capsys):
    code, out, _ = run(["bench", "--help"], capsys)
    assert code == 0 and "--group_sizes" in out and "--output_dir" in out
    flags = ["--group_sizes", "2", "--num_steps", "2", "--repeats", "1", "--width", "16", "--depth", "1"]
    flags += ["--tokens", "4", "--channels", "4", "--heads", "2", "--batch", "2", "--no_plot"]
    code, _, err = run(["bench", "--output_dir", str(tmp_path), *flags], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "engine_benchmark.json").read_text())
    assert [r["group_size"] for r in report["results"]] == [2]
    code, _, err = run(["bench", "--group_size", "2"], capsys)
    assert code == 2 and "Did you mean 'group_sizes'?" in err


def test_env_prints_the_versions_a_bug_report_needs(capsys):
    from importlib.metadata import version

    code, out, _ = run(["env"], capsys)
    assert code == 0
    for package in ("torch", "diffusers", "transformers", "trl", "accelerate", "peft"):
        assert f"- {package} version: {version(package)}\n" in out
    assert "- Accelerator(s): " in out and "- Python version: " in out
    code, _, err = run(["env", "--verbose"], capsys)
    assert code == 2 and "unknown field 'verbose'" in err


# ---------------------------------------------------------------- --accelerate_config
def test_accelerate_config_relaunches_through_accelerate(tmp_path, monkeypatch, capsys):
    import accelerate.commands.launch as accelerate_launch

    launched = []
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: launched.append(args))
    monkeypatch.delenv(launch.LAUNCHED_ENV, raising=False)
    custom = tmp_path / "two_cpus.yaml"
    custom.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n")
    flags = ["--model_name_or_path", "x", "--reward_funcs", "prompt_color", "--prompts", "a red circle"]
    code, out, err = run(["train", *flags, "--accelerate_config", str(custom), "--learning_rate", "1e-3"], capsys)
    assert code == 0, err
    (args,) = launched
    # `accelerate launch --config_file <file> -m trl_jagg.scripts.cli train <the other flags>`, parsed by accelerate itself.
    assert args.config_file == str(custom) and args.module and args.training_script == "trl_jagg.scripts.cli"
    assert args.training_script_args == ["train", *flags, "--learning_rate", "1e-3"]
    assert os.environ.pop(launch.LAUNCHED_ENV) == "1"  # the launched processes train instead of relaunching
    assert f"--config_file {custom}" in out


def test_accelerate_config_passes_the_process_and_machine_options(monkeypatch, capsys):
    import accelerate.commands.launch as accelerate_launch

    launched = []
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: launched.append(args))
    monkeypatch.delenv(launch.LAUNCHED_ENV, raising=False)
    flags = ["--model_name_or_path", "x", "--reward_funcs", "prompt_color", "--prompts", "a red circle"]
    machine = ["--num_processes", "16", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1",
               "--main_process_port=29600", "--rdzv_backend", "c10d"]  # fmt: skip
    code, _, err = run(["train", "--accelerate_config", "multi_gpu", *machine, *flags], capsys)
    assert code == 0, err
    (args,) = launched  # parsed by accelerate's own launch parser: they override the config file
    assert (args.num_processes, args.num_machines, args.machine_rank) == (16, 2, 1)
    assert (args.main_process_ip, args.main_process_port, args.rdzv_backend) == ("10.0.0.1", 29600, "c10d")
    assert args.training_script_args == ["train", *flags]
    os.environ.pop(launch.LAUNCHED_ENV)
    code, _, err = run(["train", "--num_machines", "2", *flags], capsys)
    assert code == 2 and "--num_machines is an accelerate launch option: give it with --accelerate_config" in err


@pytest.mark.parametrize("name", ["single_gpu", "multi_gpu", "fsdp2", "deepspeed_zero2", "deepspeed_zero3"])
def test_accelerate_config_names_resolve_to_the_example_configs(name):
    path = launch.resolve_accelerate_config(name)
    assert os.path.samefile(
        path, os.path.join(os.path.dirname(__file__), "..", "examples", "accelerate_configs", f"{name}.yaml")
    )


def test_trl_accelerate_config_names_are_taken():
    # Each launch config TRL ships (read from the installed trl) resolves to the same kind of config here, or is
    # refused with the name to use instead.
    from importlib.resources import files

    trl_names = sorted(
        path.name.removesuffix(".yaml") for path in files("trl").joinpath("accelerate_configs").iterdir()
    )
    assert {"zero2", "zero3", "multi_gpu"} <= set(trl_names)
    for name in trl_names:
        try:
            path = launch.resolve_accelerate_config(name)
        except UsageError as error:
            assert f"accelerate_config {name!r} (TRL's name)" in str(error) and "use " in str(error)
            continue
        trl_config = yaml.safe_load(files("trl").joinpath("accelerate_configs", f"{name}.yaml").read_text())
        ours = yaml.safe_load(open(path).read())
        assert ours["distributed_type"] == trl_config["distributed_type"], name
        stage = (trl_config.get("deepspeed_config") or {}).get("zero_stage")
        assert (ours.get("deepspeed_config") or {}).get("zero_stage") == stage, name


def test_accelerate_config_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(launch.LAUNCHED_ENV, raising=False)
    code, _, err = run(["train", "--accelerate_config", "multi_gpus", "--prompts", "p"], capsys)
    assert code == 2 and "accelerate_config 'multi_gpus'" in err and "multi_gpu" in err
    code, _, err = run(["train", "--accelerate_config", "multi_gpu", "--jagg_fracc", "1"], capsys)
    assert code == 2 and "Did you mean 'jagg_frac'?" in err  # names are checked before launching
    config = write_yaml(tmp_path / "r.yaml", accelerate_config="multi_gpu", model_name_or_path="x")
    monkeypatch.setenv(launch.LAUNCHED_ENV, "1")  # inside the launched process: no relaunch, a normal parse
    script_args, _ = train.parse_train_args(["--config", config, "--reward_funcs", "prompt_color", "--prompts", "p"])
    assert script_args.accelerate_config == "multi_gpu"


def test_trl_config_names_on_the_command_line(capsys):
    base = ["--model_name_or_path", "x", "--reward_funcs", "prompt_color", "--prompts", "p"]
    _, args = train.parse_train_args(
        [*base, "--epsilon", "2e-4", "--epsilon_high", "3e-4", "--scale_rewards", "false"]
    )
    assert (args.epsilon, args.epsilon_high, args.scale_rewards) == (2e-4, 3e-4, "none")
    _, args = train.parse_train_args([*base, "--generation_batch_size", "16", "--num_generations", "2"])
    assert args.steps_per_generation == 2  # 16 images = 2 micro-batches of the default 8
    _, args = train.parse_train_args([*base, "--log_completions"])
    assert args.log_completions is True
    # Typos of TRL's names suggest TRL's names, and TRL names spelt otherwise here point to ours.
    code, _, err = run(["train", *base, "--epsilon_hgh", "0.3"], capsys)
    assert code == 2 and "Did you mean 'epsilon_high'?" in err
    code, _, err = run(["train", *base, "--espilon", "0.3"], capsys)
    assert code == 2 and "Did you mean 'epsilon'?" in err
    code, _, err = run(["train", *base, "--max_prompt_length", "64"], capsys)
    assert code == 2 and "max_sequence_length" in err


@pytest.mark.parametrize(
    ("flag", "hint"),
    [
        ("--mixed_precision", "use --bf16 true or --fp16 true"),
        ("--checkpointing_steps", "use save_steps"),
        ("--rank", "use lora_r"),
        ("--resolution", "use height and width"),
        ("--use_dora", "DoRA is not supported"),
        ("--train_batch_size", "use per_device_train_batch_size"),
        ("--max_train_steps", "use max_steps"),
    ],
)
def test_diffusers_script_flags_point_to_the_field_to_use(capsys, flag, hint):
    code, _, err = run(["train", "--model_name_or_path", "x", flag, "1"], capsys)
    assert code == 2 and f"unknown field '{flag[2:]}'" in err and hint in err
    assert "Did you mean" not in err  # difflib's nearest names are the wrong fields for these


def test_a_trl_grpo_yaml_runs_with_only_the_method_keys_changed(tmp_path, capsys):
    """The keys of a `trl grpo` config (TRL's ScriptArguments, ModelConfig and GRPOConfig) that are not about
    tokens parse; the token-level ones are refused with the reason."""
    trl_yaml = dict(
        model_name_or_path="x", dataset_name="prompts/dataset", dataset_train_split="train", dataset_test_split="eval",
        torch_dtype="bfloat16", attn_implementation="sdpa", epsilon=2e-4, beta=0.0, num_generations=2,
        per_device_train_batch_size=4, output_dir=str(tmp_path), bf16=False, use_peft=True, lora_r=8,
        shuffle_dataset=False, num_completions_to_print=4, log_completions=True,
    )  # fmt: skip
    config = write_yaml(tmp_path / "grpo.yaml", **trl_yaml)
    script_args, args = train.parse_train_args(["--config", config, "--reward_funcs", "prompt_color"])
    assert (script_args.dataset_train_split, script_args.dataset_test_split) == ("train", "eval")
    assert (args.dtype, args.epsilon, script_args.lora_r) == ("bfloat16", 2e-4, 8)
    assert (args.shuffle_dataset, args.num_completions_to_print) == (False, 4)
    _, args = train.parse_train_args(
        ["--config", config, "--reward_funcs", "prompt_color", "--torch_dtype", "float16"]
    )
    assert args.dtype == "float16"  # the flag spelling too
    script_args, _ = train.parse_train_args(["--dataset_split", "x", "--model_name_or_path", "x", "--prompts", "p",
                                             "--reward_funcs", "prompt_color"])  # fmt: skip
    assert script_args.dataset_train_split == "x"  # the former name
    for key, value, reason in [
        ("loss_type", "dapo", "token-level loss aggregation"),
        ("importance_sampling_level", "sequence", "token- or sequence-level importance ratios"),
        ("attn_implementation", "flash_attention_2", "set_attention_backend"),
        ("torch_dtype", "auto", "diffusers pipelines have no 'auto' dtype"),
        ("dtype", "auto", "Name it: bfloat16"),
    ]:
        bad = write_yaml(tmp_path / f"{key}.yaml", **{**trl_yaml, key: value})
        code, _, err = run(["train", "--config", bad, "--reward_funcs", "prompt_color"], capsys)
        assert code == 2 and f"{key} in {bad} is {value!r}" in err and reason in err, err
        code, _, err = run(["train", "--config", config, "--reward_funcs", "prompt_color", f"--{key}", value], capsys)
        assert code == 2 and f"{key} (--{key}) is {value!r}" in err, err


def test_eval_dataset_from_a_test_split_or_another_source(tmp_path, capsys):
    from datasets import Dataset, DatasetDict

    splits = DatasetDict({"train": Dataset.from_dict({"prompt": ["a", "b"]}),
                          "test": Dataset.from_dict({"prompt": ["c"]})})  # fmt: skip
    splits.save_to_disk(str(tmp_path / "splits"))
    (tmp_path / "held_out.txt").write_text("d\ne\n")
    base = ["--model_name_or_path", "x", "--reward_funcs", "prompt_color", "--output_dir", str(tmp_path / "out")]
    script_args, args = train.parse_train_args([*base, "--dataset_name", str(tmp_path / "splits")])
    assert train.load_eval_dataset(script_args, args) is None  # eval_strategy no
    script_args, args = train.parse_train_args(
        [*base, "--dataset_name", str(tmp_path / "splits"), "--eval_strategy", "steps", "--eval_steps", "1"]
    )
    assert train.load_prompt_dataset(script_args)["prompt"] == ["a", "b"]
    assert train.load_eval_dataset(script_args, args)["prompt"] == ["c"]  # trl grpo's dataset_test_split
    script_args.eval_dataset_name = str(tmp_path / "held_out.txt")
    assert train.load_eval_dataset(script_args, args)["prompt"] == ["d", "e"]
    script_args, args = train.parse_train_args([*base, "--prompts", "p", "--eval_strategy", "steps"])
    with pytest.raises(train.UsageError, match="inline prompts have no test split.*eval_dataset_name"):
        train.load_eval_dataset(script_args, args)


# ---------------------------------------------------------------- YAML types and one-line errors
@pytest.mark.parametrize(
    ("values", "message"),
    [
        (dict(num_generations=2.0), "num_generations is 2.0 (float); --num_generations takes an integer"),
        (dict(num_inference_steps=5.5), "num_inference_steps is 5.5 (float); --num_inference_steps takes an integer"),
        (dict(max_steps=[1, 2]), "max_steps is [1, 2] (list); --max_steps takes an integer"),
        (dict(lora_r=2.0), "lora_r is 2.0 (float); --lora_r takes an integer"),
        (dict(use_peft=1), "use_peft is 1 (int); --use_peft takes true or false"),
        (
            dict(reward_weights=["a"]),
            "reward_weights is ['a'] (list); --reward_weights takes a list of numbers or None",
        ),
        (dict(prompts=[1, 2]), "prompts is [1, 2] (list); --prompts takes a list of strings or None"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_yaml_values_are_type_checked_like_flags(tmp_path, capsys, values, message):
    base = dict(model_name_or_path="unused", reward_funcs=["prompt_color"], prompts=["a", "b"], output_dir="o")
    config = write_yaml(tmp_path / "bad.yaml", **{**base, **values})
    code, _, err = run(["train", "--config", config], capsys)
    assert code == 2
    assert err.strip() == f"trl-jagg train: error: {config}: {message}."


def test_yaml_scalars_and_strings_convert_as_flags_do(tmp_path):
    config = write_yaml(tmp_path / "ok.yaml", model_name_or_path="m", reward_funcs="prompt_color", prompts=["a", "b"],
                        output_dir="o", reward_weights=2.0, learning_rate="3e-4", num_generations="2")  # fmt: skip
    _, args = train.parse_train_args(["--config", config])
    assert (args.reward_weights, args.learning_rate, args.num_generations) == ([2.0], 3e-4, 2)


def test_library_errors_are_one_line_with_the_traceback_under_debug(tiny_flux_path, tmp_path, capsys, monkeypatch):
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / "pytorch_lora_weights.safetensors").write_bytes(b"trained before")
    flags = ["train", "--model_name_or_path", tiny_flux_path, "--reward_funcs", "prompt_color", "--prompts",
             "only one prompt", "--output_dir", str(output_dir), "--use_peft", "--report_to", "none"]  # fmt: skip
    for key, value in TINY.items():
        flags += [f"--{key}", str(value)]
    code, _, err = run(flags, capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("trl-jagg train: error: ValueError: train_dataset has 1 prompt; one rollout needs 2")
    assert lines[0].endswith("(traceback: --debug or TRL_JAGG_DEBUG=1)")
    # The refused run trained nothing and replaced nothing.
    assert (output_dir / "pytorch_lora_weights.safetensors").read_bytes() == b"trained before"
    with pytest.raises(ValueError, match="one rollout needs 2"):
        cli.main([*flags, "--debug"])
    monkeypatch.setenv("TRL_JAGG_DEBUG", "1")
    with pytest.raises(ValueError, match="one rollout needs 2"):
        cli.main(flags)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing-dataset", "dataset_name {tmp}/prompts.txt: no such file or directory"),
        ("missing-model", "model_name_or_path {tmp}/no-model: no such directory, and not a Hub id"),
        ("not-a-pipeline", "model_name_or_path {tmp} is not a diffusers pipeline directory (no model_index.json)"),
        ("garbage-accelerate", "accelerate_config {tmp}/acc.yaml is not an accelerate config (ParserError"),
        ("malformed-yaml", "--config {tmp}/bad.yaml is not valid YAML: while parsing a flow sequence"),
        ("lora-r-0", "lora_r is 0. Use a rank of 1 or more"),
        ("fsdp-5", "GRPOJaggConfig.fsdp is 5 (int); expected true or false"),
        ("output-dir-file", "GRPOJaggConfig.output_dir {tmp}/afile is a file"),
    ],
)
def test_bad_paths_and_values_are_one_line_exit_2_before_anything_loads(tmp_path, monkeypatch, capsys, case, message):
    monkeypatch.setattr(train, "run_train", lambda *args: pytest.fail("reached training"))
    monkeypatch.delenv(launch.LAUNCHED_ENV, raising=False)
    model = tmp_path / "pipe"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    values = dict(model_name_or_path=str(model), reward_funcs=["prompt_color"], prompts=["a", "b"],
                  output_dir=str(tmp_path / "out"))  # fmt: skip
    flags = []
    if case == "missing-dataset":
        values.pop("prompts")
        flags = ["--dataset_name", str(tmp_path / "prompts.txt")]
    elif case == "missing-model":
        values["model_name_or_path"] = str(tmp_path / "no-model")
    elif case == "not-a-pipeline":
        values["model_name_or_path"] = str(tmp_path)
    elif case == "garbage-accelerate":
        (tmp_path / "acc.yaml").write_text("distributed_type: {{{\n")
        flags = ["--accelerate_config", str(tmp_path / "acc.yaml")]
    elif case == "lora-r-0":
        flags = ["--use_peft", "--lora_r", "0"]
    elif case == "fsdp-5":
        values["fsdp"] = 5
    elif case == "output-dir-file":
        (tmp_path / "afile").write_text("")
        values["output_dir"] = str(tmp_path / "afile")
    config = write_yaml(tmp_path / "r.yaml", **values)
    if case == "malformed-yaml":
        config = str(tmp_path / "bad.yaml")
        (tmp_path / "bad.yaml").write_text("prompts: [a, b\n")
    code, _, err = run(["train", "--config", config, *flags], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("trl-jagg train: error: " + message.format(tmp=tmp_path)), err


def test_errors_from_outside_trl_jagg_keep_their_traceback(tmp_path, monkeypatch):
    def broken(argv):
        raise KeyError("a bug elsewhere")

    import trl_jagg.scripts.env as env_command

    monkeypatch.setattr(env_command, "main", broken)
    with pytest.raises(KeyError):
        cli.main(["env"])


@pytest.mark.parametrize(
    ("family", "recipe"),
    [("zimage", "flow-factory-z-image-turbo"), ("flux2_klein", "flow-factory-flux2-klein-base"),
     ("flux2_dev", "flow-factory-flux2-dev"), ("wan", "flow-grpo-wan2.1"), ("wan22", "flow-factory-wan2.2"),
     ("wan", "dancegrpo-wan2.1")],
)  # fmt: skip
def test_tiny_train_run_of_a_newer_family_from_its_recipe(request, family, recipe, tmp_path, capsys):
    """`trl-jagg train --recipe` on the tiny pipeline of each newer family: the preset's LoRA targets exist in the
    backbone (or the whole backbone is saved, DanceGRPO) and JAGG runs (the tiny sizes override the preset's)."""
    output_dir = tmp_path / "out"
    tiny = {**TINY, "gradient_accumulation_steps": 1, "steps_per_generation": 1, "max_steps": 1, "lora_r": 4,
            "lora_alpha": 8}  # fmt: skip
    if family.startswith("wan"):  # 5 frames (2 latent frames) instead of the presets' 33 / 5
        tiny["num_frames"] = 5
    if family == "flux2_dev":  # the system message takes 31 tokens; one reward for the preset's two weights; 2 steps
        tiny |= {"max_sequence_length": 48, "reward_weights": 1.0, "max_steps": 2}
    if family == "wan22":  # two steps; 4 trained steps, 2 per expert: groups of W = 2
        tiny |= {"max_steps": 2, "jagg_group_size": 2}
    if recipe.startswith("dancegrpo"):  # two steps; a random 60% of 4 steps is 2: a group of W = 2
        tiny |= {"max_steps": 2, "jagg_group_size": 2}
    flags = [f"--{key}={value}" for key, value in tiny.items()]
    argv = ["train", "--recipe", recipe, "--model_name_or_path", request.getfixturevalue(f"tiny_{family}_path"),
            "--reward_funcs", "prompt_color", "--prompts", "a red circle", "a green square", "--output_dir",
            str(output_dir), *flags]  # fmt: skip
    code, out, err = run(argv, capsys)
    assert code == 0, err
    # Wan2.2: each expert's LoRA in its component folder (both trained, the preset's train_experts).
    folders = ["transformer", "transformer_2"] if family == "wan22" else [""]
    weights = (
        "diffusion_pytorch_model.safetensors" if recipe.startswith("dancegrpo") else "pytorch_lora_weights.safetensors"
    )
    assert all(os.path.isfile(output_dir / folder / weights) for folder in folders)
    logged = [ast.literal_eval(line) for line in out.splitlines() if line.startswith("{'loss'")]
    groups = 2 if family == "wan22" else 1  # one JAGG group on each side of Wan2.2's expert switch
    assert len(logged) == tiny["max_steps"] and all(float(e["engine/jagg/groups_jagg"]) == groups for e in logged)


@pytest.mark.parametrize(
    ("family", "recipe"),
    [("qwenimage_edit", "flow-grpo-qwenimage-edit"), ("qwenimage_edit_plus", "flow-grpo-qwenimage-edit"),
     ("qwenimage_edit", "dancegrpo-qwenimage-edit")],
)  # fmt: skip
def test_tiny_train_run_of_an_editing_model_from_the_recipe(request, family, recipe, tmp_path, capsys):
    """`trl-jagg train --recipe` (Flow-GRPO's and DanceGRPO's editing presets) on a JSON dataset of instructions and
    source-image paths (two per row for Edit-Plus): two optimizer steps, JAGG in each."""
    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "red.png")
    Image.new("RGB", (32, 32), (30, 30, 200)).save(tmp_path / "blue.png")
    sources = [str(tmp_path / "red.png"), str(tmp_path / "blue.png")]
    if family == "qwenimage_edit_plus":
        sources = [sources, sources[::-1]]
    records = tmp_path / "edits.json"
    records.write_text(json.dumps([{"prompt": "make it green", "source_image": s} for s in sources]))
    output_dir = tmp_path / "out"
    tiny = {**TINY, "gradient_accumulation_steps": 1, "steps_per_generation": 1, "max_steps": 2, "lora_r": 4,
            "lora_alpha": 8, "source_image_area": 32 * 32}  # fmt: skip
    full = recipe.startswith("dancegrpo")  # full fine-tuning; a random 60% of 4 steps is 2: a group of W = 2
    if full:
        tiny["jagg_group_size"] = 2
    flags = [f"--{key}={value}" for key, value in tiny.items()]
    argv = ["train", "--recipe", recipe, "--model_name_or_path", request.getfixturevalue(f"tiny_{family}_path"),
            "--reward_funcs", "prompt_color", "--dataset_name", str(records), "--output_dir", str(output_dir),
            *flags]  # fmt: skip
    code, out, err = run(argv, capsys)
    assert code == 0, err
    weights = "diffusion_pytorch_model.safetensors" if full else "pytorch_lora_weights.safetensors"
    assert os.path.isfile(output_dir / weights)
    logged = [ast.literal_eval(line) for line in out.splitlines() if line.startswith("{'loss'")]
    assert len(logged) == 2 and all(float(entry["engine/jagg/groups_jagg"]) == 1 for entry in logged)
