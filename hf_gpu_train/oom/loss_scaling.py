"""Is this loss a per-batch mean or a sum normalised by ``num_items_in_batch``? Ask the loss, not the signature.

transformers 5 decides from a model's ``forward`` signature (``**kwargs`` means yes) that its loss is a
sum over the items of the whole global batch divided by their count (``num_items_in_batch``). For such a
loss the Trainer skips the division by the gradient-accumulation steps and, with
``average_tokens_across_devices`` (on by default), multiplies it by the number of processes, which DDP's
gradient averaging then undoes. A model whose ``forward`` takes ``**kwargs`` but returns a plain mean
(BERT sequence classification and most classification heads) therefore carries N times its loss and its
gradients on N processes: the logged loss is N times too large and gradient clipping trips N times sooner
(measured here: 2 processes log exactly 2x the loss of one on the same global batch).

``loss_normalisation`` asks the loss once: without a graph and without dropout, the loss of the same inputs
for n and for 2n items halves when it is sum-normalised and does not move when it is a mean.
``guard_loss_scaling(trainer)`` applies the answer before the first loss is used: a mean loss sets
``trainer.model_accepts_loss_kwargs = False``, the public switch the Trainer reads in ``compute_loss``
(no multiplication by the number of processes) and in ``training_step`` (division by the accumulation
steps), and says so once.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch

from . import trainer_state as restorable
from .microbatch import is_oom_error, label_counts

log = logging.getLogger("hf_gpu_train.loss_scaling")
MEAN, SUM, UNKNOWN = "mean", "sum-normalised", "unknown"


def loss_normalisation(compute_loss, model, inputs, num_items_in_batch) -> str:
    """MEAN, SUM or UNKNOWN for ``compute_loss(model, inputs, num_items_in_batch=...)``.

    The inputs are copied for each call: ``Trainer.compute_loss`` pops ``labels`` from the dict it is given
    when label smoothing or a ``compute_loss_func`` is on."""
    if num_items_in_batch is None:
        return MEAN
    was_training = model.training
    model.eval()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            once = float(compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch))
            twice = float(compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch * 2))
    finally:
        model.train(was_training)
    if once == 0.0 or twice == 0.0:
        return UNKNOWN
    ratio = once / twice  # 1 for a mean, 2 for a sum normalised by the count: bands, not ulps (bf16 kernels, atomics)
    if 0.9 <= ratio <= 1.1:
        return MEAN
    if 1.8 <= ratio <= 2.2:
        return SUM
    return UNKNOWN


class LossScalingGuard:
    """Wraps ``trainer.compute_loss`` on the instance; decides at the first call that carries an item count."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.compute_loss_unguarded = trainer.compute_loss
        # the Trainer counts items (and trusts the loss to be normalised by them) for these two only
        counted = getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None) is not None
        self.answer: str | None = None if counted else MEAN

    def install(self) -> LossScalingGuard:
        self.trainer.compute_loss = self.compute_loss
        self.trainer._hf_gpu_train_loss_guard = self  # our own attribute: one guard per Trainer
        return self

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.answer is None and num_items_in_batch is not None:
            self.decide(model, inputs, num_items_in_batch)
        return self.compute_loss_unguarded(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def decide(self, model, inputs, num_items_in_batch) -> str:
        # DDP's forward would broadcast buffers and change its sync flags: its module answers the same question.
        # FSDP and DeepSpeed wrappers are asked as they are (every rank probes at the same step).
        probed = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        # the probe runs the Trainer's own compute_loss: whatever it tallies (TRL files entropy and token accuracy
        # under "eval" while the model is in eval mode) is put back as it was, and the random state is not drawn from
        tallies = restorable.take(self.trainer)
        try:
            found = loss_normalisation(self.compute_loss_unguarded, probed, inputs, num_items_in_batch)
        finally:
            restorable.put_back(self.trainer, tallies)
        self.answer = agree_across_ranks(found, self.trainer.accelerator)
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        if self.answer == MEAN and self.trainer.compute_loss_func is not None:
            log.warning("hf_gpu_train: the compute_loss_func given to the Trainer returns a per-batch mean, but transformers "
                        "treats a compute_loss_func's loss as normalised by num_items_in_batch (it skips the division by the "
                        "accumulation steps and multiplies by the number of processes): return the sum of the per-item losses "
                        "divided by num_items_in_batch, as its contract says, or the loss and gradients are off by those factors")
        elif self.answer == MEAN and self.trainer.model_accepts_loss_kwargs:
            self.trainer.model_accepts_loss_kwargs = False
            log.warning("hf_gpu_train: %s's forward takes **kwargs, so transformers treats its loss as normalised by "
                        "num_items_in_batch, but it is a per-batch mean: set trainer.model_accepts_loss_kwargs = False, so the "
                        "loss is divided by the accumulation steps and not multiplied by the %d process(es)",
                        type(unwrapped).__name__, self.trainer.accelerator.num_processes)
        elif self.answer == UNKNOWN:
            log.warning("hf_gpu_train: cannot tell whether %s's loss is a mean or normalised by num_items_in_batch; "
                        "left as transformers decided (model_accepts_loss_kwargs=%s)", type(unwrapped).__name__,
                        self.trainer.model_accepts_loss_kwargs)
        return self.answer


def agree_across_ranks(answer: str, accelerator) -> str:
    """Every rank's verdict must be the same (each scales its loss by it): any disagreement is UNKNOWN everywhere."""
    if accelerator.num_processes < 2 or not torch.distributed.is_initialized():
        return answer
    codes = {MEAN: 0, SUM: 1, UNKNOWN: 2}
    votes = torch.tensor([codes[answer], -codes[answer]], dtype=torch.int64, device=accelerator.device)
    torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.MAX)
    highest, lowest = int(votes[0]), -int(votes[1])
    return answer if highest == lowest else UNKNOWN


