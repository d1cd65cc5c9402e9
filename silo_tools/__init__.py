"""Tools that read a finished run: `silo-predict` classifies images, `silo-export` writes ONNX or TorchScript,
`silo-audit` verifies and reports a silo's (or the hub's) audit and privacy ledger.

Predict and export read only a hub's state folder (model_card.json and the weights it names) and import only
silo_core. `silo-audit` reads a state folder's audit.jsonl and privacy-ledger.json through security.audit and
silo_client.ledger, which load neither gRPC nor torch. None of them talks to a hub, so they run on a workstation
(or a privacy officer's laptop) with `pip install silokit` alone."""
