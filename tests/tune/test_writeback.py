"""The winner into NAME.plan.json and NAME.yaml: backups first, the plan still reads, accelerate still loads the
YAML, the next run takes the tuned values, and they count as measured for this recipe only."""

from __future__ import annotations

from dataclasses import replace

from hf_gpu_train.cli import main
from hf_gpu_train.hardware.snapshot import load_machine
from hf_gpu_train.plan.resolution import resolve_with_plan
from hf_gpu_train.plan.run_plan_file import APPLIED_KEYS, generating_command, read_run_plan, tuned_keys_for
from hf_gpu_train.tune.job import load_job
from hf_gpu_train.tune.results import OK, OOM, TrialResult, choose
from hf_gpu_train.tune.writeback import BLOCK_BEGIN, write_winner


def tuned_box(tmp_path, *config_args: str, recipe_text: str = "per_device_train_batch_size: 32\nglobal_batch_size: 64\n"
              "max_length: 128\n"):
    assert main(["config", "--machine", "1x-h200", "--output", str(tmp_path / "box"), *config_args]) == 0
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text)
    job = load_job(str(tmp_path / "box.yaml"), "scripts/finetune.py", ["--config", str(recipe)], {},
                   profile=load_machine("1x-h200"))  # tuned on the machine it was planned for
    base = job.space.base
    winner = replace(base.with_micro_batch(16), precision="fp16", torch_compile=True)
    results = [TrialResult(base.with_micro_batch(64), OOM, rescued_micro_batch=32, samples_per_s=90.0),
               TrialResult(base, OK, samples_per_s=100.0, tokens_per_s=3000.0, peak_memory_bytes=20 * 2**30,
                           device_memory_bytes=140 * 2**30),
               TrialResult(winner, OK, samples_per_s=130.0, tokens_per_s=3900.0, peak_memory_bytes=12 * 2**30,
                           device_memory_bytes=140 * 2**30)]
    return job, recipe, results, choose(results, job.space.metric, base)


def test_backups_first_then_the_plan_holds_the_measured_values_and_the_next_run_takes_them(tmp_path):
    job, recipe, results, choice = tuned_box(tmp_path)
    before = {p: p.read_text() for p in (tmp_path / "box.plan.json", tmp_path / "box.yaml")}
    written = write_winner(job.config_file, choice, results, job.space, "S", "now", str(recipe), [], "box.tune_report.md", 60.0)
    assert {b.name for b in written.backups} == {"box.plan.json.bak-S", "box.yaml.bak-S"}
    for original, text in before.items():
        assert (tmp_path / f"{original.name}.bak-S").read_text() == text
    plan = read_run_plan(tmp_path / "box.plan.json", "test")
    assert plan.value("per_device_train_batch_size") == 16 and plan.value("gradient_accumulation_steps") == 4
    assert plan.value("global_batch_size") == 64 and plan.value("precision") == "fp16" and plan.value("torch_compile") is True
    assert plan.values["per_device_train_batch_size"].reason.startswith("measured by hf-gpu-train tune (now): fastest that fits: "
                                                                        "3,900 tokens/s with micro-batch 16 x 4")
    resolved = resolve_with_plan(plan, {k: None for k in APPLIED_KEYS}, explicit_keys=(), world_size=1)
    assert {k: resolved.values[k] for k in ("per_device_train_batch_size", "global_batch_size", "torch_compile", "precision")} == {
        "per_device_train_batch_size": 16, "global_batch_size": 64, "torch_compile": True, "precision": "fp16"}
    assert tuned_keys_for(plan, recipe) == {"per_device_train_batch_size", "global_batch_size", "gradient_checkpointing",
                                            "checkpoint_layers", "offload_activations", "dataloader_num_workers", "precision",
                                            "torch_compile"}  # the levers' axes too (checkpointing policy, offloading on CUDA)
    again = load_job(str(tmp_path / "box.yaml"), "scripts/finetune.py", ["--config", str(recipe)], {},
                     profile=load_machine("1x-h200"))
    assert again.space == job.space and again.cache_key == job.cache_key  # a rerun starts where the first run started
    recipe.write_text(recipe.read_text() + "learning_rate: 1.0e-4\n")
    assert tuned_keys_for(plan, recipe) == frozenset()  # another recipe text: the recipe's own values win again


