"""The memory levers, each where it is applied (selective checkpointing, activation offload, the optimizer step in
the backward, freed memory given back) and from a run's config (``from_config``). Where they are planned (what each
lever saves and costs on a machine, the set a launch records) is the planner's: ``plan/lever_table.py`` and
``plan/lever_plan.py``, so that the planner never imports what runs inside a Trainer."""
