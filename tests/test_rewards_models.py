"""Model-backed rewards on tiny random models of the real architectures, loaded through each reward's own code.

Each score is compared with a direct computation written here (from the published scoring code's definition),
and with itself across batch sizes. Random weights carry no semantics, so "better-matching pair scores higher"
is checked where it can be built by hand (CLIPScore's clamp via a sign-flipped text projection).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

import trl_jagg.rewards as rewards

PROMPTS = ["a red cat", "a photo of a blue dog", "green", "an image of a cat on a very long prompt " * 3]
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def make_images(count: int = 4, seed: int = 0) -> list[Image.Image]:
    """Random images of varied sizes and aspect ratios (so resizing and cropping are exercised)."""
    rng = np.random.default_rng(seed)
    sizes = [(40, 40), (56, 40), (40, 72), (33, 47)]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in (sizes * count)[:count]]


def clip_transform(size: int):
    """The CLIP eval transform (short side to ``size`` bicubic, centre crop, CLIP statistics)."""
    from torchvision import transforms

    return transforms.Compose(
        [
            transforms.Resize(size, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize(CLIP_MEAN, CLIP_STD),
        ]
    )


def assert_batch_invariant(factory, prompts, images):
    one = factory(batch_size=1)(prompts, images)
    four = factory(batch_size=4)(prompts, images)
    assert one == pytest.approx(four, abs=1e-4)
    return one


# ----------------------------------------------------------------------------------------------- tiny CLIP


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-to-printable-character table, for a byte-level BPE vocabulary built in code."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    """A tiny transformers CLIPModel + CLIPProcessor saved like a Hub repo; logit_scale is set away from its
    default so that a reward using a hard-coded scale would fail."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    chars = list(bytes_to_unicode().values())
    vocab = {token: index for index, token in enumerate(chars + [c + "</w>" for c in chars])}
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    special = {"bos_token_id": vocab["<|startoftext|>"], "eos_token_id": vocab["<|endoftext|>"]}
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(vocab),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            pad_token_id=special["eos_token_id"],
            **special,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=16,
    )
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(42.0))
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
    )
    path = tmp_path_factory.mktemp("tiny_clip")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    # The same model with its text projection negated: every cosine flips sign.
    with torch.no_grad():
        model.text_projection.weight.neg_()
    flipped = tmp_path_factory.mktemp("tiny_clip_flipped")
    model.save_pretrained(flipped)
    processor.save_pretrained(flipped)
    return str(path), str(flipped)


def reference_clip_cosine(model_dir: str, prompts: list[str], images: list[Image.Image]) -> torch.Tensor:
    """Cosine of each (prompt, image) pair computed straight from the saved model, one pair at a time."""
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(model_dir).eval(), CLIPProcessor.from_pretrained(model_dir)
    cosines = []
    with torch.no_grad():
        for prompt, image in zip(prompts, images):
            inputs = processor(text=[prompt], images=[image], return_tensors="pt", truncation=True)
            outputs = model(**inputs)  # CLIPModel's forward normalises both embeddings
            cosines.append((outputs.image_embeds * outputs.text_embeds).sum())
    return torch.stack(cosines)


def test_pickscore_is_logit_scale_times_cosine(tiny_clip_dir):
    path, _ = tiny_clip_dir
    prompts, images = PROMPTS, make_images()
    # Every prompt against every image, so a reward that mixed up the pairing would fail.
    all_prompts = [p for p in prompts for _ in images]
    all_images = [im for _ in prompts for im in images]
    scores = assert_batch_invariant(
        lambda batch_size: rewards.pickscore(device="cpu", model_id=path, processor_id=path, batch_size=batch_size),
        all_prompts,
        all_images,
    )
    expected = 42.0 * reference_clip_cosine(path, all_prompts, all_images)
    assert scores == pytest.approx(expected.tolist(), abs=1e-4)
    assert len(set(np.round(scores, 4))) > len(images)  # scores depend on both prompt and image


