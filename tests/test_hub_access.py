"""A model id or reward repo that is gated, unknown or (offline) not cached fails early with the project's own message:
what to do (accept the license and log in, fix the id, set up the cache or a local path), naming the repo and, for a
reward, the reward; before the pipeline loads. The Hub is played by patching the functions that reach it."""

from __future__ import annotations

import importlib

import huggingface_hub.constants
import huggingface_hub.file_download
import pytest
from huggingface_hub import errors

import trl_jagg.trainer.ddpo_jagg_trainer as trainer_module
from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.models import load_adapter
from trl_jagg.rewards import hpsv2, load_reward_funcs, pickscore
from trl_jagg.scripts import cli

GATED = "black-forest-labs/FLUX.1-dev"


def http_error(kind: type[errors.HfHubHTTPError], status: int) -> errors.HfHubHTTPError:
    """The Hub's answer as huggingface_hub raises it (its response class, from its own HTTP library)."""
    http = importlib.import_module(errors.Response.__module__.split(".")[0])
    response = errors.Response(status, request=http.Request("HEAD", "https://huggingface.co/x"))
    return kind("answered by the test", response=response)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """Nothing is cached: every Hub id must come from the (patched) Hub."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


@pytest.fixture
def offline(empty_cache, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def hub_answers(empty_cache, monkeypatch):
    """Online, with the Hub answering every file request with the error given."""

    def install(error: Exception) -> None:
        def answer(*args, **kwargs):
            raise error

        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        # Wherever the metadata request is made from: huggingface_hub's downloads and trl_jagg's check.
        monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", answer)
        monkeypatch.setattr("trl_jagg.utils.hub_access.get_hf_file_metadata", answer, raising=False)

    return install


# ---------------------------------------------------------------- model ids (load_adapter: every entry point)
def test_offline_uncached_model_id_names_offline_mode_and_the_local_path_form(offline):
    with pytest.raises(OSError, match=r"'someone/uncached-pipeline' is not in the local Hugging Face cache") as info:
        load_adapter("someone/uncached-pipeline")
    assert "HF_HUB_OFFLINE=1" in str(info.value) and "path of a local directory" in str(info.value)


def test_gated_model_id_names_the_license_and_the_login(hub_answers):
    hub_answers(http_error(errors.GatedRepoError, 403))
    with pytest.raises(OSError, match=f"model '{GATED}' is gated") as info:
        load_adapter(GATED)
    message = str(info.value)
    assert f"https://huggingface.co/{GATED}" in message
    assert "hf auth login" in message and "HF_TOKEN" in message


def test_unknown_model_id_says_so(hub_answers):
    hub_answers(http_error(errors.RepositoryNotFoundError, 404))
    with pytest.raises(OSError, match="'someone/no-such-model' is neither a local directory nor a repository"):
        load_adapter("someone/no-such-model")


@pytest.mark.parametrize(
    ("model", "match"),
    [
        ("./no/such/pipeline", "is written as a path, but no such directory exists"),
        ("not a valid id!", "is neither a local directory nor a repository"),
    ],
)
def test_missing_local_path_or_malformed_id(offline, model, match):
    with pytest.raises(OSError, match=match):
        load_adapter(model)


@pytest.mark.parametrize("peft", [[], ["--use_peft", "true"]], ids=["full", "lora-default-targets"])
def test_the_cli_prints_the_message_on_one_line(offline, tmp_path, capsys, peft):
    # `--use_peft` without targets reads the pipeline class for the family's default targets: checked there too.
    argv = ["train", "--model_name_or_path", "someone/uncached-pipeline", "--reward_funcs", "prompt_color",
            "--prompts", "a red circle", "--output_dir", str(tmp_path / "out"), "--report_to", "none", *peft]  # fmt: skip
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "'someone/uncached-pipeline' is not in the local Hugging Face cache" in err and "Traceback" not in err


def test_a_cached_or_local_model_passes_the_check(tiny_flux_path):
    assert type(load_adapter(str(tiny_flux_path))).__name__ == "FluxAdapter"


# ---------------------------------------------------------------- reward weights: checked when rewards are built
@pytest.fixture
def no_model_load(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the reward weights were checked")

    monkeypatch.setattr(trainer_module, "load_adapter", fail)


def make_args(tmp_path) -> GRPOJaggConfig:
    return GRPOJaggConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, report_to="none")


def test_offline_reward_weights_fail_before_the_pipeline_loads(tmp_path, offline, no_model_load):
    local_model = str(tmp_path)  # a local folder passes the model's check; its pipeline is never loaded here
    with pytest.raises(OSError, match=r"reward 'pickscore': model 'yuvalkirstain/PickScore_v1' is not in the local"):
        DDPOJaggTrainer(local_model, "pickscore", args=make_args(tmp_path), train_dataset=["a", "b"])


def test_an_unreachable_model_is_named_before_an_unreachable_reward(tmp_path, offline, no_model_load):
    with pytest.raises(OSError, match=rf"^model '{GATED}' is not in the local Hugging Face cache"):
        DDPOJaggTrainer(GATED, "pickscore", args=make_args(tmp_path), train_dataset=["a", "b"])


def test_gated_reward_weights_name_the_reward_and_the_repo(hub_answers):
    hub_answers(http_error(errors.GatedRepoError, 403))
    reward = hpsv2(device="cpu")
    with pytest.raises(OSError, match=r"reward 'hpsv2.1': model 'xswu/HPSv2' is gated") as info:
        reward.check_weights()
    assert "hf auth login" in str(info.value)


def test_missing_reward_file_names_the_file(hub_answers):
    hub_answers(http_error(errors.RemoteEntryNotFoundError, 404))
    with pytest.raises(OSError, match=r"reward 'hpsv2.1': model 'xswu/HPSv2' has no file 'HPS_v2.1_compressed.pt'"):
        hpsv2(device="cpu").check_weights()


def test_local_reward_weights_pass(tmp_path, offline):
    (tmp_path / "clip").mkdir()
    [reward] = load_reward_funcs([pickscore(model_id=str(tmp_path / "clip"), processor_id=str(tmp_path / "clip"))])
    reward.check_weights()  # a local directory is the loader's business: nothing to reach


def test_unreachable_hub_is_named(hub_answers):
    hub_answers(ConnectionResetError("no route"))
    with pytest.raises(OSError, match=r"could not be reached \(ConnectionResetError\).*HF_HUB_OFFLINE=1"):
        hpsv2(device="cpu").check_weights()
