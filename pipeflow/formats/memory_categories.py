"""The memory categories: what holds a device's bytes, one list that the simulator's walk
(:mod:`pipeflow.sim.memory_tape`) and the runtime's measurement
(:mod:`pipeflow.runtime.memory_replay`) both count in, so that the two compare one by one
(:data:`pipeflow.sim.device_memory.COMPARED`). How to add one: docs/architecture.md,
"Adding a memory category".
"""

from __future__ import annotations

# category -> what it holds, from when to when. The order is a tape's category numbers
# and the order a walk sums the categories in (so an instant's bytes are the same to the bit).
MEANINGS: dict[str, str] = {
    "parameters": "the weights of every stage the device holds, the whole run (ZeRO-3: a slice, whole from a "
                  "GATHER to its FREE)",
    "optimizer_state": "the optimizer's moments of the stages it holds, the whole run (AMDP's ZeRO: of those "
                       "it owns; pipeline.shard: a slice)",
    "weight_versions": "the extra weight copies an asynchronous policy keeps, at its most",
    "gradients": "a stage's, from its first backward (B or W) to its optimizer step (ZeRO-2/3: to its REDUCE, "
                 "then a slice)",
    "casts": "at 16 bits, the 16-bit copy of the weights a stage's matrix products use, from its first forward "
             "to its step",
    "activations": "what forwards keep for their backwards (a Seq1F1B segment's keys and values included)",
    "residuals": "what a zero-bubble I keeps for its W, from I until W",
    "outputs": "a stage's output from its forward until its backward is done, and a gradient sent back, each "
               "send held until a later message from the peer proves it arrived (runtime.messages)",
    "inputs": "a message's receive buffer, from the action before the one that needs it (receives are posted "
              "one action ahead) until its forward starts or its backward is done",
    "temporaries": "what an action holds for a moment (workspace, an optimizer step's buffers, gradients laid "
                   "end to end for a REDUCE): the runtime's untagged allocations",
}
CATEGORIES: tuple[str, ...] = tuple(MEANINGS)

# The one runtime-only measurement: tag -> the category the simulator counts it within.
# A Seq1F1B segment's keys and values are held by hand (runtime.saved_bytes), so the
# runtime can name them apart; a cost model prices them within the activations.
APART: dict[str, str] = {"kv": "activations"}
# what the runtime measures: each category, followed by the tags measured apart within it
MEASURED: tuple[str, ...] = tuple(t for c in CATEGORIES for t in (c, *(k for k, v in APART.items() if v == c)))

# the categories of a stage's model state, the keys of a cost model's state_bytes
STATE: tuple[str, ...] = ("parameters", "optimizer_state", "gradients", "casts")
