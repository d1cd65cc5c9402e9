"""What the hub keeps: the silos it knows (registry.py), the run's records and scores (scoring.py) and the
checkpoints and exported models on disk (checkpoint.py). Plain Python, no gRPC."""
