"""Tune's strategy round without a trial: which strategies are candidates, the configs `hf-gpu-train config` writes for
them, the planner's refusals, the pick among synthetic measurements, the round's launches (a stand-in launcher), the
writeback of a winner of another strategy, and the command line's usage errors."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hf_gpu_train.cli import main
from hf_gpu_train.cli import tune as tune_command
from hf_gpu_train.errors import UsageError
from hf_gpu_train.launch.accelerate_env import launch_environment
from hf_gpu_train.launch.launched_strategy import launched_strategy
from hf_gpu_train.plan.run_plan_file import PLAN_ENV, parse_env, read_run_plan
from hf_gpu_train.tune.candidates import Candidate
from hf_gpu_train.tune.job import load_job
from hf_gpu_train.tune.results import FAILED, OK, OOM, SKIPPED, TrialResult, choose
from hf_gpu_train.tune.strategies import ROUND, parse_strategies, strategy_config_argv
from tests.tune.simulated import space

CASE = ["max_length=32", "global_batch_size=16", "per_device_train_batch_size=4"]


def config(tmp_path: Path, monkeypatch, *args: str, name: str = "cpu") -> Path:
    """`hf-gpu-train config ...` as a shell runs it (its plan records the command line, which the round reruns)."""
    argv = ["config", "--machine", "cpu-only", *args, "--output", str(tmp_path / name)]
    monkeypatch.setattr(sys, "argv", ["hf-gpu-train", *argv])
    assert main(argv) == 0
    return tmp_path / f"{name}.yaml"


def result(candidate: Candidate, tokens_per_s: float, status: str = OK, **kw) -> TrialResult:
    steps = tuple([0.1] * 6)
    return TrialResult(candidate, status, samples_per_s=tokens_per_s / 10, tokens_per_s=tokens_per_s, measured_steps=6,
                       step_times_s=steps, seconds=2.0, **kw)


# -- the candidate list ------------------------------------------------------------------------------------------------

def test_the_round_measures_the_named_strategies_in_order_once_each_beside_the_configs_own():
    assert parse_strategies(None, "ddp", 2, "cpu.yaml") == ()  # the default: the config's own strategy only
    assert parse_strategies("all", "ddp", 2, "cpu.yaml") == ("deepspeed-zero2", "deepspeed-zero3", "fsdp") == ROUND[1:]
    assert parse_strategies("deepspeed-zero3, own,ddp,deepspeed-zero3", "deepspeed-zero2", 2, "z2.yaml") == ("deepspeed-zero3", "ddp")
    assert parse_strategies("all", "fsdp-shard-grad-op", 4, "g.yaml") == ("ddp", "deepspeed-zero2", "deepspeed-zero3")  # any FSDP is its own
    assert parse_strategies("deepspeed-zero2-offload", "deepspeed-zero2", 2, "z2.yaml") == ("deepspeed-zero2-offload",)
    assert parse_strategies("own", "single", 1, "one.yaml") == ()  # nothing else asked: fine on one process


@pytest.mark.parametrize(("text", "own", "world", "message"), [
    ("ddp,zero2", "ddp", 2, r"--strategies ddp,zero2: 'zero2' is not a strategy: use all, own or names from ddp, deepspeed-zero2"),
    (",", "ddp", 2, r"--strategies ,: no strategy named"),
    ("all", "single", 1, r"--strategies all: one.yaml launches 1 process, and one process has one strategy: .*--num-processes 2"),
])
def test_a_bad_strategy_list_names_the_value_and_the_fix(text, own, world, message):
    with pytest.raises(UsageError, match=message):
        parse_strategies(text, own, world, "one.yaml")


def test_a_strategys_config_command_is_the_configs_own_with_another_strategy():
    command = "hf-gpu-train config --machine cpu-only --num-processes 2 --strategy=ddp --output launch/box --force"
    assert strategy_config_argv(command, "deepspeed-zero3", "launch/box.strategies/deepspeed-zero3", force=True) == [
        "config", "--machine", "cpu-only", "--num-processes", "2", "--strategy", "deepspeed-zero3", "--output",
        "launch/box.strategies/deepspeed-zero3", "--force"]
    assert strategy_config_argv(command, "fsdp", machine="2x-rtx4090")[-4:] == ["--strategy", "fsdp", "--machine", "2x-rtx4090"]
    with pytest.raises(UsageError, match="is not an `hf-gpu-train config` line"):
        strategy_config_argv("accelerate config", "ddp")


def test_a_candidate_of_another_strategy_is_keyed_and_named_by_it_and_the_configs_own_keeps_its_key():
    own = Candidate(micro_batch=4, accumulation=2, gradient_checkpointing=False, dataloader_num_workers=0, precision="fp32")
    assert own.key == "mb4xga2|ckpt0|w0|fp32|compile0|pack-"  # saved measurements of earlier tunes still match
    zero2 = replace(own, strategy="deepspeed-zero2")
    assert zero2.key == own.key + "|deepspeed-zero2" and zero2.describe().endswith(", fp32, deepspeed-zero2")
    assert Candidate.from_dict(json.loads(json.dumps(zero2.to_dict()))) == zero2


# -- the pick ------------------------------------------------------------------------------------------------------

def test_the_fastest_strategy_that_fits_wins_and_within_the_noise_the_configs_own_does():
    sp = space(per_process=8, world=2)
    own = sp.base
    zero2, zero3 = replace(own, strategy="deepspeed-zero2"), replace(own, strategy="deepspeed-zero3")
    faster = choose([result(own, 1000.0), result(zero2, 1300.0), result(zero3, 700.0)], sp.metric, own)
    assert faster.winner.candidate == zero2
    assert faster.reasons[1] == f"next: {own.describe()} at 1,000 tokens/s (+30.0%)"
    tie = choose([result(own, 1000.0), result(zero2, 1020.0)], sp.metric, own)
    assert tie.winner.candidate == own  # 2% is noise, and another strategy asks for another launch config
    assert "asks more of the run (deepspeed-zero2 instead of the config's own strategy: another launch config)" in tie.reasons[1]
    # the fastest ran out of memory (or over the budget): never the winner; a skipped or failed strategy neither
    cases = [result(own, 1000.0), result(zero2, 2000.0, OOM), result(zero3, 3000.0, peak_memory_bytes=9 * 2**30,
                                                                    memory_budget_bytes=8 * 2**30),
             TrialResult(replace(own, strategy="fsdp"), SKIPPED, "the planner refuses fsdp here: ..."),
             TrialResult(replace(own, strategy="ddp"), FAILED, "the launch of ddp.yaml stopped (exit 1)")]
    picked = choose(cases, sp.metric, own)
    assert picked.winner.candidate == own and "not eligible: " in picked.reasons[-1] and "deepspeed-zero2: oom" in picked.reasons[-1]


def test_the_round_skips_what_the_planner_refuses_or_says_does_not_fit_and_measures_each_strategy_once():
    base = space(per_process=8, world=2).base
    checks = {"deepspeed-zero2": SimpleNamespace(fits=False, estimate_bytes=30 * 2**30, usable_bytes=22 * 2**30),
              "fsdp-shard-grad-op": SimpleNamespace(fits=True)}
    job = SimpleNamespace(searches=False, own_strategy="deepspeed-zero3", config_file=Path("z3.yaml"), world_size=2,
                          memory_check=lambda values, strategy: checks[strategy])
    folder = Path("z3.strategies")
    configs = [tune_command.StrategyConfig("ddp", "c", refused="big does not fit in 24.0 GiB per GPU with any of ddp"),
               tune_command.StrategyConfig("deepspeed-zero2", "c", folder / "deepspeed-zero2.yaml", "deepspeed-zero2", "deepspeed-zero2"),
               tune_command.StrategyConfig("fsdp", "c", folder / "fsdp.yaml", "fsdp-shard-grad-op", "fsdp-shard-grad-op"),
               tune_command.StrategyConfig("deepspeed-zero3-offload", "c", folder / "o.yaml", "deepspeed-zero3", None)]
    launches, skipped, notes = tune_command._round_candidates(job, base, configs)
    # a sharded config has no search: its own strategy is measured in a launch of its own, first
    assert launches == [(base, Path("z3.yaml")), (replace(base, strategy="fsdp-shard-grad-op"), folder / "fsdp.yaml")]
    assert [(r.candidate.strategy, r.status) for r in skipped] == [("ddp", SKIPPED), ("deepspeed-zero2", SKIPPED)]
    assert skipped[0].reason == "the planner refuses ddp here: big does not fit in 24.0 GiB per GPU with any of ddp"
    assert skipped[1].reason == "the planner says it does not fit under deepspeed-zero2: 30.00 GiB > 22.00 GiB usable"
    assert notes == ["strategy round: deepspeed-zero3-offload: the planner made it deepspeed-zero3, measured already"]


def test_on_gpus_the_planners_memory_check_decides_which_strategies_are_measured(tmp_path, monkeypatch, capsys):
    """A 2.0B-parameter BERT on two RTX 4090s, planned for ZeRO-3 (micro-batch 6): DDP does not fit at any micro-batch
    (the planner refuses it), ZeRO-2 and FSDP (the planner's shard-grad-op for it) not at micro-batch 6 (its check): only
    the config's own is measured; a dry plan, nothing launched."""
    from transformers import BertConfig

    BertConfig(hidden_size=2560, num_hidden_layers=24, num_attention_heads=16, intermediate_size=10240,
               vocab_size=30522).save_pretrained(tmp_path / "big")
    argv = ["config", "--machine", "2x-rtx4090", "--model", str(tmp_path / "big"), "--seq-len", "512", "--global-batch", "64",
            "--strategy", "deepspeed-zero3", "--output", str(tmp_path / "z3")]
    monkeypatch.setattr(sys, "argv", ["hf-gpu-train", *argv])
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["tune", "--machine", "2x-rtx4090", "--strategies", "all", "--config-file", str(tmp_path / "z3.yaml"),
                 "scripts/finetune.py", f"model={tmp_path / 'big'}", "max_length=512", "global_batch_size=64"]) == 0
    out = capsys.readouterr().out
    assert "no search (its trials would share one wrapped model)" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("deepspeed", "ddp ", "fsdp"))}
    assert "z3.yaml" in rows["deepspeed-zero3"] and "one launch at the plan's values" in rows["deepspeed-zero3"]
    assert "skipped: the planner refuses ddp here: " in rows["ddp"]
    assert "big (1.97B parameters) does not fit in 24.0 GiB per GPU with any of ddp" in rows["ddp"]
    assert "skipped: the planner says it does not fit under deepspeed-zero2: 23.49 GiB > 22.07 GiB usable" in rows["deepspeed-zero2"]
    # the planner made fsdp its ZeRO-2-like variant for this model (at a smaller micro-batch): not at 6 either
    assert "skipped: the planner says it does not fit under fsdp-shard-grad-op: 24.86 GiB > 22.07 GiB" in rows["fsdp-shard-grad-op"]
    assert not (tmp_path / "z3.strategies").exists()  # a dry plan writes nothing


