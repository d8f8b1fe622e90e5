#!/usr/bin/env python3
"""Renders kvroute's kustomizations and validates every manifest offline.

Usage:
  validate.py [--k8s-version X.Y.Z] TARGET...   validate; TARGET is a kustomization directory
                                                (rendered first) or a YAML file; exit 1 on any error
  validate.py --render DIR                      print the rendered kustomization (YAML stream)

Core kinds go to kubernetes-validate --strict (the Kubernetes OpenAPI schemas it ships, version
K8S_VERSION); Istio kinds (networking.istio.io, extensions.istio.io) to check-jsonschema with the
schemas vendored in schemas/ (see schemas/README.md). An Istio kind/version with no vendored
schema, or a document without apiVersion/kind, is an error.

The renderer implements the part of kustomize these kustomizations use, nothing more:
`resources` (files and directories holding a kustomization.yaml), `images` (name, newName,
newTag, digest, on containers and initContainers), `replicas` (name, count) and `patches` whose
`patch` is a JSON 6902 list (add, replace, remove) selected by `target` kind and name. Any other
kustomization field is refused. tests/tests/k8s_manifests.rs checks the result equals
`kubectl kustomize` when kubectl is installed.
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile

import yaml

K8S_VERSION = "1.33.0"
HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMAS = os.path.join(HERE, "schemas")
ISTIO_GROUPS = ("networking.istio.io", "extensions.istio.io", "inference.networking.k8s.io")
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "images", "replicas", "patches"}


class RenderError(Exception):
    pass


def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def pointer(path):
    if not path.startswith("/"):
        raise RenderError(f"patch path {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def apply_op(doc, op, where):
    parts = pointer(op.get("path", ""))
    parent = doc
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    kind = op.get("op")
    if isinstance(parent, list):
        if kind == "add":
            if last == "-":
                parent.append(copy.deepcopy(op["value"]))
            else:
                parent.insert(int(last), copy.deepcopy(op["value"]))
        elif kind == "replace":
            parent[int(last)] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[int(last)]
        else:
            raise RenderError(f"{where}: op {kind!r} not supported (add, replace, remove)")
    else:
        if kind in ("add", "replace"):
            if kind == "replace" and last not in parent:
                raise RenderError(f"{where}: replace of missing {op['path']}")
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[last]
        else:
            raise RenderError(f"{where}: op {kind!r} not supported (add, replace, remove)")


def set_images(doc, images):
    spec = doc.get("spec", {})
    pod = spec.get("template", {}).get("spec", {}) if "template" in spec else None
    if not pod:
        return
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        image = c.get("image", "")
        name = image.split("@")[0]
        if ":" in name.rsplit("/", 1)[-1]:
            name = name.rsplit(":", 1)[0]
        for img in images:
            if img["name"] != name:
                continue
            new = img.get("newName", name)
            if "digest" in img:
                c["image"] = f"{new}@{img['digest']}"
            elif "newTag" in img:
                c["image"] = f"{new}:{img['newTag']}"
            else:
                c["image"] = new + image[len(name):]


def render(directory):
    kfile = os.path.join(directory, "kustomization.yaml")
    if not os.path.isfile(kfile):
        raise RenderError(f"{directory}: no kustomization.yaml")
    (k,) = load_docs(kfile)
    unknown = set(k) - KNOWN_FIELDS
    if unknown:
        raise RenderError(
            f"{kfile}: fields {sorted(unknown)} not supported by this renderer "
            f"(supported: {sorted(KNOWN_FIELDS - {'apiVersion', 'kind'})})"
        )
    docs = []
    for res in k.get("resources", []):
        path = os.path.normpath(os.path.join(directory, res))
        docs.extend(render(path) if os.path.isdir(path) else load_docs(path))
    for img in k.get("images", []):
        if "name" not in img:
            raise RenderError(f"{kfile}: images entry without name")
    for doc in docs:
        set_images(doc, k.get("images", []))
    for rep in k.get("replicas", []):
        hits = [d for d in docs if d["metadata"]["name"] == rep["name"] and "replicas" in d.get("spec", {})]
        if not hits:
            raise RenderError(f"{kfile}: replicas: no workload named {rep['name']}")
        for d in hits:
            d["spec"]["replicas"] = rep["count"]
    for i, p in enumerate(k.get("patches", [])):
        target = p.get("target", {})
        if set(target) - {"kind", "name"} or "patch" not in p:
            raise RenderError(f"{kfile}: patches[{i}]: only target kind/name and an inline patch supported")
        ops = yaml.safe_load(p["patch"])
        if not isinstance(ops, list):
            raise RenderError(f"{kfile}: patches[{i}]: only JSON 6902 patches (a list of ops) supported")
        hits = [
            d
            for d in docs
            if d.get("kind") == target.get("kind", d.get("kind"))
            and d["metadata"]["name"] == target.get("name", d["metadata"]["name"])
        ]
        if not hits:
            raise RenderError(f"{kfile}: patches[{i}]: target {target} matches nothing")
        for d in hits:
            for op in ops:
                try:
                    apply_op(d, op, f"{kfile}: patches[{i}]")
                except (KeyError, IndexError, ValueError) as e:
                    raise RenderError(f"{kfile}: patches[{i}]: {op.get('path')}: {e!r}") from e
    return docs


def gather(target):
    if os.path.isdir(target):
        return render(target)
    return load_docs(target)


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    return out.returncode, (out.stdout + out.stderr).strip()


def tool(name):
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else name


def validate(targets, k8s_version):
    errors = []
    core, istio = [], []
    with tempfile.TemporaryDirectory(prefix="kvroute-k8s-") as tmp:
        for t_i, target in enumerate(targets):
            try:
                docs = gather(target)
            except (RenderError, OSError, yaml.YAMLError) as e:
                errors.append(f"{target}: {e}")
                continue
            if not docs:
                errors.append(f"{target}: no documents")
            for d_i, doc in enumerate(docs):
                what = f"{target} #{d_i}"
                if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
                    errors.append(f"{what}: not a Kubernetes object (apiVersion and kind required)")
                    continue
                name = (doc.get("metadata") or {}).get("name", "?")
                what = f"{target}: {doc['kind']} {name}"
                path = os.path.join(tmp, f"{t_i}-{d_i}-{doc['kind']}-{name}.json")
                with open(path, "w") as f:
                    json.dump(doc, f)
                group, _, version = doc["apiVersion"].rpartition("/")
                if group in ISTIO_GROUPS:
                    schema = os.path.join(SCHEMAS, f"{doc['kind'].lower()}_{version}.json")
                    if not os.path.isfile(schema):
                        errors.append(f"{what}: no vendored schema for {doc['apiVersion']} {doc['kind']}")
                        continue
                    istio.append((what, schema, path))
                else:
                    core.append((what, path))
        # One run per tool (and schema): each run loads its schemas once; they name the failing file.
        names = {path: what for what, path in core}
        if core:
            rc, out = run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", k8s_version] + list(names))
            if rc != 0:
                for path, what in names.items():
                    out = out.replace(path, what)
                errors.append(f"kubernetes-validate {k8s_version} (exit {rc}):\n{out}")
        for schema in sorted({s for _, s, _ in istio}):
            names = {path: what for what, s, path in istio if s == schema}
            rc, out = run([tool("check-jsonschema"), "--schemafile", schema] + list(names))
            if rc != 0:
                for path, what in names.items():
                    out = out.replace(path, what)
                errors.append(f"check-jsonschema {os.path.basename(schema)} (exit {rc}):\n{out}")
    for e in errors:
        print(f"validate.py: {e}", file=sys.stderr)
    print(
        f"validate.py: {len(core)} core objects (Kubernetes {k8s_version}), {len(istio)} Istio objects, "
        f"{len(errors)} errors"
    )
    return 1 if errors else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k8s-version", default=K8S_VERSION)
    ap.add_argument("--render", metavar="DIR")
    ap.add_argument("targets", nargs="*")
    args = ap.parse_args()
    if args.render:
        try:
            docs = render(args.render)
        except RenderError as e:
            print(f"validate.py: {e}", file=sys.stderr)
            return 1
        sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=True))
        return 0
    if not args.targets:
        ap.error("no TARGET")
    return validate(args.targets, args.k8s_version)


if __name__ == "__main__":
    sys.exit(main())
