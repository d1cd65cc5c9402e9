"""Use a trained model: `silo-predict` classifies images, `silo-export` writes ONNX or TorchScript.

Both read only a hub's state folder (model_card.json and the weights it names) and import only silo_core: no gRPC,
no hub, silo or security code, so they run on a workstation with `pip install silokit` alone."""