def test_clipscore_is_100_times_clamped_cosine(tiny_clip_dir):
    path, flipped = tiny_clip_dir
    prompts, images = PROMPTS, make_images()
    scores = assert_batch_invariant(
        lambda batch_size: rewards.clip_score(device="cpu", model_id=path, batch_size=batch_size), prompts, images
    )
    cosine = reference_clip_cosine(path, prompts, images)
    assert scores == pytest.approx((100 * cosine.clamp(min=0)).tolist(), abs=1e-4)
    # Hand-built contrast: negating the text projection flips every cosine; exactly the pairs that matched
    # (cos > 0) score positive under one model and 0 under the other, and the difference is 100 * cos.
    flipped_scores = rewards.clip_score(device="cpu", model_id=flipped)(prompts, images)
    for score, flipped_score, cos in zip(scores, flipped_scores, cosine.tolist()):
        assert min(score, flipped_score) == 0.0
        assert score - flipped_score == pytest.approx(100 * cos, abs=1e-4)


# ----------------------------------------------------------------------------------------------- clip-edit


def reference_edit_terms(model_dir: str, directions: list, outputs: list, sources: list) -> tuple[list, list]:
    """InstructPix2Pix's directional and image similarity written out from CLIPModel's forward (which returns
    L2-normalised embeddings), one edit at a time: ``directions[i]`` is a text or a (source, target) caption pair."""
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(model_dir).eval(), CLIPProcessor.from_pretrained(model_dir)
    direction_terms, preservation_terms = [], []
    with torch.no_grad():
        for texts, output, source in zip(directions, outputs, sources):
            texts = [texts] if isinstance(texts, str) else list(texts)
            inputs = processor(text=texts, images=[source, output], return_tensors="pt", padding=True)
            result = model(**inputs)
            source_embed, output_embed = result.image_embeds
            text = result.text_embeds[0] if len(texts) == 1 else result.text_embeds[1] - result.text_embeds[0]
            change = output_embed - source_embed
            direction_terms.append(float(change @ text / (change.norm() * text.norm())))
            preservation_terms.append(float(source_embed @ output_embed))
    return direction_terms, preservation_terms


def test_clip_edit_is_directional_plus_preservation_similarity(tiny_clip_dir):
    path, _ = tiny_clip_dir
    instructions = ["make it red", "add a dog", "turn it green", "make it night"]
    sources, outputs = make_images(seed=1), make_images(seed=2)
    logged = {}
    reward = rewards.clip_edit(
        device="cpu", model_id=path, direction_weight=2.0, preservation_weight=0.5, batch_size=3
    )
    scores = reward(instructions, outputs, source_images=sources, log_metric=logged.__setitem__)
    direction, preservation = reference_edit_terms(path, instructions, outputs, sources)
    expected = [2.0 * d + 0.5 * p for d, p in zip(direction, preservation)]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert logged["clip-edit/direction"] == pytest.approx(np.mean(direction), abs=1e-4)
    assert logged["clip-edit/preservation"] == pytest.approx(np.mean(preservation), abs=1e-4)
    # With the dataset's captions the text direction is target - source.
    captions = {"source_caption": ["a cat", "a room", "a tree", "a street"],
                "target_caption": ["a red cat", "a room with a dog", "a green tree", "a street at night"]}  # fmt: skip
    with_captions = reward(instructions, outputs, source_images=sources, **captions)
    pairs = list(zip(captions["source_caption"], captions["target_caption"]))
    direction, preservation = reference_edit_terms(path, pairs, outputs, sources)
    assert with_captions == pytest.approx([2.0 * d + 0.5 * p for d, p in zip(direction, preservation)], abs=1e-4)
    # An unchanged image moves nowhere (direction 0) and keeps everything (preservation 1).
    assert reward(instructions[:1], sources[:1], source_images=sources[:1]) == pytest.approx([0.5], abs=1e-5)


