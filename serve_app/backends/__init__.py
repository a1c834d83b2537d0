"""Where requests are served: the primary pools (Serve handles) and the external fallback."""
