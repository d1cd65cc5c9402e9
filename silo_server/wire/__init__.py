"""The calls silos make: the gRPC servicer (servicer.py: identity, call limits, statuses) and what those calls fetch
and send, validated (intake.py)."""
