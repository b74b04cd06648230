"""``python -m trl_jagg.recipes [DIRECTORY]``: regenerate the presets' YAML files."""

from trl_jagg.recipes import main

main()
