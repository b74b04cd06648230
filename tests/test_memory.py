"""Memory and scale controls of the trainer: gradient checkpointing, frozen components off the accelerator,
precomputed prompt embeddings, and the backward wiring under DeepSpeed. Each must leave the update's gradient (or the
rollout) unchanged."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from testing_utils import run_update

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

PROMPTS = ["a red circle", "a green square"]


def make_trainer(path: str, output_dir, *, lora: bool = True, **overrides) -> DDPOJaggTrainer:
    args = GRPOJaggConfig(
        output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=2, num_inference_steps=4,
        height=32, width=32, max_steps=1, learning_rate=1e-2, epsilon=0.1, jagg_group_size=2, jagg_frac=1.0,
        max_sequence_length=16, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=1,
        **overrides,
    )  # fmt: skip
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"], init_lora_weights=False)
    return DDPOJaggTrainer(
        model=path, reward_funcs="prompt_color", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=peft_config if lora else None,
    )  # fmt: skip


def update_gradients(trainer: DDPOJaggTrainer, batch: dict) -> dict[str, torch.Tensor]:
    trainer.model.zero_grad(set_to_none=True)
    run_update(trainer, trainer.model, batch)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_gradient_checkpointing_gives_the_same_gradient(tiny_flux_path, tmp_path, lora):
    """diffusers' gradient checkpointing recomputes each block in the backward (counted here), and the update's
    gradient equals the one without it to 1e-6."""
    plain = make_trainer(tiny_flux_path, tmp_path / "plain", lora=lora, beta=0.1)
    batch = plain._generate_and_score([{"prompt": p} for p in PROMPTS for _ in range(2)])
    expected = update_gradients(plain, batch)

    checkpointed = make_trainer(tiny_flux_path, tmp_path / "ckpt", lora=lora, beta=0.1, gradient_checkpointing=True)
    assert checkpointed.model.gradient_checkpointing
    calls = []
    checkpointed.model.transformer_blocks[0].register_forward_pre_hook(lambda *_: calls.append("ckpt"))
    got = update_gradients(checkpointed, batch)
    plain.model.transformer_blocks[0].register_forward_pre_hook(lambda *_: calls.append("plain"))
    update_gradients(plain, batch)
    # Checkpointing re-runs the block in the backward (a pre-hook: the recomputation stops once it has what it needs).
    assert calls.count("ckpt") > calls.count("plain") > 0

    assert got.keys() == expected.keys() and sum(g.abs().sum() for g in expected.values()) > 0
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-6, msg=name)


def test_every_nth_block_checkpointing_recomputes_those_blocks_with_the_same_gradient(tiny_flux_path, tmp_path):
    """activation_checkpointing_kwargs={"every_n_layers": 2}: blocks 0, 2, 4, ... of the joint then single-stream
    blocks (module order) run again in the backward, the others do not, and the gradient is the one without
    checkpointing."""
    plain = make_trainer(tiny_flux_path, tmp_path / "plain", lora=False, beta=0.1)
    batch = plain._generate_and_score([{"prompt": p} for p in PROMPTS for _ in range(2)])
    expected = update_gradients(plain, batch)
    every_2nd = make_trainer(
        tiny_flux_path, tmp_path / "every2", lora=False, beta=0.1, activation_checkpointing=True,
        activation_checkpointing_kwargs={"every_n_layers": 2},
    )  # fmt: skip

    def block_calls(trainer: DDPOJaggTrainer) -> list[int]:
        model = trainer.model
        blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
        calls = [0] * len(blocks)
        handles = [
            block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
            for i, block in enumerate(blocks)
        ]
        got = update_gradients(trainer, batch)
        for handle in handles:
            handle.remove()
        return calls, got

    plain_calls, _ = block_calls(plain)
    calls, got = block_calls(every_2nd)
    assert len(calls) >= 2 and min(plain_calls) > 0  # tiny Flux: one joint and one single-stream block
    for i, (n, n_plain) in enumerate(zip(calls, plain_calls)):
        assert n > n_plain if i % 2 == 0 else n == n_plain, (i, calls, plain_calls)

    assert got.keys() == expected.keys() and sum(g.abs().sum() for g in expected.values()) > 0
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    "overrides",
    [
        {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": 0}},
        {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"offload": True}},
        {"activation_checkpointing_kwargs": {"every_n_layers": 2}},  # no checkpointing to thin out
    ],
    ids=["zero", "unknown-key", "without-checkpointing"],
)
def test_bad_activation_checkpointing_kwargs_are_refused(tmp_path, overrides):
    with pytest.raises(ValueError, match="GRPOJaggConfig.activation_checkpointing_kwargs"):
        GRPOJaggConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **overrides)


def test_deepspeed_backward_steps_once_per_micro_batch(tiny_flux_path, tmp_path):
    """Under DeepSpeed (simulated: deepspeed is not installed here), accelerate's real DeepSpeedEngineWrapper drives
    an engine that records its calls. Several backward units of one update: every call but the last is not an
    accumulation boundary, the engine steps once, DeepSpeed does not divide by the accumulation steps again, and the
    gradient is the one without DeepSpeed. On an accumulation micro-batch (sync off) nothing steps."""
    from unittest import mock

    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    class RecordingEngine:
        def __init__(self):
            self.calls = []

        def set_gradient_accumulation_boundary(self, is_boundary):
            self.calls.append(("boundary", is_boundary))

        def backward(self, loss, **kwargs):
            self.calls.append(("backward", kwargs))
            loss.backward()

        def step(self):
            self.calls.append(("step",))

    trainer = make_trainer(tiny_flux_path, tmp_path)
    batch = trainer._generate_and_score([{"prompt": p} for p in PROMPTS for _ in range(2)])
    expected = update_gradients(trainer, batch)
    engine = RecordingEngine()
    trainer.accelerator.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)
    deepspeed = mock.patch.object(
        Accelerator, "distributed_type", new_callable=mock.PropertyMock, return_value=DistributedType.DEEPSPEED
    )
    with deepspeed:
        got = update_gradients(trainer, batch)
        num_backward = trainer._metrics["jagg/backward_calls"][-1]
        assert num_backward >= 2
        boundaries = [c[1] for c in engine.calls if c[0] == "boundary"]
        assert boundaries == [False] * (num_backward - 1) + [True]
        assert [c for c in engine.calls if c[0] == "step"] == [("step",)]
        assert all(c[1] == {"scale_wrt_gas": False} for c in engine.calls if c[0] == "backward")
        assert engine.calls[-1] == ("step",)
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-6, msg=name)

        engine.calls.clear()
        trainer.accelerator.gradient_state._set_sync_gradients(False)  # a micro-batch before the last of a window
        try:
            update_gradients(trainer, batch)
        finally:
            trainer.accelerator.gradient_state._set_sync_gradients(True)
        assert not any(c[0] == "step" for c in engine.calls)
        assert {c[1] for c in engine.calls if c[0] == "boundary"} == {False}
    assert trainer.accelerator.gradient_state.sync_gradients


def _spy_placement(modules: dict[str, torch.nn.Module], events: list) -> None:
    """Record every ``.to(device)`` of ``modules`` and every forward call with the device last requested."""
    for name, module in modules.items():
        original = module.to
        state = {"device": "initial"}

        def to(*args, _original=original, _state=state, _name=name, **kwargs):
            _state["device"] = str(args[0] if args else kwargs.get("device"))
            events.append(("to", _name, _state["device"]))
            return _original(*args, **kwargs)

        module.to = to
        runs = getattr(module, "decoder", module)  # the VAE runs through `decode`, not `forward`
        runs.register_forward_pre_hook(
            lambda *_, _state=state, _name=name: events.append(("run", _name, _state["device"]))
        )


def test_offloaded_frozen_modules_visit_the_accelerator_only_to_run(tiny_flux_path, tmp_path):
    """`offload_frozen_modules`: the VAE and text encoders start on the CPU, are moved to the accelerator right
    before they run and back to the CPU right after (the moves are recorded: on this CPU machine the accelerator is
    the CPU too); the rollout is the one without offloading."""
    kept = make_trainer(tiny_flux_path, tmp_path / "kept")
    expected = kept._generate_and_score([{"prompt": p} for p in PROMPTS for _ in range(2)])
    trainer = make_trainer(tiny_flux_path, tmp_path / "offload", offload_frozen_modules=True)
    pipe = trainer.adapter.pipeline
    modules = {"vae": pipe.vae, "text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}
    assert all(next(m.parameters()).device.type == "cpu" for m in modules.values())
    events = []
    _spy_placement(modules, events)
    got = trainer._generate_and_score([{"prompt": p} for p in PROMPTS for _ in range(2)])
    trainer.sample_images(["a blue circle"])
    device = str(trainer.accelerator.device)
    for name in modules:
        mine = [e for e in events if e[1] == name]
        assert any(e[0] == "run" for e in mine), name
        assert all(e[2] == device for e in mine if e[0] == "run"), mine  # runs only after a move to the accelerator
        moves = [e[2] for e in mine if e[0] == "to"]
        assert moves and moves[-1] == "cpu" and moves[::2] == [device] * len(moves[::2]), (name, moves)
    # Exact on purpose: offloading only moves modules between devices (both the CPU here); the calls are the same.
    for key in ("latents", "log_probs", "advantages"):
        torch.testing.assert_close(getattr(got, key), getattr(expected, key), atol=0, rtol=0)


@pytest.mark.parametrize("family", ["flux", "qwenimage"])
def test_precomputed_prompt_embeds_give_the_same_rollout(tiny_flux_path, tiny_qwenimage_path, tmp_path, family):
    """`precompute_prompt_embeds`: every training prompt is encoded once at start, one at a time; rollouts then run
    no text encoder and equal the ones that encode each batch (Qwen-Image pads prompts of different lengths into a
    batch with a mask, as its pipeline does)."""
    path = tiny_flux_path if family == "flux" else tiny_qwenimage_path
    prompts = ["a red circle", "a green square"] if family == "flux" else ["a red circle", "a very small green square"]
    inputs = [{"prompt": p} for p in prompts for _ in range(2)]
    settings = {"true_cfg_scale": 1.0} if family == "qwenimage" else {}
    plain = make_trainer(path, tmp_path / "plain", **settings)
    expected = plain._generate_and_score(inputs)

    encoder_calls = []
    trainer = make_trainer(path, tmp_path / "table", precompute_prompt_embeds=True, **settings)
    assert sorted(trainer.conditioner.table) == sorted(PROMPTS if family == "flux" else set(PROMPTS))
    pipe = trainer.adapter.pipeline
    for name, module in pipe.components.items():
        if name.startswith("text_encoder") and module is not None:
            module.register_forward_pre_hook(lambda *_: encoder_calls.append(1))
    got = trainer._generate_and_score([{"prompt": p} for p in PROMPTS for _ in range(2)])
    assert encoder_calls == []  # the training prompts come from the table
    if family == "qwenimage":  # a new prompt is encoded once, then batched with the others
        got = trainer._generate_and_score(inputs)
        assert encoder_calls and "a very small green square" in trainer.conditioner.table
        assert "prompt_embeds_mask" in got.cond.per_sample  # the two lengths differ: padded with a mask
    else:
        got = trainer._generate_and_score(inputs)
    for key in ("latents", "log_probs", "advantages"):
        torch.testing.assert_close(getattr(got, key), getattr(expected, key), atol=1e-5, rtol=1e-5, msg=key)
