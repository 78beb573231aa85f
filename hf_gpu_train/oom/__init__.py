"""In-place OOM recovery for anyone's Hugging Face Trainer (``recovery``), the pieces it is made of (the micro-batch
policy, the training and prediction steps, micro-batches, the gradient reducer, the ballots, what a loss averages over,
the Trainer state a re-run restores), and a fault injector to test it without a GPU."""

from .fault_injection import OOMFaultInjector
from .loss_scaling import guard_loss_scaling
from .policy import OOMRecoveryState
from .recovery import InPlaceOOMRecovery, enable_oom_recovery
from .remedies import OutOfMemoryAtMicroBatchOne
from .trainer_state import register_trainer_state
from .training_step import InexactSplitRefused

__all__ = ["InPlaceOOMRecovery", "InexactSplitRefused", "OOMRecoveryState", "OutOfMemoryAtMicroBatchOne",
           "enable_oom_recovery", "guard_loss_scaling", "OOMFaultInjector", "register_trainer_state"]
