"""Shared pytest setup: offline Hugging Face Hub, few CPU threads, and tiny pipelines saved once per session."""

from __future__ import annotations

import os

# Must be set before huggingface_hub is imported (it reads the variable at import time): nothing may be downloaded.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# The tiny models run tens of microsecond-sized kernels; on a shared 2-core machine extra intra-op threads spin and
# wait on each other and make them 10-50x slower, so tests run single-threaded.
torch.set_num_threads(1)


def _save_tiny(family: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    # Imported here so that test modules that do not need diffusers do not pay for importing it at collection.
    from trl_jagg.testing.tiny_models import save_tiny_pipeline

    return save_tiny_pipeline(family, tmp_path_factory.mktemp(f"tiny-{family}"), seed=0)


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny ``FluxPipeline`` (seed 0, default vocabulary); load with ``from_pretrained``."""
    return _save_tiny("flux", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny ``StableDiffusion3Pipeline`` (seed 0, default vocabulary)."""
    return _save_tiny("sd3", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwenimage_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny ``QwenImagePipeline`` (seed 0, default vocabulary)."""
    return _save_tiny("qwenimage", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_zimage_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny ``ZImagePipeline`` (seed 0, default vocabulary)."""
    return _save_tiny("zimage", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_flux2_klein_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny ``Flux2KleinPipeline`` (the base model with CFG; seed 0, default vocabulary)."""
    return _save_tiny("flux2_klein", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_flux2_dev_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny ``Flux2Pipeline`` (FLUX.2 dev: embedded guidance; seed 0, default vocabulary)."""
    return _save_tiny("flux2_dev", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_flux_kontext_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny ``FluxKontextPipeline`` (image editing; seed 0, default vocabulary)."""
    return _save_tiny("flux_kontext", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwenimage_edit_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny ``QwenImageEditPipeline`` (one source image; seed 0, default vocabulary)."""
    return _save_tiny("qwenimage_edit", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwenimage_edit_plus_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny ``QwenImageEditPlusPipeline`` (several source images; seed 0, default vocabulary)."""
    return _save_tiny("qwenimage_edit_plus", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_wan_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny ``WanPipeline`` (Wan2.1 text-to-video; seed 0, default vocabulary)."""
    return _save_tiny("wan", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_wan22_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Wan2.2 A14B-like pipeline (two experts, boundary_ratio 0.8) saved to disk."""
    return _save_tiny("wan22", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_wan22_ti2v_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Wan2.2 TI2V-5B-like pipeline (`expand_timesteps`, the 48-channel Wan2.2 VAE) saved to disk."""
    return _save_tiny("wan22_ti2v", tmp_path_factory)


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