def guard_loss_scaling(trainer) -> LossScalingGuard:
    """One line for anyone's Trainer, before ``trainer.train()``; ``enable_oom_recovery`` and
    ``attach_telemetry`` call it too. Installing it twice returns the first guard."""
    existing = getattr(trainer, "_hf_gpu_train_loss_guard", None)
    return existing if existing is not None else LossScalingGuard(trainer).install()


# -- what a mean loss averages over ----------------------------------------------------------------------------------
# A loss that is not normalised by ``num_items_in_batch`` is usually a mean, but a mean over what? Sequence
# classification and vision average over rows; T5, BART and the other encoder-decoders, token classification and masked
# LM over labelled tokens; a causal LM's own mean over the labelled tokens after the first of each row (its labels are
# shifted); Wav2Vec2's CTC with ``ctc_loss_reduction="sum"`` does not average at all. A step split into micro-batches
# gives the whole batch's gradient only when each micro-batch's loss is weighed by its share of *that*: weighed by
# rows, a token mean was off by 2-50% of the update (T5 in Seq2SeqTrainer, BERT token classification). So the loss is
# asked, as for the mean-or-sum question above: two samples of different label counts, alone and together.
WEIGHTINGS = {"rows": "rows", "tokens": "labelled tokens", "next-tokens": "labelled next tokens", "sum": "a sum"}
UNDECIDED = None
PROBE_TRIES = 3  # optimizer steps whose batches may be probed before the weighting falls back, said


class LossWeighting:
    """How a step's micro-batches are weighed: ``kind`` is a key of ``WEIGHTINGS``, ``"normalised"`` (the loss is divided
    by ``num_items_in_batch``, the whole batch's count: it adds up as it is), ``"unknown"`` (weighed by rows, said before
    the first update) or ``"custom"`` (``count(inputs)``: the items a micro-batch's loss averages over)."""

    def __init__(self, kind: str, count=None):
        self.kind = kind
        self.count = count

    @classmethod
    def told(cls, value) -> LossWeighting:
        """What a user passed as ``loss_weighting=``: a name, or a function of a micro-batch's inputs."""
        if callable(value):
            return cls("custom", count=value)
        if value not in WEIGHTINGS:
            raise ValueError(f"loss_weighting={value!r} is not one of {', '.join(map(repr, WEIGHTINGS))}, nor a function "
                             "of a micro-batch's inputs that returns how many items its loss averages over")
        return cls(value)

    def describe(self) -> str:
        others = {"custom": "the items loss_weighting counts", "unknown": "unknown",
                  "normalised": "normalised by num_items_in_batch"}
        return others.get(self.kind) or WEIGHTINGS[self.kind]

    def per_sample(self, inputs, layout) -> list[float]:
        """What each sample of ``inputs`` adds to the count the loss averages over."""
        if self.kind in ("tokens", "next-tokens"):
            counts = label_counts(inputs, shifted=self.kind == "next-tokens")
            if counts is not None:
                return layout.per_sample(counts)
        if self.kind == "custom":
            return [float(self.count(layout.slice(inputs, i, i + 1))) for i in range(layout.size(inputs))]
        return [1.0] * layout.size(inputs)

    def share(self, per_sample: list[float], start: int, stop: int) -> float:
        """The weight of samples ``start:stop`` in the loss of all of them: a mean's share, 1 for a sum."""
        if self.kind in ("sum", "normalised"):  # each micro-batch's loss adds up to the whole batch's as it is
            return 1.0
        total = sum(per_sample)
        if total <= 0:
            return (stop - start) / len(per_sample)
        return sum(per_sample[start:stop]) / total


