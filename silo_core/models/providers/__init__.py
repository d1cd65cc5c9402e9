"""The providers behind the model registry, one module each: a library's networks by `<prefix>/<name>`
(torchvision, timm, MONAI) and the user's own factory. An optional library is imported only when one of its
models is asked for; each module registers its provider when `silo_core.models` is imported (PROVIDER_MODULES)."""