def test_clip_edit_by_name_and_its_errors(tiny_clip_dir):
    path, _ = tiny_clip_dir
    [reward] = rewards.load_reward_funcs(["clip-edit"], model_id=path, device="cpu")
    images = make_images(2)
    assert reward.__name__ == "clip-edit" and len(reward(["make it red"] * 2, images, source_images=images)) == 2
    # Flow-GRPO's image_similarity: the preservation term alone, under its own name.
    [similarity] = rewards.load_reward_funcs("clip-image-similarity", model_id=path, device="cpu")
    sources = make_images(2, seed=3)
    _, preservation = reference_edit_terms(path, ["make it red"] * 2, images, sources)
    assert similarity.__name__ == "clip-image-similarity"
    assert similarity(["make it red"] * 2, images, source_images=sources) == pytest.approx(preservation, abs=1e-4)
    with pytest.raises(ValueError, match="needs `source_images`, one per image"):
        reward(["make it red"] * 2, images)
    with pytest.raises(ValueError, match="only one of the `source_caption` and `target_caption`"):
        reward(["make it red"] * 2, images, source_images=images, source_caption=["a", "b"])
    with pytest.raises(ValueError, match="both 0"):
        rewards.clip_edit(direction_weight=0, preservation_weight=0)
    with pytest.raises(ValueError, match="preservation_weight is nan"):
        rewards.clip_edit(preservation_weight=float("nan"))


# ----------------------------------------------------------------------------------------------- aesthetic


@pytest.fixture(scope="module")
def aesthetic_head(tmp_path_factory) -> tuple[str, nn.Module]:
    """A random head in the improved-aesthetic-predictor layout (Linear layers at 0, 2, 4, 6, 7 of ``layers``)."""
    torch.manual_seed(1)
    head = nn.Module()
    head.layers = nn.Sequential(
        nn.Linear(16, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2), nn.Linear(128, 64)
    )
    head.layers.extend([nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1)])
    path = tmp_path_factory.mktemp("aesthetic") / "head.pth"
    torch.save(head.state_dict(), path)
    return str(path), head.eval()


def test_aesthetic_is_the_mlp_on_normalised_clip_image_embeddings(tiny_clip_dir, aesthetic_head):
    from transformers import CLIPModel, CLIPProcessor

    path, _ = tiny_clip_dir
    head_path, head = aesthetic_head
    images = make_images()
    scores = assert_batch_invariant(
        lambda batch_size: rewards.aesthetic(device="cpu", clip_id=path, head_path=head_path, batch_size=batch_size),
        ["ignored"] * 4,
        images,
    )
    model, processor = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    with torch.no_grad():
        embeds = model(**processor(text=["x"] * 4, images=images, return_tensors="pt", padding=True)).image_embeds
        expected = head.layers(embeds).squeeze(-1)  # image_embeds are already L2-normalised
    assert scores == pytest.approx(expected.tolist(), abs=1e-5)
    assert rewards.aesthetic(device="cpu", clip_id=path, head_path=head_path)(
        ["a", "completely different prompt"], images[:2]
    ) == pytest.approx(scores[:2], abs=1e-5)  # the prompt plays no part


# ----------------------------------------------------------------------------------------------- HPSv2.1


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    """A tiny open_clip CLIP saved as an HPS-style checkpoint, with its architecture in a ``local-dir``."""
    open_clip = pytest.importorskip("open_clip")
    model_cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
    }
    path = tmp_path_factory.mktemp("hps")
    (path / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg}))
    torch.manual_seed(2)
    model = open_clip.CLIP(**model_cfg).eval()
    # HPS checkpoints are training checkpoints: the weights sit under "state_dict" next to other entries.
    torch.save({"epoch": 1, "state_dict": model.state_dict()}, path / "HPS_v2.1_compressed.pt")
    kwargs = {"checkpoint": str(path / "HPS_v2.1_compressed.pt"), "model_name": f"local-dir:{path}"}
    return kwargs, model


def test_hpsv21_through_open_clip_matches_the_reference(tiny_hps):
    import open_clip

    kwargs, model = tiny_hps
    prompts, images = PROMPTS, make_images()
    scores = assert_batch_invariant(
        lambda batch_size: rewards.hpsv2(device="cpu", batch_size=batch_size, **kwargs), prompts, images
    )
    # hpsv2.score: image_features @ text_features.T on open_clip's normalised features, diagonal taken.
    transform = clip_transform(32)
    with torch.no_grad():
        image_features, text_features, _ = model(
            torch.stack([transform(im) for im in images]), open_clip.tokenize(prompts)
        )
        expected = torch.diagonal(image_features @ text_features.T)
    assert scores == pytest.approx(expected.tolist(), abs=1e-5)


# ----------------------------------------------------------------------------------------------- ImageReward

