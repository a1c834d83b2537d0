import os

# Ray must keep its traffic on loopback on these machines; set before Ray is imported anywhere.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
