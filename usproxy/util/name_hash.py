"""The hash kube-proxy writes into chain names, for the explain renderings and the nftables offload.

kube-proxy hashes a name with SHA-256 and writes the digest in standard base32, then keeps a
prefix: 16 characters in iptables chain names (pkg/proxy/iptables/proxier.go portProtoHash), 8 in
nftables ones (pkg/proxy/nftables/proxier.go hashAndTruncate). One implementation, so usproxy's
own nftables chains and its renderings of kube-proxy's hash alike. Pure.
"""

from __future__ import annotations

import base64
import hashlib


def name_hash(text: str, length: int) -> str:
    """The first `length` characters (at most 56) of base32(sha256(text)), in upper case."""
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:length]