VISION_WIDTH, VISION_HEADS, VISION_DEPTH, PATCH, IMAGE_SIZE = 24, 2, 2, 8, 32
TEXT_WIDTH, TEXT_HEADS, TEXT_DEPTH = 32, 2, 2
IR_MEAN, IR_STD = 0.16717362830052426, 1.0333394966054072


def random_blip_state_dict(vocab_size: int) -> dict[str, torch.Tensor]:
    """An ImageReward.pt-layout state dict (BLIP's own key names) with random weights."""
    generator = torch.Generator().manual_seed(3)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=generator) * scale

    def layer_norm(prefix, width):
        return {f"{prefix}.weight": 1 + rand(width, scale=0.1), f"{prefix}.bias": rand(width, scale=0.1)}

    def linear(prefix, fan_in, fan_out):
        return {f"{prefix}.weight": rand(fan_out, fan_in, scale=fan_in**-0.5), f"{prefix}.bias": rand(fan_out)}

    grid = IMAGE_SIZE // PATCH
    vit = {
        "cls_token": rand(1, 1, VISION_WIDTH),
        "pos_embed": rand(1, grid * grid + 1, VISION_WIDTH),
        "patch_embed.proj.weight": rand(VISION_WIDTH, 3, PATCH, PATCH, scale=0.1),
        "patch_embed.proj.bias": rand(VISION_WIDTH),
        **layer_norm("norm", VISION_WIDTH),
    }
    for i in range(VISION_DEPTH):
        vit.update(layer_norm(f"blocks.{i}.norm1", VISION_WIDTH))
        vit.update(linear(f"blocks.{i}.attn.qkv", VISION_WIDTH, 3 * VISION_WIDTH))
        vit.update(linear(f"blocks.{i}.attn.proj", VISION_WIDTH, VISION_WIDTH))
        vit.update(layer_norm(f"blocks.{i}.norm2", VISION_WIDTH))
        vit.update(linear(f"blocks.{i}.mlp.fc1", VISION_WIDTH, 4 * VISION_WIDTH))
        vit.update(linear(f"blocks.{i}.mlp.fc2", 4 * VISION_WIDTH, VISION_WIDTH))
    bert = {
        "embeddings.word_embeddings.weight": rand(vocab_size, TEXT_WIDTH),
        "embeddings.position_embeddings.weight": rand(40, TEXT_WIDTH),
        "embeddings.position_ids": torch.arange(40).unsqueeze(0),  # a persistent buffer in BLIP's med.py
        **layer_norm("embeddings.LayerNorm", TEXT_WIDTH),
    }
    for i in range(TEXT_DEPTH):
        for kind, key_width in (("attention", TEXT_WIDTH), ("crossattention", VISION_WIDTH)):
            prefix = f"encoder.layer.{i}.{kind}"
            bert.update(linear(f"{prefix}.self.query", TEXT_WIDTH, TEXT_WIDTH))
            bert.update(linear(f"{prefix}.self.key", key_width, TEXT_WIDTH))
            bert.update(linear(f"{prefix}.self.value", key_width, TEXT_WIDTH))
            bert.update(linear(f"{prefix}.output.dense", TEXT_WIDTH, TEXT_WIDTH))
            bert.update(layer_norm(f"{prefix}.output.LayerNorm", TEXT_WIDTH))
        bert.update(linear(f"encoder.layer.{i}.intermediate.dense", TEXT_WIDTH, 2 * TEXT_WIDTH))
        bert.update(linear(f"encoder.layer.{i}.output.dense", 2 * TEXT_WIDTH, TEXT_WIDTH))
        bert.update(layer_norm(f"encoder.layer.{i}.output.LayerNorm", TEXT_WIDTH))
    mlp = {}
    for index, (fan_in, fan_out) in zip(
        (0, 2, 4, 6, 7), ((TEXT_WIDTH, 1024), (1024, 128), (128, 64), (64, 16), (16, 1))
    ):
        mlp.update(linear(f"layers.{index}", fan_in, fan_out))
    state = {f"blip.visual_encoder.{k}": v for k, v in vit.items()}
    state.update({f"blip.text_encoder.{k}": v for k, v in bert.items()})
    state.update({f"mlp.{k}": v for k, v in mlp.items()})
    # BLIP's contrastive projections are in the checkpoint but unused by ImageReward.
    state.update(linear("blip.vision_proj", VISION_WIDTH, 8) | linear("blip.text_proj", TEXT_WIDTH, 8))
    return state


