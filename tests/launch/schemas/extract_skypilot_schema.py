"""Write skypilot_task.json: the JSON Schemas SkyPilot checks a task YAML with, from an installed ``skypilot``.

    python3 -m venv /tmp/sky && /tmp/sky/bin/pip install skypilot
    /tmp/sky/bin/python tests/launch/schemas/extract_skypilot_schema.py

``sky.Task.from_yaml_config`` validates the task against ``sky.utils.schemas.get_task_schema()`` (whose ``resources``
is any object) and then ``Resources.from_yaml_config`` the ``resources`` section against ``get_resources_schema()``,
both with ``sky.utils.validator.get_schema_validator()``: Draft 7 plus two keywords of SkyPilot's own,
``case_insensitive_enum`` and ``case_sensitive_enum`` (tests/launch/test_skypilot.py implements them the same way).
skypilot is not a dependency of this project (it would add ~50 packages and move others, click among them): the
schemas are vendored with the version they came from.
"""

import json
from pathlib import Path

import sky
from sky.utils import schemas

OUT = Path(__file__).with_name("skypilot_task.json")

if __name__ == "__main__":
    document = {
        "skypilot_version": sky.__version__,
        "source": "sky.utils.schemas.get_task_schema() and get_resources_schema(), by extract_skypilot_schema.py",
        "task": schemas.get_task_schema(),
        "resources": schemas.get_resources_schema(),
    }
    OUT.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT} (skypilot {sky.__version__})")
