"""CONTRIBUTING.md's "Private APIs" table names exactly the underscore methods DDPOJaggTrainer overrides: a new
override of a transformers / TRL private method without its entry (and its reason) fails here."""

from __future__ import annotations

import re
from pathlib import Path

from transformers import Trainer
from trl.trainer.base_trainer import _BaseTrainer

from trl_jagg import DDPOJaggTrainer

CONTRIBUTING = Path(__file__).resolve().parents[1] / "CONTRIBUTING.md"
BASES = {"Trainer": Trainer, "_BaseTrainer": _BaseTrainer}


def _listed() -> dict[str, str]:
    """The table's rows: override name -> the base class named beside it."""
    text = CONTRIBUTING.read_text()
    section = text[text.index("## Private APIs") :]
    section = section[: section.index("\n## ")]
    return dict(re.findall(r"^\| `(_\w+)` \| `(\w+)` \| \S", section, flags=re.MULTILINE))


def _private_overrides(cls: type) -> set[str]:
    """The single-underscore methods ``cls`` defines itself that one of its bases also defines."""
    bases = cls.__mro__[1:]
    return {
        name
        for name, value in vars(cls).items()
        if name.startswith("_")
        and not name.startswith("__")
        and callable(value)
        and any(name in vars(base) for base in bases)
    }


def test_the_table_lists_every_private_override_and_nothing_else():
    listed = _listed()
    overrides = _private_overrides(DDPOJaggTrainer)
    assert set(listed) - overrides == set(), "listed in CONTRIBUTING.md but no longer overridden: remove the rows"
    assert overrides - set(listed) == set(), "overridden without a row in CONTRIBUTING.md's Private APIs: add why"
    for name, base in listed.items():  # the base named is the one that defines the method
        assert name in vars(BASES[base]), f"{name} is not {base}'s"


def test_the_introspection_finds_an_override_and_skips_own_methods():
    # Without this, an introspection that found nothing would let the table shrink to nothing.
    class Sub(Trainer):
        def _save(self, output_dir=None, state_dict=None):  # an override
            pass

        def _own_helper(self):  # not a base's
            pass

        _tag_names = ["x"]  # an attribute, not a method

    assert _private_overrides(Sub) == {"_save"}
