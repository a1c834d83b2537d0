"""The deploy gate: prompt checks, protocol checks, drills and a calibrated SLO, run against a
running Forge (``python -m evals``; see ``evals/cli.py``)."""
