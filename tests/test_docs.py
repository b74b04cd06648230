"""The docs cannot drift from the code: the generated config reference is current, links resolve, Python blocks run,
YAML recipes are valid ``trl-jagg train`` configs and documented imports exist."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from trl_jagg.models.families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# The pages written with the CLI and examples; docs/rewards.md belongs to the rewards and is only linked to.
PAGES = [
    "index", "quickstart", "recipes", "jagg", "config", "models", "distributed", "benchmarks", "troubleshooting", "api",
    "objectives",
    *(f"peers/{p.stem}" for p in sorted((DOCS / "peers").glob("*.md"))),
]  # fmt: skip


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
    from trl_jagg.scripts.utils import own_fields

    text = (DOCS / "config.md").read_text()
    for cls in (GRPOJaggConfig, ScriptArguments):
        for name in own_fields(cls):
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
        file = ((DOCS / page).parent / path).resolve() if path else DOCS / f"{page}.md"
        assert file.exists(), f"{page}.md links to missing {target}"
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
            assert anchor in {slug(h) for h in headings}, f"{page}.md links to missing anchor {target}"


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
    from trl_jagg.scripts import cli

    # The page's own recipe.yaml (it targets GPUs: bf16), so the messages are those a reader gets on any machine.
    (recipe,) = [block for page, block in code_blocks("yaml") if page == "quickstart" and "recipe:" in block]
    config = tmp_path / "recipe.yaml"
    config.write_text(recipe)
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
        if re.match(r"\| `[a-z0-9.-]+` \| `", line) and not line.startswith(("| `nft-", "| `awm-", "| `dgpo-"))
    ]
    grpo = [name for name, recipe in RECIPES.items() if recipe.config.get("objective", "grpo") == "grpo"]
    assert sorted(row[0] for row in rows) == sorted(grpo)
    for name, model, reward, sampler, noise, steps, _, size, g, _, lora, lr, beta, w, frac in rows:
        recipe, config = RECIPES[name], RECIPES[name].config
        assert model == recipe.model and [r.strip("` ") for r in reward.split(",")] == list(recipe.reward_funcs), name
        assert (sampler, float(noise)) == (config["sampler"], config["noise_level"]), name
        assert int(steps.split()[0]) == config["num_inference_steps"], name
        assert (int(size.split("x")[0]), int(g)) == (config["height"], config["num_generations"]), name  # HxW
        expected_lora = "full" if recipe.lora is None else f"{recipe.lora['r']} / {recipe.lora['lora_alpha']}"
        assert lora == expected_lora, name
        assert (float(lr), float(beta)) == (config["learning_rate"], config["beta"]), name
        assert (int(w), float(frac)) == (config["jagg_group_size"], config["jagg_frac"]), name


def test_awm_and_dgpo_presets_table_matches_the_recipes():
    from trl_jagg.recipes import RECIPES

    rows = [
        [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        for line in (DOCS / "models.md").read_text().splitlines()
        if line.startswith(("| `awm-", "| `dgpo-")) and line.count("|") == 14  # the presets table's 13 columns
    ]
    expected = sorted(name for name, recipe in RECIPES.items() if recipe.objective in ("awm", "dgpo"))
    assert sorted(row[0] for row in rows) == expected
    for name, objective, model, reward, _, steps, _, g, _, _, lora, lr, _ in rows:
        recipe, config = RECIPES[name], RECIPES[name].config
        assert (objective, model, reward) == (recipe.objective, recipe.model, ", ".join(recipe.reward_funcs)), name
        assert (int(steps), int(g)) == (config["num_inference_steps"], config["num_generations"]), name
        assert lora == f"{recipe.lora['r']} / {recipe.lora['lora_alpha']}" and float(lr) == config["learning_rate"]


def test_nft_presets_table_matches_the_recipes():
    from trl_jagg.recipes import RECIPES

    rows = [
        [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        for line in (DOCS / "models.md").read_text().splitlines()
        if re.match(r"\| `nft-[a-z0-9.-]+` \| `", line)
    ]
    assert sorted(row[0] for row in rows) == sorted(
        n for n, r in RECIPES.items() if r.config.get("objective") == "nft"
    )
    for name, model, reward, _, steps, _, size, g, images, fraction, lora, lr, kl, nft_beta, decay in rows:
        recipe, config = RECIPES[name], RECIPES[name].config
        per_step = config["per_device_train_batch_size"] * 8 * config["gradient_accumulation_steps"]
        assert int(images.split()[0]) == per_step, name
        assert model == recipe.model and [r.strip("` ") for r in reward.split(",")] == list(recipe.reward_funcs), name
        assert (int(steps), int(size), int(g)) == (
            config["num_inference_steps"],
            config["height"],
            config["num_generations"],
        )
        assert float(fraction) == config["train_timestep_fraction"], name
        assert lora == f"{recipe.lora['r']} / {recipe.lora['lora_alpha']}", name
        assert (float(lr), float(kl), float(nft_beta)) == (config["learning_rate"], config["beta"], config["nft_beta"])
        assert int(decay) == config["nft_decay_type"], name


def test_quickstart_lists_every_example():
    text = (DOCS / "quickstart.md").read_text()
    for example in sorted((ROOT / "examples").glob("train_*.py")):
        assert f"(../examples/{example.name})" in text, example.name


def test_one_trainer_name_in_the_docs_examples_and_messages():
    """The trainer is DDPOJaggTrainer everywhere a user reads it; GRPOJaggTrainer is its alias, named only where the
    API reference says so (and where trl_jagg defines it)."""
    from trl_jagg import DDPOJaggTrainer, GRPOJaggTrainer

    assert GRPOJaggTrainer is DDPOJaggTrainer
    files = [
        ROOT / "README.md",
        *DOCS.glob("*.md"),
        *(ROOT / "examples").glob("*.py"),
        *(ROOT / "trl_jagg").rglob("*.py"),
    ]
    allowed = {DOCS / "api.md", ROOT / "trl_jagg" / "__init__.py"}
    assert (
        sorted(str(p.relative_to(ROOT)) for p in files if "GRPOJaggTrainer" in p.read_text() and p not in allowed)
        == []
    )
    assert "GRPOJaggTrainer is DDPOJaggTrainer" in (DOCS / "api.md").read_text()


def test_benchmarks_page_has_the_results_section():
    assert "\n## Measured results\n" in (DOCS / "benchmarks.md").read_text()


# ---------------------------------------------------------------- every Python block runs
# The rule (CONTRIBUTING.md, "Docs"): the blocks of a page run in order in one namespace and a temporary working
# directory, offline on CPU, and whatever a block would fetch from the Hub is a tiny stand-in.
SKIP_MARKER = "<!-- docs-test: skip"
STAND_IN_FAMILIES = ("flux", "sd3", "qwenimage")
"""The families of the pipelines the docs load (by Hub id, or through a preset)."""
HUB_PIPELINES = {
    hub_id: record.name for record in FAMILIES if record.name in STAND_IN_FAMILIES for hub_id in record.hub_ids
}
"""Each Hub id of those families (their records'), and the family whose tiny pipeline stands in for it."""
DATASET_PROMPT_COLUMNS = {"nateraw/parti-prompts": "Prompt"}
"""The prompt column of the Hub datasets the docs load (``prompt`` otherwise)."""
MODEL_REWARDS = {
    "pickscore": "pickscore",
    "clipscore": "clip_score",
    "hpsv2.1": "hpsv2",
    "imagereward": "image_reward",
}
MODEL_REWARDS |= {"aesthetic": "aesthetic"}
"""Registry names and factories of the rewards that load a Hub model."""
TINY_CONFIG = dict(
    height=32, width=32, max_steps=1, max_sequence_length=16, bf16=False, fp16=False, dtype="float32",
    report_to="none", save_strategy="no", disable_tqdm=True,
)  # fmt: skip
"""What every GRPOJaggConfig of a doc block is capped to: one optimizer step at 32x32 px on CPU, no trackers."""


class OfflineHub:
    """The Hub API a block's ``push_to_hub`` reaches: it creates nothing and uploads nothing."""

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"you/{repo_id}")

    def upload_folder(self, **kwargs):
        return None


