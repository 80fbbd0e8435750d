"""Integrations with training frameworks, one module per framework, each imported on its own."""