@dataclass(frozen=True)
class Probe:
    """What two samples said about a loss: ``kind`` (a key of ``WEIGHTINGS``, ``"normalised"``, ``"unknown"``, or
    ``UNDECIDED``: this batch cannot tell) and, where no combination of the samples' losses alone gives their loss
    together, ``deviation``: the gap to the nearest one, relative to the loss together (a term over the whole batch: a
    router's load-balancing loss, a z-loss, a regulariser of the batch)."""

    kind: str | None
    deviation: float | None = None


@contextlib.contextmanager
def _quietly(model):
    """The probes' calls: no gradients, no dropout, and the random state as it was (nothing drawn from the run's)."""
    was_training = model.training
    model.eval()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            yield
    finally:
        model.train(was_training)


def _alone(splice, pair, index: int, mean: bool):
    """Sample ``index`` of ``pair`` alone, with a batch-level term split from the pair's (``batch_terms.py``) if known."""
    return splice(pair, index, mean) if splice is not None else contextlib.nullcontext()


def probe_weighting(compute_loss, model, inputs, layout, tolerance: float, splice=None, relabelled: bool = False) -> Probe:
    """Ask the loss what it averages over: the loss of two samples with different label counts, alone and together.
    ``Probe.kind`` is a kind of ``WEIGHTINGS``, ``"unknown"`` when none predicts the pair's loss (with the deviation), or
    ``UNDECIDED`` when this batch cannot tell (one sample, or two candidates predict the same within ``tolerance``).

    Two samples whose losses per labelled token are alike (a fresh head: every token near ln(vocabulary)) cannot tell a
    mean over rows from one over tokens, nor (a masked LM never labels its first position) one over tokens from one over
    the tokens after the first. ``relabelled``: the same two samples asked with labels that make them differ (each
    one's labelled positions given the token the model finds most likely there, and least likely; the first position
    labelled in one only; unequal counts): what a loss averages over does not depend on which tokens are labelled. The
    caller asks so when no rank could tell (the calls of compute_loss are the same on every rank: a pair that cannot be
    relabelled here is asked as it is). ``splice(pair, index, mean)``: a context in which sample ``index`` alone carries
    its part of a batch-level term of the pair (``batch_terms.py``)."""
    size = layout.size(inputs)
    if size < 2:
        return Probe(UNDECIDED)
    counts = label_counts(inputs)
    per_sample = layout.per_sample(counts) if counts is not None else [1.0] * size
    first, second = _most_unequal(per_sample[:16])
    pair = layout.take(inputs, [first, second])
    if relabelled:
        differing = _labels_that_differ(model, pair, layout)
        found = _weigh(compute_loss, model, differing if differing is not None else pair, layout, tolerance, splice)
        return found if differing is not None and found.kind != "unknown" else Probe(UNDECIDED)
    return _weigh(compute_loss, model, pair, layout, tolerance, splice)


def _weigh(compute_loss, model, pair, layout, tolerance: float, splice) -> Probe:
    with _quietly(model):
        alone = []
        for i in (0, 1):
            with _alone(splice, pair, i, mean=True):
                alone.append(float(compute_loss(model, layout.take(pair, [i]), num_items_in_batch=None)))
        together = float(compute_loss(model, dict(pair), num_items_in_batch=None))
    if not all(math.isfinite(x) for x in (*alone, together)):
        return Probe(UNDECIDED)
    predicted = {"rows": sum(alone) / 2, "sum": sum(alone)}
    for kind, shifted in (("tokens", False), ("next-tokens", True)):
        rows = label_counts(pair, shifted=shifted)
        if rows is not None:
            n = layout.per_sample(rows)
            if n[0] + n[1] > 0:
                predicted[kind] = (n[0] * alone[0] + n[1] * alone[1]) / (n[0] + n[1])
    scale = max(abs(together), 1e-6)
    matching = [kind for kind, value in predicted.items() if abs(value - together) <= tolerance * scale]
    if not matching:
        return Probe("unknown", min(abs(value - together) for value in predicted.values()) / scale)
    # several candidates predict the pair's loss: equal label counts, or two losses too close to tell the weights apart
    return Probe(matching[0]) if len(matching) == 1 else Probe(UNDECIDED)


