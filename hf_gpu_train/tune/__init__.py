"""`hf-gpu-train tune`: the fastest settings that fit, measured on the real model in about a minute.

Modules, one concern each (only ``trials``, ``meter``, ``lm_layouts`` and ``worker`` import torch, and only in the
training processes): ``job`` (the config, plan, recipe and processes, read without torch), ``candidates`` (what may be
tried, what the planner rules out), ``search`` (order, early stopping, the time budget), ``results`` (a trial's
measurements, the winner), ``trials`` / ``meter`` / ``lm_layouts`` / ``worker`` (the trials in the launched
processes), ``cache`` (NAME.tune.json), ``writeback`` (the winner into NAME.plan.json and NAME.yaml, with backups),
``report`` / ``plot`` (NAME.tune_report.md and its SVG chart), ``strategies`` (the strategy round: which strategies a
config of several processes may run, each measured in a launch of its own config), ``hooks``
(``HF_GPU_TRAIN_TUNE_HOOKS``: a function the trials call on the model and collator; the tests' memory limit and slow
loading use it), ``gpu_check`` (for scripts/gpu_check.py). The command is ``cli/tune.py``.
"""
