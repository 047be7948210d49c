"""The flow table: every relayed connection (TCP) or client association (UDP) as a Flow.

A leaf package: it imports nothing from datapaths or sources.
"""
