"""k3: exact Kimi K3 / Kimi-Linear inference on ordinary machines."""

__version__ = "0.1.0"
