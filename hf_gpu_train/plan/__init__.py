"""The planner: a hardware profile and a model -> LaunchPlan (precision, GPUs, CPU binding, NCCL, strategy, memory,
memory levers, method), the plan document NAME.plan.json, what a training process reads of it, and the lint of a
config against a machine. The strategies are one table (``strategies.py``). No torch here: `hf-gpu-train config` runs
it on a laptop for a machine it is not on."""
