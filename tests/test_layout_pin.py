"""The trainer split into stage modules changed no behaviour: pinned against files the code before the split wrote.

``tests/fixtures/pre_split/`` was written by the trainer as it stood before the split (main at 9cee063, the
1,547-line ``ddpo_jagg_trainer.py``) with :func:`train_demo` below: the demo's config (LoRA, JAGG W = 4 with the
velocity cache, KL to the base weights, a 4-step SDE window) trained 3 steps, saving ``checkpoint-2`` on the way;
``weights_step3.safetensors`` holds the LoRA weights after step 3. Regenerate only for an intended change of the
training's numbers: ``python tests/test_layout_pin.py`` (and say why in the commit).
"""

from __future__ import annotations

import os
import re
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
CONTRIBUTING = PACKAGE.parent / "CONTRIBUTING.md"
TRAINER = "trl_jagg.trainer.ddpo_jagg_trainer"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names, relative imports resolved; ``from m import n`` gives ``m`` and
    ``m.n``), from its syntax tree: also the imports inside functions and under ``TYPE_CHECKING``."""
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
    return found


def _package_imports(path: Path) -> set[str]:
    return {name for name in _imports(path) if name.split(".")[0] == "trl_jagg"}


def _map_text() -> str:
    text = CONTRIBUTING.read_text()
    return text[text.index("## Where code lives") : text.index("\n## ", text.index("## Where code lives") + 1)]


def _mapped_paths(text: str) -> set[str]:
    """The module paths (relative to the repository) a map text names: ``trl_jagg/x/y.py`` in a table row or a
    brace group ``trl_jagg/trainer/{a,b}.py``; a package folder ``trl_jagg/x/`` names its ``__init__.py``."""
    paths = set()
    for prefix, group, suffix in re.findall(r"`(trl_jagg/[\w/]*?)(?:\{([\w, ]+)\})?(\.py|/)?`", text):
        names = [n.strip() for n in group.split(",")] if group else [""]
        for name in names:
            if suffix == "/" or (not suffix and not group):
                paths.add(f"{prefix}{name}".rstrip("/") + "/__init__.py")
            else:
                paths.add(f"{prefix}{name}{suffix or '.py'}")
    return paths


def _stages() -> set[str]:
    """The trainer's stages as CONTRIBUTING's table marks them (a job starting with "stage:")."""
    rows = re.findall(r"^\| `trl_jagg/trainer/(\w+)\.py` \| stage:", _map_text(), flags=re.MULTILINE)
    return set(rows)


def test_every_module_is_in_contributings_map():
    """A module added without its row in "Where code lives" fails here: the map is the house's floor plan."""
    modules = {p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*.py")}
    mapped = _mapped_paths(_map_text())
    missing = modules - mapped
    assert missing == set(), f"add these modules, with their job, to CONTRIBUTING.md's map: {sorted(missing)}"
    # A package's row names its folder, which may have no __init__.py (a namespace package).
    gone = {
        path
        for path in mapped - modules
        if not (path.endswith("/__init__.py") and (PACKAGE.parent / path).parent.is_dir())
    }
    assert gone == set(), f"CONTRIBUTING.md's map names modules that are gone: {sorted(gone)}"


def test_the_map_reader_finds_paths_and_brace_groups():
    # The reader above must be able to miss a module, or the test before it could not fail.
    text = "| `trl_jagg/a/b.py` | x | `trl_jagg/t/{c, d}.py` | `trl_jagg/p/` | `trl_jagg/q/r.yaml`"
    assert _mapped_paths(text) == {"trl_jagg/a/b.py", "trl_jagg/t/c.py", "trl_jagg/t/d.py", "trl_jagg/p/__init__.py"}


def test_stages_never_import_the_trainer_or_each_other():
    stages = _stages()
    # Each module whose docstring calls itself a stage is marked one in the map, so a new stage is covered.
    declared = {
        p.stem for p in (PACKAGE / "trainer").glob("*.py") if re.match(r'"""The [\w -]*\bstage\b', p.read_text())
    }
    assert declared and declared <= stages, f"mark {sorted(declared - stages)} as 'stage:' in CONTRIBUTING's map"
    assert stages, "CONTRIBUTING's map marks no stage"
    for stage in stages:
        imported = _package_imports(PACKAGE / "trainer" / f"{stage}.py")
        others = {f"trl_jagg.trainer.{other}" for other in stages - {stage}}
        assert not imported & others, f"{stage}.py imports the stage(s) {sorted(imported & others)}"
    # Nothing under trainer/ (but the trainer module itself) or objectives/ imports the trainer class.
    for path in [*(PACKAGE / "trainer").glob("*.py"), *(PACKAGE / "objectives").rglob("*.py")]:
        if path.stem != "ddpo_jagg_trainer":
            imported = _package_imports(path)
            reached = imported & {TRAINER, "trl_jagg.DDPOJaggTrainer"}
            assert not reached, f"{path.relative_to(PACKAGE)} imports the trainer class ({sorted(reached)})"


def test_the_library_never_imports_the_tools():
    tools = {f"trl_jagg.{name}" for name in ("scripts", "benchmarks", "demo", "testing", "planning")}
    library = ("core", "config", "utils", "trainer", "objectives", "models", "rewards", "recipes")
    for path in [p for layer in library for p in (PACKAGE / layer).rglob("*.py")]:
        reached = {name for name in _package_imports(path) if ".".join(name.split(".")[:2]) in tools}
        assert reached == set(), f"{path.relative_to(PACKAGE)} imports the tool(s) {sorted(reached)}"


def test_the_core_imports_torch_the_standard_library_and_itself_only():
    """Every module of ``trl_jagg/core`` imports torch, the standard library and other core modules: no diffusers,
    numpy, transformers, nor the rest of the package (the full import list, not only the package's names)."""
    allowed = set(sys.stdlib_module_names) | {"__future__", "torch"}
    modules = sorted((PACKAGE / "core").glob("*.py"))
    assert {p.stem for p in modules} >= {"jagg", "sampling", "grpo", "nft", "velocity_cache", "sde_window"}
    for path in modules:
        outside = {
            name
            for name in _imports(path)
            if name.split(".")[0] not in allowed and not (name == "trl_jagg.core" or name.startswith("trl_jagg.core."))
        }
        # `from torch import nn` gives `torch` and `torch.nn`: both start with an allowed top-level name.
        assert outside == set(), f"core/{path.name} imports {sorted(outside)}"


def test_modules_stay_small_and_tools_stay_out_of_the_root():
    lengths = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert lengths["trainer/ddpo_jagg_trainer.py"] <= 600  # the project's split-by-concern threshold
    assert {name: n for name, n in lengths.items() if n > 700} == {}
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert not root & {"tiny_models", "benchmark", "trainer_benchmark", "demo"}


def _module_of(name: str, modules: set[str]) -> str | None:
    """The package module an imported name lives in: ``trl_jagg.a.b.f`` is ``trl_jagg.a.b`` when that is a module
    (else ``trl_jagg.a``, a package's ``__init__``); ``None`` outside the package."""
    while name not in modules:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def _import_graph() -> dict[str, set[str]]:
    """Each package module and the package modules it imports, from :func:`_imports` (so also the imports inside
    functions, where a circle hides from the interpreter until the function runs)."""
    paths = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    modules = set(paths)
    return {
        module: {m for m in (_module_of(n, modules) for n in _imports(path)) if m not in (None, module)}
        for module, path in paths.items()
    }


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module (Tarjan's
    algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle_in_the_package():
    """No module reaches itself through the package's imports, those inside functions included: a circle is two
    modules that cannot be understood (or moved) one without the other."""
    assert _circles(_import_graph()) == []


def test_the_circle_finder_finds_circles():
    # The test above must be able to fail: a three-module circle beside a chain and a self-contained module.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_function_of_the_config_is_above_ruffs_default_complexity():
    """Each field group owns its check (issue 40): no check grows back into one branchy function. Ruff's C901 at its
    default threshold (10), the rule ``make lint`` also applies to ``trl_jagg/config``."""
    import subprocess

    ruff = Path(sys.executable).with_name("ruff")  # the [dev] extra's, which `make test` installs

    proc = subprocess.run(
        [str(ruff), "check", "--isolated", "--select", "C901", "--output-format", "concise", str(PACKAGE / "config")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_test_name_is_used_once():
    """A test name in two files reads as one test in a report (`-k`, `--durations`) and hid twice-written family
    tests before the common matrix (issue 40)."""
    import collections

    names = collections.Counter(
        match
        for path in (PACKAGE.parent / "tests").rglob("test_*.py")
        for match in re.findall(r"^def (test_\w+)", path.read_text(), flags=re.MULTILINE)
    )
    assert {name: n for name, n in names.items() if n > 1} == {}