# -- the round and its writeback -------------------------------------------------------------------------------------

def cpu_job(tmp_path, monkeypatch, overrides=tuple(CASE)):
    path = config(tmp_path, monkeypatch, "--num-processes", "2")
    return load_job(str(path), "scripts/finetune.py", list(overrides), {}, strategies="deepspeed-zero2,deepspeed-zero3")


def test_the_round_launches_each_strategys_config_at_the_search_winner_over_the_same_steps(tmp_path, monkeypatch, capsys):
    job = cpu_job(tmp_path, monkeypatch)
    configs = tune_command.render_strategy_configs(job, tmp_path / "cpu.strategies", None)
    assert [(sc.asked, sc.strategy, sc.config.name) for sc in configs] == [
        ("deepspeed-zero2", "deepspeed-zero2", "deepspeed-zero2.yaml"), ("deepspeed-zero3", "deepspeed-zero3", "deepspeed-zero3.yaml")]
    written = yaml.safe_load(configs[1].config.read_text())
    assert written["distributed_type"] == "DEEPSPEED" and written["deepspeed_config"]["zero_stage"] == 3
    assert "--strategy deepspeed-zero3" in configs[1].config.read_text().splitlines()[1]  # its header names its command
    winner = job.space.base
    search = [result(winner, 1000.0), result(winner.with_micro_batch(2), 800.0)]
    launched = []

    def fake_launch(config_file, options, spec, folder):
        launched.append((config_file, spec["candidates"], spec["measure_steps"], spec["search"]))
        if "zero3" in config_file.name:
            return 1, None  # that launch stopped before any trial
        trial = Candidate.from_dict(spec["candidates"][0])
        return 0, {"startup_s": 5.0, "complete": True, "trials": [result(trial, 700.0, launched_strategy=trial.strategy).to_dict()]}

    monkeypatch.setattr(tune_command, "launch_trials", fake_launch)
    cache = tune_command.TuneCache(tmp_path / "cpu.tune.json")
    opts = SimpleNamespace(budget_s=60.0, warmup_steps=2, measure_steps=None)
    found, notes, loaded = tune_command._strategy_round(job, opts, [], cache, {}, search, configs)
    assert [(c.name, cands[0]["strategy"], cands[0]["micro_batch"], steps, mode) for c, cands, steps, mode in launched] == [
        ("deepspeed-zero2.yaml", "deepspeed-zero2", 4, 6, "fixed"), ("deepspeed-zero3.yaml", "deepspeed-zero3", 4, 6, "fixed")]
    assert [(r.candidate.strategy, r.status) for r in found] == [("deepspeed-zero2", OK), ("deepspeed-zero3", FAILED)]
    assert found[1].reason == "the launch of deepspeed-zero3.yaml stopped (exit 1; its error is above)"
    assert loaded == 5.0 and "the micro-batch and the other axes were searched under ddp only" in notes[0]
    assert set(cache.results(job.cache_key)) == {replace(winner, strategy="deepspeed-zero2").key}  # a rerun reuses it
    launched.clear()
    again, _, _ = tune_command._strategy_round(job, opts, [], cache, cache.results(job.cache_key), search, configs)
    assert again[0].from_cache and [c.name for c, *_ in launched] == ["deepspeed-zero3.yaml"]


