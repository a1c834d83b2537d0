"""Resilience: circuit breakers shared by every gateway replica, the retry budget, and the
classification of a backend's answer into what a breaker counts (see DESIGN.md, Resilience)."""
