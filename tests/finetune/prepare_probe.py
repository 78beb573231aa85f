"""One rank of ``run.prepare`` (no process group: ``prepare_once`` reads only RANK and WORLD_SIZE), counting the
passes over the rows and writing a digest of the datasets it got. argv: out_dir config_args [-- config_args]...
(several runs in one process: each process costs the imports)"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)


def digest(ds) -> str:
    rows = ds.with_format(None).to_dict()
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def main() -> None:
    from hf_gpu_train.finetune.loading import load_config
    from hf_gpu_train.finetune.run import prepared_for
    from hf_gpu_train.finetune.runtime import resolve_runtime
    from hf_gpu_train.finetune.tasks.language_modeling import prepare as lm
    from hf_gpu_train.finetune.tasks.text_classification import task as text

    out = Path(sys.argv[1])
    runs = " ".join(sys.argv[2:]).split(" -- ")
    rank = os.environ.get("RANK", "0")

    def counted(function):
        def wrapper(*a, **kw):
            with open(out / f"passes-{run}.txt", "a") as f:
                f.write(f"{rank}\n")
            return function(*a, **kw)
        return wrapper

    text.tokenize = counted(text.tokenize)
    lm.encode_split = counted(lm.encode_split)  # the names each task calls
    for run, args in enumerate(runs):
        cfg = load_config(None, args.split())
        p = prepared_for(cfg, resolve_runtime(cfg))
        train, validation, data = p.train, p.validation, p.data
        (out / f"rank{rank}-{run}.json").write_text(json.dumps({"train": digest(train), "validation": digest(validation),
                                                                "rows": [len(train), len(validation)], "notes": data.notes}))


if __name__ == "__main__":
    main()
