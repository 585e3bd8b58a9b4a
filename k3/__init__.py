"""k3: exact Kimi K3 / Kimi-Linear inference on ordinary machines."""

import os as _os

# OpenMP workers (torch's libgomp, which numba's pool also uses) spin after each
# parallel call by default; under load that cut the expert kernel from 4.1 to 0.7 GB/s.
# It is read when torch is imported, so it must be set before that.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
