"""One rank of faults.py's "cannot join" case: rank 1 looks for the rendezvous on a port nobody listens on (a wrong
MASTER_PORT, a firewall), then runs the preflight every scripts/finetune.py launch of several processes runs."""

import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_gpu_train.errors import report_usage_error  # noqa: E402
from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.faults.preflight_collective import PreflightError, preflight  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

if os.environ["RANK"] == "1":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
try:
    preflight(cpu=True)
except PreflightError as error:
    report_usage_error(f"preflight_probe: error: {error}")
    sys.exit(2)
