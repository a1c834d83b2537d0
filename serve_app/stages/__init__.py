"""The pipeline's stages, one module each, in the order the gateway runs them."""