def test_a_winner_of_another_strategy_goes_into_its_own_config_and_the_configs_plan_keeps_its_strategy(tmp_path, monkeypatch, capsys):
    job = cpu_job(tmp_path, monkeypatch, CASE[:2])  # the micro-batch is tuned: the recipe's 32 per process would be 8 x 1
    configs = tune_command.render_strategy_configs(job, tmp_path / "cpu.strategies", None)
    own = job.space.base.with_micro_batch(4)
    results = [result(own, 1000.0), result(replace(own, strategy="deepspeed-zero2"), 1500.0, launched_strategy="deepspeed-zero2"),
               result(replace(own, strategy="deepspeed-zero3"), 600.0, launched_strategy="deepspeed-zero3")]
    choice = choose(results, job.space.metric, own)
    opts = SimpleNamespace(budget_s=60.0)
    before = yaml.safe_load((tmp_path / "cpu.yaml").read_text())
    assert tune_command._write_and_print(job, opts, results, [], choice, 2.0, 5.0, 0.0, configs) == 0
    out = capsys.readouterr().out
    zero2 = tmp_path / "cpu.strategies" / "deepspeed-zero2.yaml"
    assert f"Next: hf-gpu-train launch --config-file {zero2} -m hf_gpu_train.finetune" in out
    assert (f"to make deepspeed-zero2 cpu.yaml's own strategy: `hf-gpu-train config --machine cpu-only --num-processes 2 "
            f"--strategy deepspeed-zero2 --output {tmp_path / 'cpu'} --force` (then tune it again)") in out
    assert "strategy  " in out and "peak GiB per rank" in out  # the table names each trial's strategy
    # the config's own launch is what it was: its strategy, its plan's strategy, no value of another strategy's winner
    assert yaml.safe_load((tmp_path / "cpu.yaml").read_text()) == before
    mine = read_run_plan(tmp_path / "cpu.plan.json", "test")
    assert mine.strategy.value == "cpu-ddp" and mine.document["tuned"]["winner"]["candidate"]["strategy"] is None
    assert "strategy round: deepspeed-zero2 is the fastest that fits" in (tmp_path / "cpu.yaml").read_text()
    # the winner's config launches its strategy with the measured values, and its run takes them
    theirs = read_run_plan(zero2.with_suffix(".plan.json"), "test")
    assert theirs.strategy.value == "deepspeed-zero2" and theirs.value("per_device_train_batch_size") == 4
    assert theirs.value("global_batch_size") == 16 and theirs.value("dataloader_num_workers") == 0
    environ = {**launch_environment(yaml.safe_load(zero2.read_text())), **parse_env(zero2.with_suffix(".env").read_text()),
               PLAN_ENV: str(zero2.with_suffix(".plan.json")), "WORLD_SIZE": "2"}
    assert launched_strategy(environ, on_cpu=True) == "deepspeed-zero2"
    from hf_gpu_train.finetune.launch_plan import apply_launch_plan
    from hf_gpu_train.finetune.loading import load_config_and_keys

    cfg, explicit = load_config_and_keys(None, CASE[:2])  # the command tune printed: the tuned job
    cfg, applied = apply_launch_plan(cfg, explicit, environ=environ, overrides=CASE[:2],
                                     command_line_keys=frozenset({"max_length", "global_batch_size"}))
    assert (cfg.per_device_train_batch_size, cfg.global_batch_size) == (4, 16)  # the default's 32 was not the measured one
    assert "plan values not applied: none" in applied.lines, applied.lines
    report = (tmp_path / "cpu.tune_report.md").read_text()
    assert "| 2 | deepspeed-zero2 | 4 | 2 |" in report and "**micro-batch 4 x 2, checkpointing off, 0 worker(s), fp32, deepspeed-zero2**" in report


