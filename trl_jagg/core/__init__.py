"""The torch-only core: the JAGG engine, the samplers, the GRPO, DiffusionNFT, AWM and DGPO losses, the velocity cache
and the SDE window. Nothing here imports diffusers, transformers or the trainer (``tests/test_layout_pin.py`` pins it)."""
