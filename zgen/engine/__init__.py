"""Programmable inference in Pie's model: contexts you fill, fork, save, mask and drive token by token,
and an engine that batches every live context's forward passes.

    from zgen import load_model
    from zgen.engine import Sampler, stop

    model = load_model("smollm2")
    ctx = model.create_context()
    ctx.fill_system("You are terse.")
    ctx.fill_user("Name three colors.")
    print(ctx.generate(Sampler.greedy(), stop.max_len(32) | stop.ends_with_any(model.eos_token_ids)))
"""

from zgen.engine import stop
from zgen.engine.context import Context, Distribution, ForwardOutput, ForwardPass, GenerateResult
from zgen.engine.drafter import Drafter, NgramDrafter
from zgen.engine.engine import Engine, EngineConfig, EngineStats
from zgen.engine.sampler import Sampler
from zgen.engine.snapshot import ImportedKVState

__all__ = [
    "Context",
    "Distribution",
    "Drafter",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "ForwardOutput",
    "ForwardPass",
    "GenerateResult",
    "ImportedKVState",
    "NgramDrafter",
    "Sampler",
    "stop",
]