def reference_vit(sd: dict[str, torch.Tensor], pixels: torch.Tensor) -> torch.Tensor:
    """BLIP's ViT forward (pre-norm blocks, LayerNorm eps 1e-6, final norm) written from its definition."""
    x = F.conv2d(pixels, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=PATCH)
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([sd["cls_token"].expand(len(x), -1, -1), x], dim=1) + sd["pos_embed"]
    batch, tokens, width = x.shape
    head_dim = width // VISION_HEADS

    def ln(name, value):
        return F.layer_norm(value, (width,), sd[f"{name}.weight"], sd[f"{name}.bias"], eps=1e-6)

    for i in range(VISION_DEPTH):
        p = f"blocks.{i}"
        qkv = F.linear(ln(f"{p}.norm1", x), sd[f"{p}.attn.qkv.weight"], sd[f"{p}.attn.qkv.bias"])
        q, k, v = qkv.reshape(batch, tokens, 3, VISION_HEADS, head_dim).permute(2, 0, 3, 1, 4)
        attention = (q @ k.transpose(-2, -1) * head_dim**-0.5).softmax(dim=-1)
        mixed = (attention @ v).transpose(1, 2).reshape(batch, tokens, width)
        x = x + F.linear(mixed, sd[f"{p}.attn.proj.weight"], sd[f"{p}.attn.proj.bias"])
        hidden = F.gelu(F.linear(ln(f"{p}.norm2", x), sd[f"{p}.mlp.fc1.weight"], sd[f"{p}.mlp.fc1.bias"]))
        x = x + F.linear(hidden, sd[f"{p}.mlp.fc2.weight"], sd[f"{p}.mlp.fc2.bias"])
    return ln("norm", x)


def reference_bert(sd, input_ids, attention_mask, image_embeds) -> torch.Tensor:
    """BLIP's med.py BertModel in multimodal mode (post-norm, self- then cross-attention, eps 1e-12)."""

    def ln(name, value):
        return F.layer_norm(value, (TEXT_WIDTH,), sd[f"{name}.weight"], sd[f"{name}.bias"], eps=1e-12)

    def lin(name, value):
        return F.linear(value, sd[f"{name}.weight"], sd[f"{name}.bias"])

    def heads(value):
        return value.reshape(*value.shape[:2], TEXT_HEADS, -1).transpose(1, 2)

    def attention(prefix, hidden, context, additive_mask):
        q, k, v = (
            heads(lin(f"{prefix}.self.{n}", s)) for n, s in (("query", hidden), ("key", context), ("value", context))
        )
        probs = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + additive_mask).softmax(dim=-1)
        mixed = (probs @ v).transpose(1, 2).reshape(hidden.shape)
        return ln(f"{prefix}.output.LayerNorm", lin(f"{prefix}.output.dense", mixed) + hidden)

    positions = torch.arange(input_ids.shape[1])
    x = sd["embeddings.word_embeddings.weight"][input_ids] + sd["embeddings.position_embeddings.weight"][positions]
    x = ln("embeddings.LayerNorm", x)
    padding = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0  # BLIP's extended attention mask
    for i in range(TEXT_DEPTH):
        p = f"encoder.layer.{i}"
        x = attention(f"{p}.attention", x, x, padding)
        x = attention(f"{p}.crossattention", x, image_embeds, 0.0)
        x = ln(f"{p}.output.LayerNorm", lin(f"{p}.output.dense", F.gelu(lin(f"{p}.intermediate.dense", x))) + x)
    return x


