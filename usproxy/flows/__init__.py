"""The relay's own flow table (not kernel conntrack): every relayed connection (TCP) or client
association (UDP) as a Flow.

A leaf package: it imports nothing from datapaths or sources.
"""
