"""The memory levers, each where it is applied (selective checkpointing, activation offload, the optimizer step in
the backward, freed memory given back) and where it is planned (``table``: what each lever saves and costs on this
machine; ``plan``: the set a launch records for the run)."""
