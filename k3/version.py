"""k3's version, on the ground floor: modules that record it (state files, the prompt
cache, the pipeline's handshake, the doctor) import it from here, not from the package
root, whose ``load`` reaches the whole engine."""

__version__ = "0.2.0"
