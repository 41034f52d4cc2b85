"""The Hydra config tree, installed as the package ``multiloss.configs`` (``pkg://multiloss.configs``)."""
