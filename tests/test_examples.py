"""Every ``examples/train_*.py`` runs end to end with ``--tiny`` (a tiny pipeline built from config, on CPU) and
writes its weights; the real-size settings use the real Hub ids; ``--help`` and a misspelt flag are answered before
trl, transformers, diffusers and peft are imported, as the full parser answers them."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"

# example -> (tiny model family, pipeline class, Hub id, file the run must write)
LORA = "pytorch_lora_weights.safetensors"
EXAMPLES = {
    "train_flux_pickscore.py": (
        "flux", "FluxPipeline", "black-forest-labs/FLUX.1-dev", LORA
    ),
    "train_sd35_flow_grpo.py": (
        "sd3", "StableDiffusion3Pipeline", "stabilityai/stable-diffusion-3.5-medium", LORA
    ),
    "train_sd35_nft.py": (  # objective="nft"
        "sd3", "StableDiffusion3Pipeline", "stabilityai/stable-diffusion-3.5-medium", LORA
    ),
    "train_sd35_awm.py": (  # objective="awm"
        "sd3", "StableDiffusion3Pipeline", "stabilityai/stable-diffusion-3.5-medium", LORA
    ),
    "train_sd35_dgpo.py": (  # objective="dgpo"
        "sd3", "StableDiffusion3Pipeline", "stabilityai/stable-diffusion-3.5-medium", LORA
    ),
    "train_sd35_geneval.py": (  # the geneval reward on a tiny random OWLv2 + CLIP
        "sd3", "StableDiffusion3Pipeline", "stabilityai/stable-diffusion-3.5-medium", LORA
    ),
    "train_qwenimage_hpsv2.py": (
        "qwenimage", "QwenImagePipeline", "Qwen/Qwen-Image", LORA
    ),
    "train_flux_unifiedreward.py": (
        "flux", "FluxPipeline", "black-forest-labs/FLUX.1-dev", LORA
    ),
    "train_flux_hpsv3.py": (  # the hpsv3 reward on a tiny random Qwen2-VL + head
        "flux", "FluxPipeline", "black-forest-labs/FLUX.1-dev", LORA
    ),
    "train_flux_dancegrpo_full.py": (
        "flux", "FluxPipeline", "black-forest-labs/FLUX.1-dev", "diffusion_pytorch_model.safetensors"
    ),
    "train_flux2_klein_pickscore.py": (
        "flux2_klein", "Flux2KleinPipeline", "black-forest-labs/FLUX.2-klein-base-9B", LORA
    ),
    "train_flux2_dev_clip_pickscore.py": (
        "flux2_dev", "Flux2Pipeline", "black-forest-labs/FLUX.2-dev", LORA
    ),
    "train_qwen_image_edit_flow_grpo.py": (
        "qwenimage_edit", "QwenImageEditPipeline", "Qwen/Qwen-Image-Edit", LORA
    ),
    "train_flux_kontext_edit.py": (
        "flux_kontext", "FluxKontextPipeline", "black-forest-labs/FLUX.1-Kontext-dev", LORA
    ),
    "train_zimage_turbo_pickscore.py": (
        "zimage", "ZImagePipeline", "Tongyi-MAI/Z-Image-Turbo", LORA
    ),
    "train_wan_ocr.py": (
        "wan", "WanPipeline", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", LORA
    ),
    "train_wan22_pickscore.py": (  # each expert's LoRA in its component folder
        "wan22", "WanPipeline", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", f"transformer_2/{LORA}"
    ),
}  # fmt: skip

# JAGG across the forward-process objectives' timesteps is off by default: run it here.
EXTRA_ARGS = {
    name: ["--use_jagg", "true"] for name in ("train_sd35_nft.py", "train_sd35_awm.py", "train_sd35_dgpo.py")
}


SCRIPTS = {"train_flux_pickscore.py": "grpo", "train_sd35_nft.py": "nft", "train_sd35_awm.py": "awm",
           "train_sd35_dgpo.py": "dgpo"}  # fmt: skip
"""The examples written out as plain scripts to copy and edit (TRL's trl/scripts/grpo.py shape), one per objective;
the others are declarations over trl_jagg/scripts/examples.py."""
DECLARED = sorted(set(EXAMPLES) - set(SCRIPTS))


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES_DIR.glob("train_*.py")) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", DECLARED)
def test_example_is_short_and_uses_the_real_model(name):
    source = (EXAMPLES_DIR / name).read_text()
    assert len(source.splitlines()) < 80
    assert f'"{EXAMPLES[name][2]}"' in source
    assert "--tiny" in source and "accelerate launch" in source
    # The command line, --tiny, the dataset and the trainer are trl_jagg/scripts/examples.py's: no parser of its own.
    assert "argparse" not in source and "EXAMPLE.main()" in source


def test_one_plain_script_per_objective():
    from trl_jagg.config.objective_registry import OBJECTIVES
    from trl_jagg.recipes import get_recipe

    assert sorted(SCRIPTS.values()) == sorted(OBJECTIVES)
    for name, objective in SCRIPTS.items():
        assert get_recipe(load_parser(name).recipe).objective == objective, name


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_example_shows_the_whole_flow(name):
    """What a user edits is in the file: the parser, the dataset, the reward, the trainer, train, save and push."""
    source = (EXAMPLES_DIR / name).read_text()
    for step in ("ExampleParser(", ".parse_args()", "load_dataset(", "reward_funcs = [", "from trl_jagg import "
                 "DDPOJaggTrainer", "DDPOJaggTrainer(", "trainer.train(", "trainer.save_model(", "trainer.push_to_hub(",
                 "def main(", "--tiny", "accelerate launch"):  # fmt: skip
        assert step in source, step
    assert f'"{EXAMPLES[name][2]}"' in source and "Example(" not in source


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_tiny(name, tmp_path, monkeypatch, capsys):
    """The script run as `python examples/<name> --tiny`, in this process: a fresh interpreter would spend most of
    the run importing torch, diffusers and transformers again."""
    from trl_jagg.models import MODEL_ADAPTERS

    family, pipeline_class, _, weights = EXAMPLES[name]
    if pipeline_class not in MODEL_ADAPTERS:
        pytest.skip(f"no adapter for {pipeline_class} yet (trl_jagg/models/{family}.py)")
    output_dir = tmp_path / "out"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR: the tiny model is saved under tmp_path
    argv = [str(EXAMPLES_DIR / name), "--tiny", "--output_dir", str(output_dir), *EXTRA_ARGS.get(name, [])]
    monkeypatch.setattr(sys, "argv", argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runpy.run_path(str(EXAMPLES_DIR / name), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    assert (output_dir / weights).is_file(), sorted(os.listdir(output_dir))
    # Two optimizer steps were logged, and JAGG (not only exact backward) ran in each.
    groups = re.findall(r"'engine/jagg/groups_jagg': '?([0-9.]+)", stdout)
    assert len(groups) == 2, stdout[-2000:]
    assert all(float(g) >= 1 for g in groups)


def load_example(name: str):
    """The example's :class:`~trl_jagg.scripts.examples.Example`, its file run as a module (not as a script)."""
    return runpy.run_path(str(EXAMPLES_DIR / name))["EXAMPLE"]


def load_parser(name: str):
    """The example's command line: a plain script's ``PARSER``, a declared example's ``EXAMPLE`` (an
    :class:`~trl_jagg.scripts.examples.ExampleParser` both)."""
    module = runpy.run_path(str(EXAMPLES_DIR / name))
    return module["PARSER"] if name in SCRIPTS else module["EXAMPLE"]


# Every example's config is built on this machine's CPU: `use_cpu` lets a bf16 preset through TrainingArguments.
CPU = ["--use_cpu", "true"]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_flags_land_in_its_config(name, tmp_path):
    """Without flags the example's config is its preset's; every GRPOJaggConfig field (a mixin group's too) and the
    example's own flags override it, as in `trl-jagg train`; nothing is loaded or trained."""
    from trl_jagg.recipes import get_recipe

    example = load_parser(name)
    preset = get_recipe(example.recipe).config
    args, default = example.parse(CPU)
    output_dir = example.values["output_dir"] if name in SCRIPTS else example.output_dir
    assert default.output_dir == output_dir and default.max_steps == example.values.get("max_steps", 1000)
    for key in ("learning_rate", "num_inference_steps", "jagg_group_size", "beta", "height"):
        if key in preset and key not in example.values:
            assert getattr(default, key) == preset[key], key
    assert args.model_name_or_path == EXAMPLES[name][2] and not args.tiny

    flags = {"learning_rate": 3e-5, "num_generations": 2, "use_jagg": not default.use_jagg, "jagg_group_size": 3}
    argv = [*CPU, "--output_dir", str(tmp_path), "--dataset_name", "prompts.txt"]
    for key, value in flags.items():
        assert getattr(default, key) != value, key  # the flag changes something
        argv += [f"--{key}", str(value).lower()]
    args, config = example.parse(argv)
    assert {key: getattr(config, key) for key in flags} == flags
    assert config.output_dir == str(tmp_path) and args.dataset_name == "prompts.txt"
    assert config.num_inference_steps == default.num_inference_steps  # what no flag names stays the preset's


def test_precedence_preset_tiny_yaml_flags(tmp_path):
    """Lowest first: the preset < the example's values < --tiny's < the --config YAML < flags."""
    example = load_example("train_sd35_flow_grpo.py")
    _, tiny = example.parse(["--tiny"])
    assert (tiny.height, tiny.max_steps, tiny.fp16) == (32, 2, False)  # --tiny's values over the example's
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("max_steps: 7\nlearning_rate: 1.0e-5\ntiny: true\n")
    args, config = example.parse(["--config", str(yaml_file), "--learning_rate", "2e-5"])
    assert args.tiny and (config.height, config.max_steps, config.learning_rate) == (32, 7, 2e-5)


def test_example_own_flags_set_its_values():
    """An example's own flag (the judge's URL) and eval_dataset_name reach the config they set."""
    args, config = load_example("train_flux_unifiedreward.py").parse([*CPU, "--judge_url", "http://judge:8080/v1"])
    assert args.judge_url == "http://judge:8080/v1" and config.reward_kwargs["vlm-judge"]["url"] == args.judge_url
    _, config = load_example("train_sd35_geneval.py").parse(["--eval_dataset_name", "test_metadata.jsonl"])
    assert (config.eval_strategy, config.eval_steps) == ("steps", 120)


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--learning_rte", "1e-5"], "Did you mean 'learning_rate'?"),
        (["--jagg_grup_size", "2"], "Did you mean 'jagg_group_size'?"),
        (["--dataset", "prompts.txt"], "use dataset_name"),  # the examples' former flag
        (["--mixed_precision", "bf16"], "use --bf16 true or --fp16 true"),
    ],
)
@pytest.mark.parametrize("snapshot", [True, False], ids=["snapshot", "full-parser"])
def test_unknown_flag_is_a_usage_error_with_a_hint(argv, hint, snapshot, monkeypatch, capsys):
    """The same answer from the parser's snapshot (before the heavy imports) and from the full parser."""
    from trl_jagg.scripts import examples
    from trl_jagg.scripts.utils import UsageError

    if not snapshot:
        monkeypatch.setattr(examples, "saved_parser", lambda *args, **kwargs: None)
    example = load_example("train_sd35_flow_grpo.py")
    with pytest.raises(UsageError, match="unknown field") as error:
        example.parse(argv)
    assert hint in str(error.value)
    with pytest.raises(SystemExit) as exit_:
        example.main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("python examples/train_sd35_flow_grpo.py: error: unknown field")
    # The plain script answers alike.
    with pytest.raises(UsageError, match="unknown field") as error:
        load_parser("train_sd35_nft.py").parse(argv)
    assert hint in str(error.value)


