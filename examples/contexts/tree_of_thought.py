"""Tree of thought: expand several candidate steps per node, score them, keep the best, go deeper.

Every node is a fork of its parent, so the whole tree shares the prompt's pages; expanded parents and
pruned branches are released, and pages no node holds any more return to the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zgen import Context, Model, Sampler, load_model, stop
from zgen.contexts import gather

QUESTION = "Question: Plan a 3-step morning routine for a student.\n"


@dataclass
class Node:
    ctx: Context
    score: float  # mean log-probability of the path's thoughts (empty thoughts rank last)
    path: list[str]


def main(model: Model | None = None, breadth: int = 3, keep: int = 2, depth: int = 2) -> list[Node]:
    model = model or load_model("smollm2")
    root = Context(model, seed=1)
    root.fill(QUESTION)
    line = stop.max_len(16) | stop.ends_with_any([*model.eos_token_ids, *model.tokenizer.encode("\n", add_special_tokens=False)])
    frontier = [Node(root, 0.0, [])]
    for level in range(depth):
        children = [Node(node.ctx.fork(), node.score, node.path) for node in frontier for _ in range(breadth)]
        for parent in frontier:  # its children hold its pages now
            parent.ctx.release()
        for child in children:
            child.ctx.fill(f"Step {level + 1}:")
        thoughts = gather(*(c.ctx.generate_result_async(Sampler.top_k(0.8, 20), line) for c in children))
        for child, thought in zip(children, thoughts):
            step_score = sum(thought.logprobs) / len(thought.logprobs) if thought.text.strip() else -math.inf
            child.score = (child.score * level + step_score) / (level + 1)
            child.path = [*child.path, thought.text.strip()]
        children.sort(key=lambda c: c.score, reverse=True)
        for pruned in children[keep:]:
            pruned.ctx.release()
        frontier = children[:keep]
    for node in frontier:
        print(f"{node.score:8.2f}  " + " | ".join(node.path))
    return frontier


if __name__ == "__main__":
    main()
