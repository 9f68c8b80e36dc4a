"""Programmable inference in Pie's model: contexts you fill, fork, save, mask and drive token by token,
batched together by the runtime's engine.

    from zgen import Context, Sampler, load_model, stop

    model = load_model("smollm2")
    ctx = Context(model)
    ctx.fill_system("You are terse.")
    ctx.fill_user("Name three colors.")
    print(ctx.generate(Sampler.greedy(), stop.max_len(32) | stop.ends_with_any(model.eos_token_ids)))
"""

from zgen.contexts.context import Context, Distribution, ForwardOutput, ForwardPass, default_engine, gather
from zgen.contexts.drafter import Drafter, NgramDrafter
from zgen.contexts.snapshot import ImportedKVState, drop_export, import_kv_pages

__all__ = [
    "Context",
    "Distribution",
    "Drafter",
    "ForwardOutput",
    "ForwardPass",
    "ImportedKVState",
    "NgramDrafter",
    "default_engine",
    "drop_export",
    "gather",
    "import_kv_pages",
]
