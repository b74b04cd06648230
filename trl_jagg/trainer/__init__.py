"""The stages the trainer composes (generation, update, evaluation, checkpointing, hub) and the small pieces they
share. A stage never imports the trainer: it gets what it needs as arguments or a small state object."""