DOC_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of every ```python block of ``path`` not preceded by the skip marker."""
    text = path.read_text()
    blocks = []
    for match in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
        before = text[: match.start()].rstrip().splitlines()
        if before and before[-1].startswith(SKIP_MARKER):
            continue
        blocks.append((text[: match.start()].count("\n") + 2, match.group(1)))
    return blocks


@pytest.fixture(scope="session")
def tiny_hub_cache(tmp_path_factory) -> Path:
    """A Hugging Face cache in which each pipeline id of ``HUB_PIPELINES`` is a tiny pipeline of its family."""
    from trl_jagg.testing.tiny_models import save_tiny_pipeline

    cache = tmp_path_factory.mktemp("hub-cache")
    revision = "0" * 40
    saved = {family: save_tiny_pipeline(family, cache / f"tiny-{family}", seed=0) for family in STAND_IN_FAMILIES}
    for repo_id, family in HUB_PIPELINES.items():  # every id of a family serves its one tiny pipeline
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        (repo / "snapshots").mkdir(parents=True)
        (repo / "snapshots" / revision).symlink_to(saved[family], target_is_directory=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
    return cache


@pytest.fixture
def tiny_hub(tiny_hub_cache, tmp_path, monkeypatch):
    """Install the stand-ins of the rule for one page."""
    import datasets
    import diffusers
    import huggingface_hub.constants
    import transformers.trainer

    import trl_jagg.rewards as rewards
    from trl_jagg import GRPOJaggConfig
    from trl_jagg.rewards import REWARD_REGISTRY, brightness

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tiny_hub_cache))
    monkeypatch.setattr(transformers.trainer, "hf_api", OfflineHub)

    def load_dataset(path, *args, **kwargs):
        column = DATASET_PROMPT_COLUMNS.get(path, "prompt")
        # Four prompts twelve times: enough for any page's preset on one process (the NFT presets draw 6 a rollout).
        prompts = ["a red circle", "a green square", "a blue circle", "a red cat"] * 12
        return datasets.Dataset.from_dict({column: prompts})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)

    def stand_in(name):
        def factory(**kwargs):
            score = brightness()

            def reward(prompts, images, **kw):
                return score(prompts=prompts, images=images)

            reward.__name__ = name
            return reward

        return factory

    for name, factory in MODEL_REWARDS.items():
        monkeypatch.setitem(REWARD_REGISTRY, name, stand_in(name))
        monkeypatch.setattr(rewards, factory, stand_in(name))

    original = GRPOJaggConfig.__post_init__

    def tiny_post_init(self):
        for key, value in TINY_CONFIG.items():
            setattr(self, key, value)
        original(self)

    monkeypatch.setattr(GRPOJaggConfig, "__post_init__", tiny_post_init)
    # Pipelines sample 32 px by default, the size the tiny ones are built for (their __init__ sets the attribute:
    # a property with a no-op setter keeps it).
    small = property(lambda self: 4, lambda self, value: None)
    for record in FAMILIES:
        if record.name in STAND_IN_FAMILIES:
            monkeypatch.setattr(getattr(diffusers, record.pipeline), "default_sample_size", small, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(
    "path", [p for p in DOC_FILES if python_blocks(p)], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_python_blocks_run(path, tiny_hub):
    namespace: dict = {"__name__": "__docs__"}
    for line, block in python_blocks(path):
        code = re.sub(r"([\"'])cuda(:\d+)?\1", r"\1cpu\1", block)  # "cuda" devices are the CPU
        try:
            exec(compile(code, f"{path.name}:{line}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{path.relative_to(ROOT)}, block at line {line} fails: {error!r}") from error


# ---------------------------------------------------------------- docs/recipes.md: every command parses
RECIPES_PAGE = DOCS / "recipes.md"


def shell_commands(path: Path) -> list[list[str]]:
    """The commands of every ```bash block of ``path``, one token list each (``\\`` continuations joined, comments
    dropped)."""
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            if tokens:
                commands.append(tokens)
    return commands


def train_argv(tokens: list[str]) -> list[str] | None:
    """The arguments after ``train`` of a ``trl-jagg train`` or ``accelerate launch ... -m trl_jagg.scripts.cli train``
    command; ``None`` for any other command."""
    if tokens[:2] == ["trl-jagg", "train"]:
        return tokens[2:]
    if tokens[:2] == ["accelerate", "launch"] and "trl_jagg.scripts.cli" in tokens:
        rest = tokens[tokens.index("trl_jagg.scripts.cli") + 1 :]
        assert rest[:1] == ["train"], tokens
        return rest[1:]
    return None


def test_recipes_page_commands_parse_with_the_train_parser(tmp_path, monkeypatch):
    from trl_jagg.scripts.launch import split_launch_options
    from trl_jagg.scripts.train import DATASET_FILE_TYPES, parse_train_args

    commands = shell_commands(RECIPES_PAGE)
    trains = [(tokens, train_argv(tokens)) for tokens in commands]
    trains = [(tokens, argv) for tokens, argv in trains if argv is not None]
    assert len(trains) >= 10  # every recipe of the page has at least one
    presets = set()
    for tokens, argv in trains:
        if "--config_file" in tokens:
            config_file = tokens[tokens.index("--config_file") + 1]
            assert (ROOT / config_file).is_file(), f"docs/recipes.md names a missing {config_file}"
        # The launch options go to accelerate (with --accelerate_config); the rest is what each process parses.
        _, rest = split_launch_options(argv)
        # The prompt files the commands name are the reader's: stand-ins in an empty folder.
        monkeypatch.chdir(tmp_path)
        for token in rest:
            if token.lower().endswith(DATASET_FILE_TYPES):
                (tmp_path / token).write_text("a prompt\n")
        # The recipes target GPUs; mixed precision cannot be validated on a CPU-only machine.
        script_args, args = parse_train_args([*rest, "--bf16", "false", "--fp16", "false"])
        assert script_args.model_name_or_path and script_args.reward_funcs and args.output_dir, tokens
        presets.add(script_args.recipe)
    # The combinations the page promises.
    assert {
        "flow-grpo-flux", "dancegrpo-flux-8gpu", "flow-grpo-sd35-geneval", "flow-grpo-sd35-ocr", "nft-sd35",
        "flow-grpo-qwenimage-edit", "flow-grpo-wan2.1", "flow-factory-wan2.2", "mixgrpo-flux",
    } <= presets  # fmt: skip


def test_recipes_page_names_only_existing_presets():
    from trl_jagg.recipes import RECIPES

    text = RECIPES_PAGE.read_text()
    for name in re.findall(r"--recipe ([\w.-]+)", text):
        assert name in RECIPES, f"docs/recipes.md names an unknown preset {name}"
