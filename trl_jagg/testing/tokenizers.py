"""Tokenizers of the tiny pipelines, built in code (nothing is downloaded) from a small vocabulary.

Every word of :data:`DEFAULT_VOCAB_WORDS` plus the caller's ``vocab_words`` is a single token with its own embedding
in every tokenizer (CLIP, T5, Qwen2, Mistral-3's in a PixtralProcessor); other words still encode (byte-level BPE for
CLIP, Qwen and Mistral-3, single characters for T5), only into several tokens.
"""

from __future__ import annotations

import string
import unicodedata
from collections.abc import Mapping, Sequence

from transformers import (
    CLIPTokenizer,
    PixtralImageProcessor,
    PixtralProcessor,
    PreTrainedTokenizerBase,
    Qwen2Tokenizer,
    T5Tokenizer,
)

# Words that are single tokens in every tiny tokenizer: the vocabulary of the prompts used by tests, examples and the
# demo (colours, shapes, simple scene words). Callers add their own with `vocab_words`.
DEFAULT_VOCAB_WORDS: tuple[str, ...] = (
    # function words
    "a", "an", "the", "of", "on", "in", "with", "and", "at", "to", "is", "no",
    # colours
    "red", "green", "blue", "yellow", "orange", "purple", "pink", "white", "black", "gray", "grey", "brown",
    "cyan", "magenta", "colour", "color", "colored", "coloured",
    # shapes and sizes
    "circle", "square", "triangle", "star", "heart", "cross", "ring", "disk", "dot", "rectangle", "shape",
    "small", "large", "big", "tiny", "one", "two", "three",
    # scenes
    "photo", "picture", "image", "painting", "drawing", "background", "dark", "light", "bright", "plain",
    "centered", "left", "right", "top", "bottom", "middle", "cat", "dog", "car", "tree", "house", "sign",
    "text", "says", "hello", "world",
)  # fmt: skip

# Words of QwenImagePipeline's prompt template. The pipeline encodes `template.format(prompt)` and drops the first
# `prompt_template_encode_start_idx` (34) hidden states, which is the length of the template prefix with the real
# Qwen2.5 tokenizer. Making each of these words one token reproduces that count; `build_tiny_qwenimage_pipeline`
# checks it against the pipeline it builds.
_QWEN_TEMPLATE_WORDS: tuple[str, ...] = (
    "system", "Describe", "the", "image", "by", "detailing", "color", "shape", "size", "texture", "quantity",
    "text", "spatial", "relationships", "of", "objects", "and", "background", "user", "assistant",
)  # fmt: skip

# QwenImageEditPipeline's template prefix (the same for QwenImageEditPlusPipeline): the pipeline drops its 64 hidden
# states, the prefix's length with the real tokenizer, where " (", ")," and "'s" are single tokens too.
QWEN_EDIT_TEMPLATE_TEXTS: tuple[str, ...] = (
    "Describe", "key", "features", "input", "texture", "then", "explain", "how", "instruction", "should", "alter",
    "or", "modify", "Generate", "new", "that", "meets", "requirements", "while", "maintaining", "consistency",
    "original", "where", "appropriate", " (", "),", "'s",
)  # fmt: skip

_CLIP_BOS, _CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
_QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_T5_PIECE_CHARACTERS = string.ascii_letters + string.digits + string.punctuation
# Qwen3's chat template reduced to what the pipelines render: one user turn and the generation prompt, with the empty
# thinking block Qwen3 writes when thinking is switched off (Flux2KleinPipeline); ZImagePipeline switches it on.
_QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

# Mistral-Small-3's special tokens (its Tekken vocabulary starts with them), the chat turn and the image placeholders.
_MISTRAL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]",
    "[IMG_END]", "<pad>",
)  # fmt: skip
# Mistral-Small-3's chat template reduced to what Flux2Pipeline renders (format_input): the beginning of sequence, the
# system message, then each user turn's text blocks inside [INST] ... [/INST] (an image block: the [IMG] placeholder).
_MISTRAL3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set text = message.content if message.content is string else "
    "message.content | map(attribute='text', default='[IMG]') | join('') %}"
    "{% if message.role == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message.role == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)


