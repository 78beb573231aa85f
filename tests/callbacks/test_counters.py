"""Token counter, forward timer and window throughput on hand-made inputs."""

import pytest
import torch

from hf_gpu_train.callbacks import forward_timer as forward_timer_module
from hf_gpu_train.callbacks.flops import ModelFlops, window_throughput
from hf_gpu_train.callbacks.forward_timer import ForwardTimer
from hf_gpu_train.callbacks.tokens import TokenCounter
from hf_gpu_train.callbacks.window import deciding_window


class Echo(torch.nn.Module):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, past_key_values=None):
        return input_ids


def test_tokens_non_padding_with_a_mask_all_tokens_when_packed_and_none_in_eval():
    model = Echo()
    counter = TokenCounter().install(model)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    model(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=mask)
    counter.micro_step_done()
    packed = torch.ones(1, 7, dtype=torch.long)  # padding-free: no mask, every position is a token
    model(input_ids=packed, position_ids=torch.tensor([[0, 1, 2, 0, 1, 0, 1]]))
    counter.micro_step_done()
    model.eval()
    model(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=mask)
    assert counter.take() == 5 + 7
    assert counter.take() == 0


def test_a_retried_batch_counts_once_and_its_micro_batches_add_up():
    """What the OOM recovery tells the counter (training.microbatch.CHUNKS): a micro-batch that failed is void, a
    restart voids the micro-step so far, a replayed micro-step is not counted."""
    from hf_gpu_train.oom.microbatch import CHUNKS, replaying_micro_steps

    model = Echo()
    counter = TokenCounter().install(model)
    ids = torch.ones(4, 3, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    CHUNKS.begin_micro_step()
    CHUNKS.begin_chunk()
    model(input_ids=ids, attention_mask=mask)  # the whole batch: forward done, then an OOM in backward
    CHUNKS.void_current()
    for start in (0, 2):  # the recovery retries the same batch as two micro-batches
        CHUNKS.begin_chunk()
        model(input_ids=ids[start:start + 2].clone(), attention_mask=mask[start:start + 2].clone())
    counter.micro_step_done()
    CHUNKS.begin_micro_step()
    CHUNKS.begin_chunk()
    model(input_ids=ids, attention_mask=mask)  # the next micro-step: an OOM in a later micro-step restarts it
    CHUNKS.void_all()
    with replaying_micro_steps():
        model(input_ids=ids, attention_mask=mask)  # the earlier micro-step computed again: already counted
    CHUNKS.begin_chunk()
    model(input_ids=ids, attention_mask=mask)
    assert counter.take() == 9 + 9


def test_packed_rows_count_their_tokens_without_the_trailing_padding():
    class Packed(Echo):
        config = type("Config", (), {"pad_token_id": 0})()

    model = Packed()
    counter = TokenCounter().install(model)
    # row 0: examples of 3 and 2 tokens, then 3 of padding (restarting positions, pad id, no label)
    ids = torch.tensor([[5, 6, 7, 8, 9, 0, 0, 0], [5, 6, 7, 8, 9, 4, 3, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]])
    labels = torch.tensor([[5, 6, 7, 8, 9, -100, -100, -100], [5, 6, 7, 8, 9, 4, 3, 2]])
    model(input_ids=ids, position_ids=positions, labels=labels)
    assert counter.take() == 5 + 8
    with torch.no_grad():  # a generation's decode step: generated tokens, not training tokens
        model(input_ids=torch.ones(3, 1, dtype=torch.long), past_key_values=object())
    assert counter.take() == 0 and counter.take_generated() == 3


class FakeEvent:
    """torch.cuda.Event on a fake clock: the forward 'runs' 0.25 s on the device."""

    clock = [0.0]

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        FakeEvent.clock[0] += 0.25
        self.at = FakeEvent.clock[0]

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 1000.0 * (end.at - self.at)


def test_cuda_forward_time_comes_from_events_not_the_host_clock(monkeypatch):
    monkeypatch.setattr(forward_timer_module.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(forward_timer_module.time, "perf_counter", lambda: pytest.fail("host clock used on CUDA"))
    model = Echo()
    timer = ForwardTimer(torch.device("cuda", 0)).install(model)
    for _ in range(3):
        model(input_ids=torch.ones(1, 2))
    model.eval()
    model(input_ids=torch.ones(1, 2))
    assert timer.take() == (pytest.approx(0.75), 3)
    timer.remove()
    model.train()
    model(input_ids=torch.ones(1, 2))
    assert timer.take() == (0.0, 0)


def test_window_throughput_uses_training_time_and_the_attention_term():
    flops = ModelFlops(per_token=6e6, attention_per_token_per_position=1e4)
    out = window_throughput(train_time_s=2.0, steps=4, samples_per_step=16, tokens=6400, flops=flops, peak_flops_per_gpu=1e11, world=2)
    assert out["loop/samples_per_s"] == 32 and out["loop/tokens_per_s"] == 3200 and out["loop/tokens"] == 6400
    flops_per_s = 3200 * (6e6 + 1e4 * 100)  # mean sequence: 3200 tokens/s over 32 samples/s
    assert out["loop/model_tflops_per_s"] == pytest.approx(flops_per_s / 1e12)
    assert out["loop/mfu_pct"] == pytest.approx(100 * flops_per_s / 2 / 1e11)
    assert "loop/mfu_pct" not in window_throughput(2.0, 4, 16, 6400, flops, None, 2)  # unknown peak: no MFU
    per_sample = window_throughput(2.0, 4, 16, 0, ModelFlops(per_sample=1e9), 1e11, 1)
    assert "loop/tokens_per_s" not in per_sample and per_sample["loop/mfu_pct"] == pytest.approx(100 * 32e9 / 1e11)
    assert window_throughput(None, 0, 16, 0, flops, 1e11, 1) == {}


def test_deciding_window_is_the_last_full_one():
    def rec(steps, kind):
        return {"metrics": {"loop/steps": steps} if steps else {}, "verdict": {"kind": kind}}

    assert deciding_window([rec(10, "a"), rec(10, "b"), rec(1, "c")], 10)["verdict"]["kind"] == "b"
    assert deciding_window([rec(3, "a"), rec(1, "b")], 10)["verdict"]["kind"] == "b"  # no full window: the last with steps
    assert deciding_window([], 10) is None


@pytest.mark.gpu
def test_real_cuda_forward_time_is_the_device_time():
    """On a GPU the forward returns before its kernels finish: the events must see the device's time."""
    import time

    class Matmuls(torch.nn.Module):
        def forward(self, input_ids=None):
            x = input_ids
            for _ in range(20):
                x = x @ x
                x = x / x.norm()
            return x

    model = Matmuls().cuda()
    x = torch.randn(4096, 4096, device="cuda")
    model(input_ids=x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model(input_ids=x)
    torch.cuda.synchronize()
    reference_s = time.perf_counter() - start
    timer = ForwardTimer(torch.device("cuda")).install(model)
    model(input_ids=x)
    seconds, calls = timer.take()
    assert calls == 1 and 0.7 * reference_s <= seconds <= 1.5 * reference_s, (seconds, reference_s)