def test_the_yaml_keeps_its_header_and_its_precision_and_gets_one_block(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    job, recipe, results, choice = tuned_box(tmp_path)
    command = generating_command(tmp_path / "box.yaml")
    for stamp in ("S1", "S2"):  # twice: the block is replaced, not added again
        write_winner(job.config_file, choice, results, job.space, stamp, "now", str(recipe), [], "box.tune_report.md", 60.0)
    text = (tmp_path / "box.yaml").read_text()
    assert text.count(BLOCK_BEGIN) == 1 and "#     micro-batch 64 x 1, checkpointing off, 8 worker(s), bf16" in text
    assert text.splitlines()[0].startswith("# accelerate config for 1x-h200")
    assert command is not None and generating_command(tmp_path / "box.yaml") == command  # the launcher still knows it is ours
    # the YAML reaches every recipe launched with it: its precision is not the tuned recipe's to change (issue 17)
    assert load_config_from_file(str(tmp_path / "box.yaml")).mixed_precision == "bf16"


def test_tuned_values_reach_the_tuned_recipe_only(tmp_path):
    """Issue 17, item 2: tune for recipe A, then recipe B with the same launch config got A's micro-batch, global batch,
    compile and precision without a word. Now B gets the plan as `config` wrote it and says why; A gets its values, and
    only A's launches get the tuned precision."""
    from hf_gpu_train.cli.launch import build_launch
    from hf_gpu_train.finetune.launch_plan import apply_launch_plan
    from hf_gpu_train.finetune.loading import load_config
    from hf_gpu_train.plan.run_plan_file import PLAN_ENV

    job, recipe, results, choice = tuned_box(tmp_path)
    write_winner(job.config_file, choice, results, job.space, "S", "now", str(recipe), [], "box.tune_report.md", 60.0)
    other = tmp_path / "other.yaml"
    other.write_text("max_length: 64\n")
    keys = ("per_device_train_batch_size", "global_batch_size", "torch_compile", "precision", "gradient_checkpointing")

    def applied(path, plan_file):
        explicit = frozenset(line.split(":")[0] for line in path.read_text().splitlines() if ":" in line)
        cfg, plan = apply_launch_plan(load_config(str(path), []), explicit, environ={PLAN_ENV: str(plan_file)}, recipe=str(path),
                                      here=load_machine("1x-h200"))  # on the machine it was planned for
        return {k: getattr(cfg, k) for k in keys}, plan.lines

    b_values, b_lines = applied(other, tmp_path / "box.plan.json")
    before_tune, _ = applied(other, tmp_path / "box.plan.json.bak-S")  # the plan as `config` wrote it
    assert b_values == before_tune and b_values["torch_compile"] is False and b_values["precision"] != "fp16"
    assert any("not applied" in line and str(recipe) in line for line in b_lines), b_lines
    a_values, _ = applied(recipe, tmp_path / "box.plan.json")
    assert {k: a_values[k] for k in keys[:4]} == {"per_device_train_batch_size": 16, "global_batch_size": 64,
                                                  "torch_compile": True, "precision": "fp16"}
    script = tmp_path / "train.py"
    script.write_text("")
    for path, tuned in ((recipe, True), (other, False)):
        launch = build_launch(["--config-file", str(tmp_path / "box.yaml"), str(script), "--config", str(path)], environ={},
                              here=load_machine("1x-h200"))
        at = launch.cmd.index(str(script))
        assert (launch.cmd[at - 2:at] == ["--mixed_precision", "fp16"]) is tuned and ("--mixed_precision" in launch.cmd) is tuned


def test_the_gpu_check_sets_the_planner_estimate_beside_every_measured_peak(tmp_path):
    from scripts.gpu_checks.tune_on_gpu import planner_errors
    from tests.tune.test_candidates import planned_t4, t4_model

    config = planned_t4(tmp_path)
    args = [t4_model(tmp_path), "max_length=512", "global_batch_size=64"]
    job = load_job(str(config), "scripts/finetune.py", args, {}, profile=load_machine("1x-t4"))
    c = job.space.base.with_micro_batch(8)
    estimate = job.space.verdict(c).estimate_bytes
    results = [TrialResult(c, OK, samples_per_s=10.0, peak_memory_bytes=int(estimate * 1.25), device_memory_bytes=16 * 2**30)]
    write_winner(config, choose(results, job.space.metric, job.space.base), results, job.space, "S", "now", None, args, "r.md", 60.0)
    rows = planner_errors(config, args, profile=load_machine("1x-t4"))
    assert rows[1] == [c.describe(), f"{estimate * 1.25 / 2**30:.2f}", f"{estimate / 2**30:.2f}", "+25.0"]


def test_tuned_values_are_scoped_to_the_recipe_and_the_command_lines_job(tmp_path):
    """Tune of the default run (no recipe file) said "Next: hf-gpu-train launch ... scripts/finetune.py max_length=128",
    and that very run got none of the tuned values. And a recipe tuned with model=X on its command line gave its
    values to the same recipe with model=Y. Both halves: the job is the recipe's text and the command line's keys
    that change what trains (not output_dir, logging or the tuned keys themselves)."""
    from hf_gpu_train.finetune.launch_plan import apply_launch_plan
    from hf_gpu_train.finetune.loading import load_config_and_keys
    from hf_gpu_train.plan.run_plan_file import PLAN_ENV

    job, recipe, results, choice = tuned_box(tmp_path)
    write_winner(job.config_file, choice, results, job.space, "S", "now", None, ["max_length=128"], "r.md", 60.0)
    plan = read_run_plan(tmp_path / "box.plan.json", "test")
    assert "per_device_train_batch_size" in tuned_keys_for(plan, None, ["max_length=128", "output_dir=elsewhere",
                                                                        "per_device_train_batch_size=4"])
    assert tuned_keys_for(plan, None, ["max_length=256"]) == frozenset()
    assert tuned_keys_for(plan, None, []) == frozenset()
    assert tuned_keys_for(plan, recipe, ["max_length=128"]) == frozenset()  # a recipe file is another job

    def run(*overrides):
        cfg, explicit = load_config_and_keys(None, list(overrides))
        cfg, applied = apply_launch_plan(cfg, explicit, environ={PLAN_ENV: str(tmp_path / "box.plan.json")}, recipe=None,
                                         overrides=overrides, here=load_machine("1x-h200"))
        return cfg

    assert (run("max_length=128").per_device_train_batch_size, run("max_length=128").torch_compile) == (16, True)
    assert run("max_length=64").torch_compile is False  # the plan as config wrote it

    write_winner(job.config_file, choice, results, job.space, "T", "now", str(recipe), ["model=builtin:minilm"], "r.md", 60.0)
    plan = read_run_plan(tmp_path / "box.plan.json", "test")
    assert tuned_keys_for(plan, recipe, ["model=builtin:minilm"]) and not tuned_keys_for(plan, recipe, ["model=other"])


def test_a_tuned_plan_on_another_machine_gives_neither_its_tuned_nor_its_planned_values(tmp_path):
    """Review of issue 17: tuned for an H200, launched on this CPU box, hf-gpu-train launch passed
    `--mixed_precision None` (accelerate refuses it) and the run said "precision=None measured by hf-gpu-train tune"."""
    from hf_gpu_train.cli.launch import build_launch
    from hf_gpu_train.finetune.launch_plan import apply_launch_plan
    from hf_gpu_train.finetune.loading import load_config
    from hf_gpu_train.plan.run_plan_file import PLAN_ENV

    job, recipe, results, choice = tuned_box(tmp_path)
    write_winner(job.config_file, choice, results, job.space, "S", "now", str(recipe), [], "r.md", 60.0)
    script = tmp_path / "train.py"
    script.write_text("")
    launch = build_launch(["--config-file", str(tmp_path / "box.yaml"), str(script), "--config", str(recipe)], environ={},
                          here=load_machine("cpu-only"))
    assert "--mixed_precision" not in launch.cmd
    explicit = frozenset(line.split(":")[0] for line in recipe.read_text().splitlines() if ":" in line)
    environ = {PLAN_ENV: str(tmp_path / "box.plan.json"), "ACCELERATE_MIXED_PRECISION": "bf16", "OMP_NUM_THREADS": "16"}
    cfg, plan = apply_launch_plan(load_config(str(recipe), []), explicit, environ=environ, recipe=str(recipe),
                                  here=load_machine("cpu-only"))
    lines = "\n".join(plan.lines)
    assert "None measured" not in lines and "measured by hf-gpu-train tune for this recipe" not in lines, lines
    assert cfg.per_device_train_batch_size == 32 and cfg.precision == "auto"  # the recipe's own
    assert "plan made for another machine (1x-h200" in lines
    # the YAML's bf16 and the plan's threads had reached the process (a sourced NAME.env): unset, and said so
    assert "ACCELERATE_MIXED_PRECISION" not in environ and "OMP_NUM_THREADS" not in environ
    assert "OMP_NUM_THREADS=16 from the plan for 1x-h200 unset" in lines


def test_tuned_values_hold_for_the_data_they_were_measured_on(tmp_path):
    """The same recipe text naming a train_file that has changed since tune (longer texts, at the same path) is another
    job; an edit of the learning rate on the command line is the same job."""
    from hf_gpu_train.plan.run_plan_file import data_stamps

    job, recipe, results, choice = tuned_box(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "short"}\n')
    values = {"train_file": str(data), "model": "builtin:minilm"}
    write_winner(job.config_file, choice, results, job.space, "S", "now", str(recipe), [], "r.md", 60.0, data=data_stamps(values))
    plan = read_run_plan(tmp_path / "box.plan.json", "test")
    assert tuned_keys_for(plan, recipe, ["learning_rate=1e-4", "num_train_epochs=3"], data_stamps(values))
    data.write_text('{"text": "a much longer text than the one tune measured on"}\n' * 50)
    assert tuned_keys_for(plan, recipe, [], data_stamps(values)) == frozenset()
