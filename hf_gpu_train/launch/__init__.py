"""From a plan to processes: the accelerate YAML, .env, torchrun and sbatch lines (``render``), the environment
accelerate gives a strategy (``accelerate_env``), the strategy a process was launched with (``launched_strategy``),
the plan's environment put into a training process (``run_environment``), and the report of a failed launch
(``rank_report``). The command that launches is ``cli/launch.py``."""
