#!/usr/bin/env python3
"""Writes the JSON Schemas in this directory from Istio's CRD file.

Usage: extract.py CRD_ALL_GEN_YAML OUT_DIR SOURCE_NOTE

For each (kind, version) in WANTED it takes the CRD's openAPIV3Schema, wraps it with apiVersion,
kind and metadata checks, and makes every object that lists its properties (and does not say
x-kubernetes-preserve-unknown-fields) refuse other properties: what `kubectl apply
--validate=strict` reports as unknown fields. CEL rules (x-kubernetes-validations) stay in the
file but are not checked by JSON Schema validators.
"""
import json
import sys

import yaml

WANTED = [
    ("EnvoyFilter", "networking.istio.io", "v1alpha3"),
    ("WasmPlugin", "extensions.istio.io", "v1alpha1"),
    ("DestinationRule", "networking.istio.io", "v1"),
    ("VirtualService", "networking.istio.io", "v1"),
    ("InferencePool", "inference.networking.k8s.io", "v1"),
]


def strict(node):
    if isinstance(node, dict):
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for value in node.values():
            strict(value)
    elif isinstance(node, list):
        for value in node:
            strict(value)


def main():
    crd_path, out_dir, source = sys.argv[1:4]
    with open(crd_path) as f:
        crds = [d for d in yaml.safe_load_all(f) if d]
    for kind, group, version in WANTED:
        crd = next(
            (c for c in crds if c["spec"]["names"]["kind"] == kind and c["spec"]["group"] == group),
            None,
        )
        if crd is None:  # each source file holds some of the kinds
            continue
        ver = next(v for v in crd["spec"]["versions"] if v["name"] == version)
        body = ver["schema"]["openAPIV3Schema"]
        props = dict(body.get("properties", {}))
        strict(props.get("spec", {}))
        props["apiVersion"] = {"const": f"{group}/{version}"}
        props["kind"] = {"const": kind}
        props["metadata"] = {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        }
        schema = {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "title": f"{kind} {group}/{version}",
            "$comment": f"From {source}; regenerate with deploy/kubernetes/schemas/extract.py.",
            "type": "object",
            "required": sorted(set(body.get("required", [])) | {"apiVersion", "kind", "metadata"}),
            "properties": props,
            "additionalProperties": False,
        }
        path = f"{out_dir}/{kind.lower()}_{version}.json"
        with open(path, "w") as f:
            json.dump(schema, f, indent=1, sort_keys=True)
            f.write("\n")
        print(path)


if __name__ == "__main__":
    main()
