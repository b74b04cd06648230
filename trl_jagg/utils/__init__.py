"""Utilities every layer may use: errors, redaction, quiet logging, Hub access, process groups and prompt sets."""