def _vocabulary(vocab_words: Sequence[str] | None) -> list[str]:
    """Default words followed by the caller's, NFC-normalised and deduplicated, in a stable order."""
    if isinstance(vocab_words, str):
        raise TypeError("`vocab_words` must be a sequence of words, not a single string.")
    words: list[str] = []
    for word in (*DEFAULT_VOCAB_WORDS, *(vocab_words or ())):
        word = unicodedata.normalize("NFC", word)
        # Every tokenizer's pre-tokenizer splits on spaces, digits and punctuation, so only letter runs can be
        # guaranteed to stay one token.
        if not word.isalpha():
            raise ValueError(f"Vocabulary words must consist of letters only, got {word!r}.")
        if word not in words:
            words.append(word)
    return words


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: each byte maps to a printable character (GPT-2/CLIP/Qwen convention).

    Printable Latin-1 bytes map to themselves; the others (control characters, space, ...) are shifted to code
    points from 256 on, in byte order, so a space becomes ``"Ġ"`` and a newline ``"Ċ"``.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    mapping: dict[int, str] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def _apply_merges(symbols: list[str], ranks: Mapping[tuple[str, str], int]) -> list[str]:
    """Segment a word the way a BPE model does: repeatedly merge the adjacent pair of lowest rank (leftmost first)."""
    symbols = list(symbols)
    while len(symbols) > 1:
        candidates = [
            (ranks[pair], position) for position, pair in enumerate(zip(symbols[:-1], symbols[1:])) if pair in ranks
        ]
        if not candidates:
            break
        _, position = min(candidates)
        symbols[position : position + 2] = [symbols[position] + symbols[position + 1]]
    return symbols


