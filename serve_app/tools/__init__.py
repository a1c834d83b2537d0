"""Developer tools run with ``python -m serve_app.tools.NAME``; never imported by the app."""
