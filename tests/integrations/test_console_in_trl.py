"""Under TRL's SFTTrainer (which keeps the Trainer's progress bar) with the two lines: one display, the compact lines,
not a bar with lines written through it."""

from __future__ import annotations

import pytest

from tests.integrations.peers import MAX_STEPS, common_args, llama, lora, prompt_completion, tokenizer


def test_sft_trainer_with_telemetry_prints_the_lines_and_no_bar(tmp_path, capsys):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_gpu_train import attach_telemetry

    tok = tokenizer()
    args = SFTConfig(**{**common_args(str(tmp_path), 4), "disable_tqdm": False}, max_length=32, gradient_checkpointing=False)
    trainer = SFTTrainer(model=llama(tok), args=args, train_dataset=Dataset.from_list(prompt_completion()),
                         processing_class=tok, peft_config=lora())
    attach_telemetry(trainer, write_report=False)
    capsys.readouterr()  # the datasets' own bars while TRL tokenizes: not the training's display
    trainer.train()
    out, err = capsys.readouterr()
    steps = [line.split(" [")[0] for line in out.splitlines() if line.startswith("step ")]
    assert steps[:MAX_STEPS] == [f"step {i}/{MAX_STEPS}" for i in range(1, MAX_STEPS + 1)]  # logging_steps=1
    assert "it/s]" not in err + out and "%|" not in err + out  # no tqdm bar during training, on either stream
    assert any(line.startswith("train done") for line in out.splitlines())
