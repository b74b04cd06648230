"""``trl-jagg train`` answers before its heavy imports: a typo, an unknown YAML key, ``--help`` and an unreachable
model are reported before trl, transformers, diffusers or peft are imported (from the parser's snapshot), and the
answers are those of the full parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trl_jagg.scripts import cli, train, train_snapshot

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
        "trl_jagg/scripts/train_parser.json is stale: run `python -m trl_jagg.scripts.train_snapshot`"
    )
    saved, built = train_snapshot.load_snapshot(), train_snapshot.build_snapshot()
    assert saved["options"] == built["options"] and saved["help"] == built["help"]


def test_typos_help_and_an_unreachable_model_come_before_the_heavy_imports(tmp_path):
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
    assert model["code"] == 1 and "someone/not-cached" in model["err"]
    assert model["imported"] == [], model  # every run above came first: nothing heavy was imported by any


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
