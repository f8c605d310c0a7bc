"""Integrations with other libraries: ``moeshard.integrations.transformers`` (Hugging Face models)."""