@pytest.fixture(scope="module")
def tiny_image_reward(tmp_path_factory):
    """A random ImageReward.pt (BLIP key names), its med_config.json and a tiny BERT tokenizer, on disk."""
    from transformers import BertTokenizer

    path = tmp_path_factory.mktemp("image_reward")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words += "a red cat photo of blue dog green an image on very long prompt".split()
    BertTokenizer(vocab={word: index for index, word in enumerate(words)}).save_pretrained(path / "tokenizer")
    state = random_blip_state_dict(len(words))
    torch.save(state, path / "ImageReward.pt")
    med_config = {
        "vocab_size": len(words),
        "hidden_size": TEXT_WIDTH,
        "num_hidden_layers": TEXT_DEPTH,
        "num_attention_heads": TEXT_HEADS,
        "intermediate_size": 2 * TEXT_WIDTH,
        "max_position_embeddings": 40,
        "layer_norm_eps": 1e-12,
        "hidden_act": "gelu",
        "pad_token_id": 0,
        "encoder_width": VISION_WIDTH,
        "add_cross_attention": True,
    }
    (path / "med_config.json").write_text(json.dumps(med_config))
    kwargs = {
        "checkpoint": str(path / "ImageReward.pt"),
        "med_config": str(path / "med_config.json"),
        "tokenizer_id": str(path / "tokenizer"),
        "vision_num_heads": VISION_HEADS,
    }
    return kwargs, state


def test_image_reward_matches_a_reference_blip_forward(tiny_image_reward):
    pytest.importorskip("torchvision")
    from transformers import AutoTokenizer

    kwargs, state = tiny_image_reward
    prompts, images = PROMPTS, make_images()
    scores = assert_batch_invariant(
        lambda batch_size: rewards.image_reward(device="cpu", batch_size=batch_size, **kwargs), prompts, images
    )

    def part(prefix):
        return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}

    tokenizer = AutoTokenizer.from_pretrained(kwargs["tokenizer_id"])
    tokens = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    pixels = torch.stack([clip_transform(IMAGE_SIZE)(im) for im in images])
    with torch.no_grad():
        image_embeds = reference_vit(part("blip.visual_encoder."), pixels)
        text = reference_bert(part("blip.text_encoder."), tokens["input_ids"], tokens["attention_mask"], image_embeds)
        mlp = part("mlp.layers.")
        features = text[:, 0]
        for index in (0, 2, 4, 6, 7):  # linear layers only, dropout is inactive at eval
            features = F.linear(features, mlp[f"{index}.weight"], mlp[f"{index}.bias"])
        expected = (features.squeeze(-1) - IR_MEAN) / IR_STD
    assert np.std(scores) > 1e-3  # random weights still separate the pairs
    assert scores == pytest.approx(expected.tolist(), abs=1e-4)


def test_image_reward_rejects_a_checkpoint_of_another_model(tmp_path):
    torch.save({"visual.proj": torch.zeros(2, 2)}, tmp_path / "other.pt")
    reward = rewards.image_reward(device="cpu", checkpoint=str(tmp_path / "other.pt"), med_config={})
    with pytest.raises(KeyError, match="Not an ImageReward checkpoint"):
        reward(["a"], make_images(1))


# ----------------------------------------------------------------------------------------------- all of them


@pytest.fixture
def reward_kwargs(request):
    """Factory kwargs pointing each model reward at its tiny local model, keyed by registry name."""

    def kwargs_for(name: str) -> dict:
        if name in ("pickscore", "clipscore"):
            path = request.getfixturevalue("tiny_clip_dir")[0]
            return {"model_id": path, "processor_id": path}
        if name == "aesthetic":
            clip_path, head_path = (
                request.getfixturevalue("tiny_clip_dir")[0],
                request.getfixturevalue("aesthetic_head")[0],
            )
            return {"clip_id": clip_path, "head_path": head_path}
        if name == "hpsv2.1":
            return request.getfixturevalue("tiny_hps")[0]
        return request.getfixturevalue("tiny_image_reward")[0]

    return kwargs_for


@pytest.mark.parametrize("name", ["pickscore", "clipscore", "aesthetic", "hpsv2.1", "imagereward"])
def test_model_rewards_by_name_in_bfloat16_follow_float32(name, reward_kwargs):
    """Selecting by name forwards the factory kwargs; bf16 (the usual GPU setting) runs and stays close."""
    images = make_images()
    (full,) = rewards.load_reward_funcs(name, device="cpu", **reward_kwargs(name))
    (half,) = rewards.load_reward_funcs([name], device="cpu", dtype="bfloat16", **reward_kwargs(name))
    assert half.dtype == torch.bfloat16 and full.__name__ == name
    full_scores, half_scores = full(PROMPTS, images), half(PROMPTS, images)
    scale = max(1.0, max(abs(score) for score in full_scores))
    assert half_scores == pytest.approx(full_scores, abs=0.05 * scale)
