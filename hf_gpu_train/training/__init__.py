"""In-place OOM recovery for the Hugging Face Trainer, the loss-scaling guard it relies on, and a fault
injector to test it without a GPU."""

from .fault_injection import OOMFaultInjector
from .loss_scaling import guard_loss_scaling
from .oom import InPlaceOOMRecovery, enable_oom_recovery
from .remedies import OutOfMemoryAtMicroBatchOne

__all__ = ["InPlaceOOMRecovery", "OutOfMemoryAtMicroBatchOne", "enable_oom_recovery", "guard_loss_scaling", "OOMFaultInjector"]
