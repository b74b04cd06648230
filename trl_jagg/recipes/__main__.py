"""``python -m trl_jagg.recipes [DIRECTORY]``: regenerate the presets' YAML files."""

from . import main

main()
