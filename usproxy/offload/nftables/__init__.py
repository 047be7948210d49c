"""The nftables datapath (placeholder docstring, rewritten when the layout is split)."""
