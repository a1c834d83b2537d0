"""The pipeline's stages, one module each; `serve_app/stack.py` lists them in order."""