# -- the command line --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("config_args", "tune_args", "message"), [
    (["--num-processes", "2"], ["--strategies", "ddp,zero9"],
     "--strategies ddp,zero9: 'zero9' is not a strategy: use all, own or names from ddp, deepspeed-zero2"),
    (["--num-processes", "1"], ["--strategies", "all"],
     "--strategies all: cpu.yaml launches 1 process, and one process has one strategy: tune a config of several"),
    (["--num-processes", "2", "--strategy", "deepspeed-zero2"], [],
     "shards the model (deepspeed-zero2): tune searches with trials on one shared model with DDP or one process; tune a DDP "
     "config of the same GPUs (`hf-gpu-train config --strategy ddp`), then use its micro-batch in the sharded run, or measure "
     "this strategy against others at the plan's values, one launch each, with --strategies (e.g. --strategies ddp,deepspeed-zero2)"),
])
def test_usage_errors_exit_2_and_name_the_value_and_the_fix(tmp_path, monkeypatch, capsys, config_args, tune_args, message):
    path = config(tmp_path, monkeypatch, *config_args)
    capsys.readouterr()
    assert main(["tune", "--dry-run", *tune_args, "--config-file", str(path), "scripts/finetune.py", *CASE]) == 2
    assert message in capsys.readouterr().err


