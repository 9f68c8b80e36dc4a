"""The residual add and RMS norm between transformer blocks, as one kernel."""

from zgen.pallas.rms_norm.api import add_rms_norm

__all__ = ["add_rms_norm"]
