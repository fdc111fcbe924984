"""A CRD's openAPIV3Schema as a JSON Schema that check-jsonschema can validate a custom resource with.

    python tests/deploy/schemas/convert_crd.py CRD.yaml VERSION OUT.json --source "repo@commit, licence"

Kubernetes' structural schemas differ from JSON Schema in a few keywords:
- `x-kubernetes-int-or-string: true`: an integer or a string (anyOf);
- `nullable: true`: null is allowed too;
- `x-kubernetes-preserve-unknown-fields: true`: fields not declared are kept; elsewhere the API server prunes
  them. Objects that declare `properties` and do not preserve unknown fields get `additionalProperties: false`,
  so a misspelled field fails here instead of vanishing in the cluster;
- `x-kubernetes-embedded-resource: true`: an object with apiVersion, kind and metadata.
Descriptions, defaults, CEL rules (x-kubernetes-validations, which JSON Schema cannot evaluate), list and map
markers and integer formats (int32/int64, not JSON Schema formats) are dropped, which keeps the file small; a Go
regex's case flag, `(?i)`, which ECMA-262 patterns lack, becomes letter classes ([aA]).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

DROP = {
    "description",
    "default",
    "example",
    "externalDocs",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-embedded-resource",
    "nullable",
}
KEEP_FORMATS = {"date-time", "date", "uri", "email", "hostname", "ipv4", "ipv6", "uuid"}


def case_insensitive(pattern: str) -> str:
    """A Go regex with the (?i) flag in ECMA-262 syntax, which has no inline flags: each letter outside escapes
    and character classes becomes [xX]."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        in_class = (in_class or c == "[") and c != "]"
        out.append(f"[{c.lower()}{c.upper()}]" if c.isascii() and c.isalpha() and not in_class else c)
        i += 1
    return "".join(out)


def convert(node: dict) -> dict:
    """One schema node, converted recursively."""
    out: dict = {}
    for key, value in node.items():
        if key in DROP or (key == "format" and value not in KEEP_FORMATS):
            continue
        if key == "properties":
            out[key] = {name: convert(sub) for name, sub in value.items()}
        elif key in ("items", "not") or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = convert(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [convert(sub) for sub in value]
        elif key == "pattern" and "(?i)" in value:
            out[key] = case_insensitive(value.replace("(?i)", ""))
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("x-kubernetes-embedded-resource"):
        out.setdefault("properties", {})
        out["required"] = sorted({*out.get("required", []), "apiVersion", "kind"})
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    if node.get("type") == "object" and "properties" in node and not preserve and "additionalProperties" not in node:
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def crd_to_json_schema(crd: dict, version: str, source: str) -> dict:
    """The JSON Schema of one served version of the CRD, with its group/version and kind pinned."""
    spec = crd["spec"]
    served = next(v for v in spec["versions"] if v["name"] == version)
    schema = convert(served["schema"]["openAPIV3Schema"])
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"const": f"{spec['group']}/{version}"}
    props["kind"] = {"const": spec["names"]["kind"]}
    props["metadata"] = {"type": "object"}  # checked by the API server, not by the CRD
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": f"{spec['names']['kind']} {spec['group']}/{version}: the openAPIV3Schema of {source}, converted by "
        "tests/deploy/schemas/convert_crd.py (no descriptions, defaults or CEL rules; undeclared fields rejected).",
        **schema,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("crd", type=Path)
    p.add_argument("version")
    p.add_argument("out", type=Path)
    p.add_argument("--source", required=True, help="where the CRD comes from: repository, commit, licence")
    a = p.parse_args()
    crd = next(d for d in yaml.safe_load_all(a.crd.read_text()) if d and d.get("kind") == "CustomResourceDefinition")
    a.out.write_text(json.dumps(crd_to_json_schema(crd, a.version, a.source), separators=(",", ":"), sort_keys=True))


if __name__ == "__main__":
    main()