def test_a_config_whose_command_does_not_write_it_again_stops_tune_naming_the_command(tmp_path, capsys):
    """Written in-process (no `hf-gpu-train config` on the command line: its plan records only `--output`), with 3
    processes: the same command would plan another config, so tune says so before anything runs."""
    assert main(["config", "--machine", "cpu-only", "--num-processes", "3", "--output", str(tmp_path / "cpu")]) == 0
    capsys.readouterr()
    assert main(["tune", "--dry-run", "--strategies", "ddp,deepspeed-zero2", "--config-file", str(tmp_path / "cpu.yaml"),
                 "scripts/finetune.py", *CASE]) == 2
    err = capsys.readouterr().err
    assert "--strategies: `hf-gpu-train config --strategy deepspeed-zero2 --output " in err  # a dry plan's: a scratch folder
    assert (f"--force` plans 2 process(es), cpu.yaml 3: its plan's command (`hf-gpu-train config --output {tmp_path / 'cpu'}`) "
            "does not write this config again; regenerate it with `hf-gpu-train config ... --output") in err


def test_the_dry_plan_lists_each_strategy_and_its_config_without_writing_one(tmp_path, monkeypatch, capsys):
    path = config(tmp_path, monkeypatch, "--num-processes", "2")
    capsys.readouterr()
    assert main(["tune", "--dry-run", "--strategies", "all", "--config-file", str(path), "scripts/finetune.py", *CASE]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Strategies for cpu.yaml"):].splitlines()
    assert [line.split()[:2] for line in table[3:]] == [
        ["ddp", "cpu.yaml"], ["deepspeed-zero2", "cpu.strategies/deepspeed-zero2.yaml"],
        ["deepspeed-zero3", "cpu.strategies/deepspeed-zero3.yaml"], ["fsdp", "cpu.strategies/fsdp.yaml"]]
    assert "one launch at the search's winner" in table[4] and not (tmp_path / "cpu.strategies").exists()
