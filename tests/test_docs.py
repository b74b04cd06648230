"""The docs cannot drift from the code: the generated config reference is current, links resolve, code blocks parse,
YAML recipes are valid ``trl-jagg train`` configs and documented imports exist."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# The pages written with the CLI and examples; docs/rewards.md belongs to the rewards and is only linked to.
PAGES = ["index", "quickstart", "jagg", "config", "models", "distributed", "benchmarks", "troubleshooting", "api"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code_blocks(language: str) -> list[tuple[str, str]]:
    blocks = []
    for page in PAGES:
        text = (DOCS / f"{page}.md").read_text()
        blocks += [(page, block) for block in re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)]
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_config_reference_is_up_to_date():
    generator = load_script("generate_config_reference")
    assert (DOCS / "config.md").read_text() == generator.render(), (
        "docs/config.md is stale: run `make docs` (python docs/generate_config_reference.py)"
    )


def test_every_own_config_field_is_in_the_reference():
    from trl_jagg import GRPOJaggConfig
    from trl_jagg.scripts.train import ScriptArguments

    text = (DOCS / "config.md").read_text()
    for cls in (GRPOJaggConfig, ScriptArguments):
        for name in cls.__dict__.get("__annotations__", {}):
            if not name.startswith("_"):
                assert f"| `{name}` |" in text, name


def test_jagg_figure_is_committed_and_its_script_runs(tmp_path):
    assert (DOCS / "assets" / "jagg.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "(assets/jagg.png)" in (DOCS / "jagg.md").read_text()
    out = load_script("make_jagg_figure").draw(tmp_path / "jagg.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    text = (DOCS / f"{page}.md").read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = (DOCS / path).resolve() if path else DOCS / f"{page}.md"
        assert file.exists(), f"{page}.md links to missing {target}"
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
            assert anchor in {slug(h) for h in headings}, f"{page}.md links to missing anchor {target}"


def test_python_blocks_compile():
    for page, block in code_blocks("python"):
        compile(block, f"docs/{page}.md", "exec")


def test_documented_imports_exist():
    for page, block in code_blocks("python"):
        for module, names in re.findall(r"^from (trl_jagg[\w.]*) import ([\w, ]+)$", block, flags=re.M):
            imported = importlib.import_module(module)
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(imported, name), f"docs/{page}.md: {module} has no {name}"


def test_yaml_recipes_are_valid_train_configs(tmp_path):
    from trl_jagg.scripts.train import parse_train_args

    recipes = [(page, block) for page, block in code_blocks("yaml") if "model_name_or_path:" in block]
    assert recipes
    for i, (page, block) in enumerate(recipes):
        path = tmp_path / f"recipe{i}.yaml"
        path.write_text(block)
        # The recipes target GPUs; bf16 cannot be validated on a CPU-only machine.
        script_args, args = parse_train_args(["--config", str(path), "--bf16", "false"])
        assert script_args.model_name_or_path and args.output_dir, page


def test_quickstart_error_messages_are_real(tmp_path, capsys):
    from trl_jagg import cli

    config = tmp_path / "recipe.yaml"
    config.write_text("model_name_or_path: x\nreward_funcs: [prompt_color]\nprompts: [a red circle]\n")
    lines = (DOCS / "quickstart.md").read_text().splitlines()
    commands = [(i, line) for i, line in enumerate(lines) if line.startswith("$ trl-jagg train --config recipe.yaml")]
    assert commands
    for i, line in commands:
        flags = line.split("--config recipe.yaml", 1)[1].split()
        assert cli.main(["train", "--config", str(config), *flags]) == 2
        assert capsys.readouterr().err.strip() == lines[i + 1], line


def test_presets_table_matches_the_recipes():
    from trl_jagg.recipes import RECIPES

    rows = [
        [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        for line in (DOCS / "models.md").read_text().splitlines()
        if re.match(r"\| `[a-z0-9-]+` \| `", line)
    ]
    assert sorted(row[0] for row in rows) == sorted(RECIPES)
    for name, model, reward, sampler, noise, steps, _, size, g, _, lora, lr, beta, w, frac in rows:
        recipe, config = RECIPES[name], RECIPES[name].config
        assert (model, reward) == (recipe.model, recipe.reward_funcs[0]), name
        assert (sampler, float(noise)) == (config["sampler"], config["noise_level"]), name
        assert int(steps.split()[0]) == config["num_inference_steps"], name
        assert (int(size), int(g)) == (config["height"], config["num_generations"]), name
        expected_lora = "full" if recipe.lora is None else f"{recipe.lora['r']} / {recipe.lora['lora_alpha']}"
        assert lora == expected_lora, name
        assert (float(lr), float(beta)) == (config["learning_rate"], config["beta"]), name
        assert (int(w), float(frac)) == (config["jagg_group_size"], config["jagg_frac"]), name


def test_quickstart_lists_every_example():
    text = (DOCS / "quickstart.md").read_text()
    for example in sorted((ROOT / "examples").glob("train_*.py")):
        assert f"(../examples/{example.name})" in text, example.name


def test_benchmarks_page_has_the_results_section():
    assert "\n## Measured results\n" in (DOCS / "benchmarks.md").read_text()