def _labels_that_differ(model, pair, layout):
    """``pair`` with token labels rewritten so its two samples' losses differ (None: no token labels, or no logits to
    choose the tokens from): sample 0's labelled positions, and its first position, all get the token the model finds
    most likely there on average; sample 1's, but its first, the least likely; sample 1 keeps half of them when the
    counts are equal. The logits come from the model's own forward without labels (never the Trainer's compute_loss:
    no collective, no tally)."""
    labels = pair.get("labels") if hasattr(pair, "get") else None
    if not (isinstance(labels, torch.Tensor) and labels.dim() == 2 and labels.shape[0] == layout.size(pair) == 2):
        return None
    try:
        with _quietly(model):
            outputs = model(**{key: value for key, value in pair.items() if key != "labels"})
    except Exception as error:  # a model that needs what a Trainer of its own passes: the pair is asked as it is
        if is_oom_error(error):
            raise
        return None
    logits = outputs.get("logits") if hasattr(outputs, "get") else getattr(outputs, "logits", None)
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[:2] == labels.shape):
        return None
    mask = labels.ne(-100).clone()
    # the first position labelled in one sample only: a mean over labelled tokens and one over the labelled tokens after
    # the first (a causal LM's) then weigh the two samples differently (a masked LM never labels position 0 itself)
    mask[0, 0], mask[1, 0] = True, False
    kept = mask[1].nonzero().flatten()
    if len(kept) < 2 or not labels.ne(-100).any():
        return None
    if int(mask[0].sum()) == int(mask[1].sum()):
        mask[1, kept[len(kept) // 2:]] = False
    scores = logits[labels.ne(-100)].float().mean(0)
    likely, unlikely = int(scores.argmax()), int(scores.argmin())
    rewritten = torch.full_like(labels, -100)
    rewritten[0][mask[0]] = likely
    rewritten[1][mask[1]] = unlikely
    return {**pair, "labels": rewritten}


def decomposes(compute_loss, model, inputs, layout, num_items_in_batch, tolerance: float, splice=None) -> Probe:
    """For a loss normalised by ``num_items_in_batch`` (it adds up over micro-batches as it is, each weighed 1): does it?
    Two samples' loss together against the sum of each alone, all normalised by the same count. A term over the whole
    batch (a router's load-balancing loss) is counted once per micro-batch and does not add up: ``Probe("unknown",
    deviation)``. Asked at the pair's own count (the deviation said) and at a thousand times it, where the per-item part
    is small beside any batch-level term (so a small coefficient is found at any precision)."""
    size = layout.size(inputs)
    if size < 2:
        return Probe(UNDECIDED)
    counts = label_counts(inputs)
    per_sample = layout.per_sample(counts) if counts is not None else [1.0] * size
    first, second = _most_unequal(per_sample[:16])
    pair = layout.take(inputs, [first, second])
    items = max(1.0, per_sample[first] + per_sample[second]) if counts is not None else 2.0
    deviations = []
    with _quietly(model):
        for factor in (1, 1000):  # both asked whatever the first says: every rank makes the same calls
            n = _like(num_items_in_batch, items * factor)
            together = float(compute_loss(model, dict(pair), num_items_in_batch=n))
            alone = 0.0
            for i in (0, 1):
                with _alone(splice, pair, i, mean=False):
                    alone += float(compute_loss(model, layout.take(pair, [i]), num_items_in_batch=n))
            deviations.append(abs(together - alone) / max(abs(together), 1e-12)
                              if math.isfinite(together) and math.isfinite(alone) else math.nan)
    if any(math.isnan(d) for d in deviations):
        return Probe(UNDECIDED)
    return Probe("normalised") if max(deviations) <= tolerance else Probe("unknown", deviations[0])


def _like(num_items_in_batch, value: float):
    """``value`` as the Trainer passes an item count: a tensor where it passed one."""
    if isinstance(num_items_in_batch, torch.Tensor):
        whole = float(value).is_integer()
        dtype = num_items_in_batch.dtype if num_items_in_batch.is_floating_point() or whole else torch.float32
        return torch.tensor(value, dtype=dtype, device=num_items_in_batch.device)
    return int(value) if float(value).is_integer() else value


def _most_unequal(per_sample: list[float]) -> tuple[int, int]:
    """The two samples whose counts differ most (by ratio): their weights then differ most between the candidates."""
    best, pair = -1.0, (0, 1)
    for i in range(len(per_sample)):
        for j in range(i + 1, len(per_sample)):
            a, b = per_sample[i], per_sample[j]
            score = abs(a - b) / (a + b) if a + b > 0 else 0.0
            if score > best:
                best, pair = score, (i, j)
    return pair


def agree_on_weighting(found: str | None, accelerator) -> str | None:
    """Every rank weighs by the same rule (the loss is the same code on every rank): a rank whose rows could not tell
    takes the others' answer; ranks that found different answers make it unknown everywhere."""
    if accelerator.num_processes < 2 or not torch.distributed.is_initialized():
        return found
    kinds = [None, "unknown", "normalised", *WEIGHTINGS]
    mine = torch.zeros(len(kinds), dtype=torch.int64, device=accelerator.device)
    mine[kinds.index(found)] = 1
    torch.distributed.all_reduce(mine)
    decided = [kinds[i] for i in range(1, len(kinds)) if mine[i] > 0]
    if not decided:
        return UNDECIDED
    return decided[0] if len(decided) == 1 else "unknown"