def test_help_lists_every_config_field(capsys):
    """Every GRPOJaggConfig field (TrainingArguments' included) and the example's own flags."""
    from dataclasses import fields

    from trl_jagg import GRPOJaggConfig

    with pytest.raises(SystemExit) as exit_:
        load_example("train_wan22_pickscore.py").main(["--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    # The example's defaults, not the dataclass's (help wraps lines at spaces and hyphens).
    assert "(default:Wan-AI/Wan2.2-T2V-A14B-Diffusers)" in "".join(text.split())
    names = {item.name for item in fields(GRPOJaggConfig) if item.init} | {
        "tiny",
        "model_name_or_path",
        "dataset_name",
    }
    assert {"jagg_group_size", "use_jagg", "learning_rate", "output_dir"} <= names
    assert [name for name in sorted(names) if f"--{name} " not in text] == []


def test_without_tiny_the_dataset_is_required_and_read_from_a_file(tmp_path):
    """Checked before any model loads; an editing example's source images are read relative to its .jsonl."""
    from PIL import Image

    from trl_jagg.scripts.utils import UsageError

    example = load_example("train_wan_ocr.py")
    with pytest.raises(UsageError, match="dataset_name is required"):
        example.build_trainer(*example.parse(CPU))
    Image.new("RGB", (8, 6), (10, 20, 30)).save(tmp_path / "a.png")
    (tmp_path / "train.jsonl").write_text('{"prompt": "two cats", "image": "a.png"}\n')
    kontext = load_example("train_flux_kontext_edit.py")
    args, _ = kontext.parse([*CPU, "--dataset_name", str(tmp_path / "train.jsonl")])
    dataset = kontext.load_dataset(args)
    assert dataset["prompt"] == ["two cats"]
    assert dataset[0]["source_image"].size == (8, 6) and dataset[0]["source_image"].getpixel((0, 0)) == (10, 20, 30)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_documented_commands_parse(name):
    """The command lines in the example's docstring and in docs/quickstart.md use flags the example takes."""
    docs = (EXAMPLES_DIR.parent / "docs" / "quickstart.md").read_text()
    text = runpy.run_path(str(EXAMPLES_DIR / name))["__doc__"].replace("\\\n", " ") + docs
    commands = re.findall(rf"examples/{re.escape(name)} ([^#\n`]*)", text)
    assert commands
    parse = load_parser(name).parse
    for flags in commands:
        assert parse([*CPU, *flags.split()]) is not None, flags


@pytest.mark.parametrize("name, flags", [
    ("train_sd35_flow_grpo.py", ["--model_name_or_path", "me/model"]),
    ("train_sd35_flow_grpo.py", ["--reward_funcs=pickscore"]),
    ("train_sd35_flow_grpo.py", ["--dataset_name", "p.txt", "--reward_funcs", "clipscore"]),
    ("train_sd35_dgpo.py", ["--dataset_name=p.txt", "--model_name_or_path", "me/model"]),  # a plain script
])  # fmt: skip
def test_tiny_refuses_the_flags_it_would_replace(tmp_path, name, flags):
    """Issue 42: `--tiny` swaps in its model, reward and prompts; a flag naming one of them is refused by name
    (before anything loads) instead of being silently replaced."""
    from trl_jagg.scripts.utils import UsageError

    example = load_parser(name)
    with pytest.raises(UsageError, match="--tiny replaces") as error:
        example.parse(["--tiny", "--output_dir", str(tmp_path), *flags])
    assert all(f"{flag.split('=')[0]}" in str(error.value) for flag in flags if flag.startswith("--"))


# ---------------------------------------------------------------- answers before the heavy imports
HEAVY = ("trl", "transformers", "diffusers", "peft")

# Runs each example of sys.argv[1] (a JSON list) as `python examples/<name> ARGV` for each ARGV of sys.argv[2], in one
# interpreter, and prints per run the exit status, what it wrote and the heavy modules imported by then (sys.modules
# only grows: what is absent after a run was absent when it answered).
PROBE = f"""
import contextlib, io, json, runpy, sys
results, paths, argvs = [], json.loads(sys.argv[1]), json.loads(sys.argv[2])
for path in paths:
    for argv in argvs:
        out, err = io.StringIO(), io.StringIO()
        sys.argv = [path, *argv]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(path, run_name="__main__")
                code = None
            except SystemExit as stop:
                code = stop.code
        imported = sorted(m for m in {HEAVY!r} if m in sys.modules)
        results.append(dict(code=code, out=out.getvalue(), err=err.getvalue().strip(), imported=imported))
print(json.dumps(results))
"""


def test_help_and_typos_come_before_the_heavy_imports(tmp_path):
    """Every example, plain or declared: ``--help``, a misspelt flag and a misspelt YAML key are answered with none
    of trl, transformers, diffusers and peft imported."""
    config = tmp_path / "run.yaml"
    config.write_text("learnig_rate: 1.0\n")
    argvs = [["--help"], ["--learnig_rate", "1"], ["--config", str(config)]]
    paths = [str(EXAMPLES_DIR / name) for name in sorted(EXAMPLES)]
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(paths), json.dumps(argvs)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    assert len(results) == len(paths) * len(argvs)
    for path, (help_, typo, yaml_typo) in zip(paths, zip(*[iter(results)] * 3), strict=True):
        name = os.path.basename(path)
        assert help_["code"] == 0 and "--learning_rate" in help_["out"] and "--tiny" in help_["out"], name
        assert EXAMPLES[name][2] in "".join(help_["out"].split()), name  # the example's default model
        assert typo["code"] == 2 and "'learnig_rate'" in typo["err"] and "'learning_rate'" in typo["err"], name
        assert yaml_typo["code"] == 2 and str(config) in yaml_typo["err"] and "'learning_rate'" in yaml_typo["err"]
    assert [run["imported"] for run in results] == [[]] * len(results)


@pytest.mark.parametrize("name", ["train_sd35_awm.py", "train_flux_unifiedreward.py"])
def test_the_snapshot_prints_the_full_parsers_help(name, monkeypatch):
    """The help rebuilt from the snapshot is the full parser's, the example's defaults included (a plain script, and
    a declared example with flags of its own)."""
    from trl_jagg.scripts import examples

    monkeypatch.setenv("COLUMNS", "119")
    parser = load_parser(name)
    helps = []
    for snapshot in (examples.saved_parser, lambda *args, **kwargs: None):
        monkeypatch.setattr(examples, "saved_parser", snapshot)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert parser.parse(["--help"]) is None
        helps.append(out.getvalue())
    assert helps[0] == helps[1]
    assert name in SCRIPTS or "--judge_url" in helps[0]


def test_the_example_snapshot_is_current(tmp_path):
    """The file answers only while it matches the parser and the examples' own flags; a stale one makes the examples
    slow, not wrong: rebuild it with `python -m trl_jagg.scripts.snapshots`."""
    from trl_jagg.scripts import example_snapshot, snapshots, train_snapshot
    from trl_jagg.scripts.examples import ScriptArguments

    saved = train_snapshot.load_snapshot(example_snapshot.SNAPSHOT_PATH)
    assert saved is not None, "trl_jagg/scripts/example_parser.json is stale"
    built = snapshots.build_example_snapshot()
    assert saved["config"] == built["config"] and saved["arguments"] == built["arguments"]
    stale = tmp_path / "example_parser.json"
    stale.write_text(json.dumps({**saved, "key": "0" * 64}))
    assert example_snapshot.saved_parser(ScriptArguments) is not None
    assert example_snapshot.saved_parser(ScriptArguments, path=str(stale)) is None
