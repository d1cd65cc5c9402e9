"""A round, from sampling to its record: the round loop (round_loop.py), streaming sums (aggregate.py), robust rules
around silo_server/rules/ (robust.py), the privacy layer around a round (privacy.py), finding a secure-aggregation
breaker (breaker.py) and where a finished round's record goes (sinks.py). Plain Python, no gRPC."""
