"""A JSON Schema validator from a CustomResourceDefinition's openAPIV3Schema, as strict as the API server.

A CRD's ``openAPIV3Schema`` is a "structural schema" (OpenAPI v3.0 with Kubernetes extensions), close to JSON Schema
but not the same; ``validator_for_crd`` converts what matters for the manifests tested here:

- Unknown fields: the API server prunes a field the schema does not name (silently, or rejects it under
  ``kubectl apply``'s default ``--validate=strict``); JSON Schema accepts it. So every object schema with
  ``properties`` and no ``additionalProperties`` gets ``additionalProperties: false``, except where
  ``x-kubernetes-preserve-unknown-fields: true`` keeps unknown fields. Without this a misspelt or removed field
  (``podTemplateOverrides``, which TrainJob had before ``runtimePatches``) would pass.
- ``x-kubernetes-int-or-string: true``: in these CRDs it always comes with ``anyOf: [integer, string]``, plain JSON
  Schema; one without the ``anyOf`` gets it (a test below checks which case occurs).
- ``x-kubernetes-validations`` (CEL rules): JSON Schema cannot run CEL. The rules of these CRDs that apply when an
  object is created are translated by hand (CEL_RULES); transition rules (``oldSelf``: immutability on update) and the
  status' rule do not apply to a new object. A rule that is neither fails the conversion, so a CRD vendored anew with a
  new rule is read before it is trusted.
- The root: ``apiVersion`` and ``kind`` must be the CRD's (the API server routes by them); ``metadata`` is ObjectMeta,
  which the CRD leaves to the API server (its name rules come from the CEL rules where the CRD has them).

Not checked: ``format`` (int32/int64 ranges, date-time), the uniqueness of list-map keys
(``x-kubernetes-list-type: map``), defaults; and whatever the operators' admission webhooks check (e.g. that the
runtime named exists, that the trainer's env holds no ``PET_*``: tests of the renderers check those).
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import yaml

SCHEMAS = Path(__file__).with_name("schemas")

# CEL rule -> the JSON Schema of ``self`` it means (checked by hand against the rule and its message in the CRD).
_NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
CEL_RULES = {
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')":
        {"required": ["metadata"], "properties": {"metadata": {"required": ["name"],
                                                               "properties": {"name": {"type": "string", "pattern": _NAME_PATTERN}}}}},
    "size(self.metadata.name) <= 63": {"properties": {"metadata": {"properties": {"name": {"maxLength": 63}}}}},
    # CEL's matches() finds the pattern anywhere, like JSON Schema's pattern
    "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')": {"pattern": "^$|^[A-Za-z][A-Za-z0-9+.-]*://.+$"},
    "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']":
        {"enum": ["trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue"]},
    "self >= 1": {"minimum": 1},
}
NOT_ON_CREATE = ("oldSelf", "has(self.lastUpdatedTime)")  # transition rules; the status' rule


def _convert(node):
    if isinstance(node, list):
        return [_convert(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _convert(value) for key, value in node.items()
           if key not in ("x-kubernetes-validations", "properties")}
    if "properties" in node:  # property names are data, not keywords: convert their schemas only
        out["properties"] = {name: _convert(schema) for name, schema in node["properties"].items()}
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    rules = []
    for rule in node.get("x-kubernetes-validations", ()):
        text = rule["rule"]
        if any(marker in text for marker in NOT_ON_CREATE):
            continue
        if text not in CEL_RULES:
            raise ValueError(f"a CEL rule this converter does not know: {text!r} ({rule.get('message')}): "
                             "translate it in CEL_RULES or say why it does not apply")
        rules.append(CEL_RULES[text])
    if rules:
        out["allOf"] = out.get("allOf", []) + rules
    return out


def load_crd(name: str) -> dict:
    return yaml.safe_load((SCHEMAS / name).read_text())


def schema_for_crd(crd: dict, version: str | None = None) -> dict:
    """The converted schema of ``version`` (the CRD's storage version by default)."""
    versions = crd["spec"]["versions"]
    chosen = next(v for v in versions if (v["name"] == version if version else v.get("storage")))
    schema = _convert(copy.deepcopy(chosen["schema"]["openAPIV3Schema"]))
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema.setdefault("allOf", []).append({
        "required": ["apiVersion", "kind", "metadata"],
        "properties": {"apiVersion": {"const": f"{group}/{chosen['name']}"}, "kind": {"const": kind}},
    })
    return schema


def validator_for_crd(name: str, version: str | None = None) -> jsonschema.Draft7Validator:
    schema = schema_for_crd(load_crd(name), version)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def errors(validator: jsonschema.Draft7Validator, document: dict) -> list[str]:
    """Every violation, as 'path: message' (empty: valid)."""
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))]
