"""The wheels ``make gpu-check`` installs offline on the GPU machine, and ``make gpu-wheels``, which prepares them.

The GPU machine (``/work/shared/docs/platform_notes.md``, "The GPU machine") has no network and Python 3.12 with
torch, transformers, accelerate, peft, pyarrow, pandas, matplotlib and the rest of :data:`GPU_MACHINE_HAS`, but not
diffusers, trl or datasets. ``make gpu-wheels`` downloads the wheels of what it lacks (:data:`GPU_MACHINE_LACKS`,
at the versions of ``requirements.lock``, for CPython 3.12 on manylinux x86-64 where a wheel is not pure Python)
from the configured package index, builds the project's own wheel, and checks that the folder stays under
:data:`MAX_BYTES` (the device tool carries 64 MiB in all). ``make gpu-check`` installs them with
:func:`install_command`: no index, no dependency resolution, into a folder put first on ``PYTHONPATH``::

    python -m trl_jagg.benchmarks.gpu_wheels download --dest gpu-wheels    # here, where the index is
    python3 -m trl_jagg.benchmarks.gpu_wheels install --wheels gpu-wheels --target .gpu-site   # there

This module imports nothing beyond the standard library: it runs on the GPU machine before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

WHEEL_DIR = "gpu-wheels"
SITE_DIR = ".gpu-site"
MAX_BYTES = 20 * 10**6
"""The wheels' size limit: well inside the 64 MiB the device tool carries with the checkout."""
GPU_MACHINE_LACKS = ("diffusers", "trl", "datasets", "dill", "multiprocess", "importlib-metadata", "lazy-importer")
"""What ``trl_jagg`` needs at run time that the GPU machine does not have: the project's own dependencies
diffusers, trl and datasets, and theirs (datasets: dill, multiprocess; diffusers: importlib-metadata, which needs
lazy-importer on Python < 3.15). ``tests/test_gpu_check.py`` recomputes this from the installed metadata."""
GPU_MACHINE_REPLACES = ("peft",)
"""Packages the GPU machine has at a version nobody recorded, carried at the lock's so that the LoRA code that runs
there is the tested one (pure Python, small). torch, transformers and accelerate stay the machine's (their wheels,
or the huggingface-hub that the lock's transformers needs, would pass the size limit)."""
CARRIED = GPU_MACHINE_LACKS + GPU_MACHINE_REPLACES
"""Every wheel ``make gpu-wheels`` downloads (the project's own is built besides)."""
GPU_MACHINE_HAS = frozenset(
    # The GPU image's Python packages as the device notes list them (.library/device/KINDS.md, 2026-11-17), those
    # trl_jagg's dependency tree reaches (tensorboard's tree included, a base dependency since the quickstart logs
    # to it); the rest of that list is left out.
    "absl-py accelerate aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer click "
    "contourpy cycler filelock fonttools frozenlist fsspec grpcio h11 hf-xet httpcore httpx huggingface-hub idna "
    "jinja2 kiwisolver markdown markdown-it-py markupsafe matplotlib mdurl mpmath multidict networkx numpy packaging "
    "pandas peft pillow propcache protobuf psutil pyarrow pygments pyparsing python-dateutil pyyaml regex requests "
    "rich safetensors setuptools shellingham six sympy tensorboard tensorboard-data-server tokenizers torch tqdm "
    "transformers triton typer typing-extensions urllib3 werkzeug xxhash yarl zipp".split()
)
"""Packages already on the GPU machine. Its torch (2.11), transformers (5.17) and accelerate (1.15) are older than
the lock's; the ``--tiny`` dry run passed by hand with that transformers, accelerate and huggingface-hub (1.33) over
the lock's other packages (docs/benchmarks.md, "GPU"), not with that torch."""
PLATFORM_FLAGS = (
    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
)  # fmt: skip
"""``pip download`` flags for the GPU machine's interpreter: pure-Python wheels match any of them."""


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (``importlib_metadata`` is ``importlib-metadata``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(lock: str | Path, names: Sequence[str] = CARRIED) -> dict[str, str]:
    """The pinned version of each of ``names`` in the lock file ``lock`` (``name==version`` lines); a name the lock
    does not pin raises a ``ValueError`` naming it."""
    pins = {}
    for line in Path(lock).read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", line.strip())
        if match:
            pins[normalize(match[1])] = match[2]
    missing = [name for name in names if normalize(name) not in pins]
    if missing:
        raise ValueError(f"{lock} pins no version of {missing}: run `make lock`, or drop them from CARRIED.")
    return {name: pins[normalize(name)] for name in names}


def download_command(python: str, dest: str | Path, versions: dict[str, str]) -> list[str]:
    """``pip download`` of exactly ``versions`` (no dependencies) as wheels for the GPU machine into ``dest``."""
    pins = [f"{name}=={version}" for name, version in versions.items()]
    return [python, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM_FLAGS, "-d", str(dest), *pins]


def project_wheel_command(python: str, dest: str | Path, project: str | Path = ".") -> list[str]:
    """``pip wheel`` of the project alone, built with the running environment's setuptools (offline)."""
    return [python, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), str(project)]


def install_command(python: str, wheels: str | Path, target: str | Path) -> list[str]:
    """``pip install`` of every wheel in ``wheels`` into ``target``: no index, no dependency resolution (the GPU
    machine's own packages stay as they are), replacing what an earlier run put there."""
    files = sorted(str(p) for p in Path(wheels).glob("*.whl"))
    if not files:
        raise FileNotFoundError(f"No wheels in {wheels}: run `make gpu-wheels` where the package index is.")
    return [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
            "--target", str(target), *files]  # fmt: skip


def download(dest: str | Path, lock: str | Path = "requirements.lock", project: str | Path = ".") -> list[Path]:
    """Download the wheels of :data:`CARRIED` and build the project's into ``dest`` (emptied of wheels
    first); returns them. Raises if they pass :data:`MAX_BYTES`."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    versions = locked_versions(lock)
    subprocess.run(download_command(sys.executable, dest, versions), check=True, timeout=600)
    subprocess.run(project_wheel_command(sys.executable, dest, project), check=True, timeout=600)
    wheels = sorted(dest.glob("*.whl"))
    total = sum(p.stat().st_size for p in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 1e6:7.2f} MB  {wheel.name}")
    print(f"{total / 1e6:7.2f} MB  in {len(wheels)} wheels ({dest})")
    if total > MAX_BYTES:
        raise RuntimeError(f"The wheels in {dest} take {total / 1e6:.1f} MB, over {MAX_BYTES / 1e6:.0f} MB.")
    return wheels


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("download", help="Download and build the wheels (where the package index is).")
    get.add_argument("--dest", default=WHEEL_DIR)
    get.add_argument("--lock", default="requirements.lock")
    put = commands.add_parser("install", help="Install the wheels offline into a folder (on the GPU machine).")
    put.add_argument("--wheels", default=WHEEL_DIR)
    put.add_argument("--target", default=SITE_DIR)
    ns = parser.parse_args(argv)
    if ns.command == "download":
        download(ns.dest, ns.lock)
    else:
        subprocess.run(install_command(sys.executable, ns.wheels, ns.target), check=True, timeout=300)


if __name__ == "__main__":
    main()