def _byte_level_bpe(
    words: Sequence[str], *, end_of_word_suffix: str = ""
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Build a byte-level BPE vocabulary and merge list in which each of ``words`` is a single token.

    The base vocabulary is the 256 byte symbols (and, for CLIP, the same symbols carrying the end-of-word suffix), so
    any text encodes. Words are then processed in order: while a word still splits into several tokens under the
    merges so far, the merge of its first two tokens is appended with the lowest priority. A merge appended later can
    never touch a word that is already one token (it has no adjacent pair left), so every word ends as one token.

    Returns:
        ``(vocab, merges)`` in the form taken by ``CLIPTokenizer``/``Qwen2Tokenizer`` (merges as ``(left, right)``).
    """
    byte_symbols = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for symbol in byte_symbols.values():
        vocab.setdefault(symbol, len(vocab))
    if end_of_word_suffix:
        for symbol in byte_symbols.values():
            vocab.setdefault(symbol + end_of_word_suffix, len(vocab))
    ranks: dict[tuple[str, str], int] = {}
    for word in words:
        symbols = [byte_symbols[byte] for byte in word.encode("utf-8")]
        symbols[-1] += end_of_word_suffix
        while len(segments := _apply_merges(symbols, ranks)) > 1:
            ranks[(segments[0], segments[1])] = len(ranks)
            vocab.setdefault(segments[0] + segments[1], len(vocab))
    return vocab, list(ranks)


def _check_single_tokens(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> None:
    """Raise if one of ``texts`` does not encode to exactly one token (guards the BPE construction above)."""
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) != 1:
            pieces = tokenizer.convert_ids_to_tokens(ids)
            raise RuntimeError(f"{type(tokenizer).__name__}: {text!r} encodes to {pieces}, expected one token.")


def build_clip_tokenizer(vocab_words: Sequence[str] | None = None, *, model_max_length: int = 77) -> CLIPTokenizer:
    """A CLIP tokenizer (lower-cased byte-level BPE with ``</w>`` word ends) in which :data:`DEFAULT_VOCAB_WORDS`
    and ``vocab_words`` are single tokens.

    ``model_max_length`` must be set explicitly: the pipelines pad to it, and the class default (a huge integer)
    makes them fail with ``OverflowError``. It must not exceed the text model's ``max_position_embeddings``.
    The special tokens come last, as in the real tokenizer; padding uses the end-of-text token, like CLIP-L's.
    """
    # CLIP lower-cases its input, so the vocabulary is built from the lower-cased words.
    lowered = list(dict.fromkeys(word.lower() for word in _vocabulary(vocab_words)))
    vocab, merges = _byte_level_bpe(lowered, end_of_word_suffix="</w>")
    for special in (_CLIP_BOS, _CLIP_EOS):
        vocab[special] = len(vocab)
    tokenizer = CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        bos_token=_CLIP_BOS,
        eos_token=_CLIP_EOS,
        unk_token=_CLIP_EOS,
        pad_token=_CLIP_EOS,
        model_max_length=model_max_length,
    )
    _check_single_tokens(tokenizer, lowered)
    return tokenizer


def build_t5_tokenizer(vocab_words: Sequence[str] | None = None, *, model_max_length: int = 512) -> T5Tokenizer:
    """A T5 tokenizer (Unigram over ``"▁"``-prefixed words) in which :data:`DEFAULT_VOCAB_WORDS` and
    ``vocab_words`` are single tokens.

    The pieces are ``<pad>``/``</s>``/``<unk>`` (ids 0/1/2, as in T5), ``"▁"``, single ASCII characters and the
    whole words ``"▁word"``. A word piece scores far better than its characters, so the Viterbi segmentation keeps
    each vocabulary word whole; other text falls back to characters (non-ASCII characters outside the vocabulary
    become ``<unk>``). No sentinel ``<extra_id_*>`` tokens: an encoder-only T5 never uses them.
    """
    words = _vocabulary(vocab_words)
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(character, -10.0) for character in _T5_PIECE_CHARACTERS]
    pieces += [(f"▁{word}", -1.0) for word in words]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)
    _check_single_tokens(tokenizer, words)
    return tokenizer


def build_qwen2_tokenizer(
    vocab_words: Sequence[str] | None = None,
    *,
    extra_special_tokens: Sequence[str] = (),
    template_texts: Sequence[str] = (),
) -> Qwen2Tokenizer:
    """A byte-level ``Qwen2Tokenizer`` in which :data:`DEFAULT_VOCAB_WORDS`, ``vocab_words`` and the words of
    ``QwenImagePipeline``'s prompt template are single tokens.

    Qwen's pre-tokenizer attaches a leading space to the following word (``" red"`` is one chunk, ``"Ġred"``), so
    every word is added both with and without it. The chat special tokens (``<|im_start|>``, ``<|im_end|>``, the
    vision placeholders) come last, as in the real tokenizer. ``template_texts``: more pieces of a pipeline's prompt
    template that must be single tokens (words, and punctuation the real tokenizer keeps whole, such as ``" ("``).
    """
    words = (*_QWEN_TEMPLATE_WORDS, *_vocabulary(vocab_words))
    extra = [text for text in template_texts if not text.isalpha()]
    forms = [form for word in (*words, *(t for t in template_texts if t.isalpha())) for form in (word, " " + word)]
    texts = list(dict.fromkeys((*forms, *extra)))
    vocab, merges = _byte_level_bpe(texts)
    specials = (*_QWEN_SPECIAL_TOKENS, *extra_special_tokens)
    for special in specials:
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(specials[1:]),
        model_max_length=32768,
    )
    _check_single_tokens(tokenizer, texts)
    return tokenizer


def build_qwen3_tokenizer(vocab_words: Sequence[str] | None = None) -> Qwen2Tokenizer:
    """The tokenizer of Qwen3 text encoders (Z-Image, FLUX.2 klein): :func:`build_qwen2_tokenizer` with Qwen3's
    thinking tokens and a chat template, which those pipelines render each prompt through."""
    tokenizer = build_qwen2_tokenizer(vocab_words, extra_special_tokens=("<think>", "</think>"))
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    return tokenizer


def build_mistral3_processor(
    vocab_words: Sequence[str] | None = None, *, template_words: Sequence[str] = ()
) -> PixtralProcessor:
    """The ``PixtralProcessor`` of Mistral-3 text encoders (FLUX.2 dev): a byte-level BPE tokenizer in which
    :data:`DEFAULT_VOCAB_WORDS`, ``vocab_words`` and ``template_words`` (the words of the pipeline's system message,
    so that it takes about as many tokens as with the real tokenizer) are single tokens, with and without a leading
    space (Tekken's pre-tokenizer attaches it), Mistral's special tokens, and the chat template ``Flux2Pipeline``
    renders each prompt through: ``<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]prompt[/INST]``.

    The BPE is ``Qwen2Tokenizer``'s (Tekken is a byte-level BPE with the same kind of pre-tokenizer); the image
    processor is Pixtral's default, which text-only prompts never use.
    """
    words = dict.fromkeys((*template_words, *_vocabulary(vocab_words)))
    texts = [form for word in words for form in (word, " " + word)]
    vocab, merges = _byte_level_bpe(texts)
    for special in _MISTRAL_SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=[t for t in _MISTRAL_SPECIAL_TOKENS if t not in ("<unk>", "<s>", "</s>", "<pad>")],
        model_max_length=131072,
    )
    _check_single_tokens(tokenizer, texts)
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(), tokenizer=tokenizer, chat_template=_MISTRAL3_CHAT_TEMPLATE
    )
