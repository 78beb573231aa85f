"""In-place OOM recovery for the Hugging Face Trainer, and a fault injector to test it without a GPU."""

from .fault_injection import OOMFaultInjector
from .oom import InPlaceOOMRecovery, OutOfMemoryAtMicroBatchOne, enable_oom_recovery

__all__ = ["InPlaceOOMRecovery", "OutOfMemoryAtMicroBatchOne", "enable_oom_recovery", "OOMFaultInjector"]
