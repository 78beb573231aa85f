"""Faults of a run of several processes, in anyone's Trainer: the watchdog on a stalled rank, the collective gate
(saves and evaluations every rank enters, or none does), the preflight collective, a disk that fills up,
checkpoints that can be trusted (a completion marker, a resume that never takes a half-written one, a mid-epoch
resume in the epoch's order), and preemption (a scheduler's stop signal ends in a complete checkpoint, exit 75)."""
