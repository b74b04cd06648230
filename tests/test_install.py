"""The package as users install it: a wheel built from this tree, installed into a fresh virtualenv, has its
launch configurations and recipe files and trains through ``trl-jagg train --accelerate_config``."""

from __future__ import annotations

import email
import os
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


@pytest.mark.slow  # ~40 s alone on 2 cores (build, virtualenv, two interpreters importing torch), more when shared
def test_wheel_in_a_fresh_virtualenv_ships_the_configs_and_trains(tmp_path, tiny_flux_path):
    wheel = build_wheel(tmp_path)
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

    python = fresh_virtualenv(tmp_path / "venv", wheel)
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
    site = str(tmp_path / "venv")
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
