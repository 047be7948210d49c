"""`usproxy explain`: render one set of Services as each kube-proxy mode (and usproxy) holds them.

Pure rendering: nothing here touches the kernel or the network, except `live` (read-only, and only
when `--live` is asked). Every renderer reads the same `ServiceSet`, so the modes can be compared
line for line; `cost` reuses the renderers' structured rules, and `trace` walks the text each
renderer prints, so neither re-derives them. Each mode is one `Mode` record (mode.py) naming its
renderer, tracer, reply, cost rows, what a change sends and its drawing; registry.py lists them,
and every view iterates over that list, so a new mode is a new record, not a branch in each view.
"""
