"""zgen inside other systems' runtimes: :mod:`zgen.integrations.ray` (Ray Data, past one machine)."""
