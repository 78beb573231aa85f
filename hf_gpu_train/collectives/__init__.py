"""What every rank of a run of several processes does together, below both ``oom/`` and ``faults/`` (each uses it, and
neither may import the other): small votes on the CPU (``cpu_votes.py``), the Trainer's control flags agreed before it
acts on them (``control_flags.py``), ``torch.distributed``'s collectives wrapped and their unwrapped originals
(``wrappers.py``), BatchNorm's running statistics kept equal on every rank so each evaluates the saved model
(``running_statistics.py``), clipping's order under DeepSpeed and FSDP said (``clipping_order.py``), which engine shards a Trainer's model
(``engines.py``), and the refusal of a rank of several whose Trainer sees one (``lone_rank.py``)."""
