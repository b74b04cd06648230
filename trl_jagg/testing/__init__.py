"""Offline test utilities: tiny random pipelines built from configs (as ``transformers.testing_utils``)."""
