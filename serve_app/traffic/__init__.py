"""Traffic policy: which pool a public model name reaches (``policy.py``), how each variant is
doing (``watch.py``), and the shadow copies (``shadow.py``). Configured by ``config/traffic.py``.
"""
