"""Forge: an OpenAI-compatible LLM gateway built as one Ray Serve application."""
