"""The package as users install it: a wheel built from this tree, installed into a fresh virtualenv, has its
launch configurations and recipe files, trains through ``trl-jagg train --accelerate_config``, and runs the
quickstart's Python block as pasted (a tiny model swapped in) from a folder with no ``docs/`` or ``examples/``."""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLEAN_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}  # nothing from the checkout (pytest's PYTHONPATH)


def build_wheel(tmp_path: Path) -> Path:
    """``pip wheel`` of a copy of the tree (the build writes build/ and *.egg-info next to the sources)."""
    source = tmp_path / "source"
    shutil.copytree(ROOT / "trl_jagg", source / "trl_jagg", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, source],
        check=True,
    )
    (wheel,) = wheels.glob("trl_jagg-*.whl")
    return wheel


def fresh_virtualenv(path: Path, wheel: Path) -> Path:
    """A new virtualenv with the wheel installed and this interpreter's site-packages behind its own (a .pth
    line: torch and the other dependencies are not reinstalled; the .pth files there, such as the editable
    install of the checkout, are not processed, so ``trl_jagg`` is the wheel's)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
        check=True, env=CLEAN_ENV,
    )  # fmt: skip
    # After the install: with the checkout's editable trl-jagg in sight, pip would call it already installed.
    Path(purelib, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """``(wheel, python)``: the wheel of this tree and the interpreter of a fresh virtualenv it is installed in."""
    tmp_path = tmp_path_factory.mktemp("install")
    wheel = build_wheel(tmp_path)
    return wheel, fresh_virtualenv(tmp_path / "venv", wheel)


@pytest.mark.slow  # ~40 s alone on 2 cores (build, virtualenv, two interpreters importing torch), more when shared
def test_wheel_in_a_fresh_virtualenv_ships_the_configs_and_trains(tmp_path, tiny_flux_path, installed):
    wheel, python = installed
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = email.message_from_bytes(archive.read(next(n for n in names if n.endswith("/METADATA"))))
    shipped = {n for n in names if n.startswith("trl_jagg/configs/") and n.endswith(".yaml")}
    assert shipped == {
        *(f"trl_jagg/configs/accelerate/{p.name}" for p in (ROOT / "examples" / "accelerate_configs").glob("*.yaml")),
        *(f"trl_jagg/configs/recipes/{p.name}" for p in (ROOT / "examples" / "recipes").glob("*.yaml")),
    }
    assert metadata["License-Expression"] == "Apache-2.0"
    assert not [c for c in metadata.get_all("Classifier") if c.startswith("License ::")]  # SPDX replaces them
    assert any(url.startswith("Repository, https://") for url in metadata.get_all("Project-URL"))

    # Every shipped name resolves inside the installed package and loads with accelerate's own reader.
    check = (
        "import sys, trl_jagg\n"
        "from accelerate.commands.config.config_args import load_config_from_file\n"
        "from trl_jagg.scripts.launch import resolve_accelerate_config\n"
        "for name in sys.argv[1:]:\n"
        "    path = resolve_accelerate_config(name)\n"
        "    load_config_from_file(path)\n"
        "    print(path)\n"
        "print(trl_jagg.__file__)\n"
    )
    names = ["single_gpu", "multi_gpu", "fsdp2", "deepspeed_zero2", "deepspeed_zero3"]
    proc = subprocess.run([python, "-c", check, *names], capture_output=True, text=True, env=CLEAN_ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = proc.stdout.split()
    site = str(python.parent.parent)
    assert all(p.startswith(site) for p in paths), paths  # the wheel's files, not the checkout's
    assert [Path(p).stem for p in paths[:-1]] == names

    # A recipe file read from the installed package trains one step through the CLI, launched by accelerate.
    recipe = yaml.safe_load(Path(paths[-1]).parent.joinpath("configs", "recipes", "flow-grpo-flux.yaml").read_text())
    assert recipe["recipe"] == "flow-grpo-flux"
    out = tmp_path / "out"
    flags = [
        "--recipe", "flow-grpo-flux", "--model_name_or_path", tiny_flux_path, "--reward_funcs", "prompt_color",
        "--prompts", "a red circle", "--output_dir", str(out), "--per_device_train_batch_size", "2",
        "--num_generations", "2", "--num_inference_steps", "3", "--jagg_group_size", "2", "--height", "32",
        "--width", "32", "--max_sequence_length", "16", "--max_steps", "1", "--gradient_accumulation_steps", "1", "--steps_per_generation", "1", "--dtype", "float32", "--bf16", "false",
        "--use_cpu", "true", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
    ]  # fmt: skip
    command = [python.parent / "trl-jagg", "train", "--accelerate_config", "single_gpu", *flags]
    proc = subprocess.run(command, capture_output=True, text=True, env=CLEAN_ENV, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Launching with accelerate ({paths[0]})" in proc.stdout
    assert (out / "pytorch_lora_weights.safetensors").is_file()


QUICKSTART_STAND_INS = """
import datasets
from trl_jagg import GRPOJaggConfig
from trl_jagg.rewards import REWARD_REGISTRY

# Offline stand-ins for what the block fetches: the prompts and PickScore's weights.
datasets.load_dataset = lambda *args, **kwargs: datasets.Dataset.from_dict({"Prompt": ["a red circle", "a blue square"] * 12})
REWARD_REGISTRY["pickscore"] = REWARD_REGISTRY["prompt_color"]
original_post_init = GRPOJaggConfig.__post_init__


def tiny_post_init(self):  # one optimizer step at 32x32 px on CPU; report_to stays what the block says
    for key, value in dict(height=32, width=32, max_steps=1, max_sequence_length=16, bf16=False, dtype="float32",
                           save_strategy="no", disable_tqdm=True, logging_steps=1).items():
        setattr(self, key, value)
    original_post_init(self)


GRPOJaggConfig.__post_init__ = tiny_post_init
"""


@pytest.mark.slow  # one optimizer step of the quickstart's config on a tiny model, in the wheel's interpreter
def test_quickstart_block_runs_from_the_wheel_and_logs_where_it_says(tmp_path, tiny_flux_path, installed):
    wheel, python = installed
    with zipfile.ZipFile(wheel) as archive:
        metadata = email.message_from_bytes(
            archive.read(next(n for n in archive.namelist() if n.endswith("/METADATA")))
        )
    # The tracker the quickstart logs to is a dependency of a plain install, not of an extra.
    requirements = metadata.get_all("Requires-Dist")
    assert [r for r in requirements if re.match(r"tensorboard\b", r) and "extra ==" not in r], requirements

    text = (ROOT / "docs" / "quickstart.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "trainer.train()" in b]
    assert 'report_to="tensorboard"' in block and "black-forest-labs/FLUX.1-dev" in block
    script = tmp_path / "quickstart.py"
    script.write_text(QUICKSTART_STAND_INS + block.replace("black-forest-labs/FLUX.1-dev", tiny_flux_path))
    proc = subprocess.run(
        [python, script], capture_output=True, text=True, env=CLEAN_ENV, cwd=tmp_path, timeout=600
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    output_dir = tmp_path / "flux-pickscore-grpo"
    assert (output_dir / "pytorch_lora_weights.safetensors").is_file()
    assert list(output_dir.rglob("events.out.tfevents.*")), sorted(p.name for p in output_dir.rglob("*"))
