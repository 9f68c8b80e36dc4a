"""A residual add and RMS norm fused into the projection that reads the norm."""

from zgen.pallas.norm_linear.api import add_rms_norm_linear, kernel_takes

__all__ = ["add_rms_norm_linear", "kernel_takes"]
