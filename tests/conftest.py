"""Shared pytest setup: offline Hugging Face Hub, few CPU threads, and tiny pipelines saved once per session."""

from __future__ import annotations

import os

# Must be set before huggingface_hub is imported (it reads the variable at import time): nothing may be downloaded.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from trl_jagg.models.families import FAMILIES  # noqa: E402  (imports nothing heavy)

# The tiny models run tens of microsecond-sized kernels; on a shared 2-core machine extra intra-op threads spin and
# wait on each other and make them 10-50x slower, so tests run single-threaded.
torch.set_num_threads(1)


def _tiny_path_fixture(family: str):
    """The session fixture ``tiny_<family>_path``: the directory of the family's tiny pipeline (seed 0, default
    vocabulary), saved on first use; load it with ``from_pretrained`` like a Hub id."""

    @pytest.fixture(scope="session", name=f"tiny_{family}_path")
    def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
        # Imported here so that test modules that do not need diffusers do not pay for importing it at collection.
        from trl_jagg.testing.tiny_models import save_tiny_pipeline

        return save_tiny_pipeline(family, tmp_path_factory.mktemp(f"tiny-{family}"), seed=0)

    return tiny_path


# One fixture per family record (trl_jagg/models/families.py): a new family gets its fixture with its record.
for _record in FAMILIES:
    globals()[f"tiny_{_record.name}_path"] = _tiny_path_fixture(_record.name)


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B in offline mode writing under ``tmp_path/wandb``. W&B reads ``WANDB_DIR`` once per process into its
    settings singleton, so an earlier test on the same worker would otherwise keep its own folder: the singleton is
    torn down before (to re-read the variables) and after (to leave none behind)."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()
    yield wandb
    wandb.finish()
    wandb.teardown()
