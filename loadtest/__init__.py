"""Benchmarks and drills. Traffic goes to 127.0.0.1 only; every loop is bounded."""
