"""Keep gRPC core's own log lines out of the hub's and silos' logs unless the user asks for them.

gRPC core prints INFO lines in a format of its own, e.g. one per failed TLS handshake with a cause that misleads
and no peer; the hub and the silo report the same failures themselves, once, with the peer and the fix. gRPC
reads GRPC_VERBOSITY when it is imported, so the CLIs call this before anything imports grpc (this module must
not import it either).
"""

from __future__ import annotations

import os


def quiet_grpc_core(verbose: bool) -> None:
    """ERROR and above only, unless --verbose or the user's own GRPC_VERBOSITY says otherwise."""
    if not verbose:
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
