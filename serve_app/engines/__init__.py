"""Engines: what a replica runs. One small interface, a simulated and a vLLM implementation."""
