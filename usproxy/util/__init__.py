"""Leaves every layer may use: errors, metrics, lock files, the /services and /flows rows,
rate-limited logs, a heap, text tables, GC pauses, time slices and kube-proxy's chain-name hash.
Imports nothing else of usproxy."""
